"""Session 38 scan-cost cuts give what the plain code gave (issue 14, item 3).

* ``repo_facts.may_register_on_another`` (attention's registered-buffer search parses another
  repo file only where it says True) is True for every text whose registering index
  (``repo_facts._registering_index``: the calls the search matches) holds a ``register_buffer``
  or ``setattr`` call on a parameter other than self / cls: crafted texts (receivers spelled
  around the self / cls forms, whitespace, longer names, text outside ASCII with and without
  characters that decompose to ASCII) and the example and sample files.
* ``engine._file_holds_any`` equals ``any(w in text for w in words)`` for word lists with
  regex metacharacters, on crafted texts and the example and sample files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from npufuse.scan import engine, repo_facts

from test_scan_prefilter import _texts


def _registers_on_a_parameter(text: str) -> bool:
    """What the search can match in ``text``: a listed call whose receiver is a parameter."""
    for _fn, params, calls in repo_facts._registering_index(ast.parse(text)):
        for call in calls:
            f = call.func
            target = f.value if isinstance(f, ast.Attribute) else call.args[0]
            if isinstance(target, ast.Name) and target.id in params:
                return True
    return False


CRAFTED = [
    ("class A:\n    def __init__(self, m):\n        self.register_buffer('a', m)\n", False),
    ("class A:\n    def __init__(self, m):\n        setattr(self, 'a', m)\n", False),
    ("class A:\n    @classmethod\n    def make(cls, m):\n        cls.register_buffer('a', m)\n        setattr(cls, 'b', m)\n", False),
    ("class A:\n    def __init__(self, m):\n        self . register_buffer('a', m)\n        setattr( self , 'b', m)\n", False),
    ("class A:\n    def __init__(self, m):\n        (self\n         .register_buffer('a', m))\n", False),
    ("def add(module, v):\n    module.register_buffer('a', v)\n", True),
    ("def add(module, v):\n    setattr(module, 'a', v)\n", True),
    ("def add(myself, v):\n    myself.register_buffer('a', v)\n", True),
    ("def add(self_, v):\n    setattr(self_, 'a', v)\n", True),
    ("def add(mself, v):\n    setattr(mself, 'a', v)\n", True),
    ("def add(a, v):\n    a.self.register_buffer('x', v)\n    self.register_buffer('y', v)\n", True),
    # text outside ASCII that no character of decomposes to ASCII: the forms as written decide
    ("# → arrows only\nclass A:\n    def __init__(self, m):\n        self.register_buffer('a', m)\n", False),
    ("# → arrows only\ndef add(module, v):\n    module.register_buffer('a', v)\n", True),
    # a ligature decomposes to ASCII ("ﬁ" -> "fi"): identifiers may be NFKC spellings, the AST decides
    ("# ﬁne\nclass A:\n    def __init__(self, m):\n        self.register_buffer('a', m)\n", True),
    ("def add(ﬁx, v):\n    ﬁx.register_buffer('a', v)\n", True),
    # names that only contain the words
    ("def add(m, v):\n    m.register_buffers('a', v)\n", True),
    ("class A:\n    def __setattr__(self, k, v):\n        super().__setattr__(k, v)\n", True),
]


@pytest.mark.parametrize("text,expected", CRAFTED)
def test_crafted_register_forms(tmp_path: Path, text: str, expected: bool) -> None:
    (tmp_path / "m.py").write_text(text, encoding="utf-8")
    repo_facts.reset()
    got = repo_facts.may_register_on_another(tmp_path, "m.py")
    assert got is expected
    if _registers_on_a_parameter(text):
        assert got


def test_never_false_where_the_search_can_match(tmp_path: Path) -> None:
    repo_facts.reset()
    texts = _texts() + [t for t, _ in CRAFTED]
    checked = 0
    for i, text in enumerate(texts):
        rel = f"f{i}.py"
        (tmp_path / rel).write_text(text, encoding="utf-8")
        if _registers_on_a_parameter(text):
            assert repo_facts.may_register_on_another(tmp_path, rel), rel
            checked += 1
    assert checked >= 8


def test_unreadable_file_lets_the_search_through(tmp_path: Path) -> None:
    repo_facts.reset()
    assert repo_facts.may_register_on_another(tmp_path, "absent.py")


WORD_LISTS = [
    ("a",),
    ("Adam", "SGD", "Adadelta", "RMSprop", "Adagrad", "Rprop", "LBFGS", "FusedLAMB", "Lamb", "optim", ")("),
    ("**", "(.", "[x]", "a|b", "\\", "$", "^"),
    ("x", "y", "z", "w", "v", "u"),
]


@pytest.mark.parametrize("words", WORD_LISTS)
def test_file_holds_any(words: tuple[str, ...]) -> None:
    texts = _texts() + ["", "a|b", "x ** 2", "f()(", "def f(.x)", "tail $", "^ head", "back\\slash", "self.optim"]
    for text in texts:
        assert engine._file_holds_any(text, words) == any(w in text for w in words)
