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

The prelude is inserted and removed as one exact block of text (``codegen.PRELUDE`` between its
start and end marker comments): blank lines belong to the *next* statement in libcst, so a
node-level insert could not tell on removal which blank lines were ours.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import CodePosition, CodeRange
from libcst.metadata.position_provider import PositionProvidingCodegenState

from npufuse.rewrite import nesting
from npufuse.rewrite.codegen import MARKER, PRELUDE, PRELUDE_MARKER

MARKER_PREFIX = "# npufuse: "


def parse_module(text: str) -> cst.Module:
    """``cst.parse_module`` behind the nesting pre-check: libcst's native parser overflows the C
    stack (SIGSEGV, nothing to catch) on deeply nested text, so such text raises
    :class:`nesting.TooDeep` (a ValueError: "nesting too deep for the rewriter: ...") instead.
    Every libcst parse of user text in npufuse goes through here or :func:`parse_expression`."""
    nesting.check(text)
    return cst.parse_module(text)


def dropped_final_break(source: str, module: cst.Module) -> str | None:
    """What libcst left out of ``source`` when it reproduces ``module`` ("" when nothing), or None when
    the difference is anything but line breaks at the very end. libcst drops a final line break that
    is not the module's default newline (CRLF lines whose last one ends in a bare "\\r", a file saved
    by an editor that mixes them): the statements and their positions are unchanged, so a rewrite
    re-appends the break and keeps the file byte for byte outside the rewritten sites."""
    code = module.code
    if code == source:
        return ""
    if source.startswith(code) and not source[len(code):].strip("\r\n"):
        return source[len(code):]
    return None


def parse_expression(text: str) -> cst.BaseExpression:
    """``cst.parse_expression`` behind the same pre-check (guards come from scan.json, which is
    hand-editable)."""
    nesting.check(text)
    return cst.parse_expression(text)


def positions(module: cst.Module) -> Mapping[cst.CSTNode, CodeRange]:
    """Every node's position in ``module``: the mapping libcst's :class:`PositionProvider` gives.

    The provider's code-generation pass is run with :class:`_PositionState`, which records the same
    positions as libcst's own state (the same rules, the same order) in plain tuples, and the mapping
    builds a :class:`CodeRange` only for the nodes it is asked about (the rewriter, the reverter and
    the marked-if finder ask about statements only). libcst's state splits every token with a regex and
    makes two frozen dataclasses per node: s49 measured ~4x the pass's own cost on the patterns'
    examples. (s48: ``MetadataWrapper.resolve`` also walked the whole tree once more for batchable
    providers, none here.) tests/test_rewrite_positions.py compares the mapping with the public
    ``MetadataWrapper.resolve(PositionProvider)`` route: every node, every position."""
    raw: dict[cst.CSTNode, tuple[tuple[int, int], tuple[int, int]]] = {}
    module._codegen(_PositionState(default_indent=module.default_indent, default_newline=module.default_newline, provider=raw))
    return _Positions(raw)


class _Positions(Mapping):
    """node -> :class:`CodeRange`, made on demand from the recorded ((line, column), (line, column))."""

    __slots__ = ("_raw",)

    def __init__(self, raw: dict[cst.CSTNode, tuple[tuple[int, int], tuple[int, int]]]) -> None:
        self._raw = raw

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        (line, column), (end_line, end_column) = self._raw[node]
        return CodeRange(CodePosition(line, column), CodePosition(end_line, end_column))

    def __contains__(self, node: object) -> bool:
        return node in self._raw

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


_NEWLINE = re.compile(r"\r\n?|\n")  # libcst's position_provider.NEWLINE_RE


