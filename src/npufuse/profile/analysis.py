"""``analyze(paths) -> dict``: read every rank, mine it, assess value, merge the ranks.

The returned dict is the profile result that crosses stage boundaries (``npufuse profile
--format json`` prints it; ``join.join_with_scan`` consumes it). Plain data only.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from npufuse import __version__
from npufuse.profile.kb import KnowledgeBase, load_kb
from npufuse.profile.mining import Finding, Miner, NGram, OpStream, build_host_stream, build_kernel_stream, \
    communication_report, gap_report, mine_ngrams, _union_us
from npufuse.profile.readers import MIN_TIME_US, KernelTable, Problem, RankSource, discover, read_kernel_details, \
    read_op_statistic, read_operator_details, read_step_trace_time, read_trace_view, share, _encode, _type_from_name
from npufuse.profile.roofline import Assumptions, assess
from npufuse.profile.trace import TraceInfo, analyze_trace


@dataclass
class Options:
    backend: str = "auto"          # kernel_details reader: auto | polars | csv
    kb_path: Path | None = None
    assumptions: Assumptions = field(default_factory=Assumptions)
    top: int = 10
    nmax: int = 8


def analyze(paths: list[str], options: Options | None = None) -> dict[str, Any]:
    """Profile result for the given folders/files. Never raises for bad input content: unreadable
    parts are listed in ``problems``; ``usable`` is False when nothing could be mined."""
    opt = options or Options()
    kb, problems = load_kb(opt.kb_path)
    sources, found_problems = discover(paths)
    problems += found_problems
    ranks: list[dict[str, Any]] = []
    all_findings: list[dict[str, Any]] = []
    all_rejected: list[dict[str, Any]] = []
    all_ngrams: dict[str, list[dict[str, Any]]] = {"by_time": [], "by_count": []}
    gaps: list[dict[str, Any]] = []
    comms: list[dict[str, Any]] = []
    step_total = 0.0
    per_rank: list[dict[str, Any]] = []
    for r, rank_problems in _analyze_ranks(sources, kb, opt):
        problems += rank_problems
        ranks.append(r["input"])
        all_findings += r["fusions"]
        all_rejected += r["rejected"]
        for k in all_ngrams:
            all_ngrams[k] += r["sequences"][k]
        if r["gaps"]:
            gaps.append(r["gaps"])
        if r["communication"]:
            comms.append(r["communication"])
        # ranks run side by side: shares divide the ranks' summed times by their summed step times,
        # but the step and device time shown are each rank's own
        step_total += r["step_time_us"]
        per_rank.append({"rank": r["input"]["rank"], "step_time_us": round(r["step_time_us"], 3),
                         "device_time_us": round(r["device_time_us"], 3)})
    capped: list[str] = []
    fusions = _merge(all_findings, step_total, capped)
    seqs = {k: _merge(v, step_total, capped)[: opt.top] for k, v in all_ngrams.items()}
    seqs["by_count"].sort(key=lambda s: (-s["count"], -len(s["kernels"])))
    unmapped = [s for s in _merge(all_ngrams["by_time"], step_total, capped) if not s.get("pattern")][: opt.top]
    gap_total = _sum_gaps(gaps, step_total, capped)
    comm_total = _sum_comms(comms, step_total, capped)
    for what in dict.fromkeys(capped):
        problems.append(Problem("input", f"{what} exceeds the step time (kernels overlap in time on one stream "
                                         f"or the step time is shorter than the kernels): shown as 100%"))
    confirmed = [r["module_confirmed_fraction"] for r in ranks if r.get("ops")]
    usable = any(r.get("ops") for r in ranks)
    result: dict[str, Any] = {
        "tool": "npufuse", "version": __version__, "kind": "profile", "usable": usable,
        "knowledge_base": kb.path if kb else None,
        "assumptions": opt.assumptions.to_dict(),
        "inputs": ranks,
        "problems": [p.to_dict() for p in problems],
        "module_confirmed": bool(confirmed) and min(confirmed) >= 0.5,
        "module_note": _module_note(ranks),
        "totals": {"ranks": len(ranks),
                   "step_time_us": max((p["step_time_us"] for p in per_rank), default=0.0),
                   "device_time_us": max((p["device_time_us"] for p in per_rank), default=0.0),
                   "per_rank": per_rank},
        "fusions": fusions,
        "rejected": _merge_rejected(all_rejected),
        "sequences": seqs,
        "unmapped": unmapped,
        "gaps": gap_total,
        "communication": comm_total,
    }
    for k, f in enumerate(result["fusions"], 1):
        f["id"] = f"S{k}"
    return result


# ranks analysed side by side: each worker holds one rank's tables (~0.6 GiB at 1M rows), so at most
# this many keep 8 ranks x 1M rows under 2 GiB while using both cores of the CI machine
MAX_RANK_WORKERS = 2


def _analyze_ranks(sources: list[RankSource], kb: KnowledgeBase | None, opt: Options
                   ) -> Iterator[tuple[dict[str, Any], list[Problem]]]:
    """Each rank's analysis, in the order of ``sources``; several ranks go to worker processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        cores = os.cpu_count() or 1
    workers = min(MAX_RANK_WORKERS, cores, len(sources))
    if workers >= 2 and kb is not None:
        # spawn, not fork: the parent may hold polars' thread pool, which a forked child would inherit
        # locked. A worker that cannot start (a __main__ spawn cannot re-import, such as a script read
        # from stdin) leaves the ranks to this process: the results are the same, only slower
        try:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                results = list(pool.map(_rank_worker, sources, [opt] * len(sources)))
        except (BrokenProcessPool, OSError, RuntimeError):
            results = None
        if results is not None:
            yield from results
            return
    for src in sources:
        probs: list[Problem] = []
        r = _analyze_rank(src, kb, opt, probs)
        yield r, probs


