"""``npufuse trace --cmd "python train.py ..."``: run the user's own command once, record what ran.

The command runs as ``verify e2e`` runs it (its own process group, the whole tree stopped at the
end, the ``torch_npu`` stand-in when the real one is absent) with a recorder in every Python
process (:mod:`npufuse.trace.recorder`). ``--steps N`` ends the launch after N optimizer steps.
Writes ``STATE_DIR/trace.json`` (facts per executed source line: see :mod:`npufuse.trace.facts`)
and the recorded op sequences as a ``trace_view.json``-style file that the profile stage mines with
its own knowledge base: sequences at lines no static candidate covers are listed as "found at run
time" candidates. When ``STATE_DIR/scan.json`` exists its candidates are annotated (reached or
not, facts), and ``npufuse scan PATH --trace STATE_DIR/trace.json`` does the same at scan time.

Exit 0 when a record was made, 1 when the command ran but nothing was recorded (it never imported
torch, or failed before), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from npufuse.cli import UsageError, number
from npufuse.verify.command import _kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cmd", required=True, help='your launch command, e.g. "python train.py --max-iters 3"')
    parser.add_argument("--root", default=".", metavar="DIR", help="the repository the command runs in (default: .)")
    parser.add_argument("--steps", type=number(int, minimum=1, maximum=1_000_000), default=None, metavar="N",
                        help="stop the launch after N optimizer steps (default: let it finish)")
    parser.add_argument("--timeout", type=number(float, above=0, maximum=7 * 86400), default=1800.0, metavar="S", help="wall-clock limit (default 1800)")
    parser.add_argument("--state-dir", default=".npufuse", metavar="DIR", help="where trace.json goes (default .npufuse)")
    parser.add_argument("--env", action="append", type=_kv, default=[], metavar="K=V", help="environment variable for the command; repeatable")
    parser.add_argument("--shell", action="store_true", help="run the command through /bin/sh (default: shlex.split, no shell)")
    parser.add_argument("--emulate", choices=("auto", "always", "never"), default="auto",
                        help="torch_npu for the run: auto = the real one when installed, else the emulator")
    parser.add_argument("--max-events", type=number(int, minimum=1, maximum=1_000_000), default=300_000, metavar="N",
                        help="op events kept for sequence mining (per-line facts are always complete; default 300000)")


def run(args: argparse.Namespace) -> int:
    from npufuse.state_folder import StateBusy, UnsafeStatePath, check_state_dir, lock

    root = Path(args.root)
    if not root.is_dir():
        raise UsageError(f"--root {args.root}: not a folder")
    state_dir = Path(args.state_dir)
    try:
        # the state folder's rules (issue 19): no symlink anywhere under it, one state-changing verb at a time
        check_state_dir(state_dir, create=True)
        with lock(state_dir, verb="npufuse trace"):
            return _run_locked(args, root, state_dir)
    except (UnsafeStatePath, StateBusy) as exc:
        raise UsageError(str(exc)) from None


def _run_locked(args: argparse.Namespace, root: Path, state_dir: Path) -> int:
    from npufuse.state_folder import UnsafeStatePath, open_state_dir
    from npufuse.trace.facts import merge_records
    from npufuse.verify import probe, runner

    work = state_dir / "trace"
    try:
        try:
            os.close(open_state_dir(state_dir, ["trace"]))   # refuses a symlink or a file there
            shutil.rmtree(work)
        except FileNotFoundError:
            pass
        os.close(open_state_dir(state_dir, ["trace", "records"], create=True))
    except UnsafeStatePath:
        raise
    except OSError as exc:
        raise UsageError(f"cannot prepare {work}: {exc.strerror or exc}") from None
    cfg = {"mode": "trace", "out_dir": str((work / "counters").resolve()), "runner_pid": os.getpid(),
           "runner_pgid": os.getpgrp(), "emulate": args.emulate,
           "trace": {"out_dir": str((work / "records").resolve()), "root": str(root.resolve()),
                     "steps": args.steps, "max_events": args.max_events}}
    cfg_path = work / "probe.json"
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    env = runner.child_env(dict(args.env), cfg_path, work / "site")
    command = runner.split_command(args.cmd, args.shell)
    print(f"npufuse trace: running {args.cmd!r} in {root} (recording every torch call of the forward pass and "
          f"optimizer; {'stops after ' + str(args.steps) + ' steps' if args.steps else 'until it ends'})", file=sys.stderr)
    started = time.monotonic()
    try:
        child = runner.run_child(command, env=env, cwd=root, timeout_s=args.timeout, log_path=work / "output.log")
    except OSError as exc:
        raise UsageError(f"--cmd: cannot start {args.cmd!r}: {exc}") from None
    wall = time.monotonic() - started
    lines, totals = merge_records(work / "records", root)
    counters = probe.read_counters(work / "counters")
    trace: dict[str, Any] = {
        "tool": "npufuse", "kind": "trace", "version": _version(), "command": args.cmd,
        "exit": child.describe_exit() if not (args.steps and totals["steps"] >= args.steps)
        else f"stopped by npufuse after {totals['steps']} optimizer steps",
        "backend": counters.get("backend", "none"), "steps": totals["steps"], "processes": totals["processes"],
        "wall_s": round(wall, 3), "events": totals["events"], "events_dropped": totals["events_dropped"],
        "trace_views": [os.path.relpath(p, state_dir) for p in totals["trace_views"]],
        "lines": lines, "runtime_candidates": [],
    }
    if not lines:
        _write(state_dir, "trace.json", trace)
        tail = "\n".join("    " + ln[:200] for ln in child.tail[-8:])
        print(f"npufuse trace: nothing was recorded ({child.describe_exit()}): the command never imported torch, or "
              f"failed first. Last output:\n{tail}", file=sys.stderr)
        return 1
    trace["optimizers"] = totals["optimizers"]
    trace["functions"] = totals["functions"]
    scan = _load_scan(state_dir)
    trace["runtime_candidates"], trace["runtime_rejected"] = mine_runtime(
        totals["trace_views"], scan["candidates"] if scan else [], root, totals["optimizers"],
        scan["near_misses"] if scan else [])
    scan_path = state_dir / "scan.json"
    annotated = None
    if scan is not None:
        # mark scan.json's candidates reached / not reached, as `scan --trace` would
        from npufuse.trace.facts import join_trace

        join_trace(scan, trace, source=str(state_dir / "trace.json"))
        _write(state_dir, "scan.json", scan)
        annotated = (sum(1 for c in scan["candidates"] if (c.get("runtime") or {}).get("reached")), len(scan["candidates"]))
    _write(state_dir, "trace.json", trace)
    in_root = sum(1 for ln in lines if ln["in_root"])
    print(f"npufuse trace: {len(lines)} source lines ran torch ops ({in_root} in the repo, {len(lines) - in_root} in "
          f"installed packages), {totals['steps']} optimizer steps, torch_npu: {trace['backend']}, {wall:.1f} s", file=sys.stderr)
    if annotated is not None:
        reached, total = annotated
        print(f"npufuse trace: {reached} of {total} scan candidates ran; the others are marked not reached in "
              f"{scan_path}", file=sys.stderr)
    if trace["runtime_candidates"]:
        print(f"npufuse trace: {len(trace['runtime_candidates'])} fusable sequence(s) found at run time that no static "
              f"candidate covers:", file=sys.stderr)
        for f in trace["runtime_candidates"][:10]:
            print(f"  {f['file']}:{f['line']}  {f.get('api') or 'no fused API known'}  ({' > '.join(f['ops'])})", file=sys.stderr)
    print(f"npufuse trace: wrote {state_dir / 'trace.json'}; use it with `npufuse scan PATH --trace "
          f"{state_dir / 'trace.json'}`", file=sys.stderr)
    return 0


def _version() -> str:
    from npufuse import __version__

    return __version__


def _write(state_dir: Path, name: str, data: dict[str, Any]) -> None:
    from npufuse.state_folder import write_state_file

    try:
        write_state_file(state_dir, name, (json.dumps(data, indent=1) + "\n").encode("utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot write {state_dir / name}: {exc.strerror or exc}") from None


def _load_scan(state_dir: Path) -> dict[str, Any] | None:
    """scan.json as this verb uses it (candidates and near misses kept only as dicts), or None."""
    from npufuse.state_folder import read_state_file

    try:
        raw = read_state_file(state_dir, "scan.json")
        scan = json.loads(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(scan, dict) or not isinstance(scan.get("candidates"), list):
        return None
    for key in ("candidates", "near_misses"):
        items = scan.get(key)
        scan[key] = [c for c in items if isinstance(c, dict)] if isinstance(items, list) else []
    return scan


def mine_runtime(trace_views: list[str], candidates: list[dict[str, Any]], root: Path,
                 optimizers: list[dict[str, Any]] | None = None, near_misses: list[dict[str, Any]] | None = None
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """Mine the recorded op sequences with the profile stage (its knowledge base, its miner, its
    join): fusable sequences at lines no static candidate covers. An optimizer's step sequence is
    placed at the line that constructed the optimizer (where a rewrite would go). Returns the
    candidates and, for each sequence left out, why."""
    if not trace_views:
        return [], []
    from npufuse.profile.analysis import analyze
    from npufuse.profile.join import join_with_scan
    from npufuse.profile.join import _same_file
    from npufuse.trace.facts import _rel

    result = analyze(list(trace_views))
    _, unexplained = join_with_scan(result, candidates)
    root_real = os.path.realpath(root)
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    cache: dict[str, Any] = {}

    def events() -> list[dict[str, Any]]:
        if "events" not in cache:
            cache["events"] = _load_events(trace_views)
        return cache["events"]

    seen: set[tuple[Any, ...]] = set()
    for u in unexplained:
        if not u.get("api"):
            continue   # a frequent sequence without a fused API: the profile report's business, not a candidate
        loc = u.get("location") or {}
        if not loc.get("file"):
            continue
        file, line = _rel(str(loc["file"]), root_real), loc.get("line")
        if u.get("pattern") == "fused_optimizer":
            made = [o["made_at"] for o in optimizers or [] if o["stepped_at"] == [file, line]]
            if made:
                file, line = made[0]
                if any(c.get("pattern") == "fused_optimizer" and _same_file(file, str(c.get("file", "")))
                       and int(c.get("line", 0)) <= line <= int(c.get("end_line", c.get("line", 0))) for c in candidates):
                    continue   # the static candidate at the construction line explains it
        elif not _dataflow_linked(events(), loc, list(u.get("kernels") or [])):
            dropped.append(f"{file}:{line} {u.get('pattern')}: ops run one after another but none feeds the next")
            continue
        key = (file, line, u.get("pattern"))
        if key in seen:
            continue
        seen.add(key)
        entry = {"file": file, "line": line, "function": loc.get("function"),
                 "api": u.get("api"), "pattern": u.get("pattern"), "ops": list(u.get("kernels") or []),
                 "count": u.get("count"), "source": "found at run time"}
        for nm in near_misses or []:
            if nm.get("pattern") == u.get("pattern") and _same_file(file, str(nm.get("file", ""))) \
                    and int(nm.get("line", 0) or 0) <= (line or 0) <= int(nm.get("end_line", nm.get("line", 0)) or 0):
                entry["static_near_miss"] = str(nm.get("reason", ""))
        out.append(entry)
    return out, dropped


def _load_events(trace_views: list[str]) -> list[dict[str, Any]]:
    """The recorded op events (ours: written by the recorder), in time order per file."""
    out: list[dict[str, Any]] = []
    for p in trace_views:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        evs = data.get("traceEvents") if isinstance(data, dict) else None
        for e in evs if isinstance(evs, list) else []:
            if isinstance(e, dict) and e.get("cat") == "cpu_op" and isinstance(e.get("args"), dict):
                out.append(e)
        out.append({})   # a process boundary: no window spans it
    return out


def _dataflow_linked(events: list[dict[str, Any]], loc: dict[str, Any], ops: list[str]) -> bool:
    """Does some occurrence of ``ops`` (consecutive events) at ``loc`` form one dataflow graph? A
    sequence that is only adjacent in time (two unrelated transposes and views) is no fusion."""
    if len(ops) < 2:
        return True
    where = f"{loc.get('file')}({loc.get('line')})"
    names = ["aten::" + o for o in ops]
    n = len(names)
    for i in range(len(events) - n + 1):
        if events[i].get("name") != names[0] or where not in str(events[i]["args"].get("Call stack", "")):
            continue
        window = events[i:i + n]
        if [e.get("name") for e in window] != names:
            continue
        if _connected(window):
            return True
    return False


def _connected(window: list[dict[str, Any]]) -> bool:
    """The ops form one dataflow graph: an edge wherever an op consumes a tensor an earlier op of
    the window produced (a side input such as ``weight.float()`` joins through its consumer)."""
    n = len(window)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for j in range(1, n):
        ins = set(_ids(window[j], "in"))
        for i in range(j):
            if ins & set(_ids(window[i], "out")):
                parent[find(i)] = find(j)
    return len({find(i) for i in range(n)}) == 1


def _ids(e: dict[str, Any], key: str) -> list[int]:
    v = (e.get("args") or {}).get(key)
    return [x for x in v if isinstance(x, int)] if isinstance(v, list) else []
