"""``npufuse verify e2e ID --cmd "..."``: baseline vs fused run of the user's own launch command.

Phases and state (each transition saved before the next phase starts, so Ctrl-C, a crash or a
SIGKILL of npufuse leaves state.json and the JSONL consistent, and a rerun resumes):

``e2e_checking``
    **baseline** — the command with this candidate's switch off (``NAME=0`` for the env switch
    of its guard; other switch kinds: the probe sets ``torch_npu = None`` in the candidate's
    module, which turns off every fused site of that file, said in the evidence). A completed
    baseline with at least ``--steps`` steps and the same fingerprint (command, shell, cwd,
    environment, log regex, the candidate file's content outside this site's fused branch) is
    reused, not rerun.

    **fused** — the same command with the switch on, compared step by step with the baseline
    as it runs (:class:`npufuse.verify.stats.LossMonitor`): a NaN/Inf loss or a smoothed relative
    difference past the tolerance stops it at once (the child's process group is killed) →
    ``e2e_failed``. A crash, a timeout, too few steps, or no call from the site (the probe's
    counters) → ``e2e_failed`` too. The baseline must show zero calls from the site.
``perf_checking``
    step times (warm-up excluded): medians, IQR, bootstrap CI of the speed-up, verdict.
``concluded``
    verdict and reasons. Emulated runs never claim NPU speed: their verdict says so.

Problems that are no evidence against the candidate (the command does not start, the baseline
crashes or prints nothing parseable, the probe cannot load) raise :class:`UsageError` and
leave the candidate in ``e2e_checking``.

Files in the state dir: ``e2e_<ID>_baseline.jsonl``, ``e2e_<ID>_fused.jsonl`` (DESIGN.md
records), ``e2e_<ID>_<run>.log`` (raw output), ``e2e_<ID>_<run>.probe/`` (counters),
``e2e_<ID>_metrics.json`` (the merged per-step array of ``merge-jsonl``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from npufuse.cli import UsageError
from npufuse.safe_write import write_text_atomic
from npufuse.verify import jsonl, logparse, probe, runner, stats
from npufuse.verify.candidate import Candidate, update_state

DEFAULT_STEPS = 50
DEFAULT_TIMEOUT = 3600.0
MIN_RECOMMENDED_STEPS = 50


@dataclass
class E2EOptions:
    cmd: str
    steps: int = DEFAULT_STEPS
    env: dict[str, str] = field(default_factory=dict)
    seed_env: dict[str, str] = field(default_factory=lambda: {"PYTHONHASHSEED": "0"})
    shell: bool = False
    timeout: float = DEFAULT_TIMEOUT
    log_regex: str | None = None
    log_format: str = "auto"  # a logparse preset name, or auto-detect
    cwd: Path | None = None
    tolerance: float = stats.DEFAULT_TOLERANCE
    skip: int = stats.DEFAULT_SKIP
    alpha: float = stats.DEFAULT_ALPHA
    warmup: int = stats.DEFAULT_WARMUP
    n_boot: int = stats.DEFAULT_BOOTSTRAP
    confidence: float = stats.DEFAULT_CONFIDENCE
    min_effect: float = stats.DEFAULT_MIN_EFFECT
    seed: int = 0
    rerun_baseline: bool = False
    force: bool = False
    emulate: str = "auto"  # auto | never | always (the child's torch_npu)


@dataclass
class RunOutcome:
    run: str
    records: dict[int, logparse.StepRecord]
    child: runner.ChildResult
    counters: dict[str, Any]
    format: str | None
    stop: str | None  # "steps" | "loss" | "nonfinite" | "timeout" | None (ended by itself)
    stop_detail: str | None = None
    unread: list[str] = field(default_factory=list)  # lines mentioning a loss that no format could read
    detected_from: str | None = None


Progress = Callable[[str], None]


def _paths(cand: Candidate, run: str) -> dict[str, Path]:
    sd = cand.state_dir
    return {
        "jsonl": sd / f"e2e_{cand.id}_{run}.jsonl",
        "log": sd / f"e2e_{cand.id}_{run}.log",
        "probe": sd / f"e2e_{cand.id}_{run}.probe",
    }


def _ids_of(value: str | None) -> list[str]:
    return [x for x in (value or "").replace(" ", "").split(",") if x]


def _switch_plan(cand: Candidate, opts: E2EOptions | None = None) -> dict[str, Any]:
    """How the baseline turns this site off and the fused run turns it on: the site's own
    switch (``_npufuse_site(ID)`` in its guard, driven by ``NPUFUSE_OFF``) when it has one, so
    no other site changes; else the pattern's env switch; else torch_npu = None in the module."""
    assert cand.site is not None
    if cand.site.site_switch is not None:
        # the user's own NPUFUSE_OFF (other candidates they keep off) stays as it is in both runs
        user_off = _ids_of((opts.env if opts else {}).get("NPUFUSE_OFF", os.environ.get("NPUFUSE_OFF")))
        me = str(cand.site.site_switch)
        others = [x for x in user_off if x != me]
        off, on = ",".join([*others, me]), ",".join(others)
        return {"kind": "site", "name": "NPUFUSE_OFF", "baseline_env": {"NPUFUSE_OFF": off}, "fused_env": {"NPUFUSE_OFF": on}, "disable_module": False,
                "describe": f"the site's own switch: baseline NPUFUSE_OFF={off}, fused NPUFUSE_OFF={on or '(empty)'}; every other site as applied",
                "off": f"NPUFUSE_OFF={off}", "on": f"NPUFUSE_OFF={on or '(empty)'}"}  # fmt: skip
    name = cand.site.env_switch
    if name:
        return {"kind": "env", "name": name, "baseline_env": {name: "0"}, "fused_env": {name: "1"}, "disable_module": False,
                "describe": f"baseline {name}=0, fused {name}=1", "off": f"{name}=0", "on": f"{name}=1"}  # fmt: skip
    return {"kind": "module", "name": None, "baseline_env": {}, "fused_env": {}, "disable_module": True,
            "describe": f"the guard has no env switch ({cand.site.guard.splitlines()[0].strip()}); the baseline sets torch_npu = None in {cand.file}, "
                        "turning off every fused site of that file",
            "off": f"torch_npu = None in {cand.file}", "on": "as applied"}  # fmt: skip