def _rank_worker(src: RankSource, opt: Options) -> tuple[dict[str, Any], list[Problem]]:
    kb, probs = load_kb(opt.kb_path)
    rank_problems: list[Problem] = []
    r = _analyze_rank(src, kb, opt, rank_problems)
    return r, rank_problems


def _module_note(ranks: list[dict[str, Any]]) -> str:
    fr = [r.get("module_confirmed_fraction", 0.0) for r in ranks if r.get("ops")]
    if not fr:
        return "no op sequence could be read"
    if min(fr) >= 0.99:
        return "module of every op confirmed from trace_view.json call stacks / module events"
    if max(fr) == 0.0:
        return ("module could not be confirmed (no call stacks / module events linked): sequences are bounded "
                "by stream contiguity and step boundaries only")
    return (f"module confirmed for {min(fr):.0%}-{max(fr):.0%} of ops; findings without a location could not be "
            f"confirmed")


def _analyze_rank(src: RankSource, kb: KnowledgeBase | None, opt: Options, problems: list[Problem]
                  ) -> dict[str, Any]:
    files: dict[str, Any] = {}
    table: KernelTable | None = None
    trace: TraceInfo | None = None
    steps = None
    if "kernel_details.csv" in src.files:
        p = src.files["kernel_details.csv"]
        table, probs = read_kernel_details(p, backend=opt.backend)
        problems += probs
        files["kernel_details.csv"] = {"path": str(p), "rows": table.n if table else 0,
                                       "columns": table.columns.to_dict() if table else None,
                                       "reader": table.backend if table else None,
                                       "notes": table.notes if table else []}
    if table is None and "profiler.db" in src.files:
        # the sqlite export, read when there is no kernel_details.csv (both hold the same kernels)
        from npufuse.profile.profiler_db import read_profiler_db

        p = src.files["profiler.db"]
        table, probs = read_profiler_db(p)
        problems += probs
        files["profiler.db"] = {"path": str(p), "rows": table.n if table else 0, "reader": "sqlite"}
    if "trace_view.json" in src.files:
        p = src.files["trace_view.json"]
        events, probs = read_trace_view(p)
        problems += probs
        if events is not None:
            trace = analyze_trace(events, str(p))
        files["trace_view.json"] = {"path": str(p), "events": len(events) if events else 0,
                                    "call_stacks": bool(trace and trace.has_stacks),
                                    "module_events": bool(trace and trace.has_modules)}
    if "step_trace_time.csv" in src.files:
        p = src.files["step_trace_time.csv"]
        steps, probs = read_step_trace_time(p)
        problems += probs
        files["step_trace_time.csv"] = {"path": str(p), "steps": len(steps.steps) if steps else 0,
                                        "columns": steps.columns.to_dict() if steps else None}
    op_stat = None
    if "op_statistic.csv" in src.files:
        p = src.files["op_statistic.csv"]
        op_stat, probs = read_op_statistic(p)
        problems += probs
        files["op_statistic.csv"] = {"path": str(p), "rows": len(op_stat.rows) if op_stat else 0,
                                     "columns": op_stat.columns.to_dict() if op_stat else None}
    if "operator_details.csv" in src.files:
        p = src.files["operator_details.csv"]
        od, probs = read_operator_details(p)
        problems += probs
        files["operator_details.csv"] = {"path": str(p), "rows": od.rows if od else 0,
                                         "with_call_stack": od.with_stack if od else 0,
                                         "columns": od.columns.to_dict() if od else None}
    rank = int(src.rank or 0)
    st: OpStream | None = None
    if table is not None:
        st = build_kernel_stream(rank, table, trace)
    elif trace is not None and trace.device:
        st = build_kernel_stream(rank, _table_from_trace(trace), trace)
    elif trace is not None and trace.host_streams:
        st = build_host_stream(rank, trace)
    info: dict[str, Any] = {"rank": rank, "label": src.label, "files": files, "ops": st.n if st else 0,
                            "level": st.level if st else None,
                            "streams": int(np.unique(st.stream).size) if st else 0,
                            "step_source": st.step_source if st else "none",
                            "module_confirmed_fraction": round(st.confirmed_fraction, 4) if st else 0.0}
    out: dict[str, Any] = {"input": info, "fusions": [], "rejected": [], "sequences": {"by_time": [], "by_count": []},
                           "gaps": None, "communication": None, "step_time_us": 0.0, "device_time_us": 0.0}
    if op_stat is not None:
        info["op_statistic_top"] = sorted(op_stat.rows, key=lambda r: -r["total_us"])[:10]
    if st is None or st.n == 0:
        if op_stat is not None:
            out["device_time_us"] = sum(r["total_us"] for r in op_stat.rows)
            info["note"] = "op_statistic.csv only: totals by kernel type, no sequences"
        return out
    step_us = _step_time(st, steps)
    if not step_us >= MIN_TIME_US:
        # nothing to divide by: this rank's shares of step time are unknown (0), not inf
        where = table.source if table is not None else (trace.source if trace is not None else src.label)
        problems.append(Problem(where, f"step time {step_us:g} us is too short to divide by (below "
                                       f"{MIN_TIME_US:g} us): shares of step time are unknown, shown as 0"))
        step_us = 0.0
    out["step_time_us"] = step_us
    problems += _time_inconsistencies(st, step_us, steps is not None and bool(steps.steps),
                                      table.source if table is not None else src.label)
    # device kernel time is compute: collectives are reported as communication
    out["device_time_us"] = float(st.dur[~st.comm].sum()) if st.level == "kernel" else 0.0
    out["communication"] = communication_report(st) | {"rank": rank}
    info["steps"] = sorted({int(s) for s in np.unique(st.step).tolist() if s >= 0})
    if kb is None:
        return out
    miner = Miner(st, kb)
    miner.run_sequences()
    miner.run_loops()
    miner.run_regions()
    gaps = gap_report(st, opt.assumptions.host_gap_us) | {"rank": rank}
    a = opt.assumptions
    dispatch, how = gaps.get("dispatch_us", 0.0), "trace launch interval"
    if not dispatch > 0:
        # no launch times: the median idle gap between consecutive kernels of the main stream is the
        # host's time per op where the stream is host-bound, and small where it is not
        dispatch, how = gaps.get("median_gap_us", 0.0), "median gap between kernels (no trace)"
    if dispatch > a.launch_us:
        # a fused kernel still needs one dispatch, and each kernel fused away saves at most one
        a = dataclasses.replace(a, launch_us=dispatch)
        info["measured_dispatch_us"] = dispatch
        info["dispatch_from"] = how
    pipes = None
    if "kernel_details.csv" in src.files and table is not None and table.backend != "sqlite":
        from npufuse.profile.pipes import from_table

        # both readers take the ratio columns in their kernel read
        pipes = from_table(table) or None
        if pipes:
            info["pipe_metrics"] = list(next(iter(pipes.values())).columns)
    out["fusions"] = [_finding_dict(st, f, a, pipes) for f in miner.findings]
    out["rejected"] = [{"pattern": r.pattern, "kernels": list(r.tokens), "count": r.count, "reason": r.reason,
                        "frames": r.first_site, "ranks": [rank]} for r in miner.rejected.values()]
    by_time, by_count = mine_ngrams(st, miner.claimed, miner.findings, kb, nmax=opt.nmax, top=opt.top)
    out["sequences"] = {"by_time": [_ngram_dict(st, g, a, pipes) for g in by_time],
                        "by_count": [_ngram_dict(st, g, a, pipes) for g in by_count]}
    out["gaps"] = gaps
    return out


