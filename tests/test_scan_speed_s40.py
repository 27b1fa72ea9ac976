"""s40 cold-scan pass (helper speed40): the per-scope star tests (``dataflow.may_multiply`` /
``may_raise_to_power``), ``SCOPE_WORDS`` "*" read as a product, and the probe gate's ``self.norm``.

Each test may only let MORE scopes through than the AST test it stands for: checked here on
crafted texts (comments between an operand and its ``*``, f-strings, ``lambda **kw``,
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
from npufuse.scan.dataflow import ModuleInfo, may_multiply, may_raise_to_power

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
