"""Session 37 scan-cost cuts give what the plain code gave (issue 14, item 3).

* ``dataflow.called_outside_def`` (attention's "is this function called anywhere but its def?"
  text test, checked by hand around each occurrence of the name) equals the two regexes it
  replaces, on crafted texts (spaces and line breaks around the dot and before the parenthesis,
  names inside longer words, ``def`` before the call, text outside ASCII) and on the example
  and sample files, for every name the texts define.
"""

from __future__ import annotations

import ast
import re

import pytest

from npufuse.scan import dataflow
from npufuse.scan.dataflow import ModuleInfo

from test_scan_prefilter import _texts


def _regex_answer(src: str, name: str, method: bool) -> bool:
    called = rf"\bself\s*\.\s*{name}\s*\(" if method else rf"(?<![\w.]){name}\s*\("
    return any(not src[max(0, m.start() - 8):m.start()].rstrip().endswith("def") for m in re.finditer(called, src))


CRAFTED = [
    "def f(x):\n    return x\n",
    "def f(x):\n    return x\ny = f(1)\n",
    "def f(x):\n    return x\ny = g.f(1)\n",
    "def f(x):\n    return x\ny = gf(1)\n",
    "def f(x):\n    return x\ny = f (1)\n",
    "def f(x):\n    return x\ny = f\\\n(1)\n",
    "class A:\n    def f(self):\n        return self.f()\n",
    "class A:\n    def f(self):\n        return self . f ()\n",
    "class A:\n    def f(self):\n        return myself.f()\n",
    "class A:\n    def f(self):\n        return self.\\\n            f(1)\n",
    "class A:\n    def f(self):\n        return self.ff(1) + self.f_(2)\n",
    "class A:\n    def f(self):\n        return (self\n                .f(1))\n",
    "class A:\n    def ab(self):\n        return aab(1) + self.aab(2)\n",
    "class A:\n    def ab(self):\n        return ab(1)\n",
    "class A:\n    def s(self):\n        return self.s(1)\n",
    "class A:\n    def self(self):\n        return self.self(1)\n",
    "async def f(x):\n    return await f(x)\n",
    "def   f(x):\n    pass\nxdef f(1)\n",
    "é = 1\ndef f(x):\n    return éf(x) + ·f(x) + f(x)\n",
    "class A:\n    def f(self):\n        return éself.f(1)\n",
    "class A:\n    def f(self):\n        return self\u00a0.\u2003f\u2009(1)\n",
    "f(1)\ndef f(x):\n    pass\n",
    "self.f(1)",
    "f(",
    "(f(",
    ".f(",
]


def _names(text: str) -> set[str]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {"f", "self", "s", "ab"}
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {"f", "forward"}


@pytest.mark.parametrize("text", CRAFTED)
def test_called_outside_def_equals_the_regexes_on_crafted_texts(text: str) -> None:
    for name in _names(text) | {"f", "s", "ab", "self", "aab"}:
        for method in (False, True):
            assert dataflow._called_outside_def(text, name, method) == _regex_answer(text, name, method), (name, method)


def test_called_outside_def_equals_the_regexes_on_sample_files() -> None:
    checked = 0
    for text in _texts():
        for name in sorted(_names(text))[:40]:
            for method in (False, True):
                assert dataflow._called_outside_def(text, name, method) == _regex_answer(text, name, method), (name, method, text[:80])
                checked += 1
    assert checked > 100


def test_called_outside_def_is_cached_per_module() -> None:
    code = "class A:\n    def f(self):\n        return self.f()\n"
    module = ModuleInfo.from_source("m.py", code, ast.parse(code))
    assert dataflow.called_outside_def(module, "f", True) is True
    assert dataflow.called_outside_def(module, "f", False) is False
    assert module.__dict__["_npufuse_called_outside_def"] == {("f", True): True, ("f", False): False}
