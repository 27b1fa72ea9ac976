"""The command line imports only the chosen verb's module; every verb is still listed in --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from npufuse.cli import VERBS, _chosen_verb


def _modules_after(args: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from npufuse.cli import main\n"
        f"rc = main({args!r})\n"
        "print('MODULES', ' '.join(sorted(m for m in sys.modules if m.startswith('npufuse.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    line = next(l for l in out.splitlines() if l.startswith("MODULES"))
    return set(line.split()[1:])


def test_only_the_chosen_verb_module_is_imported() -> None:
    mods = _modules_after(["api", "--list"])
    assert "npufuse.api_docs" in mods
    for other in ("npufuse.verify.command", "npufuse.rewrite.command", "npufuse.scan.command", "npufuse.demo"):
        assert other not in mods


def test_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    from npufuse.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in VERBS:
        assert verb in out


def test_an_unknown_verb_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from npufuse.cli import main

    assert main(["scna"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, verb",
    [(["scan", "x"], "scan"), (["--version"], None), (["-h", "verify", "op"], "verify"), (["--", "scan"], None), (["nosuch"], None)],
)
def test_chosen_verb(argv: list[str], verb: str | None) -> None:
    assert _chosen_verb(argv) == verb
