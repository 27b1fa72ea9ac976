"""Session 27 scan-cost cuts give what the plain code gave (issue 14, item 3).

* ``base._called_more_often`` answers from a per-process table keyed by the original span's text
  and the fused text (copied code yields the same pair in many files): the table's answer is the
  computed one, a repeated pair is not parsed again, and a different pair is.
* ``attention._module_attrs_of`` reads one table built by one regex per file instead of a regex
  compiled and run per class: on crafted texts (annotations holding ``self.``, several
  assignments on a line, names that hold other names, line breaks) and sample files, every
  class name of the text gets what the per-class regex finds.
"""

from __future__ import annotations

import ast
import re

import pytest

from npufuse.patterns import attention, base
from npufuse.patterns.base import Finding
from npufuse.scan.dataflow import ModuleInfo

from test_scan_prefilter import _texts


def _module(code: str) -> ModuleInfo:
    return ModuleInfo.from_source("m.py", code, ast.parse(code))


# -- _called_more_often's table ---------------------------------------------------------------

DOUBLED = "class M:\n    def forward(self, x):\n        y = self.w12(x)\n        return y\n"
DOUBLED_FUSED = "y = self.w12(x) * self.w12(x)"


def _finding(fused: str) -> Finding:
    return Finding("swiglu", "M.forward", 3, 3, {}, fused, "x")


def test_table_answer_is_the_computed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_MORE_OFTEN", {})
    module = _module(DOUBLED)
    assert base._called_more_often(module, _finding(DOUBLED_FUSED)) == "self.w12(x)"
    assert base._called_more_often_in("        y = self.w12(x)\n", DOUBLED_FUSED) == "self.w12(x)"
    assert base._called_more_often(module, _finding("y = self.w12(x)")) is None


def test_a_repeated_pair_is_not_parsed_again_and_a_new_one_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_MORE_OFTEN", {})
    parsed: list[str] = []
    real = base.parsed_code
    monkeypatch.setattr(base, "parsed_code", lambda code: parsed.append(code) or real(code))
    first, copy = _module(DOUBLED), _module("# a copy in another file\n" + DOUBLED.replace("\n", "\n", 1))
    assert base._called_more_often(first, _finding(DOUBLED_FUSED)) == "self.w12(x)"
    n = len(parsed)
    assert n > 0
    moved = Finding("swiglu", "M.forward", 4, 4, {}, DOUBLED_FUSED, "x")  # the same span one line lower
    assert base._called_more_often(copy, moved) == "self.w12(x)"
    assert len(parsed) == n  # the same texts: answered from the table
    assert base._called_more_often(first, _finding("y = self.w12(x) + 1")) is None
    assert len(parsed) > n  # another fused text: computed


# -- _module_attrs_of's table ---------------------------------------------------------------------

CRAFTED = [
    "class A:\n    def __init__(self):\n        self.attn = Attn(cfg)\n        self.other: Attn = Attn(cfg)\n",
    "self.a = Attn(1); self.b = AttnX(2); self.c = XAttn(3); self.d=Attn  (4)\n",
    "self.a: Dict[str, self.b] = Attn(1)\nself.c: self.d = Other(2)\nself.e = Attn\n(3)\n",
    "self.x =\n    Attn(1)\nself.y\n  = Attn(2)\nself.z = (Attn(3))\nself.w = nn.Attn(4)\n",
    "'''self.doc = Attn(0)'''\nself.a: int = 3 = Attn(1)\nself.b : X = self.c = Attn(2)\n",
    "self.q = Attn(1)\nself.q = Attn(2)\nself.r = Attn(3)  # self.s = Attn(4)\n",
]


def _per_class(source: str, name: str) -> tuple[str, ...]:
    """_module_attrs_of before the table: a regex per class."""
    pattern = re.compile(r"self\.(\w+)\s*(?::[^=\n]*)?=\s*" + re.escape(name) + r"\s*\(")
    return tuple(sorted(set(pattern.findall(source))))


def _names(source: str) -> list[str]:
    return sorted(set(re.findall(r"\w+", source)))


@pytest.mark.parametrize("source", CRAFTED)
def test_table_equals_the_per_class_regex_on_crafted_texts(source: str) -> None:
    module = ModuleInfo(path="m.py", source=source, tree=ast.Module(body=[], type_ignores=[]))
    for name in _names(source):
        assert attention._module_attrs_of(module, name) == _per_class(source, name), name


def test_table_finds_what_the_crafted_texts_hold() -> None:
    module = ModuleInfo(path="m.py", source=CRAFTED[1], tree=ast.Module(body=[], type_ignores=[]))
    assert attention._module_attrs_of(module, "Attn") == ("a", "d")
    module = ModuleInfo(path="m.py", source=CRAFTED[2], tree=ast.Module(body=[], type_ignores=[]))
    assert attention._module_attrs_of(module, "Attn") == ("a", "e")


def test_a_name_outside_word_characters_keeps_the_per_class_regex() -> None:
    source = "self.a = A\u00b7b(1)\nself.b = A(2)\n"  # U+00B7 continues an identifier, is no \\w
    module = ModuleInfo(path="m.py", source=source, tree=ast.Module(body=[], type_ignores=[]))
    assert attention._module_attrs_of(module, "A\u00b7b") == ("a",) == _per_class(source, "A\u00b7b")
    assert attention._module_attrs_of(module, "A") == ("b",) == _per_class(source, "A")


def test_table_equals_the_per_class_regex_on_sample_files() -> None:
    checked = 0
    for source in _texts():
        module = ModuleInfo(path="m.py", source=source, tree=ast.Module(body=[], type_ignores=[]))
        for name in [n for n in _names(source) if n[:1].isupper()]:
            assert attention._module_attrs_of(module, name) == _per_class(source, name), name
            checked += 1
    assert checked > 0
