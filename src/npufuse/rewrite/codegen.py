"""The one generator of replacement code, used by the stage-1 report and by ``npufuse apply``.

For a finding spanning whole statements ``line..end_line`` it renders::

    if <guard>:
        <fused statements>  # npufuse: <pattern>
    else:
        <original statements, verbatim>

plus, once per module, the availability prelude (``PRELUDE``): ``torch_npu`` imported guarded,
so the rewritten file still imports without it and never imports npufuse.

Switches (DESIGN.md rule 1), in order of preference, are described by :class:`Switch`:
an existing repo switch expression, a new config field/argument expression, an environment
variable ``NPUFUSE_<ID>`` (default), or none (only "torch_npu importable and tensor on NPU").
That switch is pattern-wide (every site of a pattern shares it); on top of it every site of a
scanned candidate carries its own switch, ``_npufuse_site(<candidate id>)``, driven by
``NPUFUSE_ONLY=<ids>`` / ``NPUFUSE_OFF=<ids>``, so two sites are verified and turned off one at
a time (``verify e2e --all`` runs each candidate alone against one baseline).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass

from npufuse.patterns.base import Finding

MARKER = "# npufuse: {pattern}"
PRELUDE_MARKER = "# npufuse: torch_npu availability"
# Closes the prelude so revert removes exactly the lines apply inserted (blank lines included).
PRELUDE_END = "# npufuse: end of torch_npu availability"

PRELUDE = f'''{PRELUDE_MARKER} (checked once per module; the file imports without torch_npu)
import os as _npufuse_os

try:
    import torch_npu
except Exception:  # no NPU stack here: ImportError, or a CANN runtime that fails to load
    torch_npu = None


def _npufuse_on_npu(tensor) -> bool:
    """torch_npu is importable and ``tensor`` lives on an NPU."""
    return torch_npu is not None and getattr(tensor, "is_npu", False)


def _npufuse_switch(name: str) -> bool:
    """Environment switch of one fused site: on unless set to 0/false/off."""
    return _npufuse_os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def _npufuse_site(candidate: int) -> bool:
    """Per-candidate switch: NPUFUSE_OFF=3,5 runs the original code of candidates 3 and 5;
    NPUFUSE_ONLY=3 keeps only candidate 3 fused (NPUFUSE_ONLY=none: no candidate)."""
    only = _npufuse_os.environ.get("NPUFUSE_ONLY")
    if only is not None and str(candidate) not in only.replace(" ", "").split(","):
        return False
    return str(candidate) not in _npufuse_os.environ.get("NPUFUSE_OFF", "").replace(" ", "").split(",")


def _npufuse_autocast(*tensors):
    """The tensors in the dtype an autocast region gives the original's matmuls (fused torch_npu
    ops do not follow autocast, so q/k in fp32 after RoPE and v in bf16 must meet in one dtype);
    unchanged outside autocast."""
    import torch as _torch

    kind = tensors[0].device.type
    try:
        if not _torch.is_autocast_enabled(kind):
            return tensors
        dtype = _torch.get_autocast_dtype(kind)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4 has no per-device query
        return tensors
    low = (_torch.float32, _torch.float16, _torch.bfloat16)  # autocast leaves float64 alone
    return tuple(t.to(dtype) if t.dtype in low else t for t in tensors)


{PRELUDE_END}
'''


@dataclass(frozen=True)
class Switch:
    kind: str  # "existing" | "new_field" | "env" | "user" | "none"
    expr: str = ""  # for existing/new_field/user: a Python expression, e.g. "self.config.use_fused_rmsnorm"
    name: str = ""  # for env: the variable name

    def describe(self) -> str:
        if self.kind == "env":
            return f"environment variable {self.name} (on by default; set {self.name}=0 to use the original code)"
        if self.kind in ("existing", "new_field"):
            return f"{'existing switch' if self.kind == 'existing' else 'new switch'} `{self.expr}`"
        if self.kind == "user":
            return f"switch `{self.expr}` (given with --switch)"
        return "no switch: fused whenever torch_npu is importable and the tensor is on an NPU"

    def off_hint(self, candidate: int | None = None) -> str:
        """How a user turns the original code back on, in one phrase (``candidate``: also the
        per-candidate switch of that site)."""
        if candidate is not None:
            return f"NPUFUSE_OFF={candidate}" + ("" if self.kind == "none" else f" (this site) or {self._pattern_off()} (the pattern)")
        return self._pattern_off()

    def _pattern_off(self) -> str:
        if self.kind == "env":
            return f"{self.name}=0"
        if self.kind in ("existing", "new_field", "user"):
            return f"make `{self.expr}` false"
        return "no switch: `npufuse revert` restores the original"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "expr": self.expr, "name": self.name, "describe": self.describe()}

    @classmethod
    def from_json(cls, data: dict | None) -> "Switch":
        """From scan.json's ``switch`` object (extra keys such as ``reuses`` are ignored)."""
        if not isinstance(data, dict) or data.get("kind") not in ("existing", "new_field", "env", "user", "none"):
            raise ValueError(f"not a switch: {data!r}")
        return cls(str(data["kind"]), expr=str(data.get("expr") or ""), name=str(data.get("name") or ""))


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_switch(text: str) -> Switch:
    """``--switch``: an UPPER_CASE identifier is an environment variable, anything else a
    Python expression used as is. Raises ``ValueError`` for an expression that does not parse."""
    text = text.strip()
    if _ENV_NAME.fullmatch(text):
        return Switch("env", name=text)
    try:
        ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"--switch {text!r} is neither an UPPER_CASE environment variable name nor a Python expression ({exc.msg})") from None
    return Switch("user", expr=text)


