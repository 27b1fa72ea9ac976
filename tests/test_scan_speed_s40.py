"""s40 cold-scan pass (helper speed40): the shared per-scope summary (``dataflow.scope_tokens``,
``dataflow.may_multiply`` / ``may_raise_to_power``) and the necessary conditions read from it.

Each condition may only let MORE scopes through than the AST test it stands for: checked here on
crafted texts (comments between an operand and its ``*``, decorators, f-strings, ``lambda **kw``,
``myself.norm``), on random token soups and on every example and sample file. The gates-on /
gates-off identity of every FUSE / KEEP example of every pattern, and of the ``SCOPE_WORDS``
declarations on examples and sample files, is tests/test_scan_speed_paths.py (its ``gated_out``
is the engine's, "*" semantics included).
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine, numeric_probe
from npufuse.scan.dataflow import ModuleInfo, may_multiply, may_raise_to_power, scope_tokens

from test_scan_prefilter import _texts

pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")  # ``1if x`` in CRAFTED: valid, warned about

CRAFTED = [
    "@torch.no_grad()\n@decor(k=norm)\ndef f(x):\n    return x\n",
    "def f(x):\n    y = (x  # scale,\n         * 2)\n    return y\n",
    "def f(x):\n    y = (x  # (\n         ** 2)\n    return y\n",
    "def f(x):\n    y = x \\\n        * 2\n    return y\n",
    "def f(x, **kw):\n    g = lambda **k: 0\n    return f'{x*2}' + str(g(**kw))\n",
    "def f(x):\n    return 1if x else x.mean()\n",
    "def f(self, x):\n    return myself.norm(x) + x.self.norm(x) + x. self.norm(x)\n",
    "def f(self, x):\n    return self.norm(x)\n",
    "def f(a, *, b, **c):\n    return [*a, *b] + {**c} * 2\n",
    "def f(x):\n    x **= 2\n    x *= 3\n    return x\n",
    "def f(x):\n    return x.pow(2).mean(-1).rsqrt()\n",
]


def _module(code: str) -> ModuleInfo:
    return ModuleInfo.from_source("m.py", code, ast.parse(code))


def _all_texts() -> list[str]:
    return _texts() + CRAFTED


def _products(node: ast.AST) -> tuple[bool, bool]:
    """(a product or power operator anywhere, a power operator anywhere) in ``ast.walk(node)``."""
    ops = [n.op for n in ast.walk(node) if isinstance(n, (ast.BinOp, ast.AugAssign))]
    return any(isinstance(o, (ast.Mult, ast.Pow)) for o in ops), any(isinstance(o, ast.Pow) for o in ops)


def test_scope_tokens_hold_every_name_attribute_and_power() -> None:
    """Every ``Name`` / ``Attribute`` / power of the parsed text on the scope's lines (decorators
    included) is in its tokens. (ModuleInfo's canonical layer respells in place: it adds only the
    name ``torch`` and the attributes ``nn`` / ``functional``, and moves a method's attribute
    name into a ``torch.`` call: conditions on other names hold on its tree too.)"""
    seen = 0
    for code in _all_texts():
        module = _module(code)
        plain = [n for n in ast.walk(ast.parse(code)) if isinstance(n, (ast.Name, ast.Attribute, ast.BinOp, ast.AugAssign))]
        for scope in module.scopes:
            tokens = scope_tokens(module, scope)
            if tokens is None:
                continue
            seen += 1
            node = scope.node
            first = min([getattr(node, "lineno", 1), *(d.lineno for d in getattr(node, "decorator_list", ()))])
            last = getattr(node, "end_lineno", None) or 10**9
            for n in plain:
                if not (first <= n.lineno and n.end_lineno <= last):
                    continue
                if isinstance(n, ast.Name):
                    assert n.id in tokens, (scope.qualname, n.id)
                elif isinstance(n, ast.Attribute):
                    assert n.attr in tokens, (scope.qualname, n.attr)
                elif isinstance(n.op, ast.Pow):
                    assert "**" in tokens, scope.qualname
    assert seen > 500


def test_scope_tokens_read_decorators_and_are_none_outside_ascii() -> None:
    module = _module(CRAFTED[0])
    tokens = scope_tokens(module, next(s for s in module.scopes if s.qualname == "f"))
    assert tokens is not None and {"no_grad", "decor", "norm"} <= tokens
    code = "def f(x):\n    ｒｓｑｒｔ = 1\n    return x\n"
    module = _module(code)
    assert scope_tokens(module, next(s for s in module.scopes if s.qualname == "f")) is None


_STAR_BITS = ["x", "y", "2", "*", "**", "*", "(", ")", ",", " ", "\n", "lambda ", "lambda", "kw", ":", "{", "}", "[", "]",
              "f", "=", "a.b", "-", "\\\n", "#c,\n", "# (\n", "'s'", "*=", "**="]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_STAR_BITS), max_size=12))
def test_star_tests_never_miss_a_product_or_power(bits: list[str]) -> None:
    text = "".join(bits)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    product, power = _products(tree)
    if product:
        assert may_multiply(text), text
    if power:
        assert may_raise_to_power(text), text


def test_star_tests_on_real_scopes_and_unpacking() -> None:
    for code in _all_texts():
        module = _module(code)
        for scope in module.scopes:
            product, power = _products(scope.node)
            text = engine.gate_text(module, scope)
            if product:
                assert may_multiply(text), scope.qualname
            if power:
                assert may_raise_to_power(text), scope.qualname
    kwargs_only = "def forward(self, x, *args, **kwargs):\n    return self.f(x, *args, [*x], {**kwargs}, key=lambda *a, **k: 0, **kwargs)\n"
    assert not may_multiply(kwargs_only) and not may_raise_to_power(kwargs_only)
    assert may_multiply("f(a,  # note\n  * b)") and may_raise_to_power("(a  # (\n ** 2)")


def test_stat_or_root_token_counts_a_norm_of_another_object() -> None:
    """s39's text gate read ``myself.norm`` / ``x.self.norm`` as ``self.norm`` (a submodule) and
    skipped a scope whose AST names the statistic ``norm``."""
    for text in ("return myself.norm(x)", "return x.self.norm(x)", "return x. self.norm(x)"):
        assert numeric_probe._holds_stat_or_root_token(text), text
    assert not numeric_probe._holds_stat_or_root_token("return self.norm(x)")


def test_only_self_norm() -> None:
    assert numeric_probe.only_self_norm("def f(self, x):\n    return self.norm(x) + self.norm_eps\n")
    for text in ("myself.norm(x)", "x.self.norm(x)", "x. self.norm(x)", "x.\\\n  self.norm", "self .norm", "norm(x)", "y = self.norm; z = norm"):
        assert not numeric_probe.only_self_norm(text), text


def test_probe_token_gate_lets_through_every_scope_the_ast_test_accepts() -> None:
    """``_tokens_may_be_worthy`` is necessary for the AST half of ``probe_worthy`` (its called
    names and plain-name helper calls), on every function of every example and sample file."""
    checked = rejected = 0
    for code in _all_texts():
        module = _module(code)
        for scope in module.scopes:
            fn = scope.node
            if not isinstance(fn, ast.FunctionDef):
                continue
            names = numeric_probe._called_names(module, fn, scope)
            helpers = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            accepts = bool(names & numeric_probe._STAT_NAMES and names & numeric_probe._ROOT_OR_POW) or (
                bool(helpers & (set(module.functions) | module.relative_imports)) and bool(names & numeric_probe._STAT_ROOT_POW))
            gate = numeric_probe._tokens_may_be_worthy(module, scope, fn)
            checked += 1
            rejected += not gate
            if accepts:
                assert gate, (scope.qualname, code.splitlines()[0] if code else "")
    assert checked > 300 and rejected > 0


def test_probe_token_gate_skips_the_node_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward whose only statistic word is ``self.norm`` and whose only ``**`` unpacks: the
    probe gate answers from the text, without building the scope's node index."""
    code = "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x, **kwargs):\n        return self.norm(x, **kwargs).sum()\n"
    module = _module(code)
    scope = next(s for s in module.scopes if s.qualname == "M.forward")
    assert not numeric_probe.probe_worthy(module, scope, scope.node)
    assert "_nodes" not in scope.__dict__
    with monkeypatch.context() as m:
        m.setattr(engine, "SCOPE_GATES", False)
        assert numeric_probe._tokens_may_be_worthy(module, scope, scope.node)


