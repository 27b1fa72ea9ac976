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


# -- repo_facts' registering index, walked only where a registering call can be written --------

REGISTERING = [
    "def add(m, n):\n    m.register_buffer('alibi', n)\n    return m\n",
    "def add(m, n):\n    def inner(k):\n        setattr(k, 'x', 1)\n    m.\\\n        register_buffer(\n        'alibi', n)\n",
    "class A:\n    def __init__(self):\n        self.register_buffer('b', None)\n    def f(self, m):\n        if m:\n            setattr(m, 'b', 2)\n",
    "def add(m):\n    # register_buffer in a comment only\n    return m\n",
    "def add(m, n):\n    m.ｒｅｇｉｓｔｅｒ_buffer('alibi', n)\n",  # an NFKC spelling: the line outside ASCII is walked
    "def add(m, n):\r\n    m.register_buffer('alibi', n)\r\n",
    "@deco(setattr)\ndef add(m, n):\n    return n\n",
]


def _nonempty(index: list) -> list:
    return [(fn, params, calls) for fn, params, calls in index if calls]


@pytest.mark.parametrize("text", REGISTERING)
def test_registering_index_on_lines_keeps_every_registering_function(text: str) -> None:
    from npufuse.scan import repo_facts

    tree = ast.parse(text)
    whole = repo_facts._registering_index(tree)
    pruned = repo_facts._registering_index(tree, repo_facts._registering_lines(text))
    assert _nonempty(pruned) == _nonempty(whole)
    assert _nonempty(whole) or "comment" in text or "deco" in text


def test_registering_index_on_lines_equals_the_whole_walk_on_sample_files() -> None:
    from npufuse.scan import repo_facts

    seen = 0
    for text in _texts():
        tree = ast.parse(text)
        whole = repo_facts._registering_index(tree)
        assert _nonempty(repo_facts._registering_index(tree, repo_facts._registering_lines(text))) == _nonempty(whole)
        seen += bool(_nonempty(whole))
    assert seen > 0


def test_registering_calls_reads_the_text_of_a_parsed_repo_file(tmp_path) -> None:
    from npufuse.scan import repo_facts

    (tmp_path / "surgery.py").write_text(REGISTERING[2])
    repo_facts.reset()
    tree = repo_facts._parse_repo_file(tmp_path, "surgery.py")
    got = repo_facts.registering_calls(tree)
    assert [fn.name for fn, _p, calls in got] == ["__init__", "f"]  # (the class's other lines are not entered)
    assert _nonempty(got) == _nonempty(repo_facts._registering_index(tree))
    repo_facts.reset()