def env_switch(pattern: str, candidate_id: int | None = None) -> Switch:
    name = f"NPUFUSE_{pattern.upper()}" if candidate_id is None else f"NPUFUSE_{pattern.upper()}_{candidate_id}"
    return Switch("env", name=name)


# s41 (fwdad41): the fused branch of a repository that runs code under a functorch transform or
# forward-mode AD (npufuse.scan.forward_ad) falls back while one is active: torch_npu's fused ops
# have no forward-mode derivative. The finding's params name the place (TRANSFORM_PARAM); the test
# comes right after the device check. Measured on torch 2.13: the first call is True inside
# torch.func.jvp / vmap / grad, the level >= 0 inside forward_ad.dual_level(); torch.compile
# traces both (no graph break). ``torch`` is named as such: the prelude imports it where the
# module does not bind it (transform.TORCH_IMPORT_LINE).
TRANSFORM_PARAM = "transform_fallback"
NO_TRANSFORM = "not torch._C._are_functorch_transforms_active() and torch.autograd.forward_ad._current_level < 0"


def transform_guarded(fused: str) -> str | None:
    """``fused`` with every device check npufuse writes inside fused code (``_npufuse_on_npu(x)``,
    e.g. in an nn.RMSNorm swap's forward, run on every call) joined with :data:`NO_TRANSFORM`;
    None when the text does not parse (the caller then refuses the site)."""
    if "_npufuse_on_npu" not in fused:
        return fused
    try:
        tree = ast.parse(fused)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    lines = fused.splitlines(keepends=True)
    starts = [0]
    for row in lines:
        starts.append(starts[-1] + len(row))

    def offset(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return starts[line - 1] + len(lines[line - 1].encode("utf-8")[:col].decode("utf-8", "replace"))

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "_npufuse_on_npu"
             and n.end_lineno is not None and n.end_col_offset is not None]
    if len(calls) != fused.count("_npufuse_on_npu("):
        return None  # a mention that is no call of the name (a string, another spelling): not rewritten blindly
    out = fused
    for n in sorted(calls, key=lambda c: (c.lineno, c.col_offset), reverse=True):
        a, b = offset(n.lineno, n.col_offset), offset(n.end_lineno, n.end_col_offset)  # type: ignore[arg-type]
        out = f"{out[:a]}({out[a:b]} and {NO_TRANSFORM}){out[b:]}"
    return out


def guard_expression(finding: Finding, switch: Switch, site_id: int | None = None) -> str:
    """The ``if`` test of a fused site. ``site_id``: the candidate id, whose per-candidate switch
    ``_npufuse_site(id)`` comes right after the device check (and, in a repository that runs code
    under a functorch transform or forward-mode AD, the :data:`NO_TRANSFORM` test)."""
    on_npu = f"_npufuse_on_npu({finding.guard_tensor})"
    if isinstance(finding.params, dict) and finding.params.get(TRANSFORM_PARAM):
        on_npu = f"{on_npu} and {NO_TRANSFORM}"
    if site_id is not None:
        on_npu = f"{on_npu} and _npufuse_site({int(site_id)})"
    if switch.kind == "env":
        return f'{on_npu} and _npufuse_switch("{switch.name}")'
    if switch.kind in ("existing", "new_field", "user"):
        # parenthesised: a user's `a or b` must not bind looser than the device check
        expr = switch.expr if switch.kind != "user" else f"({switch.expr})"
        return f"{on_npu} and {expr}"
    return on_npu


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def source_lines(text: str) -> list[str]:
    """Lines with their ends, split only where Python (ast, libcst) counts a line: ``str.splitlines``
    also splits at form feeds and U+2028, which would shift every line number after one."""
    return _LINE.findall(text)


# What str.splitlines breaks at besides "\r" and "\n" (Python code does not end a line there).
_ASCII_OTHER_BREAKS = ("\x0c", "\x0b", "\x1c", "\x1d", "\x1e")
_OTHER_BREAKS = _ASCII_OTHER_BREAKS + ("\x85", "\u2028", "\u2029")


def has_other_breaks(text: str) -> bool:
    """Whether ``str.splitlines`` splits ``text`` where Python does not (a form feed, U+2028, ...):
    only then do its lines differ from :func:`source_lines`."""
    return any(c in text for c in (_ASCII_OTHER_BREAKS if text.isascii() else _OTHER_BREAKS))


