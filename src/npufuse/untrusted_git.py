"""Running ``git`` inside a repository npufuse was pointed at, which is untrusted input.

A repository that arrives with its own ``.git`` folder (an archive, a shared disk) carries its own
``.git/config``, and git runs commands that config names: ``core.fsmonitor`` runs on index reads
(``git ls-files``, ``git status``). Every git call npufuse makes goes through :func:`run_git`,
which switches that hook off on the command line and drops the user's ``GIT_*`` variables (a
``GIT_DIR`` or ``GIT_INDEX_FILE`` set for another repository would answer for that one).
Git is optional: without it, or when it refuses, callers get ``None`` and carry on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# Hooks a repository's own config can name that read-only commands would run.
_HARDENING = ("-c", "core.fsmonitor=false", "--no-optional-locks")


def run_git(args: list[str], cwd: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[bytes] | None:
    """``git <args>`` in ``cwd`` with the hardening above; None where git is absent, fails to start
    or runs past ``timeout`` (the caller treats that as "git cannot tell")."""
    git = shutil.which("git")
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0")
    try:
        return subprocess.run([git, *_HARDENING, *args], cwd=os.fspath(cwd), capture_output=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
