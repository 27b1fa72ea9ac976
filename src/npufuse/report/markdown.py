"""``report.md`` of ``npufuse scan``: a jinja2 template over the plain scan.json data.

Everything taken from the scanned repository is escaped where it is prose (reasons, details,
errors) and quoted as code where it is code (paths, names, expressions: inline code spans; the
matched code and the replacement: fenced blocks whose fence is longer than any backtick run
inside). The output has no timestamps and a fixed ordering, so it can be diffed and golden-tested.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2

from npufuse.rewrite.codegen import PRELUDE

_TEMPLATES = Path(__file__).parent / "templates"
# Markdown's special characters get a backslash (the backslash itself first, so the added ones
# are not escaped again), then & becomes &amp;. A report escapes tens of thousands of short
# strings: a search for any of them, then str.replace per character present, is several times
# faster than a regex substitution with a group template or a str.translate to longer strings.
_SPECIALS = "\\`*_{}[]<>|#~!"
_ANY_SPECIAL = re.compile(r"[\\`*_{}\[\]<>|#~!&]")
_LINE_START = re.compile(r"^(\s*)([-+=]|\d+[.)])(?=\s|$)", re.MULTILINE)


def _escape(s: str) -> str:
    if _ANY_SPECIAL.search(s) is None:
        return s
    for c in _SPECIALS:
        if c in s:
            s = s.replace(c, "\\" + c)
    return s.replace("&", "&amp;")


def _one_line(text: Any) -> str:
    """The text on one line, whitespace runs as one space, stripped (str.split and the regex
    ``\\s`` agree on what whitespace is)."""
    return " ".join(str(text).split())


def _guard_line_start(s: str) -> str:
    """A backslash before what would start a list item or heading (``- x``, ``1. x``, ``= x``)."""
    first = s.lstrip()[:1]
    if not first or not (first in "-+=" or first.isdigit()):
        return s  # cannot match: skip the regex (most strings)
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), s)


def md(text: Any) -> str:
    """Markdown-escape prose from the repository (one line: newlines become spaces)."""
    return _guard_line_start(_escape(_one_line(text)))


def code(text: Any, table: bool = False) -> str:
    """An inline code span that survives any backticks inside (and ``|`` inside tables)."""
    s = " ".join(str(text).split())
    if "`" not in s:  # the common case, without the regex
        return f"`{s}`".replace("|", "\\|") if table else f"`{s}`"
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or (s.startswith(" ") and s.strip()) else ""
    out = f"{fence}{pad}{s}{pad}{fence}"
    return out.replace("|", "\\|") if table else out


_SPAN = re.compile(r"`([^`]+)`")


def prose(text: Any, table: bool = False) -> str:
    """Prose that may quote code between backticks (as npufuse's own messages and detector
    reasons do): the quoted parts become safe code spans, everything else is escaped."""
    s = _one_line(text)
    if "`" not in s:
        return _guard_line_start(_escape(s))
    out, pos = [], 0
    for m in _SPAN.finditer(s):
        out.append(_escape(s[pos : m.start()]))
        out.append(code(m.group(1), table=table))
        pos = m.end()
    out.append(_escape(s[pos:]))
    return _guard_line_start("".join(out))


def tprose(text: Any) -> str:
    return prose(text, table=True)


def tcode(text: Any) -> str:
    return code(text, table=True)


def cell(text: Any) -> str:
    return md(text)


def fence(text: str, lang: str = "python") -> str:
    """A fenced block around ``text`` verbatim (fence longer than any backtick run inside)."""
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=0) if "```" in text else 0
    bar = "`" * max(3, longest + 1)
    body = text if text.endswith("\n") else text + "\n"
    return f"{bar}{lang}\n{body}{bar}"


def value_label(value: dict[str, Any]) -> str:
    bound = value.get("bound", "?")
    speedup = value.get("speedup_bound")
    if isinstance(speedup, (int, float)) and not isinstance(speedup, bool):
        if speedup < 0.95:  # the site's own estimate is a slowdown: say so, not "≤0.73×"
            merged = value.get("merged_speedup_bound")
            return f"slower as written ({speedup:.2f}×)" + (f"; merged weights ≤{merged:.2f}×" if isinstance(merged, (int, float)) else "")
        return f"≤{speedup:.2f}× ({bound})"
    return f"{bound}, symbolic"


def risk_label(c: dict[str, Any]) -> str:
    n = len(c.get("risks", []))
    return f"{c.get('risk_level', 'none')} ({n})" if n else "none"


def _shapes_line(shapes: dict[str, Any]) -> str:
    """``hidden_size=1024, num_attention_heads=16 (from config.json); batch_size=4 (assumed)``,
    grouped by where the values come from, as prose with code spans."""
    groups: dict[str, list[str]] = {}
    for key in sorted(shapes):
        entry = shapes[key]
        groups.setdefault(str(entry.get("from")), []).append(f"`{key}={entry.get('value')}`")
    parts = []
    for origin in sorted(groups, key=lambda o: (o in ("assumed", "command line"), o)):
        label = origin if origin in ("assumed", "command line") else f"from `{origin}`"
        parts.append(f"{', '.join(groups[origin])} ({label})")
    return "; ".join(parts)


def switch_text(switch: dict[str, Any]) -> str:
    """How a candidate's fused branch is switched, as prose with code spans."""
    kind = switch.get("kind")
    if kind == "env":
        name = switch.get("name", "")
        return f"the environment variable `{name}` (on by default; `{name}=0` runs the original code)"
    if kind == "existing":
        reused = switch.get("reuses") or {}
        where = f", the repo's {reused.get('kind', 'switch').replace('_', ' ')} `{reused.get('name')}` from `{reused.get('file')}:{reused.get('line')}`" if reused else ""
        return f"the existing switch `{switch.get('expr')}`{where}"
    if kind == "new_field":
        return f"a new config field, read as `{switch.get('expr')}` (on unless the config sets it false)"
    return "no switch: the fused branch runs whenever torch_npu is importable and the tensor is on an NPU"


