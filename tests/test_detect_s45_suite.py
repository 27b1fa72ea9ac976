"""s45 suite time: the rewriter's faster bookkeeping gives what the full libcst walk gave.

rewrite_source finds where each new if/else block landed in its output from the position table it
resolves anyway (marked ifs sorted by where they start) instead of walking the output tree a second
time. These tests recompute every span the slow way (a full CSTVisitor walk in document order) and
compare, on every runnable pattern example and on files that already hold marked sites."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from npufuse.patterns.registry import all_patterns
from npufuse.rewrite.codegen import env_switch, site_edit
from npufuse.rewrite.transform import _MarkedCollector, rewrite_source
from pattern_harness import detect_all

def _full_walk_spans(text: str) -> list[tuple[int, int]]:
    """(first, last) line of every marked if in ``text``, in the order a full libcst visit meets them."""
    wrapper = MetadataWrapper(cst.parse_module(text))
    positions = wrapper.resolve(PositionProvider)
    walker = _MarkedCollector()
    wrapper.module.visit(walker)
    return [(positions[n].start.line, positions[n].end.line) for n in walker.nodes]


def _edits(pattern, code: str, tag_from: int = 0):
    findings, _ = detect_all(pattern, code)
    return [site_edit(f, env_switch(f.pattern), site_id=tag_from + k) for k, f in enumerate(findings)]


def _check_spans(source: str, edits) -> str:
    outcome = rewrite_source(source, edits)
    assert not outcome.skipped, outcome.skipped
    walked = _full_walk_spans(outcome.text)
    # one span per applied edit, each the span of a marked if in the output
    assert len(outcome.spans) == len(outcome.applied) >= 1
    assert set(outcome.spans.values()) <= set(walked)
    # the new ifs keep their document order: tags sorted by span are the edits sorted by line
    by_span = [tag for tag, _ in sorted(outcome.spans.items(), key=lambda kv: kv[1])]
    by_line = [e.tag or str(e.line) for e in sorted(outcome.applied, key=lambda e: e.line)]
    assert by_span == by_line
    # and each span holds its own fused text's guard
    lines = outcome.text.splitlines()
    for tag, (first, last) in outcome.spans.items():
        assert lines[first - 1].lstrip().startswith("if "), (tag, lines[first - 1])
        assert last >= first
    return outcome.text


def test_spans_are_those_of_the_full_walk() -> None:
    """Per pattern, its first three runnable examples (of its first 20) with two sites or more (where the order of the
    new ifs matters), else its first runnable example."""
    checked = 0
    for pattern in all_patterns():
        runnable = [ex for ex in pattern.FUSE if ex.run]
        several = [ex for ex in runnable[:20] if len(detect_all(pattern, ex.code)[0]) >= 2][:3]
        for ex in several or runnable[:1]:
            _check_spans(ex.code, _edits(pattern, ex.code))
            checked += 1
    assert checked >= len(all_patterns())


def test_spans_next_to_sites_rewritten_earlier() -> None:
    """A file that already holds marked ifs (an earlier apply): the new ones are mapped past them."""
    by_id = {p.id: p for p in all_patterns()}
    rms = by_id["rms_norm"]
    ex = next(e for e in rms.FUSE if e.run and len(detect_all(rms, e.code)[0]) >= 1)
    # the same example twice in one file, under two function names: rewrite the first, then the second
    first_half = ex.code
    second_half = ex.code.replace("def ", "def again_").replace("class ", "class Again")
    source = first_half + "\n\n" + second_half
    edits = _edits(rms, source)
    if len(edits) < 2:
        pytest.skip("example gives one site only when doubled")
    once = _check_spans(source, edits[len(edits) // 2 :])
    # positions moved: detect again on the rewritten text, rewrite the sites left
    left = [e for e in _edits(rms, once, tag_from=100) if not once.splitlines()[e.line - 1].lstrip().startswith("if ")]
    if left:
        _check_spans(once, left[:1])