class _PositionState(PositionProvidingCodegenState):
    """libcst's :class:`PositionProvidingCodegenState` with its bookkeeping in tuples: ``provider`` is a
    plain dict node -> (start, end). Each method does what the state it overrides does (libcst 1.x:
    ``_update_position``, ``before_codegen`` / ``after_codegen`` and ``record_syntactic_position``),
    a token without a line break only moving the column, as libcst's regex split of it does."""

    __slots__ = ()

    def add_indent_tokens(self) -> None:
        for token in self.indent_tokens:
            self.add_token(token)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        if "\n" in value or "\r" in value:
            segments = _NEWLINE.split(value)
            self.line += len(segments) - 1
            self.column = len(segments[-1])
        else:
            self.column += len(value)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self._stack.append((self.line, self.column))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self._stack.pop()
        computed = self.provider
        if node not in computed:  # a syntactic position recorded inside the node stays
            computed[node] = (start, (self.line, self.column))

    @contextmanager
    def record_syntactic_position(self, node: cst.CSTNode, *, start_node: cst.CSTNode | None = None, end_node: cst.CSTNode | None = None) -> Iterator[None]:
        start = (self.line, self.column)
        try:
            yield
        finally:
            end = (self.line, self.column)
            computed = self.provider
            if start_node is not None:
                start = computed[start_node][0]
            if end_node is not None:
                end = computed[end_node][1]
            computed[node] = (start, end)


