"""``npufuse scan PATH``: stage 1, read-only.

Writes the identification report (``report.md`` in the current folder, or ``-o FILE``) and the
scan state (``.npufuse/scan.json`` in the current folder, or ``--state-dir DIR``), which
``npufuse apply`` reads. ``--format json`` prints scan.json on stdout instead of writing the
report (unless ``-o`` is given too). Never touches the scanned source. Exit 0; 2 for bad input
(a path that does not exist, an unknown pattern id).

Module-level imports stay light: the engine loads only when the verb runs, and jinja2 and rich
only when something has to be scanned: a re-scan whose inputs all match the last complete scan's
(:func:`npufuse.scan.cache.run_key`) and whose outputs are still on disk as written reuses them
untouched (``last_run.shortcut == "hit"``). ``--no-cache`` and ``--profile`` always scan.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunInfo:
    """How the latest :func:`run` in this process came by its outputs (for tests and debugging)."""

    shortcut: str = "off"  # hit: outputs reused as they were; miss: scanned; off: --no-cache, --profile or an input that cannot be keyed
    files: int = 0  # Python files the walk found
    files_analyzed: int = 0  # of those, parsed and analysed in this run (0 on a hit)
    files_from_cache: int = 0  # of those, per-file results read from the cache (0 on a hit: none needed)
    written: list[str] = field(default_factory=list)  # outputs written; the others already held these bytes


last_run = RunInfo()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from npufuse.cli import number

    parser.add_argument("path", help="the model repository (a folder) or one Python file")
    parser.add_argument("-o", "--output", metavar="FILE", help="report path (default: report.md in the current folder)")
    parser.add_argument("--state-dir", metavar="DIR", default=".npufuse", help="folder for scan.json (default: .npufuse in the current folder)")
    parser.add_argument("--format", choices=("md", "json"), default="md", help="md: write the report (default); json: print scan.json on stdout")
    parser.add_argument("--only", metavar="IDS", help="comma-separated pattern ids to run, e.g. rms_norm,swiglu")
    parser.add_argument("--profile", metavar="DIR", help="Ascend profiler output to join with the candidates (report section 1.2)")
    parser.add_argument("--trace", metavar="FILE", help="run-time facts from `npufuse trace` (trace.json): reached or not, shapes, dtypes, mask values (report section 1.3)")
    parser.add_argument("--max-file-mb", type=number(float, above=0, maximum=1 << 20), default=10.0, metavar="MB", help="skip Python files larger than this (default 10)")
    parser.add_argument("-j", "--jobs", type=number(int, minimum=1, maximum=4096), default=None, metavar="N", help="worker processes (default: all cores; small trees run in-process)")
    parser.add_argument("--batch-size", type=number(int, minimum=1, maximum=1 << 31), default=None, metavar="N", help="batch size for the value estimate (default: read from the repo, else 4)")
    parser.add_argument("--seq-len", type=number(int, minimum=1, maximum=1 << 31), default=None, metavar="N", help="sequence length for the value estimate (default: read from the repo, else 2048)")
    parser.add_argument("--switch", choices=("auto", "env", "none"), default="auto",
                        help="how fused branches are switched: auto = DESIGN rule 1 (repo switch > new config field > env var); env = always NPUFUSE_<ID>; none = only the NPU check")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown only when stderr is a terminal)")
    parser.add_argument("--include-tests", action="store_true", help="also scan tests/, examples/, tutorials/ (and similar) folders below PATH (skipped by default; the report lists them)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the per-file result cache (STATE_DIR/cache)")
    # issue 14 class 5: an explicit zero_grad(set_to_none=True) is the code's choice; overriding it is the user's
    parser.add_argument("--optimizer-zero-grad-in-place", action="store_true",
                        help="fused_optimizer: where the code frees grads with zero_grad(set_to_none=True) (which torch_npu's fused "
                             "optimizers reject with ValueError), propose the fused class anyway with that zero_grad rebound to zero "
                             "grads in place (risk: a parameter without a grad in some step still gets weight decay and momentum); "
                             "default: such optimizers are near misses")
    # issue 16: model code that lives in installed packages (npufuse.scan.follow)
    parser.add_argument("--no-follow-imports", action="store_true", help="scan only the repo, not the installed modeling files it uses (transformers)")
    parser.add_argument("--python", metavar="EXE", help="the interpreter the repo runs with: its sys.path says where installed packages live")
    parser.add_argument("--site", metavar="PATH", action="append", help="a folder holding installed packages (repeatable; overrides --python)")


def _progress(enabled: bool):
    """A rich progress bar on stderr, or None. Manual refresh: no thread (the pool forks)."""
    if not enabled:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("scanning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True), auto_refresh=False, transient=True)
    task = bar.add_task("scan", total=None)
    state = {"n": 0}

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)
        state["n"] += 1
        if state["n"] % 8 == 0 or done == total:
            bar.refresh()

    return bar, update


def _join_profile(scan: dict[str, Any], profile_dir: str) -> str:
    """Profile result joined onto the candidates (in place); returns report section 1.2."""
    from npufuse.profile.analysis import analyze
    from npufuse.profile.join import join_with_scan, render_section_1_2

    result = analyze([profile_dir])
    ranked, unexplained = join_with_scan(result, scan["candidates"])
    by_id = {c.get("id"): c for c in ranked}
    for c in scan["candidates"]:
        joined = by_id.get(c["id"], {})
        c["profile"] = joined.get("profile")
        if joined.get("profile_covers"):
            c["profile_covers"] = joined["profile_covers"]
    scan["profile"] = {"source": profile_dir, "unexplained": unexplained}
    return render_section_1_2(unexplained)


class _NotPlain(Exception):
    """A value :func:`dumps` leaves to the json module (not a plain str/int/float/dict/list)."""


def dumps(obj: Any) -> str:
    """``json.dumps(obj, indent=2, ensure_ascii=False)``, byte for byte, about twice as fast.
    The json module indents only with its pure-Python encoder, which pays for generality (key
    coercion, circular-reference markers, one generator per level) on each of the ~10^6 values
    of a large scan.json; this writes plain data directly and hands anything else (a non-str
    key, NaN, a subclass) back to the json module, so the result is always json's."""
    import json
    from json.encoder import encode_basestring as quote  # the C version where there is one

    parts: list[str] = []
    append = parts.append
    inf = float("inf")

    def enc(o: Any, indent: str) -> None:
        t = type(o)
        if t is str:
            append(quote(o))
        elif t is dict:
            if not o:
                append("{}")
                return
            inner = indent + "  "
            sep = ",\n" + inner
            append("{\n" + inner)
            first = True
            for k, v in o.items():
                if type(k) is not str:
                    raise _NotPlain
                if first:
                    first = False
                else:
                    append(sep)
                append(quote(k))
                append(": ")
                tv = type(v)
                if tv is str:  # the most common values, inline
                    append(quote(v))
                elif tv is int:
                    append(int.__repr__(v))
                else:
                    enc(v, inner)
            append("\n" + indent + "}")
        elif t is list or t is tuple:
            if not o:
                append("[]")
                return
            inner = indent + "  "
            sep = ",\n" + inner
            append("[\n" + inner)
            first = True
            for v in o:
                if first:
                    first = False
                else:
                    append(sep)
                enc(v, inner)
            append("\n" + indent + "]")
        elif o is None:
            append("null")
        elif o is True:
            append("true")
        elif o is False:
            append("false")
        elif t is int:
            append(int.__repr__(o))
        elif t is float and o == o and o != inf and o != -inf:
            append(float.__repr__(o))
        else:
            raise _NotPlain

    try:
        enc(obj, "")
    except (_NotPlain, RecursionError):
        return json.dumps(obj, indent=2, ensure_ascii=False)
    return "".join(parts)