def test_star_word_skips_kwargs_only_scopes() -> None:
    """``SCOPE_WORDS`` "*" (swiglu, geglu, rope) reads the scope's stars as operators: a scope whose
    only stars unpack is skipped, one that multiplies is not."""
    code = ("import torch\n\ndef a(x, **kwargs):\n    return g(x, **kwargs)\n\n"
            "def b(x, **kwargs):\n    return g(x, **kwargs) * 2\n")
    module = _module(code)
    by_id = {p.id: p for p in all_patterns()}
    for pid in ("swiglu", "geglu", "rope"):
        words = engine.gate_words(module, by_id[pid])
        assert words is not None and "*" in words
        scopes = {s.qualname: s for s in module.scopes}
        assert engine.gated_out(module, scopes["a"], words)
        assert not engine.gated_out(module, scopes["b"], words)
    # a product without an operator star: a "mul" spelling, or an import alias of one
    for code in ("def c(x, **kw):\n    return torch.mul (g(x, **kw), x)\n",
                 "from torch import mul as m\n\ndef c(x, **kw):\n    return m(g(x, **kw), x)\n"):
        module = _module(code)
        scope = next(s for s in module.scopes if s.qualname == "c")
        for pid in ("swiglu", "geglu", "rope"):
            assert not engine.gated_out(module, scope, engine.gate_words(module, by_id[pid])), (pid, code)
