"""Formatting-preserving rewrites with libcst.

``rewrite_source`` turns each accepted site — whole statements ``line..end_line`` of one block —
into::

    if <guard>:  # npufuse: <pattern>
        <fused statements>
    else:
        <the original statements: the same libcst nodes, so byte-identical>

and adds the availability prelude once per module. ``revert_source`` does the inverse: each
marked ``if`` is replaced by its ``else`` statements, and the prelude goes when no marked site
is left. Every other byte of the file is untouched. Results and reasons are returned, never
raised, for sites that cannot be edited.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from npufuse.rewrite.codegen import MARKER, PRELUDE, PRELUDE_MARKER

MARKER_PREFIX = "# npufuse: "


@dataclass(frozen=True)
class SiteEdit:
    """One site to rewrite: statement span, fused statements, guard expression, pattern id."""

    line: int
    end_line: int
    fused: str
    guard: str
    pattern: str
    tag: str = ""  # caller's handle (candidate id) echoed back in the outcome


@dataclass
class RewriteOutcome:
    text: str
    applied: list[SiteEdit] = field(default_factory=list)
    skipped: list[tuple[SiteEdit, str]] = field(default_factory=list)
    # tag -> (first line, last line) of the rendered if/else block in ``text``
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


def is_marker(comment: cst.Comment | None) -> str | None:
    """Pattern id if ``comment`` is an npufuse site marker."""
    if comment is not None and comment.value.startswith(MARKER_PREFIX):
        rest = comment.value[len(MARKER_PREFIX) :].strip()
        if rest and not rest.startswith("torch_npu availability"):
            return rest.split()[0]
    return None


def _marked_if(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.If) and isinstance(node.body, cst.IndentedBlock):
        return is_marker(node.body.header.comment)
    return None


class _SiteRewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, edits: list[SiteEdit]) -> None:
        super().__init__()
        self.pending = {e.line: e for e in edits}
        self.applied: list[SiteEdit] = []
        self.reasons: dict[int, str] = {}
        self.new_ifs: dict[str, cst.If] = {}

    # Both kinds of statement containers: module body and indented blocks.
    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        return updated.with_changes(body=self._rewrite_body(original.body, updated.body))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=self._rewrite_body(original.body, updated.body))

    def _rewrite_body(self, original_body, updated_body) -> list:
        out = []
        i = 0
        orig = list(original_body)
        upd = list(updated_body)
        while i < len(orig):
            start = self.get_metadata(PositionProvider, orig[i]).start.line
            edit = self.pending.get(start)
            if edit is None:
                out.append(upd[i])
                i += 1
                continue
            if _marked_if(orig[i]):
                self.reasons[edit.line] = "already fused: this site is an npufuse-marked branch"
                self.pending.pop(start)
                out.append(upd[i])
                i += 1
                continue
            j = i
            while j < len(orig) and self.get_metadata(PositionProvider, orig[j]).end.line < edit.end_line:
                j += 1
            if j >= len(orig) or self.get_metadata(PositionProvider, orig[j]).end.line != edit.end_line:
                self.reasons[edit.line] = f"lines {edit.line}-{edit.end_line} are not whole statements of one block"
                self.pending.pop(start)
                out.append(upd[i])
                i += 1
                continue
            originals = upd[i : j + 1]
            first = originals[0]
            # Comments/blank lines above the first statement stay above the new `if`.
            leading = first.leading_lines
            originals[0] = first.with_changes(leading_lines=())
            try:
                fused_body = cst.parse_module(textwrap.dedent(edit.fused).strip("\n") + "\n").body
                test = cst.parse_expression(edit.guard)
            except cst.ParserSyntaxError as exc:
                self.reasons[edit.line] = f"generated code does not parse: {exc.message}"
                self.pending.pop(start)
                out.extend(upd[i : j + 1])
                i = j + 1
                continue
            node = cst.If(
                test=test,
                body=cst.IndentedBlock(
                    body=fused_body,
                    header=cst.TrailingWhitespace(
                        whitespace=cst.SimpleWhitespace("  "),
                        comment=cst.Comment(MARKER.format(pattern=edit.pattern)),
                    ),
                ),
                orelse=cst.Else(body=cst.IndentedBlock(body=originals)),
                leading_lines=leading,
            )
            self.new_ifs[edit.tag or str(edit.line)] = node
            self.applied.append(edit)
            self.pending.pop(start)
            out.append(node)
            i = j + 1
        return out


def _prelude_index(body: list) -> int:
    """Insert after the module docstring, ``__future__`` imports and the leading import block."""
    idx = 0
    for k, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Import, cst.ImportFrom)) or (k == 0 and isinstance(s, cst.Expr) and isinstance(s.value, (cst.SimpleString, cst.ConcatenatedString)))
            for s in stmt.body
        ):
            idx = k + 1
        else:
            break
    return idx


def has_prelude(module: cst.Module) -> bool:
    return PRELUDE_MARKER in module.code


def _prelude_statements() -> list:
    parsed = cst.parse_module(PRELUDE)
    body = list(parsed.body)
    # The marker comment is the prelude module's header; keep it on the first statement.
    body[0] = body[0].with_changes(leading_lines=(cst.EmptyLine(), *parsed.header, *body[0].leading_lines))
    return body


def add_prelude(module: cst.Module) -> cst.Module:
    """Insert the availability prelude once (recognised later by its marker comment)."""
    if has_prelude(module):
        return module
    body = list(module.body)
    idx = _prelude_index(body)
    return module.with_changes(body=body[:idx] + _prelude_statements() + body[idx:])


def remove_prelude(module: cst.Module) -> cst.Module:
    """Drop exactly the statements ``add_prelude`` inserted, so apply + revert is byte-identical."""
    want = [cst.Module(body=[s]).code for s in _prelude_statements()]
    body = list(module.body)
    n = len(want)
    for k in range(len(body) - n + 1):
        if [cst.Module(body=[s]).code for s in body[k : k + n]] == want:
            return module.with_changes(body=body[:k] + body[k + n :])
    return module


def rewrite_source(source: str, edits: list[SiteEdit], *, prelude: bool = True) -> RewriteOutcome:
    """Apply ``edits`` to ``source``; unparseable source raises ``cst.ParserSyntaxError``."""
    module = cst.parse_module(source)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    rewriter = _SiteRewriter(edits)
    new = wrapper.visit(rewriter)
    outcome = RewriteOutcome(text=source)
    outcome.applied = list(rewriter.applied)
    for e in edits:
        if e not in rewriter.applied:
            outcome.skipped.append((e, rewriter.reasons.get(e.line, f"no statement starts at line {e.line}")))
    if not rewriter.applied:
        return outcome
    if prelude:
        new = add_prelude(new)
    outcome.text = new.code
    # Where each new if/else block landed, for the report and the state file.
    positions = MetadataWrapper(cst.parse_module(outcome.text)).resolve(PositionProvider)
    rendered = {new.code_for_node(n): tag for tag, n in rewriter.new_ifs.items()}
    for node, pos in positions.items():
        if isinstance(node, cst.If) and _marked_if(node):
            code = new.code_for_node(node)
            tag = rendered.get(code)
            if tag is not None and tag not in outcome.spans:
                outcome.spans[tag] = (pos.start.line, pos.end.line)
    return outcome


@dataclass
class MarkedSite:
    pattern: str
    line: int
    end_line: int
    qualname: str


class _MarkedFinder(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.sites: list[MarkedSite] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.stack.append(node.name.value)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self.stack.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.stack.append(node.name.value)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.stack.pop()

    def visit_If(self, node: cst.If) -> None:
        pattern = _marked_if(node)
        if pattern:
            pos = self.get_metadata(PositionProvider, node)
            self.sites.append(MarkedSite(pattern, pos.start.line, pos.end.line, ".".join(self.stack) or "<module>"))


def marked_sites(source: str) -> list[MarkedSite]:
    """Every npufuse-marked if/else in ``source``, in order."""
    finder = _MarkedFinder()
    MetadataWrapper(cst.parse_module(source)).visit(finder)
    return finder.sites


class _Reverter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, lines: set[int] | None) -> None:
        super().__init__()
        self.lines = lines  # start lines of marked ifs to revert; None = all
        self.reverted: list[int] = []

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        return updated.with_changes(body=self._revert_body(original.body, updated.body))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=self._revert_body(original.body, updated.body))

    def _revert_body(self, original_body, updated_body) -> list:
        out = []
        for orig, upd in zip(original_body, updated_body):
            line = self.get_metadata(PositionProvider, orig).start.line
            if _marked_if(orig) and (self.lines is None or line in self.lines) and isinstance(upd.orelse, cst.Else):
                restored = list(upd.orelse.body.body)
                restored[0] = restored[0].with_changes(leading_lines=(*upd.leading_lines, *restored[0].leading_lines))
                out.extend(restored)
                self.reverted.append(line)
            else:
                out.append(upd)
        return out


def revert_source(source: str, lines: set[int] | None = None) -> tuple[str, list[int]]:
    """Replace marked ifs (all, or those starting at ``lines``) by their else statements."""
    module = cst.parse_module(source)
    reverter = _Reverter(lines)
    new = MetadataWrapper(module, unsafe_skip_copy=True).visit(reverter)
    if not reverter.reverted:
        return source, []
    if not marked_sites(new.code):
        new = remove_prelude(new)
    return new.code, reverter.reverted