def _write(path: Path, data: bytes, *, state_dir: Path | None = None) -> bool:
    """Atomic write, unless the file already holds exactly ``data`` (then it is left alone, mtime
    included). A new file gets the usual umask permissions (mkstemp would give 0600). True: written.
    With ``state_dir``, ``path`` is a file of the state folder, written without following links
    (:mod:`npufuse.state_folder`); else a user-named output (:func:`write_output`: a device, FIFO
    or symlink named by ``-o`` is written through, not replaced)."""
    from npufuse.safe_write import read_regular_file, write_output

    if state_dir is not None:
        from npufuse.state_folder import UnsafeStatePath, read_state_file, write_state_file

        try:
            if read_state_file(state_dir, path.name) == data:
                return False
        except UnsafeStatePath:
            raise
        except OSError:
            pass
        write_state_file(state_dir, path.name, data)
        return True
    if read_regular_file(path, max_bytes=len(data)) == data:
        return False
    write_output(path, data)
    return True


_COUNTS = ("files_scanned", "candidates", "near_misses", "problems")  # what the summary line needs


def _summary(counts: dict[str, int], paths: list[Path]) -> str:
    return (
        f"npufuse scan: {counts['files_scanned']} files, {counts['candidates']} candidates, "
        f"{counts['near_misses']} near misses, {counts['problems']} problems -> "
        + ", ".join(p.as_posix() for p in paths)
    )


def _finish(args: argparse.Namespace, counts: dict[str, int], paths: list[Path], scan_json: bytes) -> int:
    summary = _summary(counts, paths)
    if args.format == "json":
        sys.stdout.write(scan_json.decode("utf-8"))
        print(summary, file=sys.stderr)
    else:
        print(summary)
    return 0


