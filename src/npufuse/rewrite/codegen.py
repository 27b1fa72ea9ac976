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

import textwrap
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


def render_site(source: str, finding: Finding, switch: Switch) -> str:
    """The guarded replacement of the site, indented as the original; the else branch is the
    original text byte for byte (re-indented one level, nothing else changed)."""
    original = original_text(source, finding)
    first = original.splitlines()[0] if original else ""
    indent = first[: len(first) - len(first.lstrip())]
    step = "    "
    fused_lines = textwrap.dedent(finding.fused).strip("\n").splitlines()
    marker = MARKER.format(pattern=finding.pattern)
    out = [f"{indent}if {guard_expression(finding, switch)}:  {marker}\n"]
    out += [f"{indent}{step}{ln}\n" if ln.strip() else "\n" for ln in fused_lines]
    out.append(f"{indent}else:\n")
    out += [f"{step}{ln}" if ln.strip() else ln for ln in original.splitlines(keepends=True)]
    if not out[-1].endswith("\n"):
        out[-1] += "\n"
    return "".join(out)


def splice(source: str, findings: list[Finding], switches: dict[int, Switch] | None = None) -> str:
    """Text-level rewrite of ``source`` with every finding guarded and the prelude added.

    Used to show and exercise replacements (report, example tests). ``npufuse apply`` does the
    same edit with libcst on the user's file; both call :func:`render_site`.
    """
    lines = source.splitlines(keepends=True)
    for f in sorted(findings, key=lambda f: f.line, reverse=True):
        switch = (switches or {}).get(f.line) or env_switch(f.pattern)
        lines[f.line - 1 : f.end_line] = [render_site(source, f, switch)]
    body = "".join(lines)
    if PRELUDE_MARKER in body:
        return body
    return _insert_prelude(body)


def _insert_prelude(body: str) -> str:
    """After the module docstring, ``from __future__`` imports and the leading import block."""
    import ast

    tree = ast.parse(body)
    insert_after = 0
    for i, node in enumerate(tree.body):
        is_doc = i == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant) and isinstance(node.value.value, str)
        if is_doc or isinstance(node, (ast.Import, ast.ImportFrom)):
            insert_after = node.end_lineno or node.lineno
        else:
            break
    lines = body.splitlines(keepends=True)
    head, tail = lines[:insert_after], lines[insert_after:]
    if head and not head[-1].endswith("\n"):
        head[-1] += "\n"
    return "".join(head) + ("\n" if head else "") + PRELUDE + "\n\n" + "".join(tail)
