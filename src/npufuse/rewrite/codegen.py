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
"""

from __future__ import annotations

from dataclasses import dataclass

from npufuse.patterns.base import Finding

MARKER = "# npufuse: {pattern}"
PRELUDE_MARKER = "# npufuse: torch_npu availability"

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
'''


@dataclass(frozen=True)
class Switch:
    kind: str  # "existing" | "new_field" | "env" | "none"
    expr: str = ""  # for existing/new_field: a Python expression, e.g. "self.config.use_fused_rmsnorm"
    name: str = ""  # for env: the variable name

    def describe(self) -> str:
        if self.kind == "env":
            return f"environment variable {self.name} (on by default; set {self.name}=0 to use the original code)"
        if self.kind in ("existing", "new_field"):
            return f"{'existing switch' if self.kind == 'existing' else 'new switch'} `{self.expr}`"
        return "no switch: fused whenever torch_npu is importable and the tensor is on an NPU"


def env_switch(pattern: str, candidate_id: int | None = None) -> Switch:
    name = f"NPUFUSE_{pattern.upper()}" if candidate_id is None else f"NPUFUSE_{pattern.upper()}_{candidate_id}"
    return Switch("env", name=name)


def guard_expression(finding: Finding, switch: Switch) -> str:
    on_npu = f"_npufuse_on_npu({finding.guard_tensor})"
    if switch.kind == "env":
        return f'{on_npu} and _npufuse_switch("{switch.name}")'
    if switch.kind in ("existing", "new_field"):
        return f"{on_npu} and {switch.expr}"
    return on_npu


def original_text(source: str, finding: Finding) -> str:
    """The site's statements exactly as in the file (whole lines, with their indentation)."""
    lines = source.splitlines(keepends=True)
    return "".join(lines[finding.line - 1 : finding.end_line])


def site_edit(finding: Finding, switch: Switch, tag: str = ""):
    """The libcst edit for one finding (see :mod:`npufuse.rewrite.transform`)."""
    from npufuse.rewrite.transform import SiteEdit

    return SiteEdit(
        line=finding.line,
        end_line=finding.end_line,
        fused=finding.fused,
        guard=guard_expression(finding, switch),
        pattern=finding.pattern,
        tag=tag or str(finding.line),
    )


def render_site(source: str, finding: Finding, switch: Switch) -> str:
    """The guarded replacement of one site exactly as ``npufuse apply`` writes it: the lines of
    the rewritten file holding the new ``if``/``else`` (the else branch holds the original
    statements byte for byte). Raises ``ValueError`` if the site cannot be rewritten."""
    from npufuse.rewrite.transform import rewrite_source

    outcome = rewrite_source(source, [site_edit(finding, switch, "site")], prelude=False)
    if outcome.skipped:
        raise ValueError(outcome.skipped[0][1])
    first, last = outcome.spans["site"]
    return "".join(outcome.text.splitlines(keepends=True)[first - 1 : last])


def splice(source: str, findings: list[Finding], switches: dict[int, Switch] | None = None) -> str:
    """Rewrite ``source`` with every finding guarded and the prelude added — the same libcst
    transform ``npufuse apply`` runs (used to show and exercise replacements in tests)."""
    from npufuse.rewrite.transform import rewrite_source

    edits = [site_edit(f, (switches or {}).get(f.line) or env_switch(f.pattern)) for f in findings]
    outcome = rewrite_source(source, edits)
    if outcome.skipped:
        raise ValueError("; ".join(f"line {e.line}: {why}" for e, why in outcome.skipped))
    return outcome.text
