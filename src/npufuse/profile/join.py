"""Joining the profile with the static scan (``npufuse scan PATH --profile DIR``), and section 1.2.

Pure functions over plain data: the profile result dict (``analysis.analyze`` / ``npufuse profile
--format json``) and scan.json candidate dicts (DESIGN.md). The scan stage calls them.
"""

from __future__ import annotations

import copy
import re
from pathlib import PurePosixPath
from typing import Any

from npufuse.profile.render import fmt_pct, fmt_us, location_text, seq_text

_FRAME_TEXT = re.compile(r"^(?P<file>.*):(?P<line>\d+)(?: (?P<func>.*))?$")


def _parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in PurePosixPath(str(path).replace("\\", "/")).parts if p not in ("/", "."))


def _same_file(trace_file: str, cand_file: str) -> bool:
    """Trace paths are absolute on the profiled host; scan paths are relative to the scanned root:
    the candidate's path must be a suffix of the trace path."""
    a, b = _parts(trace_file), _parts(cand_file)
    return bool(b) and len(b) <= len(a) and a[-len(b):] == b


def _sites(item: dict[str, Any]) -> list[tuple[str, int]]:
    """(file, line) pairs of a sequence: its scope lines and the innermost frame of each op."""
    loc = item.get("location") or {}
    out: list[tuple[str, int]] = []
    if loc.get("file"):
        for ln in loc.get("lines") or ([loc["line"]] if loc.get("line") else []):
            out.append((loc["file"], int(ln)))
    for fr in loc.get("frames") or []:
        m = _FRAME_TEXT.match(fr)
        if m:
            out.append((m.group("file"), int(m.group("line"))))
    return out


def _inside(c: dict[str, Any], file: str, line: int) -> bool:
    try:
        lo, hi = int(c["line"]), int(c.get("end_line", c["line"]))
    except (KeyError, TypeError, ValueError):
        return False
    return _same_file(file, str(c.get("file", ""))) and lo <= line <= hi


