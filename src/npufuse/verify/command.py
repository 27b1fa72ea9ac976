"""``npufuse verify op ID`` and ``npufuse verify e2e ID --cmd "..."`` (see opcheck.py and e2e.py).

Exit codes: 0 passed (e2e: concluded without a "do not replace" verdict), 1 the candidate failed
(accuracy_failed / e2e_failed / slower), 2 usage or input error, 130 interrupted (state saved;
rerun to resume).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from npufuse.cli import UsageError, number


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k, v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {v}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="check", metavar="CHECK")
    sub.required = True

    def common(p: argparse.ArgumentParser, optional_id: bool = False) -> None:
        if optional_id:
            p.add_argument("id", type=int, nargs="?", help="candidate id (npufuse status lists them); omit with --all")
        else:
            p.add_argument("id", type=int, help="candidate id (npufuse status lists them)")
        p.add_argument("--state-dir", default=".npufuse", help="npufuse state folder (default .npufuse)")
        p.add_argument("--root", default=None, help="repository root (default: scan.json's root)")
        p.add_argument("--env", action="append", type=_kv, default=[], metavar="K=V", help="environment variable for the child process(es); repeatable")
        p.add_argument("--shell", action="store_true", help="run the command through /bin/sh (default: shlex.split, no shell)")
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.add_argument("--quiet", action="store_true", help="no progress on stderr")

    op = sub.add_parser("op", help="operator-level accuracy (forward + backward) against a float64 golden (fp32 on an NPU)", description="operator-level accuracy of one applied candidate")
    common(op)
    op.add_argument("--check-unreached", action="store_true", help="check a candidate that `npufuse trace` recorded as never executed")
    op.add_argument("--capture", metavar="CMD", help='launch command whose first call of the target gives the inputs, e.g. "python train.py --steps 1"')
    op.add_argument("--capture-timeout", type=number(float, above=0, maximum=1e7), default=600.0, metavar="S", help="seconds to wait for the capture (default 600)")
    op.add_argument("--capture-max-mb", type=number(int, minimum=0, maximum=1 << 20), default=512, metavar="MB", help="tensors captured by value up to this total (default 512)")
    op.add_argument("--shape", action="append", default=[], metavar="[NAME=]AxBxC[:dtype]", help="input shape of a parameter; repeatable")
    op.add_argument("--dtype", help="low precision to check in (default: captured, else config torch_dtype, else bfloat16)")
    op.add_argument("--init", action="append", type=_kv, default=[], metavar="NAME=VALUE", help="constructor/argument value (Python literal); repeatable")
    op.add_argument("--batch", type=_positive_int, help="batch size for config-derived shapes (default min(config, 2))")
    op.add_argument("--seq-len", type=_positive_int, help="sequence length for config-derived shapes (default min(config, 256))")
    op.add_argument("--factor", type=number(float, above=0, maximum=1e6), default=2.0, help="allowed multiple of the original's own low-precision error (default 2.0)")
    op.add_argument("--seed", type=number(int, minimum=0, maximum=2**32 - 1), default=0)
    op.add_argument("--backend", choices=("auto", "emulated"), default="auto", help="auto: real torch_npu on an NPU host, else emulated")
    op.add_argument("--python", metavar="PY", help="run the check in this interpreter (your training environment, with your repo's imports); "
                    "npufuse's checker is loaded from npufuse's own install (default: the Python of --capture, when that is another interpreter)")
    op.add_argument("--autocast", choices=("bfloat16", "float16", "off"), help="also check under torch.autocast in this dtype with float32 inputs, as AMP training runs "
                    "(default: bfloat16 when the scan saw autocast at the site or in the repo; a captured call replays its own autocast state)")

    e2e = sub.add_parser("e2e", help="baseline vs fused run of your launch command: loss, then step time", description="end-to-end check of one applied candidate")
    common(e2e, optional_id=True)
    e2e.add_argument("--all", action="store_true", dest="all_candidates",
                     help="every applied candidate: one baseline with all off, each candidate alone, then all together (N+2 runs)")
    e2e.add_argument("--cmd", required=True, help='your launch command, e.g. "python train.py --steps 50" (its program is looked up on the PATH of the child environment: --env PATH=... picks a venv)')
    e2e.add_argument("--steps", type=number(int, minimum=1, maximum=10**7), default=50, help="logged steps to compare (default 50); the run is stopped after them")
    e2e.add_argument("--timeout", type=number(float, above=0, maximum=1e7), default=3600.0, metavar="S", help="per run, seconds (default 3600)")
    e2e.add_argument("--log-regex", help="regex with named groups loss (required), step, step_time (seconds)")
    e2e.add_argument("--log-format", default="auto", metavar="NAME", help="log preset: megatron (mindspeed), torchtitan, litgpt, nanogpt, deepspeed, hf, step; default auto (detected from the output)")
    e2e.add_argument("--seed-env", action="append", type=_kv, default=[], metavar="K=V", help="seed variables set identically in both runs (default PYTHONHASHSEED=0)")
    e2e.add_argument("--cwd", help="folder to run in (default: the repository root)")
    e2e.add_argument("--tolerance", type=number(float, above=0, maximum=1e6), default=0.01, help="max smoothed relative loss difference (default 0.01 = 1%%)")
    e2e.add_argument("--skip", type=number(int, minimum=0, maximum=10**7), default=10, help="first steps not compared (default 10)")
    e2e.add_argument("--ema", type=number(float, above=0, maximum=1), default=0.1, help="EMA smoothing factor of the loss curves (default 0.1)")
    e2e.add_argument("--warmup", type=number(int, minimum=0, maximum=10**7), default=5, help="first steps excluded from step-time statistics (default 5)")
    e2e.add_argument("--bootstrap", type=number(int, minimum=1, maximum=10**6), default=2000, help="bootstrap resamples (default 2000)")
    e2e.add_argument("--min-effect", type=number(float, minimum=0, maximum=1e3), default=0.01, help="smallest speed-up worth calling faster/slower (default 0.01)")
    e2e.add_argument("--seed", type=number(int, minimum=0, maximum=2**32 - 1), default=0, help="bootstrap seed")
    e2e.add_argument("--rerun-baseline", action="store_true", help="do not reuse a completed baseline run")
    e2e.add_argument("--force", action="store_true", help="run even if the op check has not passed")
    e2e.add_argument("--emulate", choices=("auto", "never", "always"), default="auto", help="the child's torch_npu: auto = real if installed, else emulated")


def _progress(args: argparse.Namespace) -> Any:
    if args.quiet or args.json:
        return None
    return lambda msg: print(f"npufuse verify {args.check} {args.id}: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from npufuse.verify.candidate import load_candidate

    from npufuse.state_folder import StateBusy, UnsafeStatePath, check_state_dir, lock

    try:
        # before resolving it: a state folder that is a symlink (a hostile repo's) is refused
        check_state_dir(args.state_dir)
        # The child runs in the repo root, not here: every path handed to it (probe settings,
        # counter files) must be absolute, so resolve the state folder once, up front.
        args.state_dir = str(Path(args.state_dir).resolve())
        if args.check == "e2e" and args.all_candidates:
            if args.id is not None:
                raise UsageError("verify e2e: give a candidate id or --all, not both")
            with lock(args.state_dir, verb="npufuse verify e2e --all"):
                return _run_e2e_all(args)
        if args.id is None:
            raise UsageError("verify e2e: a candidate id is required (or --all)")
        if not Path(args.state_dir).is_dir():
            cand = load_candidate(args.id, args.state_dir, args.root)  # says what is missing
        with lock(args.state_dir, verb=f"npufuse verify {args.check}"):
            cand = load_candidate(args.id, args.state_dir, args.root)
            if args.check == "op":
                return _run_op(args, cand)
            return _run_e2e(args, cand)
    except (UnsafeStatePath, StateBusy) as exc:
        raise UsageError(str(exc)) from None


def _run_op(args: argparse.Namespace, cand: Any) -> int:
    from npufuse.verify.inputs import parse_literal
    from npufuse.verify.opcheck import NOT_OP_LEVEL, OpOptions, skip_op_check, verify_op

    if cand.pattern in NOT_OP_LEVEL:
        evidence = skip_op_check(cand)
        print(json.dumps(evidence, indent=2) if args.json else f"candidate {cand.id}: op check not applicable ({evidence['skipped']}); next: npufuse verify e2e {cand.id} --cmd \"...\"")
        return 0

    from npufuse.trace.inputs import not_reached, recorded_arguments, recorded_autocast, recorded_configs, recorded_init, recorded_shapes

    unreached = not_reached(cand.scan)
    if unreached and not args.check_unreached:
        from npufuse.verify.candidate import update_state

        update_state(cand, status="not_reached", note=unreached)
        print(json.dumps({"candidate": cand.id, "check": "op", "status": "not_reached", "reason": unreached}, indent=2)
              if args.json else f"candidate {cand.id}: {unreached} (--check-unreached checks it anyway)")
        return 1
    traced_notes: list[str] = []
    init_configs: dict[str, Any] = {}
    traced_arguments: dict[str, Any] = {}
    if not args.shape and not args.capture:
        traced, traced_notes = recorded_shapes(cand.scan)
        args.shape = traced
        given = {k for k, _ in args.init}
        built = [(k, repr(v)) for k, v in recorded_init(cand.scan).items() if k not in given]
        if traced and built:
            args.init = list(args.init) + built
            traced_notes.append("constructed with the traced run's __init__ arguments: " + ", ".join(f"{k}={v}" for k, v in built))
        if traced:
            # issue 16: what --shape/--init cannot say (a config object, a tuple of tensors, flags)
            init_configs = {k: v for k, v in recorded_configs(cand.scan).items() if k not in given}
            traced_arguments = recorded_arguments(cand.scan)
            for k, v in init_configs.items():
                traced_notes.append(f"`{k}`: a {v['type'].rpartition('.')[2] or 'config'} built from the traced run's "
                                    f"{len(v['config'])} plain config fields")
            if traced_arguments:
                traced_notes.append("arguments as the traced run passed them: " + ", ".join(
                    f"{k}={_traced_text(v)}" for k, v in traced_arguments.items()))
    opts = OpOptions(
        capture=args.capture, capture_timeout=args.capture_timeout, capture_max_mb=args.capture_max_mb, shell=args.shell,
        env=dict(args.env), shapes=args.shape, dtype=args.dtype, init={k: parse_literal(v) for k, v in args.init},
        batch=args.batch, seq_len=args.seq_len, factor=args.factor, seed=args.seed, backend=args.backend, autocast=args.autocast or recorded_autocast(cand.scan),
    )  # fmt: skip
    if opts.factor <= 0:
        raise UsageError("--factor must be positive")
    opts.input_notes = traced_notes
    opts.init_configs, opts.traced_arguments = init_configs, traced_arguments
    from npufuse.verify.op_python import capture_python, run_op_in

    python = args.python or capture_python(args.capture, args.shell)
    report = run_op_in(python, cand, opts, _progress(args)) if python else verify_op(cand, opts, _progress(args))
    if args.json:
        out = report.summary()
        out["checks"] = [c.to_json() for c in report.checks]
        print(json.dumps(out, indent=2))
    else:
        _print_op(report)
    return 0 if report.passed else 1


def _traced_text(v: Any) -> str:
    """How a note shows one traced argument (npufuse.trace.inputs.recorded_arguments)."""
    if not isinstance(v, dict):
        return repr(v)
    if "tensors" in v:
        return "(" + ", ".join("x".join(map(str, t[0])) for t in v["tensors"]) + ")"
    if "ints" in v:
        return f"{'x'.join(map(str, v['ints']))} ids in [{v['range'][0]}, {v['range'][1]}]"
    if "causal_mask" in v:
        return f"causal 0/-inf mask {'x'.join(map(str, v['causal_mask']))}"
    if "object" in v:
        return f"a {str(v['object']).rpartition('.')[2]} built with the traced run's __init__ arguments"
    return "?"


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "—"


def _print_op(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped/CI output: keep one row per line
    table = Table(title=f"op check of candidate {report.candidate}: {report.pattern} in {report.file} ({report.qualname}) — {report.backend}")
    for col in ("tensor", "shape", "dtype", "cosine", "max abs", "max rel", "orig max rel", "over bound", "row cos min", "ok"):
        table.add_column(col, justify="right" if col not in ("tensor", "dtype") else "left")
    for c in report.checks:
        table.add_row(c.name, "×".join(map(str, c.shape)), c.dtype, _fmt(c.cosine, ".6f"), _fmt(c.max_abs, ".3g"), _fmt(c.max_rel, ".3g"),
                      _fmt(c.orig_max_rel, ".3g"), str(c.violations), _fmt(c.row_cos_min, ".5f"), "yes" if c.passed else "NO")  # fmt: skip
    console.print(table)
    print(f"inputs: {report.inputs['source']} ({report.inputs['dtype']}); backward {report.backward}; fused calls from the site: {report.calls['site_calls_on']}")
    for note in report.inputs.get("notes", []) + report.notes:
        print(f"note: {note}")
    for line in report.not_compared:
        print(line)
    if report.not_checked:
        print(f"NOT CHECKED: {report.not_checked}")
    elif report.passed:
        every = f"every compared tensor ({len(report.not_compared)} output(s) not compared, above)" if report.not_compared else "every tensor"
        print(f"PASSED: the seed criterion and the relative-error bound ({report.factor}× the original's own error) hold for {every}")
    else:
        print("FAILED (accuracy_failed):")
        for r in report.reasons:
            print(f"  - {r}")
    print(f"results: {report.jsonl}")


def _e2e_options(args: argparse.Namespace) -> Any:
    from npufuse.verify.e2e import E2EOptions

    seed_env = dict(args.seed_env) if args.seed_env else {"PYTHONHASHSEED": "0"}
    if not 0 < args.ema <= 1:
        raise UsageError("--ema must be in (0, 1]")
    if args.tolerance <= 0:
        raise UsageError("--tolerance must be positive")
    opts = E2EOptions(
        cmd=args.cmd, steps=args.steps, env=dict(args.env), seed_env=seed_env, shell=args.shell, timeout=args.timeout,
        log_regex=args.log_regex, cwd=Path(args.cwd) if args.cwd else None, tolerance=args.tolerance, skip=max(0, args.skip),
        alpha=args.ema, warmup=max(0, args.warmup), n_boot=args.bootstrap, min_effect=args.min_effect, seed=args.seed,
        rerun_baseline=args.rerun_baseline, force=args.force, emulate=args.emulate,
    )  # fmt: skip
    opts.log_format = args.log_format
    return opts


def _run_e2e_all(args: argparse.Namespace) -> int:
    from npufuse.verify.candidate import load_candidate, load_state
    from npufuse.verify.e2e import verify_e2e_all

    opts = _e2e_options(args)
    ids = sorted(cid for cid, entry in load_state(Path(args.state_dir)).candidates.items() if entry.applied)
    cands = [load_candidate(cid, args.state_dir, args.root) for cid in ids]
    args.id = "all"
    out = verify_e2e_all(cands, opts, _progress(args))
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"verify e2e --all: {out['runs']} runs (one baseline, {len(ids)} candidate(s) alone, one joint run)")
        for r in out["results"]:
            print(f"candidate {r['candidate']} alone: {r['status']}" + (f" — {r['verdict']}" if r["verdict"] else ""))
        j = out["joint"]
        print(f"joint run ({', '.join(map(str, ids))}): " + ("loss ok" if j["passed"] else f"FAILED: {j['reason']}"))
        print(f"summary: {out['summary']}")
    bad = [r for r in out["results"] if r["status"] in ("e2e_failed", "accuracy_failed") or "do not replace" in str(r["verdict"] or "")]
    return 1 if bad or not out["joint"]["passed"] else 0


def _run_e2e(args: argparse.Namespace, cand: Any) -> int:
    from npufuse.verify.e2e import verify_e2e

    opts = _e2e_options(args)
    result = verify_e2e(cand, opts, _progress(args))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(f"candidate {result['candidate']}: {result['status']}" + (f" — {result['verdict']}" if result["verdict"] else ""))
        for r in result["reasons"]:
            print(f"  - {r}")
        runs = result["e2e"].get("runs", {})
        for name in ("baseline", "fused"):
            if name in runs:
                print(f"{name}: {runs[name].get('jsonl')}")
        print(f"metrics: {result['metrics']}")
    failed = result["status"] in ("e2e_failed", "accuracy_failed") or "do not replace" in str(result["verdict"] or "")
    return 1 if failed else 0
