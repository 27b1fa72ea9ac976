"""How deeply a source file nests, measured before libcst may parse it.

libcst's native parser recurses on the C stack once per nesting level, and a deep enough file
overflows that stack: the Python process dies with SIGSEGV, no exception to catch. Measured
with libcst 1.9.0 on CPython 3.11 and an 8 MiB main-thread stack (``tests/test_rewrite_nesting.py``
checks the margin in a subprocess), ``x = ((…1…))`` crashes at about 1,200 brackets,
``f(f(…))`` and ``[[…]]`` likewise; unbracketed chains cost less stack per level:
``lambda: lambda: …`` crashes at about 3,500 lambdas, ``a.b.c…`` at 6,000 attributes,
``1 + 1 + …``, ``2 ** 2 ** …`` and ``a and a and …`` at about 7,000 terms, ``- - … 1`` at
8,200 operators.

``ast.parse`` succeeding is no guarantee: it stops brackets at 200 but (CPython 3.11) accepts
2,000-term chains, 2,000 lambdas, limits that differ between CPython versions; and ``npufuse
revert`` parses
files the user edited after apply, which nothing has ast-parsed. So every libcst parse of user
text in npufuse goes through :func:`check` first (``transform.parse_module``).

The measure, in bracket levels (the costliest construct per level), over code tokens only
(strings and comments skipped, except the replacement fields of f-strings, which libcst
parses): each open bracket is one level; within a bracket level, a chain of operators of one
precedence class (``+`` after ``+``, ``.`` after ``.``, ``lambda`` after ``lambda``, ...) nests
the tree one node per operator, weighed by the stack libcst spends on it (:data:`_WEIGHT`, in
twelfths of a level); an operator of a looser class starts the tighter chains afresh (the
``*`` chain of each term of a sum), a comma, ``=`` or the end of a logical line all of them;
each indented block adds one level. :data:`LIMIT` sits at about a third of every measured
crash depth and above anything CPython itself accepts in brackets (200), so a file the scan
parsed is refused only for an absurd chain (thousands of terms in one expression).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# About a third of the measured crash depth of pure brackets (~1,200): room for a smaller stack
# and for the frames of whoever calls the parser.
LIMIT = 400
# Chain operators are weighed in twelfths of a bracket level, by the stack libcst spends on each
# (measured crash depth of a chain of that operator vs ~1,200 brackets, rounded up): so every
# construct is refused at about a third of its own crash depth.
UNITS_PER_LEVEL = 12

_TOKEN = re.compile(
    r"""
    (?P<string>(?i:[rbuf]{0,2})(?:'''(?:[^\\]|\\.)*?(?:'''|\Z)|\"\"\"(?:[^\\]|\\.)*?(?:\"\"\"|\Z)
                                |'(?:[^'\\\r\n]|\\.|\\\r?\n)*(?:'|$)|"(?:[^"\\\r\n]|\\.|\\\r?\n)*(?:"|$)))
    |(?P<comment>\#[^\r\n]*)
    |(?P<cont>\\\r?\n)
    |(?P<newline>\r\n|\r|\n)
    |(?P<indent>(?<![^\r\n])[ \t\f]+(?=[^ \t\f\r\n#\\]))
    |(?P<open>[(\[{])
    |(?P<close>[)\]}])
    |(?P<sep>,|;|(?:\*\*|//|>>|<<|[-+*/%@&|^])?=(?!=))
    |(?P<space>[ \t\f]+)
    |(?P<word>\w+|\.\d\w*|\*\*|//|<<|>>|<=|>=|==|!=|->|:=|\.\.\.|\S)
    """,
    re.VERBOSE | re.MULTILINE | re.DOTALL,
)
_FSTRING = re.compile(r"(?i)^[rb]?f[rb]?['\"]")


@dataclass(frozen=True)
class Nesting:
    depth: int  # in bracket levels (see the module docstring)
    line: int  # where it is deepest (1-based)


# Operator classes, loosest first. An operator nests the tree one node deeper than the previous
# one of its own class (``a + b + c`` is ``(a + b) + c``; ``- - x``, ``a.b.c``, ``f()()``,
# ``lambda: lambda: x``, ``2 ** 2 ** 2`` likewise) and starts a new operand for every tighter
# class (the ``*`` chain of each term of a sum begins afresh), so the depth of an unbracketed
# expression is about the sum of the per-class chain lengths. Comparisons (one flat node in
# libcst) only start new operands.
_CLASSES = ["lambda", "ifexp", "or", "and", "not", "compare", "|", "^", "&", "shift", "+", "*", "unary", "**", "await", "trailer", "concat"]
_C = {name: i for i, name in enumerate(_CLASSES)}
# crash depth of a chain of the class alone (libcst 1.9, 8 MiB stack) -> its weight, 12 * 1,200 / depth
_WEIGHT = [
    5,  # lambda: 3,500 (`lambda: lambda: ...`)
    2,  # ifexp: more than 4,000 levels of `a if b else ...`, two tokens each (libcst needs minutes there)
    3, 3,  # or, and: 7,140
    2,  # not: 8,211 (as unary minus)
    0,  # compare: one flat node however long (`a < b < c`)
    3, 3, 3, 3, 3, 3,  # | ^ & shift + *: 7,000 (`1 + 1 + ...`)
    2,  # unary: 8,211
    3,  # **: 7,000
    2,  # await: no chain without brackets (`await (await x)`): as unary
    3,  # trailer: 6,000 (`a.b.c...`; `f()()`, `a[0][0]` more than 4,000)
    1,  # concat: parsed up to ~3,000 adjacent strings, a ParserSyntaxError (no crash) from ~4,000 on
]  # fmt: skip
_BINARY = {"|": "|", "^": "^", "&": "&", "<<": "shift", ">>": "shift", "+": "+", "-": "+", "*": "*", "/": "*", "//": "*", "%": "*", "@": "*",
           "**": "**", "<": "compare", ">": "compare", "==": "compare", "!=": "compare", "<=": "compare", ">=": "compare", "<>": "compare"}  # fmt: skip
_KEYWORDS = {"lambda": "lambda", "if": "ifexp", "else": "ifexp", "or": "or", "and": "and", "in": "compare", "is": "compare", "await": "await"}
_STATEMENT_WORDS = frozenset(
    "as assert async break class continue def del elif except finally for from global import "
    "nonlocal pass raise return try while with yield".split()
)  # fmt: skip
_OPERAND, _OPERATOR, _STRING = 0, 1, 2


_N = len(_CLASSES)
_MAX_FRAMES = 100_000  # beyond this, open brackets are only counted: the measure's memory stays bounded


class _Frame:
    """One bracket level: the levels below it and the chain counts of its current segment."""

    __slots__ = ("base", "counts", "total", "prev")

    def __init__(self, base: int) -> None:
        self.base = base
        self.counts: list[int] | None = None  # allocated at the first operator: most frames hold none
        self.total = 0
        self.prev = _OPERATOR  # a segment starts like after an operator: `-x` is unary

    def chain(self, cls: int) -> None:
        counts = self.counts
        if counts is None:
            counts = self.counts = [0] * _N
        dropped = sum(counts[cls + 1 :])
        if dropped:
            counts[cls + 1 :] = [0] * (_N - cls - 1)
            self.total -= dropped
        counts[cls] += _WEIGHT[cls]
        self.total += _WEIGHT[cls]

    def depth(self) -> int:
        return self.base + self.total // UNITS_PER_LEVEL

    def reset(self) -> None:
        self.counts, self.total, self.prev = None, 0, _OPERATOR


def measure(text: str) -> Nesting:
    """The deepest nesting of ``text`` and its line; linear in the text, no parser involved."""
    frame = _Frame(0)
    stack: list[_Frame] = []
    uncounted = 0  # open brackets past _MAX_FRAMES
    indents: list[int] = [0]
    best, best_line, line = 0, 1, 1
    at_line_start = True
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "newline" or kind == "cont":
            line += 1
            if kind == "newline" and not stack:
                frame.reset()  # a logical line ends: a new statement starts
                at_line_start = True
            continue
        if kind in ("space", "comment"):
            continue
        if kind == "indent":
            if not stack and at_line_start:
                width = len(m.group().expandtabs(8))
                while width < indents[-1] and len(indents) > 1:
                    indents.pop()
                if width > indents[-1]:
                    indents.append(width)
            continue
        if at_line_start and m.start() > 0 and text[m.start() - 1] in "\r\n":
            del indents[1:]  # a statement at column 0 closes every block
        at_line_start = False
        tok = m.group()
        extra = 0
        if kind == "string":
            line += tok.count("\n") + tok.count("\r") - tok.count("\r\n")
            if frame.prev == _STRING:
                frame.chain(_C["concat"])  # "a" "b" "c": implicit concatenation nests too
            frame.prev = _STRING
            extra = _fstring_depth(tok) if _FSTRING.match(tok) else 0
        elif kind == "open":
            if frame.prev != _OPERATOR:
                frame.chain(_C["trailer"])  # f(...), a[...]: a call or subscript of what precedes
            if len(stack) >= _MAX_FRAMES:
                uncounted += 1
            else:
                stack.append(frame)
                frame = _Frame(frame.depth() + 1)
        elif kind == "close":
            if uncounted:
                uncounted -= 1
            elif stack:
                frame = stack.pop()
            frame.prev = _OPERAND
        elif kind == "sep":
            frame.reset()
            continue
        elif tok == ".":
            frame.chain(_C["trailer"])
            frame.prev = _OPERATOR
        elif tok == "not":
            frame.chain(_C["compare"] if frame.prev != _OPERATOR else _C["not"])  # `a not in b` / `not a`
            frame.prev = _OPERATOR
        elif tok in _KEYWORDS:
            frame.chain(_C[_KEYWORDS[tok]])
            frame.prev = _OPERATOR
        elif tok in ("-", "+", "~") and frame.prev == _OPERATOR:
            frame.chain(_C["unary"])
        elif tok in _BINARY:
            frame.chain(_C[_BINARY[tok]])
            frame.prev = _OPERATOR
        elif tok in _STATEMENT_WORDS or not (tok[0].isalnum() or tok[0] == "_" or tok[0] == "."):
            frame.prev = _OPERATOR  # `return -x`, `x: -1`, `**kwargs`: what follows starts an operand
        else:
            frame.prev = _OPERAND  # a name or a number
        here = frame.depth() + uncounted + len(indents) - 1 + extra
        if here > best:
            best, best_line = here, line
    return Nesting(best, best_line)


def _fstring_depth(tok: str) -> int:
    """Bracket depth inside an f-string (its replacement fields are parsed as code): every
    bracket of the literal counts, an over-estimate bounded by the string itself."""
    depth = deepest = 0
    for ch in tok:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


class TooDeep(ValueError):
    """The file nests deeper than libcst can parse without overflowing the C stack."""

    def __init__(self, nesting: Nesting, limit: int) -> None:
        self.nesting, self.limit = nesting, limit
        super().__init__(f"nesting too deep for the rewriter: depth {nesting.depth} > limit {limit} (line {nesting.line}); left unchanged")


def problem(text: str, limit: int | None = None) -> str | None:
    """The refusal message when ``text`` nests deeper than ``limit`` (default :data:`LIMIT`), else None."""
    limit = LIMIT if limit is None else limit
    n = measure(text)
    return str(TooDeep(n, limit)) if n.depth > limit else None


def check(text: str, limit: int | None = None) -> None:
    """Raise :class:`TooDeep` (a ValueError) when libcst must not parse ``text``."""
    limit = LIMIT if limit is None else limit
    n = measure(text)
    if n.depth > limit:
        raise TooDeep(n, limit)
