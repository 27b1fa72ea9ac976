"""Scan speed, session 30: the numeric probe's name gate read from the text
(numeric_probe._may_name_stat_or_root) turns away scopes whose only statistic/root word is
``norm`` inside another name (``layernorm``, ``self.norm``) before the scope's node index is
built, and lets through everything the AST test (probe_worthy) could accept."""

from __future__ import annotations

import textwrap

import pytest

from npufuse.scan import engine
from npufuse.scan import numeric_probe as P
from npufuse.scan.dataflow import ModuleInfo


def _scope(code: str, qual: str):
    m = ModuleInfo.from_source("m.py", textwrap.dedent(code))
    s = next(s for s in m.scopes if s.qualname == qual)
    return m, s


_SUBMODULE_ONLY = '''
import torch.nn as nn
class Block(nn.Module):
    def forward(self, x):
        x = self.input_layernorm(x)
        return self.norm(x) + self.post_norm_layer(x)
'''


def test_a_scope_naming_norm_only_inside_other_names_is_turned_away_before_the_ast(monkeypatch) -> None:
    m, s = _scope(_SUBMODULE_ONLY, "Block.forward")
    # the word gates pass it ("norm" is a statistic word and a root word) ...
    assert engine.scope_holds_words(m, s, P.STAT_WORDS) and engine.scope_holds_words(m, s, P.ROOT_WORDS)
    assert not P._may_name_stat_or_root(m, s)

    def no_ast(*_a, **_k):
        raise AssertionError("the node index was read")

    monkeypatch.setattr(P, "_called_names", no_ast)
    monkeypatch.setattr(P, "_fn_nodes", no_ast)
    assert not P.probe_worthy(m, s, s.node)  # ... the text gate answers without the AST


@pytest.mark.parametrize("body", [
    "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)",
    "return x / torch.norm(x, dim=-1, keepdim=True)",
    "return self.mean(x) * self.norm_scale",  # an attribute `mean` of self is still a name the AST counts
    "return x / (x ** 2).sum(-1).sqrt()",
    "return x / vn(x)",  # vector_norm only through an import alias
])
def test_every_scope_the_ast_test_accepts_passes_the_text_gate(body: str) -> None:
    code = f"import torch\nfrom torch.linalg import vector_norm as vn\nclass N:\n    def f(self, x):\n        {body}\n"
    m, s = _scope(code, "N.f")
    assert P._may_name_stat_or_root(m, s)
    names = P._called_names(m, s.node, s)
    assert names & (P._STAT_NAMES | P._ROOT_NAMES | {"**"})


def test_text_outside_ascii_is_left_to_the_ast_test() -> None:
    m, s = _scope("def f(x):\n    # ｎｏｒｍ\n    return self.norm(x)\n", "f")
    assert P._may_name_stat_or_root(m, s)


def test_the_text_gate_is_open_with_the_gates_off(monkeypatch) -> None:
    m, s = _scope(_SUBMODULE_ONLY, "Block.forward")
    monkeypatch.setattr(engine, "SCOPE_GATES", False)
    assert P._may_name_stat_or_root(m, s)
