"""The faster helpers on the scan's output path give exactly what the slower ones they replaced
gave: scan.json's serializer against json.dumps, the report's escaping against the original
regex versions, the plain-data copy against copy.deepcopy."""

from __future__ import annotations

import copy
import enum
import json
import re
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from npufuse.report import markdown
from npufuse.scan import engine
from npufuse.scan.command import dumps

# -- scan.json ----------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text()
_keys = st.text() | st.integers() | st.booleans() | st.none() | st.floats(allow_nan=False)
_json_like = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(_json_like)
def test_dumps_is_json_dumps(value: Any) -> None:
    assert dumps(value) == json.dumps(value, indent=2, ensure_ascii=False)


class _Level(enum.IntEnum):
    LOW = 1


class _Text(str):
    pass


def test_dumps_hands_odd_values_to_json() -> None:
    for value in ({"a": _Level.LOW}, {"a": [_Text("x")]}, {1: "one"}, [float("nan"), float("inf")], {"deep": [[[]], {}]}):
        assert dumps(value) == json.dumps(value, indent=2, ensure_ascii=False)
    try:
        dumps({"x": object()})
    except TypeError:
        pass
    else:
        raise AssertionError("an unserializable value must fail as json.dumps does")


def test_dumps_of_a_real_scan(tmp_path) -> None:
    from scan_fakes import copy_fixture

    scan = engine.scan_repo(copy_fixture(tmp_path), jobs=1).to_json()
    assert dumps(scan) == json.dumps(scan, indent=2, ensure_ascii=False)


# -- report.md helpers: the original implementations, kept here as the reference ----------------

_PROSE_SPECIAL = re.compile(r"([\\`*_{}\[\]<>|#~!])")
_LINE_START = re.compile(r"^(\s*)([-+=]|\d+[.)])(?=\s|$)", re.MULTILINE)


def _ref_escape(s: str) -> str:
    return _PROSE_SPECIAL.sub(r"\\\1", s).replace("&", "&amp;")


def _ref_one_line(text: Any) -> str:
    return re.sub(r"\s+", " ", str(text))


def _ref_md(text: Any) -> str:
    s = _ref_escape(_ref_one_line(text).strip())
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), s)


def _ref_prose(text: Any, table: bool = False) -> str:
    s = _ref_one_line(text).strip()
    out, pos = [], 0
    for m in re.finditer(r"`([^`]+)`", s):
        out.append(_ref_escape(s[pos : m.start()]))
        out.append(markdown.code(m.group(1), table=table))
        pos = m.end()
    out.append(_ref_escape(s[pos:]))
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), "".join(out))


def _ref_fence(text: str, lang: str = "python") -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=0)
    bar = "`" * max(3, longest + 1)
    body = text if text.endswith("\n") else text + "\n"
    return f"{bar}{lang}\n{body}{bar}"


# text rich in what the helpers treat specially: markdown specials, backticks, digits, list
# markers, ASCII and Unicode whitespace (incl. \x1c-\x1f and U+3000), & and newlines
_tricky = st.text(alphabet=st.sampled_from(list("\\`*_{}[]<>|#~!&-+=.)1234567890 \t\n\r\x0b\x0c\x1c\x1f\u00a0\u2028\u3000\u0663abcXYZé")) | st.characters(), max_size=40)


@settings(max_examples=600, deadline=None)
@given(_tricky)
def test_escaping_helpers_match_the_originals(text: str) -> None:
    assert markdown._escape(text) == _ref_escape(text)
    assert markdown._one_line(text) == _ref_one_line(text).strip()
    assert markdown.md(text) == _ref_md(text)
    assert markdown.prose(text) == _ref_prose(text)
    assert markdown.prose(text, table=True) == _ref_prose(text, table=True)
    assert markdown.fence(text) == _ref_fence(text)


def test_escaping_examples() -> None:
    assert markdown.md("1. not a list") == _ref_md("1. not a list") == "\\1. not a list"
    assert markdown.md("- dash") == "\\- dash"
    assert markdown.prose("a `x_y` & b_c") == "a `x_y` &amp; b\\_c"
    assert markdown.md(12) == "12" and markdown.md(None) == "None"


def test_template_lookups_on_dicts_behave_as_jinja2s() -> None:
    env = markdown._env()
    assert env is markdown._env()  # one per process
    import jinja2

    plain = jinja2.Environment(undefined=jinja2.StrictUndefined)
    # a key shadowed by a dict method stays the method, as in jinja2 (attribute first)
    for src in ("{{ d.file }}", "{{ d.items is callable }}", "{{ d.get('file') }}", "{{ d.keys is callable }}", "{{ d.__class__.__name__ }}"):
        data = {"file": "a.py", "items": 3}
        assert env.from_string(src).render(d=data) == plain.from_string(src).render(d=data), src
    try:
        env.from_string("{{ d.missing }}").render(d={})
    except jinja2.UndefinedError:
        pass
    else:
        raise AssertionError("a missing key stays an error (StrictUndefined)")


# -- candidates ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(_json_like)
def test_copy_plain_is_a_deep_copy(value: Any) -> None:
    copied = engine._copy_plain(value)
    assert repr(copied) == repr(copy.deepcopy(value))  # repr: NaN compares unequal to itself
    if isinstance(value, (dict, list)) and value:
        assert copied is not value


def test_copy_plain_shares_no_container() -> None:
    shapes = {"hidden_size": {"value": 8, "from": "config.json"}, "dims": {"value": [1, [2]], "from": "x"}}
    copied = engine._copy_plain(shapes)
    assert copied == shapes
    copied["dims"]["value"][1].append(3)
    copied["hidden_size"]["value"] = 9
    assert shapes == {"hidden_size": {"value": 8, "from": "config.json"}, "dims": {"value": [1, [2]], "from": "x"}}


def test_prefiltered_switches_choose_the_same(tmp_path) -> None:
    """_candidates hands choose_switch only the switches relevant to the pattern: same choice."""
    from npufuse.scan import repo_search
    from scan_fakes import copy_fixture

    root = copy_fixture(tmp_path)
    res = engine.scan_repo(root, jobs=1)
    switches = res.switches + [
        {"file": "z.py", "line": 1, "name": "use_fused_rms_norm", "kind": "config_field"},
        {"file": "a.py", "line": 9, "name": "enable_fusion", "kind": "argument"},
        {"file": "a.py", "line": 2, "name": "unrelated_flag", "kind": "env"},
    ]
    outcomes = engine._analyze_all(Path(root), engine.walk(root).files, engine.select_patterns(None)[0], engine.ScanOptions(), 1, None)
    hits = [h for o in outcomes for h in o.hits]
    assert hits
    for h in hits:
        p = h.finding.pattern
        for mode in ("auto", "env", "none"):
            full = repo_search.choose_switch(p, h.context, switches, mode)
            usable = [s for s in switches if repo_search.switch_relevance(p, s["name"])]
            assert repo_search.choose_switch(p, h.context, usable, mode) == full

