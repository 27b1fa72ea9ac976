"""The replacement text of a candidate: :func:`npufuse.rewrite.codegen.render_site`'s output,
computed without libcst where that is provably the same text.

``render_site`` runs the libcst transform ``npufuse apply`` uses (two full parses of the file
per site): exact, but ~100x the cost of ``ast.parse`` — too slow to run for every candidate of a
large scan. For the sites that make up nearly all real code, libcst's output is a plain function
of the lines: the ``if`` header at the site's indentation, each fused statement line at one
level deeper (continuation lines verbatim), ``else:``, then the original lines with one
indentation level added to every line that starts a logical line (continuation lines, strings
and bracketed comments verbatim). :func:`fast_body` produces that text and returns None whenever
a case is not covered by this rule (tabs, lone CR or mixed line ends, stray whitespace-only or
comment lines whose owner libcst decides, multi-level first indents in the fused code, ...);
those sites go to ``render_site`` itself. Files that end every line with "\r\n" are covered:
the rule runs on their lines with "\n" ends, and the text gets "\r\n" back (:func:`crlf_lines`).
tests/test_scan_replacement.py checks the two agree on many real spans, with both line ends.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from typing import Callable

from npufuse.patterns.base import Finding, parsed_code
from npufuse.rewrite.codegen import MARKER, Switch, env_switch, guard_expression, has_other_breaks, render_site, source_lines

# libcst's indent when a module has no indented block (libcst._parser.detect_config).
FALLBACK_INDENT = "    "
_NON_LOGICAL = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.ENDMARKER)


def _statements(tree: ast.Module):
    """Every statement (at any depth, nested definitions included), without visiting expressions."""
    stack: list[ast.AST] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt):
            yield node
        # pushed last-first so that they pop in source order: body, handlers, orelse, finalbody
        for name in ("cases", "finalbody", "orelse", "handlers", "body"):
            block = getattr(node, name, None)
            if type(block) is list:
                stack.extend(reversed(block))


def default_indent(tree: ast.Module, lines: list[str]) -> str:
    """The file's first indentation (libcst's ``default_indent``, the whitespace of its first
    INDENT token): the leading whitespace of the first statement that starts a line at a column
    > 0, or of the first ``case`` line of a ``match`` met before it. "" where the text does not
    tell (the caller then leaves the file to libcst)."""
    # _statements walks in source order, so the first hit is the first INDENT
    for node in _statements(tree):
        if node.col_offset > 0 and node.lineno <= len(lines):
            ws = lines[node.lineno - 1][: node.col_offset]
            if not ws.strip():
                return ws
        elif isinstance(node, ast.Match) and node.col_offset == 0:
            # a top-level match indents its `case` lines, which are no statements; the first
            # case's pattern starts on its `case` line unless it is a parenthesised one written
            # on a later line: then (and for tabs or form feeds) leave it to libcst
            pattern = node.cases[0].pattern if node.cases else None
            if pattern is None or pattern.lineno > len(lines):
                return ""
            row = lines[pattern.lineno - 1]
            head = row.lstrip(" ")
            ws = row[: len(row) - len(head)]
            keyword = head.startswith("case") and not (head[4:5].isalnum() or head[4:5] == "_")
            if ws and keyword and row.isascii() and pattern.col_offset > len(ws) + 4:  # the pattern follows `case` on this row
                return ws
            return ""
    return FALLBACK_INDENT


def _ws(row: str) -> str:
    return row[: len(row) - len(row.lstrip(" "))]


# Text the bracket scanner below covers: printable ASCII, spaces and newlines, no backslash
# (the scanner then needs no escapes, continuation lines, tabs, form feeds or Unicode rules).
_NOT_PLAIN = re.compile(r"[^\n\x20-\x5b\x5d-\x7e]")
_UNCOVERED = object()
_SPECIAL = re.compile(r"[#'\"()\[\]{}]")


def _classify(text: str) -> list[str] | None:
    """Per physical line: "logical" (starts a logical line), "comment" (comment-only, between
    statements), "blank" (between statements), "cont" (inside brackets), "string" (inside a
    multi-line string token). None for what the fast path does not cover (backslash
    continuations, tokenizer errors)."""
    kinds = _classify_plain(text)
    if kinds is not _UNCOVERED:
        return kinds  # type: ignore[return-value]
    return _classify_tokens(text)


def _classify_plain(text: str) -> list[str] | None | object:
    """:func:`_classify_tokens`'s answer without the (pure Python, slow) tokenizer, for plain
    text: printable ASCII without backslashes or triple quotes, so every string literal ends on
    its line and the only multi-line construct is a bracket. A line then starts a logical line
    when it opens at bracket depth 0 with code, is a blank or comment line at depth 0, or else
    continues a bracket. Returns ``_UNCOVERED`` for any other text, and for what would make the
    tokenizer complain or behave unusually (an unterminated string, a stray closing bracket),
    so the tokenizer decides those. tests/test_scan_prefilter.py checks both agree."""
    if "'''" in text or '"""' in text or _NOT_PLAIN.search(text) is not None:
        return _UNCOVERED
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    kinds: list[str] = []
    append = kinds.append
    special = _SPECIAL.search
    depth = 0
    indents = [0]
    for row in rows:
        n = len(row)
        start = n - len(row.lstrip(" "))
        if depth == 0:
            if start == n:
                append("blank")
                continue
            if row[start] == "#":
                append("comment")
                continue
            append("logical")
            # the tokenizer's indentation check (an unindent to no outer level is an error)
            if start > indents[-1]:
                indents.append(start)
            elif start < indents[-1]:
                while start < indents[-1]:
                    indents.pop()
                if start != indents[-1]:
                    return None
        else:
            append("cont")
        i = start
        while True:
            m = special(row, i)  # the next character that matters: a bracket, a quote, a comment
            if m is None:
                break
            i = m.start()
            c = row[i]
            if c == "#":
                break
            if c == "'" or c == '"':
                j = row.find(c, i + 1)
                if j < 0:
                    return _UNCOVERED
                i = j + 1
                continue
            if c in "([{":
                depth += 1
            else:
                depth -= 1
                if depth < 0:
                    return _UNCOVERED
            i += 1
    if depth:
        return None  # EOF inside brackets: the tokenizer's TokenError
    return kinds