def _table_from_trace(trace: TraceInfo) -> KernelTable:
    """Device kernels from trace_view.json's "Ascend Hardware" lanes (no shapes there)."""
    dev = trace.device
    types, code = _encode([_type_from_name(d[0]) for d in dev])
    names, ncode = _encode([d[0] for d in dev])
    n = len(dev)
    return KernelTable(source=trace.source, types=types, type_code=code, start=np.array([d[2] for d in dev]),
                       dur=np.array([d[3] for d in dev]), wait=None,
                       stream=np.array([d[1] for d in dev], dtype=np.int64), step=None,
                       shape_keys=[("", "", "", "")], shape_code=np.zeros(n, dtype=np.int32), names=names,
                       name_code=ncode, backend="trace_view.json")


def _step_time(st: OpStream, steps: Any) -> float:
    if steps is not None and steps.steps:
        present = {int(s) for s in np.unique(st.step).tolist() if s >= 0}
        chosen = [v["stage"] for k, v in steps.steps.items() if not present or k in present]
        if chosen:
            return float(sum(chosen))
    if (st.step >= 0).any():
        total = 0.0
        for s in np.unique(st.step[st.step >= 0]).tolist():
            m = st.step == s
            total += float(st.end[m].max() - st.start[m].min())
        return total
    return float(st.end.max() - st.start.min()) if st.n else 0.0