def _say_missing(args: argparse.Namespace, followed: Any) -> None:
    for name in followed.missing if (args.python or args.site) else ():  # asked for by name: say it was not there
        print(f"npufuse scan: the repo imports {name}, which is not installed where npufuse looked; --python EXE or --site PATH names where it is", file=sys.stderr)


def _load_template() -> None:
    from npufuse.report.markdown import _env

    _env().get_template("report.md.j2")


def _outputs_key(run_key: str, state_path: Path, report_path: Path | None) -> str:
    """The run key plus what the command adds to the outputs: the state path printed in the report."""
    import hashlib

    return hashlib.sha256(f"{run_key}\0{state_path.as_posix()}\0{report_path is not None}".encode("utf-8", "surrogatepass")).hexdigest()


def run(args: argparse.Namespace) -> int:
    global last_run
    from npufuse.cli import UsageError
    from npufuse.scan import engine

    target = Path(args.path)
    if not target.exists() and not target.is_symlink():
        raise UsageError(f"{args.path}: no such file or folder")
    if args.output and Path(args.output).suffix in (".py", ".pyi"):
        raise UsageError(f"-o {args.output}: refusing to write the report over a Python file")
    if not (0 < args.max_file_mb < 1 << 40):  # nan and inf fail this too
        raise UsageError("--max-file-mb must be a positive number of megabytes")
    if args.profile and not Path(args.profile).exists():
        raise UsageError(f"--profile {args.profile}: no such file or folder")
    trace = None
    if args.trace:
        from npufuse.trace.facts import TraceInputError, load_trace

        try:
            trace = load_trace(Path(args.trace))
        except TraceInputError as exc:
            raise UsageError(f"--trace {exc}") from None
    only = [s for s in args.only.split(",")] if args.only else None
    info = last_run = RunInfo()
    state_path = Path(args.state_dir) / "scan.json"
    report_path = Path(args.output or "report.md") if args.format == "md" or args.output else None
    outputs = [state_path] + ([report_path] if report_path is not None else [])
    cache_dir = None if args.no_cache else Path(args.state_dir) / "cache"
    from npufuse.state_folder import StateBusy, UnsafeStatePath, check_state_dir, lock

    try:
        # a repository may ship .npufuse as a symlink: refused before anything is cached or written
        check_state_dir(args.state_dir)
        # s43: no automatic full collections while the scan's results pile up (engine.collector_paused)
        with lock(args.state_dir, verb="npufuse scan"), engine.collector_paused():
            return _run_locked(args, target, only, state_path, report_path, outputs, cache_dir, trace)
    except (UnsafeStatePath, StateBusy) as exc:
        raise UsageError(str(exc)) from None


