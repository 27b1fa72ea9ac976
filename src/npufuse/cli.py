"""Command line: ``main(argv) -> int``, one module per verb.

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Verb modules are imported lazily so ``npufuse api`` does not pay for importing torch.

Exit codes: 0 ok, 1 findings/rejections a CI gate wants, 2 usage or input error (one line on
stderr, never a traceback for bad input).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any, Callable, NoReturn, Sequence

from npufuse import __version__

# verb -> (module, one-line help). Order is the order shown in --help.
VERBS: dict[str, tuple[str, str]] = {
    "scan": ("npufuse.scan.command", "stage 1: find replaceable sites, write report.md and .npufuse/scan.json"),
    "profile": ("npufuse.profile.command", "mine Ascend profiler output for fusable operator sequences"),
    "apply": ("npufuse.rewrite.command", "stage 2 gate: rewrite accepted candidates behind a switch"),
    "revert": ("npufuse.rewrite.revert_command", "restore the original code of rewritten sites"),
    "verify": ("npufuse.verify.command", "operator-level and end-to-end checks of applied candidates"),
    "merge-jsonl": ("npufuse.verify.merge_command", "merge baseline and fused JSONL runs"),
    "report": ("npufuse.report.command", "render the validation report (html)"),
    "status": ("npufuse.status_command", "the task list: every candidate and where it stands"),
    "api": ("npufuse.api_docs", "signature, constraints and returns of a torch_npu API"),
    "emulate": ("npufuse.emulate.command", "list the emulated torch_npu APIs"),
    "trace": ("npufuse.trace.command", "run your command once and record which sites ran, with shapes, dtypes and values"),
    "demo": ("npufuse.demo", "the whole flow on the bundled example model, on CPU"),
}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other bad input, instead of
    argparse's usage block plus the error."""

    def error(self, message: str) -> NoReturn:
        from npufuse.text_safety import escape_text

        self.exit(2, escape_text(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def number(kind: type = float, *, minimum: float | None = None, above: float | None = None, maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type``: a finite number of ``kind`` (int or float) within the bounds, else
    a usage error naming the range. ``nan`` and ``inf`` never pass (``--tolerance nan`` would
    pass every comparison), and a huge value (``--bootstrap 10**12``) is refused before it
    sizes an allocation."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a finite number")
        if (minimum is not None and value < minimum) or (above is not None and value <= above) or (maximum is not None and value > maximum):
            low = f"> {above:g}" if above is not None else f">= {minimum:g}" if minimum is not None else ""
            high = f"<= {maximum:g}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range (must be {' and '.join(b for b in (low, high) if b)})")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _available_verbs() -> dict[str, tuple[str, str]]:
    found = {}
    for verb, (module, help_text) in VERBS.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is not there (verb not built yet)
            present = False
        if present:
            found[verb] = (module, help_text)
    return found


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``verb``, only that verb's module is imported (its arguments added) and
    the others are listed by their help line alone: an ``npufuse scan`` that hits the warm cache
    must not pay for importing the verify, rewrite and emulate modules."""
    # allow_abbrev=False: argparse would take ``--out DIR`` as ``--output DIR`` (a prefix of one option)
    # and write the report to a file named DIR; a misspelt option must be an error, not a guess.
    parser = _OneLineParser(
        prog="npufuse",
        allow_abbrev=False,
        description="Find hand-written PyTorch that Ascend NPUs run faster as one torch_npu fused "
        "operator; rewrite accepted sites behind a switch; prove each replacement.",
    )
    parser.add_argument("--version", action="version", version=f"npufuse {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module, help_text) in _available_verbs().items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if verb is None or name == verb:
            mod = importlib.import_module(module)
            mod.add_arguments(verb_parser)
            verb_parser.set_defaults(_module=mod)
    return parser


def _chosen_verb(argv: list[str]) -> str | None:
    """The verb argparse will pick: the first argument that is not an option (global options
    take no value), if it names a verb."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in VERBS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen_verb(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except UsageError as exc:
        from npufuse.text_safety import escape_text  # messages name repository files: no raw controls

        print(f"npufuse {args.verb}: {escape_text(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"npufuse {args.verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # disk full, permissions, a state folder npufuse refuses: one line, no traceback
        where = f"{exc.filename}: " if exc.filename and str(exc.filename) not in str(exc.strerror or "") else ""
        from npufuse.text_safety import escape_text

        print(escape_text(f"npufuse {args.verb}: {where}{exc.strerror or exc}"), file=sys.stderr)
        return 2