def _time_inconsistencies(st: OpStream, step_us: float, from_step_file: bool, where: str) -> list[Problem]:
    """Why shares of this rank could pass 100% of the step: the step time of step_trace_time.csv is
    shorter than the kernels' own span, or kernels of one stream overlap in time (a stream runs its
    kernels one after another, so overlap means inconsistent timestamps). Said once per rank, so the
    capped shares of the result have a reason the user can check in the input."""
    out: list[Problem] = []
    if st.n == 0:
        return out
    if from_step_file and step_us > 0:
        # each step's first start to last end, summed (one sort, not a mask per step)
        order = np.argsort(st.step, kind="stable")
        steps = st.step[order]
        cut = np.flatnonzero(np.concatenate(([True], steps[1:] != steps[:-1])))
        span = float((np.maximum.reduceat(st.end[order], cut) - np.minimum.reduceat(st.start[order], cut)).sum())
        if span > step_us * 1.001:
            out.append(Problem(where, f"step_trace_time.csv gives a step time of {step_us:,.1f} us, shorter than "
                                      f"the kernels' own span of {span:,.1f} us: shares of the step may be capped "
                                      f"at 100%"))
    compute = ~st.comm if st.level == "kernel" else np.ones(st.n, dtype=bool)
    for sid in np.unique(st.stream[compute]).tolist():
        m = compute & (st.stream == sid)
        busy = float(st.dur[m].sum())
        us, ue = _union_us(st.start[m], st.end[m])
        wall = float((ue - us).sum())
        # a little slack: timestamps are rounded to the ns and the clock of a lane is resampled
        if busy > wall * 1.01 + 1.0:
            out.append(Problem(where, f"kernels of stream {sid} overlap in time ({busy:,.1f} us of kernel time "
                                      f"within {wall:,.1f} us of wall-clock; a stream runs one kernel at a time): "
                                      f"inconsistent timestamps, shares of the step may be capped at 100%"))
    return out


