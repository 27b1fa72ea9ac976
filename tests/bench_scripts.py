"""Load a bench/ script as a module for a test, by path.

Never by putting bench/ on sys.path: bench/profile.py would shadow the standard library's
``profile`` module for every later test in the session. The module name matches the one
bench/corpus_audit.py gives its siblings, so a script loaded by both is loaded once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    module_name = f"npufuse_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
