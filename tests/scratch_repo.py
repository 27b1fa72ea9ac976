"""Small repositories a test writes into its tmp folder, and their packages imported afresh (the
scan reads them as a user's repository; the rewritten code then runs from them)."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any


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


def run_train(root: Path, module: str) -> list[Any]:
    """``train()`` of ``root``'s train.py, with ``root``'s ``<module>.py`` installed as the module
    ``module`` (what train.py imports), the previous one restored after."""
    saved = sys.modules.get(module)
    try:
        mod = types.ModuleType(module)
        path = root / f"{module}.py"
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), mod.__dict__)
        sys.modules[module] = mod
        ns: dict[str, Any] = {}
        exec(compile((root / "train.py").read_text(encoding="utf-8"), str(root / "train.py"), "exec"), ns)
        return ns["train"]()
    finally:
        if saved is None:
            sys.modules.pop(module, None)
        else:
            sys.modules[module] = saved


def run_block(mod: types.ModuleType) -> list[Any]:
    """A scratch repo's ``Block(32)``: its bf16 output without grad (inference), then in fp32 (training)."""
    import torch

    torch.manual_seed(0)
    blk = mod.Block(32).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        inference = blk(x)
    train = blk.float()(x.float())
    return [inference, train]