def join_with_scan(profile_result: dict[str, Any], candidates: list[dict[str, Any]]
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Link mined sequences to static-scan candidates; rank candidates by measured time.

    Inputs (not modified):
      ``profile_result``: the dict ``npufuse profile --format json`` prints (uses its ``fusions``,
      ``unmapped``, ``totals``).
      ``candidates``: scan.json candidates; each needs ``file`` (relative to the scanned root),
      ``line``, ``end_line`` (1-based, inclusive) and ``pattern``; ``id``/``key`` are carried along.

    Linking, for each profile fusion and each frequent unmapped sequence, first rule that applies:
      1. ``"stack"``: a call-stack line of the sequence (its scope lines or an op's innermost frame)
         lies in ``[line, end_line]`` of a candidate in the same file (the candidate path is a
         suffix of the trace path). Among several, a candidate with the same pattern wins, then the
         narrowest span. ``same_pattern`` tells whether the ids agree (an ``add_rms_norm`` sequence
         inside an ``rms_norm`` candidate links with ``same_pattern: False``).
      2. ``"pattern"``: the sequence has no location (profile without stacks) and candidates of the
         same pattern exist: it links to all of them and its time is split evenly among them.
    An unmapped sequence is explained only by a candidate that holds all of its lines; it is then
    listed in that candidate's ``profile_covers`` and adds no time (n-grams overlap the fusions).

    Returns ``(ranked, unexplained)``:
      ``ranked``: copies of all candidates, each with ``profile`` = ``{"time_us", "share", "count",
      "kernels_launched", "sequences", "link", "same_pattern", "speedup_max", "step_saving_max"}`` or
      ``None``; linked ones first by measured time (descending), then the rest in input order.
      ``unexplained``: copies of the profile fusions no candidate explains, then the unmapped
      frequent sequences no candidate explains, each with a ``reason``.
    """
    cands = [copy.deepcopy(c) for c in candidates]
    for c in cands:
        c["profile"] = None
    unexplained: list[dict[str, Any]] = []
    items = [("fusion", f) for f in profile_result.get("fusions", [])] + \
            [("unmapped", s) for s in profile_result.get("unmapped", [])]
    for kind, item in items:
        pattern = item.get("pattern")
        hits: list[int] = []
        link = None
        sites = _sites(item)
        if kind == "unmapped":
            # a frequent sequence is explained only by a candidate holding all of its lines, and it
            # adds no time: n-grams overlap each other and the fusions
            whole = [k for k, c in enumerate(cands) if sites and all(_inside(c, f, ln) for f, ln in sites)]
            if whole:
                for k in whole:
                    cov = cands[k].setdefault("profile_covers", [])
                    cov.append(seq_text(item.get("kernels", [])))
                continue
            u = copy.deepcopy(item)
            u["reason"] = "frequent sequence with no known fused API and no static candidate"
            u["source_kind"] = kind
            unexplained.append(u)
            continue
        for file, line in sites:
            hits += [k for k, c in enumerate(cands) if _inside(c, file, line) and k not in hits]
        if hits:
            link = "stack"
            same = [k for k in hits if cands[k].get("pattern") == pattern]
            pool = same or hits
            best = min(pool, key=lambda k: int(cands[k].get("end_line", 0)) - int(cands[k].get("line", 0)))
            targets = [best]
        elif kind == "fusion" and not item.get("location") and pattern:
            targets = [k for k, c in enumerate(cands) if c.get("pattern") == pattern]
            link = "pattern" if targets else None
        else:
            targets = []
        if not targets:
            u = copy.deepcopy(item)
            if kind == "fusion":
                u["reason"] = ("no static candidate at this call-stack location" if item.get("location")
                               else "no static candidate of this pattern (profile has no call stacks)")
            else:
                u["reason"] = "frequent sequence with no known fused API and no static candidate"
            u["source_kind"] = kind
            unexplained.append(u)
            continue
        share_of = 1.0 / len(targets)
        for k in targets:
            c = cands[k]
            p = c["profile"] or {"time_us": 0.0, "share": 0.0, "count": 0, "kernels_launched": 0, "sequences": [],
                                 "link": link, "same_pattern": True, "speedup_max": None, "step_saving_max": 0.0}
            p["time_us"] = round(p["time_us"] + item.get("time_us", 0.0) * share_of, 3)
            p["share"] = round(p["share"] + item.get("share", 0.0) * share_of, 6)
            p["count"] += item.get("count", 0)
            p["kernels_launched"] += item.get("kernels_launched", 0)
            p["sequences"].append(item.get("id") or seq_text(item.get("kernels", [])))
            p["same_pattern"] = p["same_pattern"] and c.get("pattern") == pattern
            sp = (item.get("roofline") or {}).get("speedup_max")
            if sp is not None:
                p["speedup_max"] = sp if p["speedup_max"] is None else max(p["speedup_max"], sp)
            p["step_saving_max"] = round(p["step_saving_max"] + item.get("step_saving_max", 0.0) * share_of, 6)
            if link == "pattern" and len(targets) > 1:
                p["shared_with"] = len(targets)
            c["profile"] = p
    linked = sorted((c for c in cands if c["profile"]), key=lambda c: -c["profile"]["time_us"])
    ranked = linked + [c for c in cands if not c["profile"]]
    return ranked, unexplained


def render_section_1_2(unexplained: list[dict[str, Any]], heading: str = "### 1.2 Profiled sequences no static "
                       "candidate explains") -> str:
    """Markdown of report section 1.2 from ``join_with_scan``'s ``unexplained`` list."""
    out = [heading, ""]
    if not unexplained:
        out.append("Every profiled fusion sequence is explained by a static candidate.")
        return "\n".join(out) + "\n"
    out.append("Sequences measured in the profile that the static scan did not find. Those with a fused API "
               "are missed sites (dynamic code, a pattern variant, code outside the scanned tree); those "
               "without one are where a new fusion could pay.")
    out.append("")
    out.append("| sequence | fused API | count | time | share of step | verdict | speed-up <= | location | why |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for u in unexplained:
        r = u.get("roofline") or {}
        api = f"`{u['api']}` ({u['pattern']})" if u.get("api") else (u.get("pattern") or "none known")
        cells = [seq_text(u.get("kernels", []), 10), api, str(u.get("count", "")), fmt_us(u.get("time_us")),
                 fmt_pct(u.get("share")), str(r.get("verdict", "-")),
                 f"{r['speedup_max']:.2f}x" if r.get("speedup_max") is not None else "-",
                 location_text(u.get("location")), u.get("reason", "")]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"