def _only_plan(ids: list[int], run_ids: list[int], what: str) -> dict[str, Any]:
    """``verify e2e --all``: the baseline with no candidate fused, a run with ``run_ids`` only."""
    on = ",".join(map(str, run_ids))
    return {"kind": "only", "name": "NPUFUSE_ONLY", "baseline_env": {"NPUFUSE_ONLY": "none"}, "fused_env": {"NPUFUSE_ONLY": on}, "disable_module": False,
            "describe": f"{what}: baseline NPUFUSE_ONLY=none (candidates {', '.join(map(str, ids))} all off), this run NPUFUSE_ONLY={on}",
            "off": "NPUFUSE_ONLY=none", "on": f"NPUFUSE_ONLY={on}"}  # fmt: skip


def _baseline_source_sha(cand: Candidate, also: list[Candidate] = ()) -> str:  # type: ignore[assignment]
    """The candidate file's hash without this site's fused branch: the baseline never runs that
    branch, so fixing (or breaking) it must not throw a completed baseline away. ``also``: the
    other candidates the baseline turns off (``--all``), whose fused branches in this file go too."""
    try:
        text = cand.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    for c in (cand, *also):
        if c.site is not None and c.site.fused_text and c.path == cand.path:
            text = text.replace(c.site.fused_text, "", 1)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(cand: Candidate, opts: E2EOptions, cwd: Path, plan: dict[str, Any] | None = None, also: list[Candidate] = ()) -> str:  # type: ignore[assignment]
    """What the baseline depends on: a change means it must be rerun (which sites it turns off
    included: a single candidate's baseline is not the --all baseline)."""
    shas = sorted({str(c.path): _baseline_source_sha(c, [x for x in also if x is not c]) for c in (cand, *also)}.items())
    facts = {"cmd": opts.cmd, "shell": opts.shell, "cwd": str(cwd), "env": sorted(opts.env.items()), "seed_env": sorted(opts.seed_env.items()),
             "log_regex": opts.log_regex, "file_sha256": shas, "emulate": opts.emulate,
             "baseline_env": sorted((plan or {}).get("baseline_env", {}).items())}  # fmt: skip
    if opts.log_format not in (None, "auto"):  # only when set: baselines recorded before the option stay reusable
        facts["log_format"] = opts.log_format
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _first_lines(lines: list[str], n: int = 8) -> str:
    shown = [ln[:160] for ln in lines[:n]]
    return "\n".join(f"    {ln}" for ln in shown) if shown else "    (no output)"