def _run_locked(args: argparse.Namespace, target: Path, only: list[str] | None, state_path: Path, report_path: Path | None, outputs: list[Path], cache_dir: Path | None, trace: dict[str, Any] | None) -> int:
    from npufuse.cli import UsageError
    from npufuse.scan import engine

    info = last_run

    try:
        inputs = engine.gather_inputs(
            target,
            only=only,
            max_file_bytes=int(args.max_file_mb * 1024 * 1024),
            switch_mode=args.switch,
            overrides={"batch_size": args.batch_size, "seq_len": args.seq_len},
            cache_dir=cache_dir,
            include_tests=args.include_tests,
            optimizer_zero_grad_in_place=getattr(args, "optimizer_zero_grad_in_place", False),
        )
    except engine.UnknownPatternError as exc:
        raise UsageError(f"--only: {exc}") from None
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    info.files = len(inputs.walked.files)
    followed = None
    follow_key = ""  # the followed installed files' part of the outputs' key
    # only reusing recorded outputs (a cache with a run key) needs the followed files before the
    # analysis; otherwise (a cold cache, --no-cache) they are read while the pool's workers
    # analyse (this process only waits then), not before the pool starts with the cores idle
    follow_later: list[Any] = []
    if not args.no_follow_imports:
        from npufuse.scan import follow

        try:
            paths = follow.search_path(args.python, args.site)
        except follow.FollowError as exc:
            raise UsageError(str(exc)) from None
        if cache_dir is None or args.profile or trace is not None or inputs.key is None:
            follow_later.append(lambda: follow.follow_imports(Path(inputs.walked.root), inputs.walked.files, paths))
        else:
            followed = follow.follow_imports(Path(inputs.walked.root), inputs.walked.files, paths)
            follow_key = follow.digest(followed)
            _say_missing(args, followed)

    # The profile join reads profiler output the key does not cover: such a run always scans.
    # A cold cache (inputs.cold) has no record to reuse: its key comes with the scan's result.
    keyed = cache_dir is not None and not args.profile and trace is None and (inputs.key is not None or inputs.cold)
    if keyed:
        if inputs.key is not None:
            from npufuse.scan.cache import reuse_outputs

            reused = reuse_outputs(cache_dir, _outputs_key(inputs.key + follow_key, state_path, report_path), outputs)
            counts, found = reused if reused is not None else ({}, {})
            if reused is not None and all(isinstance(counts.get(k), int) for k in _COUNTS):
                from npufuse.user_secret import remember_scan

                remember_scan(Path(args.state_dir), found[state_path])
                info.shortcut = "hit"
                return _finish(args, counts, [p for p in (report_path, state_path) if p is not None], found[state_path])
        info.shortcut = "miss"

    bar, update = _progress(sys.stderr.isatty() and not args.no_progress)
    followed_early: list[Any] = []

    def while_waiting() -> None:
        # while the workers analyse, this process would only wait: import jinja2 and compile
        # the report template then, not after the last file; and follow the imports (cold scan)
        if follow_later:
            followed_early.append(follow_later[0]())
        if report_path is not None:
            _load_template()

    try:
        if bar is not None:
            bar.start()
        result = engine.run_scan(inputs, jobs=args.jobs, progress=update, while_waiting=while_waiting if (follow_later or report_path is not None) else None)
    finally:
        if bar is not None:
            bar.stop()
    if follow_later:  # (not done while waiting: no pool ran, or it raised and is done here again)
        followed = followed_early[0] if followed_early else follow_later[0]()
        follow_key = follow.digest(followed)
        _say_missing(args, followed)
    info.files_analyzed = result.stats.get("analyzed", 0)
    info.files_from_cache = result.stats.get("from_cache", 0)

    scan = result.to_json()
    if followed is not None and (followed.files or followed.unresolved or followed.trainer):
        follow.extend_scan(scan, followed, only=only, max_file_bytes=int(args.max_file_mb * 1024 * 1024), switch_mode=args.switch,
                           overrides={"batch_size": args.batch_size, "seq_len": args.seq_len},
                           optimizer_zero_grad_in_place=getattr(args, "optimizer_zero_grad_in_place", False))
    profile_section = _join_profile(scan, args.profile) if args.profile else None
    if profile_section is not None:
        scan["suggested_order"] = engine.suggested_order(scan["candidates"])
    if trace is not None:
        from npufuse.trace.facts import join_trace, runtime_section

        join_trace(scan, trace, source=str(args.trace))
        profile_section = (profile_section or "") + runtime_section(scan, trace)
    # scan.json and report.md are encoded here, one after the other: rendering the report in a
    # forked child beside the JSON encoding was measured slower (the child's reads of the whole
    # result copy-on-write most of this process's heap: ~0.1 s more than it saves)
    try:
        data: dict[Path, bytes] = {state_path: (dumps(scan) + "\n").encode("utf-8")}
    except UnicodeEncodeError:
        # a file name that is not UTF-8 (a lone surrogate from os.fsdecode): JSON's \udcXX
        # escapes keep it exact, and apply gets the same bytes back from json.loads
        import json

        data = {state_path: (json.dumps(scan, indent=2, ensure_ascii=True) + "\n").encode("ascii")}
    if report_path is not None:
        from npufuse.report.markdown import render_markdown
        from npufuse.text_safety import safe_report_text

        report_text = render_markdown(scan, state_path=state_path.as_posix(), order_rule=engine.order_rule(profile_section is not None), profile_section=profile_section)
        data[report_path] = safe_report_text(report_text).encode("utf-8", "backslashreplace")
    try:
        for path, content in data.items():
            if _write(path, content, state_dir=Path(args.state_dir) if path == state_path else None):
                info.written.append(path.as_posix())
    except OSError as exc:
        from npufuse.state_folder import UnsafeStatePath

        if isinstance(exc, UnsafeStatePath):
            raise UsageError(str(exc)) from None
        raise UsageError(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}") from None

    from npufuse.user_secret import remember_scan

    remember_scan(Path(args.state_dir), data[state_path])
    counts = {"files_scanned": scan["files_scanned"], "candidates": len(scan["candidates"]), "near_misses": len(scan["near_misses"]), "problems": len(scan["files_failed"])}
    if cache_dir is not None:
        from npufuse.scan.cache import forget_outputs, save_outputs

        if keyed and result.run_key is not None:
            save_outputs(cache_dir, _outputs_key(result.run_key + follow_key, state_path, report_path), data, counts)
        else:  # these outputs were not keyed: no record may vouch for them
            forget_outputs(cache_dir, outputs)
    return _finish(args, counts, [p for p in (report_path, state_path) if p is not None], data[state_path])