def _keys(st: OpStream, i: int, j: int) -> list[tuple[str, str, str, str]]:
    return [st.shape_keys[int(c)] for c in st.shape_code[i:j].tolist()]


def _occurrence(st: OpStream, i: int, j: int, longest_us: float, pipes: dict[str, Any] | None) -> dict[str, Any]:
    """The mean longest kernel of the occurrences and, where the file has pipe metrics, the pipe
    use of the first occurrence."""
    durs = st.dur[i:j]
    out: dict[str, Any] = {"longest_us": longest_us}
    if pipes:
        from npufuse.profile.pipes import combine

        out["pipes"] = combine([(pipes.get(st.vocab[c]), float(d))
                                for c, d in zip(st.code[i:j].tolist(), durs.tolist())])
    return out


def _finding_dict(st: OpStream, f: Finding, a: Assumptions, pipes: dict[str, Any] | None = None) -> dict[str, Any]:
    i, j = f.first, f.first + f.length
    per_k = f.kernels / f.count if f.count else 0
    roof = assess(st.tokens(i, j), _keys(st, i, j), f.span_us / f.count, f.kernel_us / f.count, a,
                  **_occurrence(st, i, j, f.longest_us / f.count if f.count else 0.0, pipes))
    if f.kind == "region":
        roof["kernels"] = round(per_k, 1)
    return {"pattern": f.pattern, "api": f.api, "kind": f.kind, "level": f.level, "kernels": list(f.tokens),
            "aten": f.aten, "count": f.count, "kernels_launched": f.kernels, "time_us": round(f.span_us, 3),
            "kernel_time_us": round(f.kernel_us, 3), "steps": len(f.steps), "ranks": [st.rank],
            "module_confirmed": f.confirmed, "location": f.site, "roofline": roof, "caveat": f.caveat,
            "note": f.note, "subsumes": dict(f.subsumed), "source": f.source,
            "shapes": [k[0].strip('"') for k in _keys(st, i, j)][:12]}


def _ngram_dict(st: OpStream, g: NGram, a: Assumptions, pipes: dict[str, Any] | None = None) -> dict[str, Any]:
    n = len(g.tokens)
    i, j = g.first, g.first + n
    status, site, _ = st.scope_of(i, j)
    roof = assess(list(g.tokens), _keys(st, i, j), g.span_us / g.count, g.kernel_us / g.count, a,
                  **_occurrence(st, i, j, g.longest_us / g.count if g.count else 0.0, pipes))
    return {"kernels": list(g.tokens), "count": g.count, "kernels_launched": g.count * n,
            "time_us": round(g.span_us, 3), "kernel_time_us": round(g.kernel_us, 3), "pattern": g.pattern,
            "mapped_by": g.mapped_by, "ranks": [st.rank], "module_confirmed": status == "ok",
            "location": site if status == "ok" else None, "roofline": roof,
            "shapes": [k[0].strip('"') for k in _keys(st, i, j)][:12]}


def _loc_key(loc: dict[str, Any] | None) -> str:
    if not loc:
        return ""
    return json.dumps([loc.get("file"), loc.get("function"), loc.get("lines"), loc.get("module")])


def _capped_share(part: float, whole: float, what: str, capped: list[str]) -> float:
    """share() kept within 100%; where the input forces more, ``what`` is noted in ``capped``."""
    sh = share(part, whole)
    if sh > 1.0 + 1e-9:
        capped.append(what)
        return 1.0
    return sh


