"""The libcst engine: guarded branch around the verbatim original, exact revert."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
import pytest

from npufuse.rewrite.codegen import PRELUDE_END, PRELUDE_MARKER, source_lines
from npufuse.rewrite.transform import SiteEdit, marked_sites, revert_source, rewrite_source

GUARD = '_npufuse_on_npu(x) and _npufuse_switch("NPUFUSE_RMS_NORM")'

SOURCE = textwrap.dedent('''\
    """Module docstring."""
    from __future__ import annotations

    import torch


    class RMSNorm:
        def forward(self, x):
            # mean of squares; keep this comment
            v = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(v + 1e-6)  # trailing comment
            return self.weight * x


    def nested(x, flag):
        if flag:
            for _ in range(2):
                y = x + 1
                z = y * 2
        return x
    ''')


def edit(line, end, fused="return x", guard=GUARD, pattern="rms_norm", tag=""):
    return SiteEdit(line, end, fused, guard, pattern, tag or f"{line}")


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(source_lines(text), 1) if needle in ln)


def original_lines(text: str, a: int, b: int) -> str:
    return "".join(source_lines(text)[a - 1 : b])


def test_fallback_is_the_original_statements_byte_for_byte():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    out = rewrite_source(SOURCE, [edit(a, b, "return torch_npu.npu_rms_norm(x, self.weight)[0]")])
    assert not out.skipped
    start, end = out.spans[str(a)]
    block = original_lines(out.text, start, end)
    assert block.splitlines()[0].endswith("# npufuse: rms_norm")
    fallback = block.split("else:\n", 1)[1]
    # one more indentation level, otherwise identical (trailing comment included)
    assert textwrap.dedent(fallback) == textwrap.dedent(original_lines(SOURCE, a, b))
    assert fallback == textwrap.indent(original_lines(SOURCE, a, b), "    ")
    ast.parse(out.text)


def test_apply_then_revert_is_identity():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    c = line_of(SOURCE, "y = x + 1")
    out = rewrite_source(SOURCE, [edit(a, b), edit(c, c + 1, "y = x + 1\nz = y * 2", pattern="swiglu")])
    assert len(out.applied) == 2 and out.text.count(PRELUDE_MARKER) == 1
    back = revert_source(out.text)
    assert back.text == SOURCE and back.notes == []
    assert len(back.reverted) == 2


def test_revert_one_site_keeps_the_other_and_the_prelude():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    c = line_of(SOURCE, "y = x + 1")
    out = rewrite_source(SOURCE, [edit(a, b, tag="n"), edit(c, c + 1, "pass", pattern="swiglu", tag="s")])
    one = revert_source(out.text, {out.spans["n"][0]})
    assert [m.pattern for m in marked_sites(one.text)] == ["swiglu"]
    assert PRELUDE_MARKER in one.text
    assert revert_source(one.text).text == SOURCE


def test_revert_after_unrelated_edits_elsewhere_keeps_them():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    out = rewrite_source(SOURCE, [edit(a, b)])
    edited = out.text.replace("import torch\n", "import torch\nimport math  # added by the user\n", 1)
    edited = edited.replace("        return x\n", "        return x  # user edit\n") + "\n\ndef added():\n    return 1\n"
    back = revert_source(edited)
    expected = SOURCE.replace("import torch\n", "import torch\nimport math  # added by the user\n", 1)
    expected = expected.replace("        return x\n", "        return x  # user edit\n") + "\n\ndef added():\n    return 1\n"
    assert back.text == expected


def test_already_marked_site_is_reported_not_rewritten_again():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    out = rewrite_source(SOURCE, [edit(a, b)])
    start, end = out.spans[str(a)]
    again = rewrite_source(out.text, [edit(start, end)])
    assert again.text == out.text and not again.applied
    assert "already fused" in again.skipped[0][1]


@pytest.mark.parametrize(
    "needle,end_offset,reason",
    [
        ("v = x.pow", 0, None),  # fine: one statement
        ("def forward", 1, "not whole statements"),  # starts at the def, ends inside it
        ("mean of squares", 0, "does not start a statement"),  # a comment line
        ("for _ in range", 1, "not whole statements"),  # ends inside the for body
    ],
)
def test_sites_not_on_whole_statements_are_refused_with_a_reason(needle, end_offset, reason):
    a = line_of(SOURCE, needle)
    out = rewrite_source(SOURCE, [edit(a, a + end_offset)])
    if reason is None:
        assert out.applied
    else:
        assert not out.applied and out.text == SOURCE
        assert reason in out.skipped[0][1]


def test_semicolon_lines_and_overlaps_are_refused():
    src = "import torch\n\n\ndef f(x):\n    a = 1; b = 2\n    c = a + b\n    return c\n"
    out = rewrite_source(src, [edit(5, 5, "a = 1")])
    assert "share a line" in out.skipped[0][1]
    out = rewrite_source(src, [edit(6, 7, tag="one"), edit(7, 7, tag="two")])
    assert [e.tag for e in out.applied] == ["one"]
    assert "overlaps site one" in out.skipped[0][1]


def test_generated_code_that_does_not_parse_is_refused():
    a = line_of(SOURCE, "v = x.pow")
    out = rewrite_source(SOURCE, [edit(a, a, fused="v = (")])
    assert "does not parse" in out.skipped[0][1] and out.text == SOURCE
    out = rewrite_source(SOURCE, [edit(a, a, guard="x and")])
    assert "does not parse" in out.skipped[0][1]


def test_comments_above_the_span_stay_above_the_if():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    out = rewrite_source(SOURCE, [edit(a, b)], prelude=False)
    lines = source_lines(out.text)
    start = out.spans[str(a)][0]
    assert lines[start - 2].strip() == "# mean of squares; keep this comment"
    assert lines[start - 1].lstrip().startswith("if " + GUARD)


def test_nested_blocks():
    a = line_of(SOURCE, "y = x + 1")
    out = rewrite_source(SOURCE, [edit(a, a + 1, "y = x + 1\nz = y * 2", pattern="swiglu")], prelude=False)
    start, end = out.spans[str(a)]
    block = original_lines(out.text, start, end)
    assert block.startswith("            if " + GUARD)  # the for body's indentation
    assert block.split("else:\n", 1)[1] == textwrap.indent(original_lines(SOURCE, a, a + 1), "    ")
    assert revert_source(out.text).text == SOURCE


def test_multiline_strings_inside_the_span_are_unchanged():
    src = textwrap.dedent('''\
        import torch


        def f(x):
            doc = """first
        second line at column 0
            third"""
            y = x * 2
            return y, doc
        ''')
    out = rewrite_source(src, [edit(5, 9, "return x + x, ''")])
    assert 'doc = """first\nsecond line at column 0\n    third"""' in out.text
    tree = ast.parse(out.text)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and "second line" in n.value]
    assert strings == ["first\nsecond line at column 0\n    third"]
    assert revert_source(out.text).text == src


def test_prelude_placement_docstring_future_imports():
    a = line_of(SOURCE, "v = x.pow")
    out = rewrite_source(SOURCE, [edit(a, a)])
    lines = out.text.splitlines()
    # docstring, __future__ and the import block come first; the prelude right after them
    assert lines[0] == '"""Module docstring."""'
    assert lines[1] == "from __future__ import annotations"
    assert lines.index("import torch") < lines.index(next(ln for ln in lines if ln.startswith(PRELUDE_MARKER)))
    assert PRELUDE_END in out.text
    compile(out.text, "m.py", "exec")  # __future__ still first


@pytest.mark.parametrize(
    "src",
    [
        "def f(x):\n    return x * 2\n",  # no imports at all
        "#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n# License header\n\ndef f(x):\n    return x * 2\n",
        '"""Only a docstring."""\ndef f(x):\n    return x * 2\n',
        "import torch\r\n\r\n\r\ndef f(x):\r\n    return x * 2\r\n",  # CRLF file
        "import torch\ndef f(x):\n    return x * 2",  # no blank lines, no final newline
        "import torch\n\n\ndef f(x):\n    s = 'a\x0cb'\n    return x * 2\n",  # form feed: str.splitlines would miscount
    ],
)
def test_files_without_imports_or_with_odd_layout_round_trip(src):
    a = line_of(src, "return x * 2")
    out = rewrite_source(src, [edit(a, a, "return x + x", guard="_npufuse_on_npu(x)")])
    assert out.applied and not out.skipped
    assert source_lines(out.text)[out.spans[str(a)][0] - 1].lstrip().startswith("if _npufuse_on_npu(x):")
    ns: dict = {}
    exec(compile(out.text, "m.py", "exec"), ns)  # imports without torch_npu
    assert ns["f"](3) == 6  # CPU int: not on an NPU, the original branch runs
    if src.startswith("#!"):
        assert out.text.startswith("#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n")
    if "\r\n" in src:
        assert "\n" not in out.text.replace("\r\n", "")
    assert revert_source(out.text).text == src


def test_two_identical_sites_get_their_own_spans():
    src = "import torch\n\n\ndef f(x):\n    return x * 2\n\n\ndef g(x):\n    return x * 2\n"
    out = rewrite_source(src, [edit(5, 5, "return x + x", tag="f"), edit(9, 9, "return x + x", tag="g")])
    assert out.spans["f"][0] < out.spans["g"][0]
    assert [(m.qualname, m.line) for m in marked_sites(out.text)] == [("f", out.spans["f"][0]), ("g", out.spans["g"][0])]


def test_marked_sites_report_qualnames_like_the_scan():
    a, b = line_of(SOURCE, "v = x.pow"), line_of(SOURCE, "return self.weight")
    c = line_of(SOURCE, "y = x + 1")
    out = rewrite_source(SOURCE, [edit(a, b), edit(c, c, "pass", pattern="swiglu")])
    assert [(m.pattern, m.qualname) for m in marked_sites(out.text)] == [("rms_norm", "RMSNorm.forward"), ("swiglu", "nested")]


def test_edited_prelude_is_left_in_place_with_a_note():
    a = line_of(SOURCE, "v = x.pow")
    out = rewrite_source(SOURCE, [edit(a, a)])
    edited = out.text.replace("torch_npu = None", "torch_npu = None  # edited")
    back = revert_source(edited)
    assert not marked_sites(back.text) and PRELUDE_MARKER in back.text
    assert any("prelude was edited" in n for n in back.notes)


def test_revert_of_unknown_line_says_so():
    back = revert_source(SOURCE, {3})
    assert back.text == SOURCE and back.reverted == [] and "line(s) 3" in back.notes[0]


def test_earlier_edits_win_an_overlap():
    src = "import torch\n\n\ndef f(x):\n    a = x + 1\n    b = a * 2\n    return b\n"
    out = rewrite_source(src, [edit(6, 7, tag="first"), edit(5, 6, tag="second")])
    assert [e.tag for e in out.applied] == ["first"]
    assert "overlaps site first (lines 6-7)" in out.skipped[0][1]


def test_a_span_starting_at_an_elif_is_skipped_saying_so():
    # found by the rewrite fuzzer: an ``elif`` is the ``if`` above it's else branch, no statement of its own
    src = ("import torch\n\n\ndef f(x, kind):\n    if kind == 'a':\n        y = x + 1\n"
           "    elif kind == 'b':\n        y = x * 2\n    else:\n        y = x\n    return y\n")
    out = rewrite_source(src, [edit(7, 10, "y = x", tag="elif")])
    assert out.text == src and not out.applied
    assert out.skipped[0][1] == "line 7 is an `elif` branch of the `if` above it, not a statement of its own block"