def run_once(cand: Candidate, opts: E2EOptions, run: str, cwd: Path, plan: dict[str, Any], monitor: stats.LossMonitor | None, progress: Progress | None,
             paths: dict[str, Path] | None = None, sites: list[Candidate] = (), label: dict[str, Any] | None = None) -> RunOutcome:  # type: ignore[assignment]
    """One run of the command (baseline or fused): JSONL line by line, stop rules, counters.
    ``paths``/``label``: where and as what its records go (``--all``'s shared runs); ``sites``:
    candidates whose calls are counted apart (``counters["by_site"]``)."""
    assert cand.site is not None
    paths = paths or _paths(cand, run)
    env_run = "baseline" if run == "baseline" else "fused"
    if paths["probe"].exists():
        shutil.rmtree(paths["probe"])
    paths["probe"].mkdir(parents=True)
    cfg = {
        "mode": "e2e",
        "run": run,
        "out_dir": str(paths["probe"] / "counters"),
        "runner_pid": os.getpid(),
        "runner_pgid": os.getpgrp(),
        "emulate": opts.emulate,
        "site": {"file": str(cand.path.resolve()), "lines": [cand.site.line, cand.site.end_line]},
        "disable_module": str(cand.path.resolve()) if (run == "baseline" and plan["disable_module"]) else None,
        "sites": [{"id": c.id, "file": str(c.path.resolve()), "lines": [c.site.line, c.site.end_line]} for c in sites if c.site is not None],
    }
    cfg_path = paths["probe"] / "probe.json"
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    env = {**opts.seed_env, **opts.env, **plan[f"{env_run}_env"]}
    child_env = runner.child_env(env, cfg_path, paths["probe"] / "site")
    parser = logparse.LogParser(opts.log_regex, preset=opts.log_format)
    records: dict[int, logparse.StepRecord] = {}
    state: dict[str, str | None] = {"stop": None, "detail": None}
    every = max(1, opts.steps // 5)
    with jsonl.JsonlWriter(paths["jsonl"]) as writer:

        def on_line(line: str) -> str | None:
            known = parser.format
            rec = parser.feed(line)
            if rec is None or rec.step is None:
                return None
            if known is None and progress and parser.auto:
                progress(f"  {run}: log format {parser.format} (auto-detected from: {parser.detected_from[:120]!r}; --log-format to fix it)")
            record = logparse.record_json(cand.id, run, rec)
            if label is not None:  # a shared run: its own labels instead of one candidate's
                record = {**label, **{k: v for k, v in record.items() if k != "candidate"}}
            writer.write(record)
            records[rec.step] = rec
            if progress and (len(records) % every == 0 or len(records) == 1):
                t = f", {rec.step_time:.4f} s/step" if rec.step_time is not None else ""
                progress(f"  {run}: step {rec.step} loss {rec.loss:.6g}{t}")
            if monitor is not None:
                reason = monitor.update(rec.step, rec.loss)
                if reason:
                    state["stop"], state["detail"] = ("nonfinite" if not math.isfinite(rec.loss) else "loss"), reason
                    return reason
            elif not math.isfinite(rec.loss):
                state["stop"], state["detail"] = "nonfinite", f"baseline loss is {rec.loss} at step {rec.step}"
                return state["detail"]
            if len(records) >= opts.steps:
                state["stop"], state["detail"] = "steps", f"reached {opts.steps} steps"
                return state["detail"]
            return None

        command = runner.split_command(opts.cmd, opts.shell)
        try:
            child = runner.run_child(command, env=child_env, cwd=cwd, timeout_s=opts.timeout, on_line=on_line, log_path=paths["log"])
        except OSError as exc:
            raise UsageError(f"--cmd: cannot start {opts.cmd!r}: {exc}") from None
    if child.timed_out:
        state["stop"], state["detail"] = "timeout", f"timed out after {opts.timeout:.0f} s"
    counters = probe.read_counters(paths["probe"] / "counters")
    return RunOutcome(run, records, child, counters, parser.format, state["stop"], state["detail"], parser.unread, parser.detected_from)


def _run_info(out: RunOutcome, cand: Candidate, status: str, fp: str, opts: E2EOptions, paths: dict[str, Path] | None = None) -> dict[str, Any]:
    paths = paths or _paths(cand, out.run)
    c = out.counters
    return {
        "status": status,
        "steps": len(out.records),
        "last_step": max(out.records) if out.records else None,
        "jsonl": str(paths["jsonl"]),
        "log": str(paths["log"]),
        "format": out.format,
        "format_detected_from": out.detected_from,
        "output": {"lines": out.child.lines, "bytes": out.child.output_bytes, "truncated_lines": out.child.truncated_lines,
                   "log_bytes_dropped": out.child.log_bytes_dropped, "descendants_killed": out.child.descendants_killed},  # fmt: skip
        "exit": out.child.describe_exit() if out.stop is None else f"stopped by npufuse: {out.stop_detail}",
        "wall_s": round(out.child.wall_s, 3),
        "backend": c["backend"],
        "site_calls": sum(c["site_calls"].values()),
        "calls": c["calls"],
        "probe_processes": c["processes"],
        "maxrss_bytes": c["maxrss_bytes"],
        "npu_max_memory_allocated": c["npu_max_memory_allocated"],
        "fingerprint": fp,
        "steps_requested": opts.steps,
        "tail": out.child.tail[-8:],
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _losses(records: dict[int, Any]) -> dict[int, float]:
    return {s: r.loss for s, r in records.items()}


def _reuse_baseline(cand: Candidate, ev: dict[str, Any], fp: str, opts: E2EOptions) -> dict[int, logparse.StepRecord] | None:
    info = (ev.get("runs") or {}).get("baseline") or {}
    if opts.rerun_baseline or info.get("status") != "complete" or info.get("fingerprint") != fp:
        return None
    try:
        recs = jsonl.read_jsonl(_paths(cand, "baseline")["jsonl"])
    except (OSError, ValueError):
        return None
    if len(recs) < opts.steps:
        return None
    out = {}
    for r in recs[: opts.steps]:
        loss = jsonl.number(r.get("loss"))
        if loss is None:
            return None
        out[r["step"]] = logparse.StepRecord(r["step"], loss, jsonl.number(r.get("step_time")))
    return out


def _precheck(cand: Candidate, opts: E2EOptions) -> Path:
    """Refusals before any run (usage errors); returns the folder to run in."""
    if opts.steps <= opts.skip:
        raise UsageError(f"--steps {opts.steps} leaves nothing to compare after the first --skip {opts.skip} steps")
    status = cand.status
    if not opts.force:
        if status in ("pending", "accuracy_checking"):
            raise UsageError(f"candidate {cand.id} has not passed its op check yet: run `npufuse verify op {cand.id}` first (or --force)")
        if status == "accuracy_failed":
            raise UsageError(f"candidate {cand.id} failed its op check ({status}); fix or revert it, or pass --force to run e2e anyway")
    try:
        opts.log_regex and logparse.compile_regex(opts.log_regex)
        if opts.log_format not in (None, "auto"):
            if opts.log_regex:
                raise ValueError("--log-format and --log-regex exclude each other: the regex replaces every preset")
            logparse.preset_name(opts.log_format)
        runner.split_command(opts.cmd, opts.shell)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cwd = (opts.cwd or cand.root).resolve()
    if not cwd.is_dir():
        raise UsageError(f"--cwd {cwd}: not a folder")
    return cwd


def verify_e2e(cand: Candidate, opts: E2EOptions, progress: Progress | None = None, *, plan: dict[str, Any] | None = None,
               shared_baseline: tuple[dict[int, logparse.StepRecord], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole e2e verification with its state transitions; returns the final evidence
    (``{"e2e": ..., "perf": ..., "status": ..., "verdict": ...}``). ``plan``/``shared_baseline``:
    set by :func:`verify_e2e_all` (this candidate alone against the baseline of all of them)."""
    cwd = _precheck(cand, opts)
    status = cand.status
    plan = plan or _switch_plan(cand, opts)
    fp = shared_baseline[1].get("fingerprint", "") if shared_baseline else fingerprint(cand, opts, cwd, plan)
    state = _entry_evidence(cand)
    ev: dict[str, Any] = dict(state.get("e2e") or {})
    standing = op_standing(state, status, opts.force, bool(ev.get("forced")))
    ev["op_check"] = standing
    ev["forced"] = standing == "skipped (forced)"
    ev.update({"cmd": opts.cmd, "shell": opts.shell, "cwd": str(cwd), "env": opts.env, "seed_env": opts.seed_env, "steps_requested": opts.steps,
               "switch": {k: plan[k] for k in ("kind", "name", "describe")}, "mode": plan.get("mode", "single"),
               "thresholds": {"tolerance": opts.tolerance, "skip": opts.skip, "alpha": opts.alpha, "warmup": opts.warmup}})  # fmt: skip
    ev.setdefault("runs", {})
    for stale in ("loss", "passed", "reason", "proof"):
        ev.pop(stale, None)

    def save(status: str | None = None, note: str = "", verdict: str | None = None, reasons: list[str] | None = None, perf: dict[str, Any] | None = None) -> None:
        def mutate(entry: Any) -> None:
            entry.evidence["e2e"] = json.loads(json.dumps(ev, default=str))
            if perf is not None:
                entry.evidence["perf"] = perf
            if verdict is not None:
                entry.verdict = verdict
            if reasons is not None:
                entry.reasons = [r for r in entry.reasons if r.startswith("op check") and r != FORCED_REASON] + reasons

        update_state(cand, mutate, status=status, note=note)

    save("e2e_checking", "e2e started" + (" (forced: op check skipped)" if ev["forced"] else ""), verdict=None)

    # -- baseline
    base = _reuse_baseline(cand, ev, fp, opts) if shared_baseline is None else None
    if shared_baseline is not None:
        base, ev["runs"]["baseline"] = dict(shared_baseline[0]), dict(shared_baseline[1])
        save(note="baseline: the shared run of verify e2e --all")
    elif base is not None:
        if progress:
            progress(f"baseline: reusing the completed run ({len(base)} steps, {_paths(cand, 'baseline')['jsonl']})")
    else:
        if progress:
            progress(f"baseline run (switch off: {plan['off']}): {opts.cmd}")
        ev["runs"]["baseline"] = {"status": "running", "fingerprint": fp, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        save(note="baseline run started")
        out = _interruptible(lambda: run_once(cand, opts, "baseline", cwd, plan, None, progress), ev, "baseline", save)
        problem = _baseline_problem(out, opts, cand)
        ev["runs"]["baseline"] = _run_info(out, cand, "failed" if problem else "complete", fp, opts)
        if problem:
            save(note=f"baseline unusable: {problem[:200]}")
            _print_output(out)
            raise UsageError(problem)
        if out.counters["site_calls"]:
            n = sum(out.counters["site_calls"].values())
            reason = f"the switch did not turn the fused branch off: {n} torch_npu call(s) from {cand.file}:{cand.site.line} in the baseline ({plan['describe']})"
            ev.update({"passed": False, "reason": reason})
            save("e2e_failed", reason[:300], verdict="do not replace: switch does not work", reasons=[f"e2e: {reason}"])
            return _result(cand, ev, None)
        save(note="baseline complete")
        base = dict(sorted(out.records.items())[: opts.steps])

    # -- fused
    if progress:
        progress(f"fused run (switch on: {plan['on']}): {opts.cmd}")
    base_info = ev["runs"]["baseline"]
    ev["runs"]["fused"] = {"status": "running", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    save(note="fused run started")
    monitor = stats.LossMonitor(_losses(base), opts.tolerance, opts.skip, opts.alpha)
    out = _interruptible(lambda: run_once(cand, opts, "fused", cwd, plan, monitor, progress), ev, "fused", save)
    fused = dict(sorted(out.records.items())[: opts.steps])
    failure = _fused_problem(out, opts, cand, base_info)
    ev["runs"]["fused"] = _run_info(out, cand, "failed" if failure else "complete", fp, opts)
    check = stats.compare_losses(_losses(base), _losses(fused), opts.tolerance, opts.skip, opts.alpha, min_steps=1)
    ev["loss"] = check.to_json() if not (failure and out.stop in ("loss", "nonfinite")) else monitor.check.to_json()
    ev["proof"] = {"fused_site_calls": sum(out.counters["site_calls"].values()), "baseline_site_calls": base_info.get("site_calls", 0),
                   "apis": out.counters["site_calls"], "backend": out.counters["backend"]}  # fmt: skip
    ev["backend"] = out.counters["backend"]
    _write_metrics(cand)
    if failure is None and not check.passed:
        failure = check.reason
    if failure:
        ev.update({"passed": False, "reason": failure})
        save("e2e_failed", failure[:300], verdict="do not replace: e2e", reasons=([FORCED_REASON] if ev["forced"] else []) + [f"e2e failed ({ev['backend']}): {failure}"])
        return _result(cand, ev, None)
    ev.update({"passed": True, "reason": None})
    few = f"; only {opts.steps} steps (50+ recommended)" if opts.steps < MIN_RECOMMENDED_STEPS else ""
    loss_reason = (f"e2e loss ({ev['backend']}): {check.steps_compared} steps compared after {opts.skip}, max smoothed relative difference "
                   f"{check.max_rel_diff:.3%} (step {check.max_at_step}) ≤ {opts.tolerance:.1%}; fused branch ran "
                   f"({ev['proof']['fused_site_calls']} calls from the site, 0 in the baseline){few}")  # fmt: skip
    op_reason = [FORCED_REASON] if ev["forced"] else []
    save("perf_checking", "loss check passed", reasons=op_reason + [loss_reason])

    # -- perf
    perf = _perf(base, fused, opts, ev, base_info)
    verdict, perf_reason = _verdict(perf, standing)
    save("concluded", perf_reason[:300], verdict=verdict, reasons=op_reason + [loss_reason, perf_reason], perf=perf)
    return _result(cand, ev, perf)


def _entry_evidence(cand: Candidate) -> dict[str, Any]:
    from npufuse.verify.candidate import load_state

    entry = load_state(cand.state_dir).candidates.get(cand.id)
    return dict(entry.evidence) if entry else {}


def _interruptible(fn: Callable[[], RunOutcome], ev: dict[str, Any], run: str, save: Callable[..., None]) -> RunOutcome:
    try:
        return fn()
    except KeyboardInterrupt:
        ev["runs"][run] = {**ev["runs"].get(run, {}), "status": "interrupted", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        save("e2e_checking", note=f"{run} run interrupted; rerun to resume")  # recorded in the history
        raise


def _print_output(out: RunOutcome) -> None:
    sys.stderr.write(f"npufuse verify e2e: {out.run} output ({out.child.lines} lines), first lines:\n{_first_lines(out.child.head)}\n")
    if out.child.lines > len(out.child.head):
        sys.stderr.write(f"  last lines:\n{_first_lines(out.child.tail[-8:])}\n")
    if not out.records and out.unread:
        sys.stderr.write(f"  lines that mention a loss but no format could read:\n{_first_lines(out.unread)}\n")


def _baseline_problem(out: RunOutcome, opts: E2EOptions, cand: Candidate) -> str | None:
    c = out.counters
    if not out.records:
        if opts.log_regex:
            fmts = "the --log-regex"
        elif opts.log_format not in (None, "auto"):
            fmts = f"--log-format {opts.log_format}"
        else:
            fmts = ", ".join(logparse.PRESETS)
        unread = f"; could not read e.g. {out.unread[0][:120]!r}" if out.unread else ""
        return (f"no step/loss lines recognised in the baseline output ({out.child.lines} lines; formats tried: {fmts}; "
                f"{out.child.describe_exit()}){unread}; pass --log-format NAME or --log-regex with named groups step, loss, step_time (seconds)")  # fmt: skip
    if out.stop == "nonfinite":
        return f"{out.stop_detail}: the original code itself diverges; fix that before comparing"
    if out.stop == "timeout":
        return f"the baseline run timed out after {opts.timeout:.0f} s at step {max(out.records)}; raise --timeout or lower --steps"
    if len(out.records) < opts.steps:
        return f"the baseline run ended ({out.child.describe_exit()}) after {len(out.records)} of {opts.steps} steps; lower --steps or fix the command"
    if c["processes"] == 0:
        return ("the npufuse probe did not load in the launched Python (run with -I/-S, a non-Python launcher that clears "
                "PYTHONPATH, or an interpreter that cannot import npufuse): the fused branch could not be proven to run")  # fmt: skip
    if c["backend"] == "none" and not c["site_module_imported"]:
        return f"the command never imported {cand.file} (nor torch_npu): is it the right command and --cwd?"
    return None


def _fused_problem(out: RunOutcome, opts: E2EOptions, cand: Candidate, base_info: dict[str, Any]) -> str | None:
    assert cand.site is not None
    last = max(out.records) if out.records else 0
    if out.stop in ("loss", "nonfinite"):
        return f"stopped early at step {last}: {out.stop_detail}"
    if out.stop == "timeout":
        return f"the fused run timed out after {opts.timeout:.0f} s at step {last} (the baseline took {base_info.get('wall_s', '?')} s)"
    if len(out.records) < opts.steps:
        tail = next((ln for ln in reversed(out.child.tail) if ln.strip()), "")
        return f"the fused run ended ({out.child.describe_exit()}) after {len(out.records)} of {opts.steps} steps" + (f"; last output: {tail[:200]}" if tail else "")
    if not out.counters["site_calls"]:
        c = out.counters
        where = f"{cand.file}:{cand.site.line}-{cand.site.end_line}"
        why = "the probe did not load" if c["processes"] == 0 else ("torch_npu was never imported" if c["backend"] == "none" else f"backend {c['backend']}, {sum(c['calls'].values())} torch_npu calls elsewhere")
        return f"fused branch never executed: no {', '.join(cand.apis) or 'torch_npu'} call from {where} in the fused run ({why})"
    return None


def _perf(base: dict[int, logparse.StepRecord], fused: dict[int, logparse.StepRecord], opts: E2EOptions, ev: dict[str, Any], base_info: dict[str, Any]) -> dict[str, Any]:
    f_info = ev["runs"]["fused"]
    memory = {
        "baseline": {"maxrss_bytes": base_info.get("maxrss_bytes"), "npu_max_memory_allocated": base_info.get("npu_max_memory_allocated")},
        "fused": {"maxrss_bytes": f_info.get("maxrss_bytes"), "npu_max_memory_allocated": f_info.get("npu_max_memory_allocated")},
        "source": "peak RSS of the largest child Python (getrusage); torch.npu.max_memory_allocated on NPU",
    }
    backend = ev.get("backend", "none")
    try:
        res = stats.compare_step_times({s: r.step_time for s, r in base.items() if r.step_time is not None},
                                       {s: r.step_time for s, r in fused.items() if r.step_time is not None},
                                       opts.warmup, opts.n_boot, opts.confidence, opts.seed, opts.min_effect)  # fmt: skip
    except ValueError as exc:
        return {"verdict": "not measured", "reason": str(exc), "backend": backend, "memory": memory}
    perf = res.to_json()
    perf["backend"] = backend
    perf["memory"] = memory
    perf["step_time_source"] = "arrival" if any(r.extra.get("step_time_source") == "arrival" for r in fused.values()) else "log"
    return perf


FORCED = "op check skipped (forced)"
FORCED_REASON = f"{FORCED}: --force ran e2e without a passed op check; the loss curve is the only accuracy evidence"


def op_standing(evidence: dict[str, Any], status: str, force: bool, forced_before: bool) -> str:
    """Where the op check stands for an e2e run: "passed", "not applicable" (a fused optimizer:
    e2e is its evidence) or "skipped (forced)" (``--force`` without a passed op check, or a rerun
    of such a run while the op check still has not passed). A forced run never says "accuracy ok"."""
    op = evidence.get("op") or {}
    if op.get("skipped") and op.get("passed") is None:
        return "not applicable"
    op_passed = op.get("passed") is True and status not in ("pending", "accuracy_checking", "accuracy_failed")
    if op_passed:
        return "passed"
    if status in ("pending", "accuracy_checking", "accuracy_failed") or op.get("outcome") in ("not checked", "failed"):
        return "skipped (forced)"
    if force or forced_before:
        return "skipped (forced)"
    return "passed"  # the state says the op check passed (its evidence is elsewhere, e.g. an older state)


def _verdict(perf: dict[str, Any], standing: str = "passed") -> tuple[str, str]:
    prefix = {"passed": "", "not applicable": "op check not applicable; ", "skipped (forced)": f"{FORCED}; "}.get(standing, f"{FORCED}; ")
    verdict, reason = _speed_verdict(perf)
    if not prefix:
        return verdict, reason
    # "accuracy ok" is the op check's word: without one the loss curve is all there is
    return prefix + verdict.replace("accuracy ok", "loss ok"), reason


def _speed_verdict(perf: dict[str, Any]) -> tuple[str, str]:
    backend = perf.get("backend")
    if perf.get("verdict") == "not measured":
        return "undecided: step time not measured", f"step time not measured: {perf.get('reason')}"
    sp, lo, hi = perf["speedup"], perf["ci_low"], perf["ci_high"]
    figures = (f"speed-up {sp:.3f}x (median {perf['baseline']['median']:.4g} s → {perf['fused']['median']:.4g} s per step, "
               f"{perf['confidence']:.0%} CI [{lo:.3f}, {hi:.3f}], {perf['fused']['n']} steps after {perf['warmup']} warm-up)")  # fmt: skip
    if backend != "real":
        return ("accuracy ok; speed not judged (emulated)",
                f"step time ({backend}: CPU timing of the emulation, not NPU performance): {figures} → {perf['verdict']}")  # fmt: skip
    verdict = {"faster": "replace: faster", "slower": "do not replace: slower"}.get(perf["verdict"], "no measurable change")
    return verdict, f"step time (NPU): {figures} → {perf['verdict']}"


def _write_metrics(cand: Candidate) -> None:
    b, f = _paths(cand, "baseline")["jsonl"], _paths(cand, "fused")["jsonl"]
    try:
        rows = jsonl.merge_runs(jsonl.read_jsonl(b), jsonl.read_jsonl(f))
    except (OSError, ValueError):
        return
    write_text_atomic(cand.state_dir / f"e2e_{cand.id}_metrics.json", json.dumps(rows, indent=1) + "\n")


def _result(cand: Candidate, ev: dict[str, Any], perf: dict[str, Any] | None) -> dict[str, Any]:
    from npufuse.verify.candidate import load_state

    entry = load_state(cand.state_dir).candidates[cand.id]
    return {"candidate": cand.id, "status": entry.status, "verdict": entry.verdict, "reasons": entry.reasons, "e2e": ev, "perf": perf,
            "metrics": str(cand.state_dir / f"e2e_{cand.id}_metrics.json")}  # fmt: skip


# -- verify e2e --all ------------------------------------------------------------------------------


def _all_paths(state_dir: Path, run: str) -> dict[str, Path]:
    return {"jsonl": state_dir / f"e2e_all_{run}.jsonl", "log": state_dir / f"e2e_all_{run}.log", "probe": state_dir / f"e2e_all_{run}.probe"}


def verify_e2e_all(cands: list[Candidate], opts: E2EOptions, progress: Progress | None = None) -> dict[str, Any]:
    """``verify e2e --all``: N+2 runs for N accepted candidates instead of 2N. One baseline with
    every candidate off (``NPUFUSE_ONLY=none``), then each candidate alone (``NPUFUSE_ONLY=<id>``,
    its own verdict in its state entry, compared with that one baseline), then a joint run with
    all of them on (``NPUFUSE_ONLY=<ids>``), compared with the same baseline. Each run is
    labelled: ``run`` "baseline" / "fused" (alone) / "joint" in the JSONL, the state and
    ``e2e_all.json``. Needs the per-candidate switch in every site's guard (``npufuse apply``
    writes it); a site without one is refused with what to do."""
    if not cands:
        raise UsageError("verify e2e --all: no applied candidate in the state; run `npufuse apply --accept ...` first")
    for c in cands:
        assert c.site is not None
        if c.site.site_switch is None:
            raise UsageError(f"candidate {c.id} ({c.file}:{c.site.line}) has no per-candidate switch in its guard (applied by an older npufuse): "
                             f"`npufuse revert {c.id}` and `npufuse apply --accept {c.id}` again, or verify it alone")  # fmt: skip
    cwd = {_precheck(c, opts) for c in cands}
    if len(cwd) != 1:
        raise UsageError("verify e2e --all: the candidates are in different repositories; pass --cwd")
    run_dir = cwd.pop()
    ids = [c.id for c in cands]
    first = cands[0]
    sd = first.state_dir
    summary_path = sd / "e2e_all.json"
    base_plan = _only_plan(ids, ids, "joint run")
    fp = fingerprint(first, opts, run_dir, base_plan, cands[1:])
    summary: dict[str, Any] = {"candidates": ids, "cmd": opts.cmd, "runs": {}, "fingerprint": fp, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save_summary() -> None:
        write_text_atomic(summary_path, json.dumps(summary, indent=1, default=str) + "\n")

    # -- the one baseline: every candidate off
    paths = _all_paths(sd, "baseline")
    if progress:
        progress(f"baseline run for candidates {', '.join(map(str, ids))} (NPUFUSE_ONLY=none): {opts.cmd}")
    summary["runs"]["baseline"] = {"status": "running", "env": base_plan["baseline_env"]}
    save_summary()
    out = run_once(first, opts, "baseline", run_dir, base_plan, None, progress, paths=paths, sites=cands, label={"candidates": ids})
    problem = _baseline_problem(out, opts, first)
    info = _run_info(out, first, "failed" if problem else "complete", fp, opts, paths)
    info["by_site"] = out.counters["by_site"]
    summary["runs"]["baseline"] = {**info, "env": base_plan["baseline_env"]}
    save_summary()
    if problem:
        _print_output(out)
        raise UsageError(problem)
    base = dict(sorted(out.records.items())[: opts.steps])
    leaking = {cid: n for cid, n in out.counters["by_site"].items() if n}
    if leaking:
        raise UsageError(f"NPUFUSE_ONLY=none did not turn every candidate off: calls from candidate(s) {', '.join(sorted(leaking))} in the baseline "
                         "(a guard edited by hand?)")  # fmt: skip

    results: dict[int, Any] = {}
    # -- each candidate alone, against that baseline
    for c in cands:
        own = _paths(c, "baseline")
        with jsonl.JsonlWriter(own["jsonl"]) as writer:  # the shared baseline under the candidate's own name (report, merge-jsonl)
            for rec in base.values():
                writer.write({**logparse.record_json(c.id, "baseline", rec), "shared_baseline": ids})
        c_info = {**info, "jsonl": str(own["jsonl"]), "site_calls": int(out.counters["by_site"].get(str(c.id), 0)), "shared": ids,
                  "log": str(paths["log"])}  # fmt: skip
        plan = {**_only_plan(ids, [c.id], f"candidate {c.id} alone"), "mode": "alone"}
        if progress:
            progress(f"candidate {c.id} alone (NPUFUSE_ONLY={c.id})")
        results[c.id] = verify_e2e(c, opts, progress, plan=plan, shared_baseline=(base, c_info))
        summary["runs"][f"alone_{c.id}"] = {"candidate": c.id, "status": results[c.id]["status"], "verdict": results[c.id]["verdict"],
                                            "jsonl": str(_paths(c, "fused")["jsonl"]), "env": plan["fused_env"]}  # fmt: skip
        save_summary()

    # -- all of them together
    joint_plan = _only_plan(ids, ids, "joint run")
    paths = _all_paths(sd, "joint")
    if progress:
        progress(f"joint run (NPUFUSE_ONLY={','.join(map(str, ids))}): {opts.cmd}")
    monitor = stats.LossMonitor(_losses(base), opts.tolerance, opts.skip, opts.alpha)
    out = run_once(first, opts, "joint", run_dir, joint_plan, monitor, progress, paths=paths, sites=cands, label={"candidates": ids})
    joint = dict(sorted(out.records.items())[: opts.steps])
    failure = _fused_problem(out, opts, first, summary["runs"]["baseline"])
    silent = [str(c.id) for c in cands if not out.counters["by_site"].get(str(c.id))]
    if failure is None and silent:
        failure = f"fused branch of candidate(s) {', '.join(silent)} never executed in the joint run"
    check = stats.compare_losses(_losses(base), _losses(joint), opts.tolerance, opts.skip, opts.alpha, min_steps=1)
    if failure is None and not check.passed:
        failure = check.reason
    jinfo = _run_info(out, first, "failed" if failure else "complete", fp, opts, paths)
    jinfo.update({"by_site": out.counters["by_site"], "env": joint_plan["fused_env"], "passed": failure is None, "reason": failure,
                  "loss": (check if not (out.stop in ("loss", "nonfinite")) else monitor.check).to_json()})  # fmt: skip
    summary["runs"]["joint"] = jinfo
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save_summary()
    joint_line = (f"joint run (all of {', '.join(map(str, ids))} fused, {jinfo['backend']}): "
                  + (f"loss within {opts.tolerance:.1%} of the baseline (max smoothed relative difference {check.max_rel_diff:.3%})" if failure is None else f"failed: {failure}"))  # fmt: skip
    for c in cands:
        def mutate(entry: Any, line: str = joint_line) -> None:
            entry.evidence["e2e_joint"] = {"candidates": ids, "passed": failure is None, "reason": failure, "jsonl": str(paths["jsonl"]), "summary": str(summary_path)}
            entry.reasons = [r for r in entry.reasons if not r.startswith("joint run")] + [line]

        update_state(c, mutate, note="joint run " + ("passed" if failure is None else "failed"))
    return {"candidates": ids, "results": [results[i] for i in ids], "joint": jinfo, "summary": str(summary_path), "runs": len(ids) + 2}
