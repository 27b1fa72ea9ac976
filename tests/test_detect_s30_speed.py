"""Scan speed, session 30: the numeric probe's name gate read from the text
(numeric_probe._may_name_stat_or_root) turns away scopes whose only statistic/root word is
``norm`` inside another name (``layernorm``, ``self.norm``) before the scope's node index is
built, and lets through everything the AST test (probe_worthy) could accept."""

from __future__ import annotations

import ast

import pytest

from npufuse.scan import engine
from npufuse.scan import numeric_probe as P
from test_detect_s27_probe import _scope  # the module and scope of a code sample


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


# --- repo_facts._registering_index: one walk per tree, the lists one walk per function gave ---

_NESTED_REGISTERING = '''
def outer(m, n=None):
    def inner(a):
        setattr(a, "x", 1)
        def deepest(b):
            b.register_buffer("y", 2)
        m.register_buffer("z", 3)
    setattr(m, "w", 4)
    return lambda q: setattr(q, "v", 5)

class C:
    def __init__(self):
        self.register_buffer("own", 0)
        getattr(self, "ignored")
        setattr(self, "too_few")

async def later(m, *, k):
    m.register_buffer("late", k)
'''


def _per_function_walks(tree):
    from npufuse.scan.dataflow import fast_walk

    out = []
    for fn in fast_walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = fn.args
            calls = [c for c in fast_walk(fn) if isinstance(c, ast.Call) and (
                (isinstance(c.func, ast.Attribute) and c.func.attr == "register_buffer" and len(c.args) >= 2)
                or (isinstance(c.func, ast.Name) and c.func.id == "setattr" and len(c.args) == 3))]
            out.append((fn, {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs} - {"self", "cls"}, calls))
    return out


def test_the_registering_index_equals_one_walk_per_function() -> None:
    from npufuse.scan import repo_facts

    tree = ast.parse(_NESTED_REGISTERING)
    got = repo_facts._registering_index(tree)
    want = _per_function_walks(tree)
    assert [(f, p, [id(c) for c in calls]) for f, p, calls in got] == [(f, p, [id(c) for c in calls]) for f, p, calls in want]
    by_name = {f.name: calls for f, _p, calls in got}
    # a call inside nested defs (or a lambda) is listed for each def around it
    assert len(by_name["outer"]) == 5 and len(by_name["inner"]) == 3 and len(by_name["deepest"]) == 1
    assert len(by_name["__init__"]) == 1  # setattr with two arguments is no registering call
    assert len(by_name["later"]) == 1
