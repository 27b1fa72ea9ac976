"""report.md: escaping, structure, the replacement shown exactly, nothing time-dependent."""

from __future__ import annotations

import re

from npufuse.report.markdown import code, fence, md, prose, render_markdown, tcode
from npufuse.rewrite.codegen import PRELUDE
from npufuse.scan.engine import ORDER_RULE, scan_repo
from scan_fakes import FAKES, copy_fixture


def test_md_escapes_markdown_syntax():
    assert md("a_b *c* [x](y) <b> | ~d~ #e") == r"a\_b \*c\* \[x\](y) \<b\> \| \~d\~ \#e"
    assert md("line one\nline two") == "line one line two"
    assert md("- item") == r"\- item"
    assert md("R&D") == "R&amp;D"


def test_inline_code_survives_backticks_and_pipes():
    assert code("x.pow(2)") == "`x.pow(2)`"
    assert code("a`b") == "``a`b``"
    assert code("`x") == "`` `x ``"
    assert tcode("a | b") == r"`a \| b`"


def test_prose_keeps_quoted_code_and_escapes_the_rest():
    assert prose("the `if` at line 3 *now*") == r"the `if` at line 3 \*now\*"
    assert prose("`a_b` and c_d") == r"`a_b` and c\_d"


def test_fence_is_longer_than_any_backtick_run_inside():
    text = 'doc = """\n```python\nx\n```\n"""\n'
    out = fence(text)
    assert out.startswith("````python\n") and out.endswith("\n````") and text in out
    assert fence("x = 1").startswith("```python\nx = 1\n```")


def _report(tmp_path):
    root = copy_fixture(tmp_path)
    scan = scan_repo(root, patterns=FAKES).to_json()
    return scan, render_markdown(scan, order_rule=ORDER_RULE)


def test_sections_in_order_and_the_closing_statement(tmp_path):
    scan, text = _report(tmp_path)
    outside = re.sub(r"^(`{3,})[a-z]*\n.*?^\1$", "", text, flags=re.MULTILINE | re.DOTALL)
    heads = re.findall(r"^(#{1,3} .+)$", outside, re.MULTILINE)
    order = ["# npufuse scan report", "## 1. Summary", "### 1.1 Candidates", "## 2. Suggested order", "## 3. Candidates",
             "## 4. Module prelude", "## 5. Near misses", "## 6. Existing fused code and switches", "## 7. Problems", "## 8. How to accept"]
    assert [h for h in heads if not h.startswith("### Candidate ")] == order
    assert len([h for h in heads if h.startswith("### Candidate ")]) == len(scan["candidates"])
    assert "npufuse apply --accept" in text and "npufuse apply --accept all" in text
    assert text.rstrip().endswith("no source file was modified.")
    assert "**Nothing was changed.**" in text


def test_replacements_shown_exactly_and_prelude_once(tmp_path):
    scan, text = _report(tmp_path)
    for c in scan["candidates"]:
        assert fence(c["replacement"]) in text
        assert fence(c["code"]) in text
    assert text.count(PRELUDE.splitlines()[0]) == 1
    assert "added once per module" in text


def test_summary_row_per_candidate_and_stable_output(tmp_path):
    scan, text = _report(tmp_path)
    rows = [ln for ln in text.splitlines() if ln.startswith("| [")]
    assert len(rows) == len(scan["candidates"])
    assert render_markdown(scan, order_rule=ORDER_RULE) == text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d:\d\d\b", text)


def test_hostile_repo_text_cannot_break_the_report():
    scan = {
        "root": "r", "files_scanned": 1, "lines_scanned": 1, "patterns": ["rms_norm"], "patterns_missing": [],
        "candidates": [], "suggested_order": [], "existing": [], "switches": [], "skipped": [],
        "near_misses": [{"pattern": "rms_norm", "file": "a|b.py", "qualname": "<module>", "line": 1, "end_line": 1,
                         "reason": "</a> [click](http://x) | # not a heading\n\n## injected"}],
        "files_failed": [{"file": "x.py", "kind": "syntax", "error": "SyntaxError: line 1: `` ` `` | <script>"}],
    }
    text = render_markdown(scan)
    row = next(ln for ln in text.splitlines() if ln.startswith("| `rms_norm`"))
    assert row.count(" | ") == 3  # still four cells
    assert "\n## injected" not in text and "<script>" not in text and "</a> [click]" not in text
