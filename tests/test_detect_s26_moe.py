"""s26 MoE detection: the shared canonical helpers added for it, and the examples of the classes it handles
(the examples themselves run end to end in tests/test_patterns.py through the pattern harness)."""

from __future__ import annotations

import ast

from npufuse.scan.canonical import host_copy_base, leading_subscript


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def test_leading_subscript_drops_trailing_whole_dimensions() -> None:
    for text, want in (("w[i, :, :]", "w[i]"), ("x[a:b, :]", "x[a:b]"), ("w[g, ...]", "w[g]"), ("w[g, :, ...]", "w[g]")):
        assert ast.unparse(leading_subscript(_expr(text))) == want


def test_leading_subscript_keeps_selective_indexing() -> None:
    # a bound, a step, a second index or two ellipses select something else: the node comes back unchanged
    for text in ("w[i, :2]", "w[i, ::2]", "w[i, j]", "w[i, ..., ...]", "w[..., i]", "w[i]", "x"):
        node = _expr(text)
        assert leading_subscript(node) is node


def test_leading_subscript_keeps_position() -> None:
    node = _expr("w[i, :, :]")
    out = leading_subscript(node)
    assert (out.lineno, out.col_offset, out.end_col_offset) == (node.lineno, node.col_offset, node.end_col_offset)


def test_host_copy_base() -> None:
    assert ast.unparse(host_copy_base(_expr("counts.cpu().numpy()"))) == "counts"
    assert ast.unparse(host_copy_base(_expr("self.sizes.detach().tolist()"))) == "self.sizes"
    assert host_copy_base(_expr("counts")) is None  # no copy at all
    assert host_copy_base(_expr("counts.to('cpu')")) is None  # a call with arguments is not read
    assert host_copy_base(_expr("counts.cumsum().tolist()")).func.attr == "cumsum"  # type: ignore[union-attr]


def test_dense_gate_column_spellings() -> None:
    from npufuse.patterns.moe_experts import _dense_gate_column

    # (text, needs a 2-D gate): every spelling of "expert e's weight per token, broadcast over the features"
    for text, rank2 in (("g[..., e:e + 1]", False), ("g[:, e:e + 1]", True), ("g[..., e].unsqueeze(-1)", False),
                        ("g[:, e].unsqueeze(-1)", True), ("g[..., e, None]", False), ("g[:, e, None]", True)):
        found = _dense_gate_column(_expr(text), "e")
        assert found is not None and ast.unparse(found[0]) == "g" and found[1] is rank2, text
    # another expert's column, a two-wide slice, a column without the broadcast axis: not a gate column of e
    for text in ("g[..., e + 1:e + 2]", "g[..., e:e + 2]", "g[..., e]", "g[e, :, None]", "g[..., k:k + 1]"):
        assert _dense_gate_column(_expr(text), "e") is None, text


def test_gate_evidence_follows_the_gate_module_of_the_file() -> None:
    from npufuse.patterns.moe_experts import _gate_evidence
    from npufuse.scan.dataflow import ModuleInfo

    code = (
        "import torch\nimport torch.nn as nn\n"
        "class Gate(nn.Module):\n"
        "    def forward(self, x):\n"
        "        p = x.softmax(-1)\n"
        "        _, i = p.topk(2, dim=-1)\n"
        "        return p * torch.zeros_like(p).scatter(-1, i, 1.0), None\n"
        "class Soft(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x.softmax(-1), None\n"
        "class Layer(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.gate = Gate()\n"
        "        self.soft = Soft()\n"
        "    def forward(self, x):\n"
        "        g, _ = self.gate(x)\n"
        "        s, _ = self.soft(x)\n"
        "        return g, s\n"
    )
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "Layer.forward")
    ret = scope.body[-1].value  # type: ignore[attr-defined]
    g, s = ret.elts
    assert {"topk", "scatter"} <= _gate_evidence(module, scope, g, ret.lineno)
    assert not _gate_evidence(module, scope, s, ret.lineno) & {"topk", "scatter", "one_hot", "masked_fill"}
