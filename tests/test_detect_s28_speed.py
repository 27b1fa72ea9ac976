"""s28 scan-speed cuts: each shortcut answers exactly what the code it replaced answered."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from npufuse.scan import numeric_probe, repo_facts
from npufuse.scan.dataflow import ModuleInfo

TEXTS = [
    "m.register_buffer('alibi', a)\n",
    'setattr(m, "alibi", a)\n',
    "m.register_buffer('alibi_slopes', a)\n",  # a longer word holding the one asked for
    "m.register_buffer(\"x'alibi'\", a)\n",  # quoted inside a string of the other quote
    "register_buffer; s = 'a'alibi'b'\n",  # the closing quote of one string opens the next
    "register_buffer; s = 'alibi\"\n",  # two quotes of different kinds: not quoted
    "s = 'alibi'\n",  # quoted, but no register_buffer/setattr in the file
    "register_buffer('ALIBI')\n",
    "register_buffer('al ibi')\n",
    "register_buffer('')\n",
    "",
]
WORDS = ["alibi", "alibi_slopes", "ALIBI", "al ibi", "b", "a", "x'alibi"]


@pytest.mark.parametrize("text", TEXTS)
def test_holds_quoted_is_the_text_test(tmp_path: Path, text: str) -> None:
    (tmp_path / "f.py").write_text(text)
    repo_facts.reset()
    needs = ("register_buffer", "setattr")
    for word in WORDS:
        expected = bool(text) and any(n in text for n in needs) and any(q in text for q in (f"'{word}'", f'"{word}"'))
        assert repo_facts.holds_quoted(tmp_path, "f.py", word, needs) == expected, word
    assert repo_facts.holds_quoted(tmp_path, "absent.py", "alibi", needs) is False


def test_holds_quoted_rereads_after_reset(tmp_path: Path) -> None:
    f = tmp_path / "f.py"
    f.write_text("m.register_buffer('alibi', a)\n")
    repo_facts.reset()
    assert repo_facts.holds_quoted(tmp_path, "f.py", "alibi", ("register_buffer",))
    f.write_text("m.register_buffer('other', a)\n")
    assert repo_facts.holds_quoted(tmp_path, "f.py", "alibi", ("register_buffer",))  # one read per scan
    repo_facts.reset()
    assert not repo_facts.holds_quoted(tmp_path, "f.py", "alibi", ("register_buffer",))


SOURCE = '''
import torch
from .ops import rms_helper as rh, other
try:
    from ..deep import inner
except ImportError:
    pass
class C:
    def f(self, x):
        from . import local_one
        y = x ** 2
        z = x
        z **= 2
        return rh(torch.rsqrt(y.mean(-1))) + self.norm(x) + other(x)
'''


def test_relative_imports_and_called_names_match_a_full_walk() -> None:
    tree = ast.parse(SOURCE)
    module = ModuleInfo.from_source("m.py", SOURCE, tree)
    walked = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level for a in n.names if a.name != "*"}
    assert numeric_probe._relative_imports(module) == walked == {"rh", "other", "inner", "local_one"}
    scope = next(s for s in module.scopes if s.qualname == "C.f")
    fn = scope.node
    expected: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and not (n.attr == "norm" and isinstance(n.value, ast.Name) and n.value.id == "self"):
            expected.add(n.attr)
        elif isinstance(n, ast.Name):
            target = module.aliases.get(n.id)
            expected.add(target.rsplit(".", 1)[-1] if target else n.id)
        elif isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Pow):
            expected.add("**")
    assert numeric_probe._called_names(module, fn, scope) == expected  # the scope's shared index
    assert numeric_probe._called_names(module, fn) == expected  # a walk of its own
    assert "**" in expected and "norm" not in expected and "rsqrt" in expected