def original_text(source: str, finding: Finding) -> str:
    """The site's statements exactly as in the file (whole lines, with their indentation)."""
    lines = source_lines(source)
    return "".join(lines[finding.line - 1 : finding.end_line])


def site_edit(finding: Finding, switch: Switch, tag: str = "", site_id: int | None = None):
    """The libcst edit for one finding (see :mod:`npufuse.rewrite.transform`)."""
    from npufuse.rewrite.transform import SiteEdit

    return SiteEdit(
        line=finding.line,
        end_line=finding.end_line,
        fused=finding.fused,
        guard=guard_expression(finding, switch, site_id),
        pattern=finding.pattern,
        tag=tag or str(finding.line),
    )


def render_site(source: str, finding: Finding, switch: Switch, site_id: int | None = None) -> str:
    """The guarded replacement of one site exactly as ``npufuse apply`` writes it: the lines of
    the rewritten file holding the new ``if``/``else`` (the else branch holds the original
    statements byte for byte). Raises ``ValueError`` if the site cannot be rewritten."""
    from npufuse.rewrite.transform import rewrite_source

    edit = site_edit(finding, switch, "site", site_id)
    part = top_level_part(source, finding.line, finding.end_line)
    if part is not None:
        text, offset = part
        shifted = dataclasses.replace(edit, line=edit.line - offset, end_line=edit.end_line - offset)
        try:
            outcome = rewrite_source(text, [shifted], prelude=False)
        except Exception:  # the whole file below says what is wrong, with its own line numbers
            outcome = None
        if outcome is not None and not outcome.skipped:
            first, last = outcome.spans["site"]
            return "".join(source_lines(outcome.text)[first - 1 : last])
    outcome = rewrite_source(source, [edit], prelude=False)
    if outcome.skipped:
        raise ValueError(outcome.skipped[0][1])
    first, last = outcome.spans["site"]
    return "".join(source_lines(outcome.text)[first - 1 : last])


# A site's rendering depends on the module only through the top-level statements holding it and two
# module-wide settings libcst detects (the indentation unit: the first indented block's; the line
# end: "\n" here). libcst costs ~1.5 ms a line, so a site in a 2,000-line file (a ``@torch.jit.script``
# function, which the fast path declines) took seconds; rendering only those statements takes
# milliseconds. A ``pass`` line goes first so that the comments above the first statement stay its
# leading lines (as in the whole file) instead of becoming the module's header.
_BACKSLASH_ONLY = re.compile(r"^[ \t]*\\\n", re.MULTILINE)


def top_level_part(source: str, line: int, end_line: int) -> tuple[str, int] | None:
    """``(text, offset)``: ``pass`` and the top-level statements overlapping lines ``line`` ..
    ``end_line`` (with the comments and blank lines between them and the previous statement), where
    rendering that text gives the site the whole file's text (line ``n`` of the file is line
    ``n - offset`` of it); None where that is not sure (not plain "\n" text, a different first
    indentation, a line libcst does not round-trip, nesting apply refuses anywhere in the file, a
    file ``ast`` cannot read)."""
    from npufuse.rewrite import nesting

    if "\r" in source or source.startswith("\ufeff") or _BACKSLASH_ONLY.search(source):
        return None
    if nesting.problem(source) is not None:
        return None  # apply refuses the whole file: the whole-file render raises that refusal
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    rows = source.splitlines(keepends=True)
    if len(rows) != source.count("\n") + (0 if source.endswith("\n") else 1):
        return None  # a form feed or another break splitlines counts: libcst's lines differ
    start = end = None
    prev_end = 0
    for stmt in body:
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
        last = stmt.end_lineno or stmt.lineno
        if last < line:
            prev_end = last
            continue
        if first > end_line:
            break
        if start is None:
            start = prev_end + 1
        end = last
    if start is None or end is None or end < end_line:
        return None
    part = "pass\n" + "".join(rows[start - 1 : end])
    if not part.endswith("\n") or _first_indent(part) != _first_indent(source):
        return None
    return part, start - 2


def _first_indent(text: str) -> str | None:
    """The whitespace of the first INDENT token (libcst's default indentation comes from it)."""
    import io
    import tokenize

    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.INDENT:
                return tok.string
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "?"
    return None


def splice(source: str, findings: list[Finding], switches: dict[int, Switch] | None = None, site_ids: dict[int, int] | None = None) -> str:
    """Rewrite ``source`` with every finding guarded and the prelude added — the same libcst
    transform ``npufuse apply`` runs (used to show and exercise replacements in tests).
    ``site_ids``: finding line -> candidate id, for the per-candidate switch."""
    from npufuse.rewrite.transform import rewrite_source

    edits = [site_edit(f, (switches or {}).get(f.line) or env_switch(f.pattern), site_id=(site_ids or {}).get(f.line)) for f in findings]
    outcome = rewrite_source(source, edits)
    if outcome.skipped:
        raise ValueError("; ".join(f"line {e.line}: {why}" for e, why in outcome.skipped))
    return outcome.text
