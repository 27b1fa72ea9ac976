"""``npufuse verify op ID --python PY``: the op check in the user's own interpreter.

npufuse's interpreter rarely has every import of the user's repo (lightning, triton, a patched
transformers); the training environment has them. Here the candidate is located in npufuse's own
process (that needs libcst), then ``PY`` runs the check itself with npufuse's checker loaded from
npufuse's own install: a private folder holding a link to the ``npufuse`` package goes first on
the child's ``PYTHONPATH`` (only the package, not npufuse's site-packages, so the user's torch and
libraries are the ones used). The checker needs nothing but torch there.

Before that, one short probe of ``PY`` says what it lacks, in one line: a missing interpreter, a
Python older than npufuse supports, no torch, or a module the checker imports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import npufuse
from npufuse.cli import UsageError

RESULT_PREFIX = "npufuse-op-result: "
MIN_PYTHON = (3, 10)

_PREFLIGHT = """\
import importlib.util, json, sys
missing = [m for m in ("torch",) if importlib.util.find_spec(m) is None]
error = None
if sys.version_info >= (3, 10) and not missing:
    try:
        import npufuse.verify.opcheck  # noqa: F401
    except ModuleNotFoundError as exc:
        missing.append(exc.name or str(exc))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"missing": missing, "error": error, "version": list(sys.version_info[:3]),
                  "npufuse": getattr(sys.modules.get("npufuse"), "__file__", None)}))
"""

_CHILD = "from npufuse.verify.op_python import child_main; child_main()"


def resolve_python(text: str) -> str:
    """The interpreter's path: as given when it has a folder part, else looked up on PATH."""
    found = text if os.sep in text else shutil.which(text)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise UsageError(f"--python {text}: no such executable")
    return found


def capture_python(capture: str | None, shell: bool) -> str | None:
    """The interpreter a ``--capture`` command starts, when its program is a Python (``python``,
    ``python3.11``, a venv's ``bin/python``) other than npufuse's own; None otherwise."""
    if not capture or shell:
        return None
    import shlex

    try:
        words = shlex.split(capture)
    except ValueError:
        return None
    if not words or not Path(words[0]).name.startswith("python"):
        return None
    found = words[0] if os.sep in words[0] else shutil.which(words[0])
    if not found or os.path.realpath(found) == os.path.realpath(sys.executable):
        return None
    return found


def _link_dir(state_dir: Path) -> tuple[Path, str]:
    """A folder whose only entry is a link to this npufuse package (PYTHONPATH entry for the child)."""
    package = Path(npufuse.__file__).resolve().parent
    folder = state_dir / "op_python"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "npufuse"
    try:
        if link.is_symlink() and Path(os.readlink(link)) != package:
            link.unlink()
        if not link.exists():
            link.symlink_to(package, target_is_directory=True)
        return folder, str(folder)
    except OSError:  # no symlinks here: the package's parent folder, after the user's own path
        return folder, str(package.parent)


def _child_env(entry: str, first: bool) -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([entry, *parts] if first else [*parts, entry])
    return env


def preflight(python: str, state_dir: Path) -> dict[str, Any]:
    """Probe ``python``; raises UsageError (one line) when it cannot run the check."""
    folder, entry = _link_dir(state_dir)
    try:
        proc = subprocess.run([python, "-c", _PREFLIGHT], env=_child_env(entry, str(folder) == entry), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"--python {python}: cannot run it ({type(exc).__name__}: {exc})") from None
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--python {python}: not a working Python interpreter ({tail[:200]})") from None
    version = tuple(info.get("version") or ())
    if version < MIN_PYTHON:
        raise UsageError(f"--python {python}: Python {'.'.join(map(str, version))} is older than npufuse's checker needs (3.10+)")
    if info.get("missing"):
        raise UsageError(f"--python {python}: cannot import {', '.join(info['missing'])} there (the op check needs it); install it in that environment or pick another --python")
    if info.get("error"):
        raise UsageError(f"--python {python}: npufuse's checker does not load there ({info['error'][:200]})")
    return info


def run_op_in(python: str, cand: Any, opts: Any, progress: Any = None) -> Any:
    """Run :func:`npufuse.verify.opcheck.verify_op` for ``cand`` in ``python``; returns the
    :class:`~npufuse.verify.opcheck.OpReport` it made (state.json is written by the child)."""
    from npufuse.verify.opcheck import OpReport, TensorCheck

    python = resolve_python(python)
    preflight(python, cand.state_dir)
    folder, entry = _link_dir(cand.state_dir)
    payload = {"candidate": _candidate_json(cand), "options": dataclasses.asdict(opts)}
    if progress:
        progress(f"running the op check in {python}")
    try:
        proc = subprocess.run([python, "-c", _CHILD], input=json.dumps(payload), env=_child_env(entry, str(folder) == entry),
                              cwd=str(cand.root), capture_output=True, text=True)  # fmt: skip
    except OSError as exc:
        raise UsageError(f"--python {python}: cannot run it ({exc})") from None
    result = next((ln[len(RESULT_PREFIX) :] for ln in reversed(proc.stdout.splitlines()) if ln.startswith(RESULT_PREFIX)), None)
    if result is None:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        usage = next((ln for ln in reversed(lines) if ln.startswith("npufuse verify:")), None)
        raise UsageError(usage.removeprefix("npufuse verify: ") if usage else f"--python {python}: the op check ended without a result (exit {proc.returncode}): {(lines or ['no output'])[-1][:300]}")
    data = json.loads(result)
    checks = [TensorCheck(**c) for c in data.pop("checks")]
    return OpReport(checks=checks, **data)


def _candidate_json(cand: Any) -> dict[str, Any]:
    out = {f.name: getattr(cand, f.name) for f in dataclasses.fields(cand)}
    out["root"], out["state_dir"] = str(cand.root), str(cand.state_dir)
    out["site"] = dataclasses.asdict(cand.site) if cand.site is not None else None
    return out


def child_main() -> None:
    """In the user's interpreter: read the payload on stdin, run the check, print the report."""
    from npufuse.verify.candidate import Candidate, Site
    from npufuse.verify.opcheck import OpOptions, verify_op

    payload = json.loads(sys.stdin.read())
    c = dict(payload["candidate"])
    site = c.pop("site")
    if site is not None:
        site["fused_lines"] = tuple(site["fused_lines"]) if site.get("fused_lines") else None
        site = Site(**site)
    cand = Candidate(**{**c, "root": Path(c["root"]), "state_dir": Path(c["state_dir"]), "site": site})
    opts = OpOptions(**payload["options"])
    try:
        report = verify_op(cand, opts)
    except UsageError as exc:
        print(f"npufuse verify: {exc}", file=sys.stderr)
        sys.exit(2)
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    fields["checks"] = [c.to_json() for c in report.checks]
    print(RESULT_PREFIX + json.dumps(fields, default=str), flush=True)