# Every attribute of a plain dict instance (its methods and object's): jinja2 resolves
# ``c.file`` as an attribute first and only then as a key.
_DICT_ATTRS = frozenset(dir(dict))


class _Environment(jinja2.Environment):
    """jinja2's ``getattr`` with a shortcut for plain dicts, which is all the report's data is.
    The default tries ``getattr(obj, name)`` first, which for a dict key costs a raised and
    caught AttributeError per lookup (about 100,000 in a large report). A name that is not a
    dict attribute can only resolve as a key, so look it up as one directly: the same result."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


_ENV: jinja2.Environment | None = None


def _env() -> jinja2.Environment:
    """One environment per process: it keeps the compiled template (recompiled only when the
    file changes, jinja2's auto_reload)."""
    global _ENV
    if _ENV is None:
        _ENV = _new_env()
    return _ENV


def _new_env() -> jinja2.Environment:
    env = _Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        autoescape=False,  # Markdown: escaping is explicit, per context (md / code / fence)
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(
        md=_memo(md), code=_memo(code), tcode=_memo(tcode), cell=_memo(cell), prose=_memo(prose), tprose=_memo(tprose), fence=fence,
        value_label=value_label, risk_label=risk_label, shapes_line=_shapes_line, switch_text=switch_text,
    )
    return env


# The escaping filters are pure functions of their text, and a report asks them the same texts
# again and again (paths, pattern names, the same risk details for every candidate of a
# pattern): each render remembers their answers for plain strings, and forgets them after.
_MEMOS: list[dict[str, str]] = []


def _memo(fn: Any) -> Any:
    cache: dict[str, str] = {}
    _MEMOS.append(cache)

    def filt(text: Any, *args: Any, **kwargs: Any) -> str:
        if type(text) is not str or args or kwargs:
            return fn(text, *args, **kwargs)
        out = cache.get(text)
        if out is None:
            out = cache[text] = fn(text)
        return out

    return filt


def render_markdown(scan: dict[str, Any], *, state_path: str = ".npufuse/scan.json", order_rule: str = "", profile_section: str | None = None) -> str:
    """The report for one scan (``ScanResult.to_json()``)."""
    by_id = {c["id"]: c for c in scan["candidates"]}
    order = [by_id[i] for i in scan.get("suggested_order", []) if i in by_id]
    rewritten = sorted({c["file"] for c in scan["candidates"]})
    first_ids = [c["id"] for c in order if c.get("risk_level") in ("none", "low")][:3] or [c["id"] for c in order][:2]
    existing = [e for e in scan["existing"]]
    template = _env().get_template("report.md.j2")
    try:
        text = template.render(
            scan=scan,
            candidates=scan["candidates"],
            order=order,
            order_rule=order_rule,
            prelude=PRELUDE,
            rewritten=rewritten,
            first_ids=first_ids,
            existing=existing,
            state_path=state_path,
            profile_section=profile_section,
        )
    finally:
        for cache in _MEMOS:
            cache.clear()
    return text.rstrip("\n") + "\n"
