"""s28 rope pass: the shared helpers and safety nets added with it (the rope forms themselves are the
pattern's own Fuse/Keep examples, run by tests/test_patterns.py)."""

from __future__ import annotations

import pytest

from npufuse.patterns import affinity_index_put
from pattern_harness import detect_all


def test_index_put_with_a_mask_over_several_lines_renders() -> None:
    """A mask written over several lines inside the subscript (Cerebras' synthetic dataset) becomes code
    that parses: the operand is bracketed in the replacement."""
    findings, _ = detect_all(affinity_index_put.AffinityIndexPut(), affinity_index_put._MULTILINE_MASK)
    assert len(findings) == 1
    fused = findings[0].fused
    compile(fused, "<fused>", "exec")
    assert "_npufuse_mask = (pos" in fused


def test_index_put_replacement_that_does_not_parse_is_no_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The safety net: were an operand's text ever emitted unbracketed (the s27 render_error), the site is a
    near miss that says so, not a candidate the renderer fails on."""
    monkeypatch.setattr(affinity_index_put, "_bracketed", lambda text: text)
    findings, misses = detect_all(affinity_index_put.AffinityIndexPut(), affinity_index_put._MULTILINE_MASK)
    assert findings == []
    assert any("parses" in m.reason for m in misses)


def test_bound_names_are_what_a_statement_binds_in_its_own_scope() -> None:
    """dataflow.bound_names: targets, nested blocks, walrus, loop/with targets, del, imports and except names;
    a def's or class's own name but not the names its body binds (its own scope), nor a lambda's parameters."""
    import ast

    from npufuse.scan.dataflow import bound_names, stored_name

    stmt = ast.parse(
        "if c:\n"
        "    a, (b, *d) = f()\n"
        "    for i in range(3):\n"
        "        e += (w := i)\n"
        "    with g() as h:\n"
        "        del k\n"
        "    import os.path as osp, sys\n"
        "    try:\n"
        "        pass\n"
        "    except E as err:\n"
        "        pass\n"
        "    def inner(p):\n"
        "        hidden = p\n"
        "    class C:\n"
        "        attr = 1\n"
        "    fn = lambda q: q\n"
        "    x.y = z[0]\n"
    ).body[0]
    assert bound_names(stmt) == {"a", "b", "d", "i", "e", "w", "h", "k", "osp", "sys", "err", "inner", "C", "fn"}
    assert stored_name(ast.parse("v = 1").body[0].targets[0]) == "v"  # type: ignore[attr-defined]
    assert stored_name(ast.parse("v").body[0].value) is None  # type: ignore[attr-defined]