# Nodes that can hold a statement block. The rewriter, the reverter and the marked-if readers only act on
# statements of blocks (and keep a class / def stack), so a walk need not enter anything else: an
# expression, a simple statement line or a one-line suite never holds an indented block.
_BLOCK_HOLDERS = (
    cst.Module,
    cst.IndentedBlock,
    cst.BaseCompoundStatement,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


class _BlocksOnly:
    """Mixin for a libcst visitor / transformer: enters only nodes that can hold a statement block (the
    statements of every block are still visited and left; their insides are not walked)."""

    def on_visit(self, node: cst.CSTNode) -> bool:
        return super().on_visit(node) and isinstance(node, _BLOCK_HOLDERS)  # type: ignore[misc]


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
        if rest and not rest.startswith("torch_npu availability") and not rest.startswith("end of torch_npu availability"):
            return rest.split()[0]
    return None


def _marked_if(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.If) and isinstance(node.body, cst.IndentedBlock):
        return is_marker(node.body.header.comment)
    return None


def _several_statements(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and len(node.body) > 1


def _fused_statements(fused: str) -> list:
    """Parse the fused-branch text. Comments before its first statement land in libcst's module
    header; they are moved onto that statement so they are not lost."""
    parsed = parse_module(textwrap.dedent(fused).strip("\n") + "\n")
    body = list(parsed.body)
    if body and parsed.header:
        body[0] = body[0].with_changes(leading_lines=(*parsed.header, *body[0].leading_lines))
    return body


def _lifted(edit: SiteEdit) -> tuple[str, str]:
    """(fused text, ``if`` test) of a site. A site lifted out of a TorchScript-compiled function
    (npufuse.patterns._compiled) is a module-level definition whose fused text holds the
    placeholder ``LIFTED_GUARD`` where the site's guard goes (inside the Python wrapper, where
    its tensor is in scope); its module-level test is ``LIFTED_TEST``."""
    from npufuse.patterns._compiled import LIFTED_GUARD, LIFTED_TEST

    if LIFTED_GUARD not in edit.fused:
        return edit.fused, edit.guard
    return re.sub(rf"\b{LIFTED_GUARD}\b", lambda _m: edit.guard, edit.fused), LIFTED_TEST


class _SiteRewriter(_BlocksOnly, cst.CSTTransformer):
    def __init__(self, edits: list[SiteEdit], where: Mapping[cst.CSTNode, CodeRange]) -> None:
        super().__init__()
        self.where = where
        self.pending = {e.line: e for e in edits}
        self.applied: list[SiteEdit] = []
        self.reasons: dict[SiteEdit, str] = {}
        self.new_ifs: list[tuple[str, cst.If]] = []

    # Both kinds of statement containers: module body and indented blocks.
    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        return updated.with_changes(body=self._rewrite_body(original.body, updated.body))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=self._rewrite_body(original.body, updated.body))

    def _line(self, node: cst.CSTNode, end: bool = False) -> int:
        pos = self.where[node]
        return pos.end.line if end else pos.start.line

    def _skip(self, edit: SiteEdit, why: str) -> None:
        self.reasons[edit] = why
        self.pending.pop(edit.line, None)

    def _rewrite_body(self, original_body, updated_body) -> list:
        out = []
        i = 0
        orig = list(original_body)
        upd = list(updated_body)
        while i < len(orig):
            edit = self.pending.get(self._line(orig[i]))
            if edit is None:
                out.append(upd[i])
                i += 1
                continue
            if _marked_if(orig[i]):
                self._skip(edit, "already fused: this site is an npufuse-marked branch")
                out.append(upd[i])
                i += 1
                continue
            j = i
            while j < len(orig) and self._line(orig[j], end=True) < edit.end_line:
                j += 1
            if j >= len(orig) or self._line(orig[j], end=True) != edit.end_line:
                self._skip(edit, f"lines {edit.line}-{edit.end_line} are not whole statements of one block")
                out.append(upd[i])
                i += 1
                continue
            if _several_statements(orig[i]) or _several_statements(orig[j]):
                # `a = 1; b = 2`: the span cannot say which of the statements on the line it means
                self._skip(edit, f"lines {edit.line}-{edit.end_line} share a line with other statements (`;`); split them first")
                out.append(upd[i])
                i += 1
                continue
            originals = upd[i : j + 1]
            first = originals[0]
            # Comments/blank lines above the first statement stay above the new `if`.
            leading = first.leading_lines
            originals[0] = first.with_changes(leading_lines=())
            fused_text, guard_text = _lifted(edit)
            try:
                fused_body = _fused_statements(fused_text)
                test = parse_expression(guard_text)
            except cst.ParserSyntaxError as exc:
                self._skip(edit, f"generated code does not parse: {exc.message}")
                out.extend(upd[i : j + 1])
                i = j + 1
                continue
            except nesting.TooDeep as exc:
                self._skip(edit, f"generated code: {exc}")
                out.extend(upd[i : j + 1])
                i = j + 1
                continue
            if not fused_body:
                self._skip(edit, "generated fused code is empty")
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
            self.new_ifs.append((edit.tag or str(edit.line), node))
            self.applied.append(edit)
            self.pending.pop(edit.line)
            out.append(node)
            i = j + 1
        return out


def _overlaps(edits: list[SiteEdit]) -> tuple[list[SiteEdit], list[tuple[SiteEdit, str]]]:
    """Refuse overlapping spans up front: a site nested in another's span would put a rewritten
    branch inside the other's fallback, which then would no longer be the original code. Earlier
    edits in the list win (``apply`` lists the sites already in the file first)."""
    kept: list[SiteEdit] = []
    refused: list[tuple[SiteEdit, str]] = []
    for e in edits:
        if e.end_line < e.line:
            refused.append((e, f"invalid span {e.line}-{e.end_line}"))
            continue
        clash = next((k for k in kept if k.line <= e.end_line and e.line <= k.end_line), None)
        if clash is not None:
            refused.append((e, f"overlaps site {clash.tag or clash.line} (lines {clash.line}-{clash.end_line}); accept only one of them"))
        else:
            kept.append(e)
    return kept, refused


# -- the prelude: one exact block of text ------------------------------------------------------


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


def has_prelude(code: str) -> bool:
    return PRELUDE_MARKER in code


# Generated code spells ``torch.<name>`` (dtypes, ``torch.cat``, ``torch.promote_types``); a module
# that imports only ``torch.nn as nn`` / ``torch.nn.functional as F`` / ``from torch import ...``
# has no ``torch`` name, and the fused branch (or its guard) would raise NameError on the NPU.
# Such modules get this line inside the prelude block, so revert still removes exactly what apply wrote.
TORCH_IMPORT_LINE = "import torch  # npufuse: the fused code below names torch\n"


def _prelude_text(newline: str, with_torch: bool = False) -> str:
    text = PRELUDE
    if with_torch:
        first_end = text.index("\n") + 1  # after the marker line
        text = text[:first_end] + TORCH_IMPORT_LINE + text[first_end:]
    return text.replace("\n", newline)


def binds_torch(tree: ast.Module) -> bool:
    """Whether a module-level statement binds the name ``torch`` (``import torch``, ``import
    torch.nn``, ``import x as torch``, ``from m import torch``, an assignment), also inside
    top-level ``if``/``try``/``with`` blocks. A function's own ``import torch`` or a parameter
    named torch binds it only in that function, so it does not count."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            if any((alias.asname or alias.name.split(".")[0]) == "torch" for alias in node.names):
                return True
        elif isinstance(node, ast.ImportFrom):
            if any((alias.asname or alias.name) == "torch" for alias in node.names):
                return True
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "torch":
                return True
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)) or type(node).__name__ == "TryStar":
            for field in ("body", "orelse", "finalbody"):
                stack.extend(getattr(node, field, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                stack.extend(handler.body)
            if isinstance(node, ast.For) and _binds_name(node.target):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_binds_name(t) for t in targets):
                return True
    return False


def _binds_name(target: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "torch" for n in ast.walk(target))


def names_torch(texts: list[str]) -> bool:
    """Whether generated code (fused bodies, guards) reads the name ``torch``."""
    for text in texts:
        try:
            tree = ast.parse(textwrap.dedent(text).strip("\n") + "\n")
        except SyntaxError:
            continue
        if any(isinstance(n, ast.Name) and n.id == "torch" for n in ast.walk(tree)):
            return True
    return False


def add_prelude(module: cst.Module, with_torch: bool = False) -> str:
    """The module's code with the availability prelude inserted once: after the docstring,
    ``__future__`` and leading imports, one blank line above it when anything precedes it.
    ``with_torch``: the prelude also imports torch (see ``TORCH_IMPORT_LINE``)."""
    code = module.code
    if has_prelude(code):
        if with_torch and TORCH_IMPORT_LINE.rstrip("\n") not in code:
            # an earlier apply wrote the plain prelude; the new site needs torch
            nl = module.default_newline
            plain = _prelude_text(nl)
            if code.count(plain) == 1:
                return code.replace(plain, _prelude_text(nl, True))
        return code
    idx = _prelude_index(list(module.body))
    # The module's text up to the insertion point: header + the leading statements.
    prefix = "".join(module.code_for_node(n) for n in (*module.header, *list(module.body)[:idx]))
    if not code.startswith(prefix):  # cannot happen for a parsed module; never corrupt the file
        raise ValueError("cannot place the npufuse prelude in this module")
    nl = module.default_newline
    sep = nl if prefix else ""
    return prefix + sep + _prelude_text(nl, with_torch) + code[len(prefix) :]


def remove_prelude(code: str, newline: str = "\n") -> tuple[str, bool]:
    """Drop exactly the text ``add_prelude`` inserted, so apply + revert is byte-identical.
    Returns (code, removed); an edited prelude is left in place (``removed`` False)."""
    block = _prelude_text(newline, with_torch=True)
    if code.find(block) < 0:
        block = _prelude_text(newline)
    at = code.find(block)
    if at < 0 or code.find(block, at + 1) >= 0:
        return code, False
    start = at
    if at > 0:
        # add_prelude put exactly one blank line above the block when anything preceded it
        # (the prefix's own last line may end in another newline style than the module default)
        head = code[:at]
        if head.endswith(newline) and head[: len(head) - len(newline)].endswith(("\n", "\r")):
            start = at - len(newline)
    return code[:start] + code[at + len(block) :], True


# -- rewrite and revert --------------------------------------------------------------------------


class _MarkedCollector(_BlocksOnly, cst.CSTVisitor):
    """Marked ifs in document order (node identity), to map new ifs to their positions."""

    def __init__(self) -> None:
        self.nodes: list[cst.If] = []

    def visit_If(self, node: cst.If) -> None:
        if _marked_if(node):
            self.nodes.append(node)


def _not_a_block_statement(source: str, line: int) -> str:
    """Why no statement of an indented block starts at ``line`` (said of the line as written)."""
    lines = source.splitlines()
    text = lines[line - 1].lstrip() if 0 < line <= len(lines) else ""
    if text.startswith("elif ") or text.startswith("elif("):
        # an ``elif`` is the else branch of the ``if`` above it: no block of its own to put a switch in
        return f"line {line} is an `elif` branch of the `if` above it, not a statement of its own block"
    return f"line {line} does not start a statement of an indented block (one-line `if x: ...` bodies are not rewritten)"


def rewrite_source(source: str, edits: list[SiteEdit], *, prelude: bool = True) -> RewriteOutcome:
    """Apply ``edits`` to ``source``; unparseable source raises ``cst.ParserSyntaxError``, source
    nesting too deep for libcst :class:`nesting.TooDeep` (nothing parsed, nothing changed)."""
    module = parse_module(source)
    tail = dropped_final_break(source, module)
    if tail is None:
        # libcst cannot reproduce this file byte for byte (e.g. a line holding only a backslash
        # continuation); its positions would be off too. Never rewrite what cannot round-trip.
        outcome = RewriteOutcome(text=source)
        outcome.skipped = [(e, "libcst does not reproduce this file byte for byte; left unchanged") for e in edits]
        return outcome
    usable, refused = _overlaps(edits)
    rewriter = _SiteRewriter(usable, positions(module))
    new = module.visit(rewriter)
    outcome = RewriteOutcome(text=source)
    outcome.applied = list(rewriter.applied)
    why = dict(refused)
    for e in edits:
        if e in why:
            outcome.skipped.append((e, why[e]))
        elif e not in rewriter.applied:
            outcome.skipped.append((e, rewriter.reasons.get(e, _not_a_block_statement(source, e.line))))
    if not rewriter.applied:
        return outcome
    with_torch = False
    if prelude and names_torch([t for e in rewriter.applied for t in _lifted(e)]):
        try:
            with_torch = not binds_torch(ast.parse(source))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            with_torch = False  # libcst parsed it; keep the earlier behaviour if ast cannot
    outcome.text = (add_prelude(new, with_torch) if prelude else new.code) + tail
    # Where each new if/else block landed: the k-th marked if of `new` is the k-th of the text
    # (the prelude holds no marked if), so positions map by order, identity picks ours.
    collector = _MarkedCollector()
    new.visit(collector)
    # our own output: the checked source plus one guarded block per site (a level or two deeper,
    # far inside the limit's margin); refusing it here would strand a half-done rewrite
    # a tree parsed here and shared with nobody: libcst's defensive deep copy of it would only cost time
    where = positions(cst.parse_module(outcome.text))
    # every node of the tree has a position and no two statements start at the same place: its marked ifs
    # sorted by where they start are the document order a full visit lists (one libcst walk fewer)
    final = sorted((node for node in where if _marked_if(node)), key=lambda n: (where[n].start.line, where[n].start.column))
    tag_of = {id(node): tag for tag, node in rewriter.new_ifs}
    for ours, there in zip(collector.nodes, final):
        tag = tag_of.get(id(ours))
        if tag is not None:
            pos = where[there]
            outcome.spans[tag] = (pos.start.line, pos.end.line)
    return outcome


@dataclass
class MarkedSite:
    pattern: str
    line: int
    end_line: int
    qualname: str


class _MarkedFinder(_BlocksOnly, cst.CSTVisitor):
    def __init__(self, where: Mapping[cst.CSTNode, CodeRange]) -> None:
        self.where = where
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
            pos = self.where[node]
            self.sites.append(MarkedSite(pattern, pos.start.line, pos.end.line, ".".join(self.stack) or "<module>"))


def marked_sites(source: str) -> list[MarkedSite]:
    """Every npufuse-marked if/else in ``source``, in order (qualname as the scan spells it).
    Raises ``cst.ParserSyntaxError`` or :class:`nesting.TooDeep` for a file libcst cannot read."""
    module = parse_module(source)
    finder = _MarkedFinder(positions(module))
    module.visit(finder)
    return finder.sites


class _Reverter(_BlocksOnly, cst.CSTTransformer):
    def __init__(self, lines: set[int] | None, where: Mapping[cst.CSTNode, CodeRange], default_indent: str = "    ") -> None:
        super().__init__()
        self.where = where
        self.lines = lines  # start lines of marked ifs to revert; None = all
        self.default_indent = default_indent  # the module's: what a block without its own indent uses
        self.reverted: list[int] = []

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body, rest = self._revert_body(original.body, updated.body)
        return updated.with_changes(body=body, footer=(*rest, *updated.footer))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        body, rest = self._revert_body(original.body, updated.body)
        return updated.with_changes(body=body, footer=(*rest, *updated.footer))

    def _revert_body(self, original_body, updated_body) -> tuple[list, list]:
        """The body with its chosen marked ifs replaced by their else statements, and the lines
        still to place after its last statement (the block's footer takes them)."""
        out = []
        carry: list[cst.EmptyLine] = []  # lines that followed a reverted else block
        for orig, upd in zip(original_body, updated_body):
            line = self.where[orig].start.line
            if carry:
                upd = upd.with_changes(leading_lines=(*carry, *upd.leading_lines))
                carry = []
            if (
                _marked_if(orig)
                and (self.lines is None or line in self.lines)
                and isinstance(upd.orelse, cst.Else)
                and upd.orelse.body.body
            ):
                restored = list(upd.orelse.body.body)
                restored[0] = restored[0].with_changes(leading_lines=(*upd.leading_lines, *restored[0].leading_lines))
                out.extend(restored)
                # Blank or comment lines indented at least as deep as the else block, right after
                # it, are its footer to libcst (in the original they began the next statement);
                # they move out with the statements, with the block's indentation made explicit
                # so that every byte of them stays as it was.
                block = upd.orelse.body
                carry = [_outdented(e, block.indent if block.indent is not None else self.default_indent) for e in block.footer]
                self.reverted.append(line)
            else:
                out.append(upd)
        return out, carry


def _outdented(line: cst.EmptyLine, indent: str) -> cst.EmptyLine:
    """``line`` as it prints one block level out: the level's indentation becomes its own."""
    if not line.indent:
        return line
    return line.with_changes(whitespace=cst.SimpleWhitespace(indent + line.whitespace.value))


@dataclass
class RevertOutcome:
    text: str
    reverted: list[int] = field(default_factory=list)  # start lines (in the input) of reverted ifs
    notes: list[str] = field(default_factory=list)


def revert_source(source: str, lines: set[int] | None = None) -> RevertOutcome:
    """Replace marked ifs (all, or those starting at ``lines``) by their else statements; the
    prelude goes with the last one. Raises like :func:`rewrite_source`."""
    module = parse_module(source)
    tail = dropped_final_break(source, module) or ""
    reverter = _Reverter(lines, positions(module), module.default_indent)
    new = module.visit(reverter)
    outcome = RevertOutcome(text=source)
    if lines is not None:
        missing = sorted(set(lines) - set(reverter.reverted))
        if missing:
            outcome.notes.append(f"no npufuse-marked if/else with an else branch starts at line(s) {', '.join(map(str, missing))}")
    if not reverter.reverted:
        return outcome
    outcome.reverted = sorted(reverter.reverted)
    text = new.code + tail
    if not marked_sites(text) and has_prelude(text):
        text, removed = remove_prelude(text, module.default_newline)
        if not removed:
            outcome.notes.append("the npufuse prelude was edited by hand; left in place")
    outcome.text = text
    return outcome
