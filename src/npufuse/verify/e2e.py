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


def _switch_plan(cand: Candidate) -> dict[str, Any]:
    """How the baseline turns this site off and the fused run turns it on."""
    assert cand.site is not None
    name = cand.site.env_switch
    if name:
        return {"kind": "env", "name": name, "baseline_env": {name: "0"}, "fused_env": {name: "1"}, "disable_module": False,
                "describe": f"baseline {name}=0, fused {name}=1", "off": f"{name}=0", "on": f"{name}=1"}  # fmt: skip
    return {"kind": "module", "name": None, "baseline_env": {}, "fused_env": {}, "disable_module": True,
            "describe": f"the guard has no env switch ({cand.site.guard.splitlines()[0].strip()}); the baseline sets torch_npu = None in {cand.file}, "
                        "turning off every fused site of that file",
            "off": f"torch_npu = None in {cand.file}", "on": "as applied"}  # fmt: skip


def _baseline_source_sha(cand: Candidate) -> str:
    """The candidate file's hash without this site's fused branch: the baseline never runs that
    branch, so fixing (or breaking) it must not throw a completed baseline away."""
    try:
        text = cand.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    if cand.site is not None and cand.site.fused_text:
        text = text.replace(cand.site.fused_text, "", 1)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(cand: Candidate, opts: E2EOptions, cwd: Path) -> str:
    """What the baseline depends on: a change means it must be rerun."""
    facts = {"cmd": opts.cmd, "shell": opts.shell, "cwd": str(cwd), "env": sorted(opts.env.items()), "seed_env": sorted(opts.seed_env.items()),
             "log_regex": opts.log_regex, "file_sha256": _baseline_source_sha(cand), "emulate": opts.emulate}  # fmt: skip
    if opts.log_format not in (None, "auto"):  # only when set: baselines recorded before the option stay reusable
        facts["log_format"] = opts.log_format
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _first_lines(lines: list[str], n: int = 8) -> str:
    shown = [ln[:160] for ln in lines[:n]]
    return "\n".join(f"    {ln}" for ln in shown) if shown else "    (no output)"


def run_once(cand: Candidate, opts: E2EOptions, run: str, cwd: Path, plan: dict[str, Any], monitor: stats.LossMonitor | None, progress: Progress | None) -> RunOutcome:
    """One run of the command (baseline or fused): JSONL line by line, stop rules, counters."""
    assert cand.site is not None
    paths = _paths(cand, run)
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
    }
    cfg_path = paths["probe"] / "probe.json"
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    env = {**opts.seed_env, **opts.env, **plan[f"{run}_env"]}
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
            writer.write(logparse.record_json(cand.id, run, rec))
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


def _run_info(out: RunOutcome, cand: Candidate, status: str, fp: str, opts: E2EOptions) -> dict[str, Any]:
    paths = _paths(cand, out.run)
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


def verify_e2e(cand: Candidate, opts: E2EOptions, progress: Progress | None = None) -> dict[str, Any]:
    """The whole e2e verification with its state transitions; returns the final evidence
    (``{"e2e": ..., "perf": ..., "status": ..., "verdict": ...}``)."""
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
    plan = _switch_plan(cand)
    fp = fingerprint(cand, opts, cwd)
    state = _entry_evidence(cand)
    ev: dict[str, Any] = dict(state.get("e2e") or {})
    ev.update({"cmd": opts.cmd, "shell": opts.shell, "cwd": str(cwd), "env": opts.env, "seed_env": opts.seed_env, "steps_requested": opts.steps,
               "switch": {k: plan[k] for k in ("kind", "name", "describe")},
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
                entry.reasons = [r for r in entry.reasons if r.startswith("op check")] + reasons

        update_state(cand, mutate, status=status, note=note)

    save("e2e_checking", "e2e started", verdict=None)

    # -- baseline
    base = _reuse_baseline(cand, ev, fp, opts)
    if base is not None:
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
        save("e2e_failed", failure[:300], verdict="do not replace: e2e", reasons=[f"e2e failed ({ev['backend']}): {failure}"])
        return _result(cand, ev, None)
    ev.update({"passed": True, "reason": None})
    few = f"; only {opts.steps} steps (50+ recommended)" if opts.steps < MIN_RECOMMENDED_STEPS else ""
    loss_reason = (f"e2e loss ({ev['backend']}): {check.steps_compared} steps compared after {opts.skip}, max smoothed relative difference "
                   f"{check.max_rel_diff:.3%} (step {check.max_at_step}) ≤ {opts.tolerance:.1%}; fused branch ran "
                   f"({ev['proof']['fused_site_calls']} calls from the site, 0 in the baseline){few}")  # fmt: skip
    save("perf_checking", "loss check passed", reasons=[loss_reason])

    # -- perf
    perf = _perf(base, fused, opts, ev, base_info)
    verdict, perf_reason = _verdict(perf)
    save("concluded", perf_reason[:300], verdict=verdict, reasons=[loss_reason, perf_reason], perf=perf)
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


def _verdict(perf: dict[str, Any]) -> tuple[str, str]:
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