def _classify_tokens(text: str) -> list[str] | None:
    """:func:`_classify` by the tokenizer (any text)."""
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    kinds = ["cont"] * len(rows)
    at_start = True
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            row = tok.start[0] - 1
            if tok.end[0] > tok.start[0] and tok.type not in (tokenize.NEWLINE, tokenize.NL):
                for r in range(tok.start[0], tok.end[0]):
                    if r < len(kinds):
                        kinds[r] = "string"
            if tok.type == tokenize.NEWLINE:
                at_start = True
            elif at_start and tok.type == tokenize.NL and kinds[row] == "cont":
                kinds[row] = "blank"
            elif at_start and tok.type == tokenize.COMMENT:
                kinds[row] = "comment"
            elif at_start and tok.type not in _NON_LOGICAL:
                kinds[row] = "logical"
                at_start = False
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    for i, row in enumerate(rows[:-1]):
        if kinds[i + 1] != "string" and row.rstrip().endswith("\\"):
            return None  # backslash continuation: libcst keeps its whitespace its own way
    return kinds


def _reindent(rows: list[str], kinds: list[str], add: str, top: str) -> list[str] | None:
    """libcst's rendering of ``rows`` moved one block deeper: a row that libcst indents (a
    logical line; a bracket continuation, comment or blank row that starts with its owning
    block's indentation) gets ``add`` in front, the rest stays verbatim. ``top`` is the
    indentation of the block the rows sit in. None when a row's owner is ambiguous."""
    out: list[str] = []
    seen: list[str] = []  # indentations of logical rows so far
    owner = top
    for i, (row, kind) in enumerate(zip(rows, kinds)):
        body = row[:-1] if row.endswith("\n") else row
        if kind == "logical":
            owner = _ws(body)
            seen.append(owner)
            out.append(add + row)
        elif kind == "string":
            out.append(row)
        elif kind == "cont":
            out.append(add + row if body.startswith(owner) else row)
        else:  # blank / comment row
            # libcst: the next statement owns the lines at (or left of) its own indentation; a
            # block closing here owns the lines indented further (its footer). The row is
            # re-indented when it starts with its owner's indentation.
            nxt = next((_ws(rows[k]) for k in range(i + 1, len(rows)) if kinds[k] == "logical"), None)
            if nxt is None:
                return None
            ws = _ws(body)
            if len(ws) <= len(nxt):
                cands = {nxt}
            else:
                cands = {w for w in [*seen, owner] if len(nxt) < len(w) <= len(owner)} or {owner}
            decisions = {body.startswith(c) for c in cands}
            if len(decisions) != 1:
                return None
            out.append(add + row if decisions.pop() else row)
    return out


