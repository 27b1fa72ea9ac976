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