def _merge(items: list[dict[str, Any]], step_total: float, capped: list[str]) -> list[dict[str, Any]]:
    """One entry per (pattern, kernels, location) over all ranks; shares against all ranks' steps."""
    merged: dict[Any, dict[str, Any]] = {}
    for it in items:
        key = (it.get("pattern"), tuple(it["kernels"]), _loc_key(it.get("location")))
        cur = merged.get(key)
        if cur is None:
            merged[key] = dict(it, ranks=list(it["ranks"]))
            continue
        for f in ("count", "kernels_launched", "time_us", "kernel_time_us", "steps"):
            if f in it:
                cur[f] = round(cur.get(f, 0) + it[f], 3)
        cur["ranks"] = sorted(set(cur["ranks"]) | set(it["ranks"]))
        for k, v in (it.get("subsumes") or {}).items():
            cur["subsumes"][k] = cur["subsumes"].get(k, 0) + v
    out = list(merged.values())
    for it in out:
        # 0 (unknown) when the step time is too short to divide by
        sh = _capped_share(it["time_us"], step_total, "time of " + " > ".join(it["kernels"][:4]), capped)
        it["share"] = round(sh, 6)
        s = it["roofline"]["speedup_max"]
        # Amdahl: what the whole step could gain at most if this sequence hit its bound (speedup_max >= 1)
        it["step_saving_max"] = round(sh * (1 - 1 / s), 6) if s >= 1 else 0.0
    out.sort(key=lambda x: -x["time_us"])
    return out


def _merge_rejected(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[Any, dict[str, Any]] = {}
    for it in items:
        key = (it["pattern"], tuple(it["kernels"]), it["reason"])
        if key in merged:
            merged[key]["count"] += it["count"]
            merged[key]["ranks"] = sorted(set(merged[key]["ranks"]) | set(it["ranks"]))
        else:
            merged[key] = dict(it)
    return sorted(merged.values(), key=lambda x: -x["count"])


def _sum_comms(comms: list[dict[str, Any]], step_total: float, capped: list[str]) -> dict[str, Any]:
    tot: dict[str, Any] = {k: round(sum(c[k] for c in comms), 3)
                           for k in ("time_us", "overlapped_us", "exposed_us")}
    tot["kernels"] = sum(c["kernels"] for c in comms)
    tot["share"] = round(_capped_share(tot["time_us"], step_total, "communication time", capped), 6)
    tot["exposed_share"] = round(_capped_share(tot["exposed_us"], step_total, "exposed communication", capped), 6)
    tot["per_rank"] = comms
    return tot


def _sum_gaps(gaps: list[dict[str, Any]], step_total: float, capped: list[str]) -> dict[str, Any]:
    if not gaps:
        return {"wait_us": 0.0, "host_bound_us": 0.0, "host_bound_gaps": 0, "between_steps_us": 0.0,
                "method": "none", "per_rank": []}
    tot = {k: round(sum(g[k] for g in gaps), 3) for k in ("wait_us", "host_bound_us", "between_steps_us")}
    tot["host_bound_gaps"] = sum(g["host_bound_gaps"] for g in gaps)
    tot["method"] = "; ".join(dict.fromkeys(g["method"] for g in gaps))
    host = _capped_share(tot["host_bound_us"], step_total, "host-bound gap time", capped)
    wait = _capped_share(tot["wait_us"], step_total, "wait gap time", capped)
    if host + wait > 1.0 + 1e-9:
        # both are idle time of one stream within the step: together they cannot pass it either, so
        # they are scaled down to fill it, each keeping its part of the idle time
        capped.append("idle (host-bound + wait) gap time")
        idle = tot["host_bound_us"] + tot["wait_us"]
        host, wait = tot["host_bound_us"] / idle, tot["wait_us"] / idle
    tot["host_bound_share"] = round(host, 6)
    tot["wait_share"] = round(wait, 6)
    tot["per_rank"] = gaps
    return tot