def decorated_lines(tree: ast.Module) -> set[int]:
    """``def``/``class`` lines that carry decorators: a span starting there would leave its
    decorators outside (libcst takes them along), so the fast path declines those."""
    return {n.lineno for n in _statements(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.decorator_list}


def fast_body(lines: list[str], finding: Finding, indent: str, decorated: set[int] | frozenset[int] = frozenset(),
              newline: str = "\n") -> tuple[str, str] | None:
    """(site indentation, everything after the ``if`` header line) as libcst renders it, or None
    when the rule above does not provably apply. ``decorated``: :func:`decorated_lines`.
    ``newline`` "\r\n": ``lines`` are :func:`crlf_lines` of a file whose every line ends so;
    the text comes back with its line ends."""
    if not indent or indent.strip(" ") or finding.line in decorated:
        return None
    span = lines[finding.line - 1 : finding.end_line]
    if not span or not span[-1].endswith("\n") or any("\r" in ln or "\t" in ln for ln in span):
        return None
    site = _ws(span[0])
    if not span[0].strip() or span[0].lstrip().startswith("#"):
        return None
    kinds = _classify("".join(span))
    if kinds is None or len(kinds) != len(span) or kinds[0] != "logical":
        return None
    fused = textwrap.dedent(finding.fused).strip("\n")
    if "\t" in fused or "\r" in fused:
        return None
    # parsed once per distinct text in this process (base.parsed_code: shared with the
    # wrapper's module-call check, and model repos repeat one fused text across many files)
    if parsed_code(fused) is None:
        return None
    frows = [r + "\n" for r in fused.split("\n")]
    fkinds = _classify(fused + "\n")
    if fkinds is None or len(fkinds) != len(frows) or "logical" not in fkinds:
        return None
    # The transform keeps the fused module's statements, with the comments above the first one
    # (libcst's module header, moved onto it); unindented comment/blank rows after the last
    # statement (the module footer) are dropped. Indented trailing rows may belong to a block.
    last = max(i for i, k in enumerate(fkinds) if k not in ("comment", "blank"))
    if any(_ws(frows[i]) for i in range(last + 1, len(frows)) if frows[i].strip()):
        return None
    frows, fkinds = frows[: last + 1], fkinds[: last + 1]
    # libcst re-renders the fused code's first indentation unit as the file's: equal text only
    # when the fused code indents by exactly the file's unit.
    indented = [_ws(r) for r, k in zip(frows, fkinds) if k == "logical" and _ws(r)]
    if indented and indented[0] != indent:
        return None
    fused_out = _reindent(frows, fkinds, site + indent, "")
    orig_out = _reindent(span, kinds, indent, site)
    if fused_out is None or orig_out is None:
        return None
    # What follows the site: a deeper comment or a whitespace-only row right after it is
    # re-attached by libcst to the new else block; leave those cases to render_site.
    for row in lines[finding.end_line : finding.end_line + 50]:
        if row == "\n":
            continue
        stripped = row.strip()
        if not stripped or "\r" in row:
            return None
        if stripped.startswith("#") and len(_ws(row)) > len(site):
            return None
        break
    rest = "".join(fused_out) + f"{site}else:\n" + "".join(orig_out)
    if newline != "\n":
        # libcst writes the module's newline (its first line end) after the code it adds, and
        # the original rows keep theirs: in a file that ends every line with "\r\n", all of
        # them. The fused code holds no string spanning lines (checked above), so every "\n"
        # here is a line end.
        if "string" in fkinds:
            return None
        rest = rest.replace("\n", newline)
    return site, rest


def _simple_guard(guard: str) -> bool:
    return guard == guard.strip() and "\n" not in guard and "#" not in guard and "\\" not in guard


def render(source: str | Callable[[], str], finding: Finding, switch: Switch, body: tuple[str, str] | None, site_id: int | None = None) -> str:
    """render_site's text: the precomputed fast body when there is one, else render_site on the
    file (``source`` may be a callable that reads it only when needed). ``site_id``: the
    candidate id of the per-candidate switch (only the ``if`` header depends on it)."""
    guard = guard_expression(finding, switch, site_id)
    if body is not None and _simple_guard(guard):
        site, rest = body
        newline = "\r\n" if rest.endswith("\r\n") else "\n"  # the body's rows all end alike (fast_body)
        return f"{site}if {guard}:  {MARKER.format(pattern=finding.pattern)}{newline}{rest}"
    return render_site(source() if callable(source) else source, finding, switch, site_id)


def libcst_body(source: str, finding: Finding) -> tuple[str, str] | None:
    """:func:`fast_body`'s pair for a site the fast path declines, taken from one run of
    ``render_site`` with the environment switch: only the ``if`` header depends on the switch,
    and :func:`render` writes the header itself for any simple guard. The scan's workers call
    this, so libcst's cost (~0.7 s a site) is spread over the cores instead of paid one site after
    another in the parent. None where render_site fails or where :func:`render` with the pair
    does not give back render_site's exact text (then the site is rendered in full later)."""
    switch = env_switch(finding.pattern)
    if not _simple_guard(guard_expression(finding, switch)):
        return None
    try:
        text = render_site(source, finding, switch)
    except Exception:  # rendered again where the switch is chosen, which reports why it fails
        return None
    rows = source_lines(text)
    if not rows:
        return None
    head = rows[0]
    body = (head[: len(head) - len(head.lstrip())], "".join(rows[1:]))
    return body if render(source, finding, switch, body) == text else None


def crlf_lines(source: str, lines: list[str]) -> list[str] | None:
    """``lines`` (``ModuleInfo.lines``) with "\n" ends, for a file whose every
    line break is "\r\n" (Windows line ends), so that :func:`fast_body` can read them (with
    ``newline="\r\n"``); None for any other file: no "\r\n", a lone "\r" or "\n", or another
    break that splitlines counts."""
    if "\r\n" not in source:
        return None
    lf = source.replace("\r\n", "\n")
    if "\r" in lf or source.count("\n") != source.count("\r\n") or not splitlines_match(lf):
        return None
    return [ln[:-2] + "\n" if ln.endswith("\r\n") else ln for ln in lines]


def splitlines_match(source: str) -> bool:
    """Whether ``source`` breaks lines only at ``\\n``, the one line end the fast path covers (not
    "\\r", nor a form feed or another break that str.splitlines counts)."""
    return "\r" not in source and not has_other_breaks(source)
