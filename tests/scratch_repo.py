"""Small repositories a test writes into its tmp folder, and their packages imported afresh (the
scan reads them as a user's repository; the rewritten code then runs from them)."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write ``{relative path: text}`` under ``root``, creating folders as needed."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def import_fresh(root: Path, name: str, package: str = "pkg") -> types.ModuleType:
    """Import ``name`` from ``root`` with no cached module of ``package`` before or after (a test
    imports the original and then the rewritten repository under the same names)."""

    def forget() -> None:
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]

    sys.path.insert(0, str(root))
    try:
        forget()
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        forget()
