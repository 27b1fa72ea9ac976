"""The scan: read each file once, parse it once, run every detector over every scope, then
assemble candidates (switch, replacement, value, risks) in a stable order.

Per file (:func:`analyze_file`, run in a process pool for large trees): read with a size limit,
decode (PEP 263 cookie, BOM), ``ast.parse``, index (:class:`ModuleInfo`), run the detectors,
collect repo facts and the risks that need the AST. Every problem becomes a :class:`Failure`
entry for that file; a detector that raises loses only its own results for that file.

Across files (:func:`scan_repo`): config shapes, switches and training markers are merged, each
finding gets an id, a key, a switch (DESIGN.md rule 1), its replacement from
:func:`npufuse.rewrite.codegen.render_site` (exactly what ``apply`` writes), a value from its
pattern's ``assess`` and its risks. :meth:`ScanResult.to_json` is the scan.json of DESIGN.md.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import copy
import gc
import hashlib
import io
import json
import math
import os
import re
import signal
import sys
import threading
import tokenize
import traceback
import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from npufuse import __version__
from npufuse.patterns import _site_s48r
from npufuse.patterns.base import Finding, NearMiss, Pattern
from npufuse.rewrite.codegen import source_lines
from npufuse.scan import config_shapes, dataflow, forward_ad, replacement, repo_facts, repo_search, repo_symbols, risks
from npufuse.scan.dataflow import ModuleInfo, Scope, folds_to_ascii, lf_line_ends, may_multiply
from npufuse.scan.walk import Failure, WalkResult, _os_failure, walk

DEFAULT_MAX_FILE_BYTES = 10 * 1024 * 1024
# Below this many files a process pool costs more (start-up, pickling) than it saves.
PARALLEL_MIN_FILES = 48
CONFIDENCE_RANK = {"high": 0, "medium": 1, "low": 2}


class UnknownPatternError(ValueError):
    """``only`` named a pattern id that does not exist."""


@dataclass(frozen=True)
class ScanOptions:
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # ``npufuse scan --optimizer-zero-grad-in-place``: where the code frees grads with an explicit
    # zero_grad(set_to_none=True) (or a flag), fused_optimizer rebinds that zero_grad to zero in
    # place instead of refusing (a behaviour change the user opts into; see fused_optimizer)
    optimizer_zero_grad_in_place: bool = False


@dataclass
class Hit:
    """A validated finding and what was learnt about it where the AST was at hand."""

    finding: Finding
    context: repo_search.SiteContext
    local_risks: list[dict[str, Any]]
    code: str  # the site's original lines
    body: tuple[str, str] | None = None  # precomputed replacement text after the `if` line (replacement.fast_body)


@dataclass
class FileOutcome:
    file: str
    parsed: bool = False
    sha256: str | None = None
    lines: int = 0
    failures: list[Failure] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    near_misses: list[dict[str, Any]] = field(default_factory=list)
    facts: repo_search.FileFacts | None = None
    source: str | None = None  # kept only when the file has hits (the replacement needs it)
    # a pool worker left a costly part of this file's analysis to the parent (see defer_import):
    # never cached nor reported as is; the parent completes it (finish_deferred)
    deferred: bool = False
    # s41: the detector calls that worker left to the parent, each (scope index, pattern index,
    # len(hits), len(near_misses) where its results belong); empty with ``deferred``: the
    # whole file is left to the parent
    pending: list[tuple[int, int, int, int]] = field(default_factory=list)
    # with ``pending``: the worker's part read other files of the repo (repo_facts.reads_other_files,
    # a record of that process): the finished outcome is not cached either
    worker_read_others: bool = False


# -- reading and parsing -----------------------------------------------------------------------

_PY2_HINTS = [
    (re.compile(r"^\s*print\s+[^\s(=.,)\[]"), "print statement"),
    (re.compile(r"^\s*exec\s+[\"'\w]"), "exec statement"),
    (re.compile(r"except\s+[\w.()\s]+,\s*\w+\s*:"), "`except X, e:`"),
    (re.compile(r"^\s*raise\s+[\w.]+\s*,"), "`raise E, msg`"),
    (re.compile(r"\bur[\"']"), "ur'' string literal"),
    (re.compile(r"<>"), "`<>` operator"),
    (re.compile(r"`[^`]+`"), "backtick repr"),
]


def _py2_hint(exc: SyntaxError, text: str) -> str:
    msg = exc.msg or ""
    if "Missing parentheses in call to 'print'" in msg:
        return " (this looks like Python 2 code: print statement; npufuse scans Python 3)"
    if "Missing parentheses in call to 'exec'" in msg:
        return " (this looks like Python 2 code: exec statement; npufuse scans Python 3)"
    if "leading zeros in decimal integer literals" in msg:
        return " (this looks like Python 2 code: old octal literal; npufuse scans Python 3)"
    rows = source_lines(text) if not exc.text and exc.lineno else []  # numbered as ast numbers them
    line = exc.text if exc.text else (rows[exc.lineno - 1] if exc.lineno and exc.lineno <= len(rows) else "")
    for rx, what in _PY2_HINTS:
        if rx.search(line or ""):
            return f" (this looks like Python 2 code: {what}; npufuse scans Python 3)"
    return ""


_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.MULTILINE)


def read_source(path: Path, rel: str, max_bytes: int) -> tuple[str | None, str | None, Failure | None]:
    """(text, sha256 of the bytes, failure). Binary, undecodable, huge and unreadable files fail."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return None, None, _os_failure(rel, exc, link=path.is_symlink())
    if size > max_bytes:
        return None, None, Failure(rel, "too_large", f"skipped: {size / 2**20:.1f} MB is over the {max_bytes / 2**20:g} MB limit (--max-file-mb)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, None, _os_failure(rel, exc)
    sha = hashlib.sha256(data).hexdigest()
    if b"\x00" in data:
        return None, sha, Failure(rel, "binary", "binary file (contains NUL bytes), not Python source")
    try:
        encoding = _detect_encoding(data)
    except SyntaxError as exc:
        cookie = _COOKIE.search(b"\n".join(data.split(b"\n", 2)[:2]))
        if cookie is not None:  # a coding cookie naming an unknown codec, or a BOM/cookie clash
            return None, sha, Failure(rel, "encoding", f"bad encoding declaration {cookie.group(1).decode('ascii', 'replace')!r}: {getattr(exc, 'msg', exc)}")
        encoding = "utf-8"  # undecodable bytes in the first two lines: report them as such below
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        if isinstance(exc, UnicodeDecodeError):
            line = data.count(b"\n", 0, exc.start) + 1
            declared = "UTF-8 (no coding cookie)" if encoding in ("utf-8", "utf-8-sig") else f"{encoding} (its coding cookie)"
            return None, sha, Failure(rel, "encoding", f"not valid {declared}: byte 0x{data[exc.start]:02x} on line {line}; save the file as UTF-8 or declare its encoding (PEP 263)")
        return None, sha, Failure(rel, "encoding", f"unknown encoding {encoding!r}")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text, sha, None


def _detect_encoding(data: bytes) -> str:
    """``tokenize.detect_encoding``'s encoding for the file's bytes, as read_source uses it.
    detect_encoding reads at most the first two lines (up to the second "\n"); without a BOM
    and without "coding" in them its answer is "utf-8", or a SyntaxError for bytes there that
    are not UTF-8, after which read_source takes "utf-8" too (no cookie to report). So only
    files with a BOM or "coding" up there need the call (it costs more than reading a file)."""
    i = data.find(b"\n")
    j = data.find(b"\n", i + 1) if i >= 0 else -1
    head = data if j < 0 else data[: j + 1]
    if not data.startswith(codecs.BOM_UTF8) and b"coding" not in head:
        return "utf-8"
    return tokenize.detect_encoding(io.BytesIO(data).readline)[0]


def parse_source(rel: str, text: str) -> tuple[ast.Module | None, Failure | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are not ours to print
            return ast.parse(text, filename=rel), None
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        return None, Failure(rel, "syntax", f"SyntaxError: {where}: {exc.msg}{_py2_hint(exc, text)}")
    except (ValueError, MemoryError, RecursionError) as exc:
        return None, Failure(rel, "syntax", f"cannot parse: {type(exc).__name__}: {exc}")


# -- one file ------------------------------------------------------------------------------------


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame in a pattern module (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    # (base.py's wrapper around every detect is no detector's own code)
    frames = [f for f in frames if not f.filename.replace("\\", "/").endswith("patterns/base.py")] or frames
    inner = [f for f in frames if "patterns" in f.filename.replace("\\", "/")] or frames
    f = inner[-1]
    return f"{Path(f.filename).name}:{f.lineno}"


def _valid_span(scope: Scope, line: int, end_line: int) -> bool:
    """Whole statements of one block: what codegen can wrap in an if/else."""
    for block, i, stmt in scope.statements():
        if stmt.lineno == line:
            for later in block[i:]:
                if (later.end_lineno or later.lineno) == end_line:
                    return True
    return False


# apply's reason, word for word (rewrite/transform.py, `_several_statements`)
_SHARED_LINE = "lines {}-{} share a line with other statements (`;`); split them first"
# the near-miss reasons of a site whose code already runs the fused op (read by bench/detect_corpus.py)
ALREADY_REWRITTEN = "already rewritten by npufuse"
ALREADY_FUSED_BESIDE = "already has a torch_npu branch beside it"


def _shares_line(scope: Scope, lines: list[str], line: int, end_line: int) -> bool:
    """Whether the span's first or last statement shares its physical line with another statement
    of its block (`a = 1; b = 2`): apply refuses those spans, since it cannot tell which of the
    statements on the line the span means. From the ast, like ``_valid_span``; only a span with a
    `;` on one of its lines pays for the block lookup."""
    if not any(";" in ln for ln in lines[line - 1 : end_line]):
        return False

    def joined(block: list[ast.stmt], j: int) -> bool:
        s = block[j]
        return ((j > 0 and (block[j - 1].end_lineno or block[j - 1].lineno) == s.lineno)
                or (j + 1 < len(block) and block[j + 1].lineno == (s.end_lineno or s.lineno)))

    for block, i, stmt in scope.statements():
        if stmt.lineno == line:
            for k in range(i, len(block)):
                if (block[k].end_lineno or block[k].lineno) == end_line:
                    return joined(block, i) or joined(block, k)
    return False


# Array frameworks whose arrays torch_npu's fused ops do not take: a file that imports one of them and
# no torch module is not PyTorch code (audit41: MiniCPM's mlx_finetune.py, where `nn` is mlx.nn and
# `x + r` then `self.post_attention_layernorm(h)` adds mx.arrays before mlx.nn.RMSNorm)
_OTHER_ARRAY_FRAMEWORKS = ("mlx", "jax", "flax", "tensorflow", "keras", "paddle", "mindspore", "oneflow", "tinygrad")


def _other_array_framework(module: ModuleInfo) -> str | None:
    """The other array framework the file imports where it imports no torch module; None otherwise
    (a file with no imports at all may well be handed torch tensors)."""
    roots = {target.split(".", 1)[0] for target in module.aliases.values()}
    if "torch" in roots or "torch_npu" in roots:
        return None
    return next((r for r in _OTHER_ARRAY_FRAMEWORKS if r in roots), None)


# a line that opens a compound statement (its body may follow the colon on the same line)
_HEADER_LINE = re.compile(r"\s*(?:async\s+def|def|if|elif|else|for|while|with|try|except|finally|class)\b")
_AFTER_HEADER = "line {} holds the header of a compound statement (`def`, `if`, ...) and the site after its colon: split the body onto its own lines first"


def _after_header(scope: Scope, lines: list[str], line: int) -> bool:
    """Whether the span starts after the colon of a compound statement's header on the same line
    (``def forward(self, t): return t * self.freqs_cos + ...``, ``if c: x = ...``): the rewrite
    works on whole lines, so the fused ``if`` would take the header's place (audit41: EVA's one-line
    rope forward became a ``return`` in the class body). Only a line that starts with a header
    keyword pays for the statement lookup."""
    text = lines[line - 1]
    if ":" not in text or not _HEADER_LINE.match(text):
        return False
    indent = len(text) - len(text.lstrip())
    body = getattr(scope.node, "body", None)
    if isinstance(body, list) and body and body[0].lineno == line and body[0].col_offset > indent:
        return True
    return any(stmt.lineno == line and stmt.col_offset > indent for _block, _i, stmt in scope.statements())


def _jsonable(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth < 6 and isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if depth < 6 and isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, ast.AST):
        return ast.unparse(value)
    return str(value)


def _lf_strings(value: Any) -> Any:
    """Every string in a JSON-able value with "\n" line ends (dataflow.lf_line_ends)."""
    if isinstance(value, str):
        return lf_line_ends(value)
    if isinstance(value, list):
        return [_lf_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _lf_strings(v) for k, v in value.items()}
    return value


def _one_line(expr: str) -> str:
    """A guard tensor cut from several source lines (``f(a, dim\n=-1)``), written on one: it
    heads the ``if`` line, whose end carries the npufuse marker. Left as it is if it does not
    parse on its own."""
    if not isinstance(expr, str) or ("\n" not in expr and "\r" not in expr):
        return expr
    try:
        return ast.unparse(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, RecursionError):
        return expr


def _inside(spans: Iterable[tuple[int, int, str]], line: int, end_line: int) -> str | None:
    for a, b, where in spans:
        if a <= line and end_line <= b:
            return where
    return None


# Pattern.SCOPE_WORDS gates on (tests switch them off to compare: the findings must not change)
SCOPE_GATES = True


def gate_words(module: ModuleInfo, pattern: Pattern) -> tuple[str, ...] | None:
    """The words a scope of ``module`` must hold (one of them) for ``pattern.detect`` to run
    there, or None (every scope). ``SCOPE_WORDS`` plus each import alias of the module whose
    target names one of them (``from torch.optim import AdamW as W``: ``W(...)`` is an AdamW
    call without the word; detectors resolve calls through ``module.aliases``). A word outside
    ASCII (or an alias that is) opens the gate: only ASCII survives ``gate_folded``'s NFKD intact."""
    declared = getattr(pattern, "SCOPE_WORDS", None)
    if not isinstance(declared, tuple):
        return None
    words = _SHORTEST.get(declared)
    if words is None:
        if not all(isinstance(w, str) and w and w.isascii() for w in declared):
            return None
        # a word holding another word is found wherever that one is: looking for it adds nothing
        words = _SHORTEST[declared] = tuple(w for w in dict.fromkeys(declared) if not any(o != w and o in w for o in declared))
    held = getattr(pattern, "held_call_words", None)
    if held is not None:
        # s39: names under which the module holds the pattern's call for a later call site (``self.attend =
        # functools.partial(F.scaled_dot_product_attention, ...)``): a scope calling ``self.attend(..)`` holds no word
        extra_held = held(module)
        if extra_held:
            if not all(w.isascii() for w in extra_held):
                return None
            words = words + extra_held
    targets = module.__dict__.get("_npufuse_alias_targets")
    if targets is None:  # every alias target on one line each: one test per word finds most words absent
        # s42 review: module-level names bound to a torch API (``Optim = torch.optim.AdamW``) resolve like imports
        targets = module.__dict__["_npufuse_alias_targets"] = "\n".join([*module.aliases.values(), *module.assigned_aliases.values()])
    if not any(w in targets for w in words):
        return words
    extra = tuple(local for aliases in (module.aliases, module.assigned_aliases) for local, target in aliases.items()
                  if any(w in target for w in words))
    if extra and not all(a.isascii() for a in extra):
        return None
    return words + extra


_SHORTEST: dict[tuple[Any, ...], tuple[str, ...]] = {}


def _file_holds_any(text: str, words: tuple[str, ...]) -> bool:
    """``any(w in text for w in words)``. For a long list (fused_optimizer's class names and words, none of them in
    most files, so every word is looked for) the words led by an ASCII capital letter (the class names: ``Adam``,
    ``SGD``, ``LBFGS``, ...) are one regex, the rest ``in`` tests: a regex's first step looks for one of the
    alternatives' first characters, and capitals are rare in code where a lower-case lead (``optim``, ``_class(``)
    stops it at most positions. s51 (perf51): 475 -> 233 ms over the 544 transformers files (one regex of all the
    words before; 581 ms for ``in`` alone); for a few words, the first of which most files hold, ``in`` is cheaper."""
    if len(words) < 5:
        return any(w in text for w in words)
    split = _WORDS_RX.get(words)
    if split is None:
        if len(_WORDS_RX) > 256:  # alias words make a tuple per file that has such aliases
            _WORDS_RX.clear()
        capital = tuple(w for w in words if "A" <= w[0] <= "Z")
        rest = tuple(w for w in words if not "A" <= w[0] <= "Z")
        split = _WORDS_RX[words] = (rest, re.compile("|".join(map(re.escape, capital))) if capital else None)
    rest, rx = split
    return any(w in text for w in rest) or (rx is not None and rx.search(text) is not None)


_WORDS_RX: dict[tuple[str, ...], tuple[tuple[str, ...], re.Pattern[str] | None]] = {}


def gate_text(module: ModuleInfo, scope: Scope) -> str:
    """The text ``SCOPE_WORDS`` are looked for in first: the scope's whole lines (the file for
    ``<module>``; ``_site.scope_text``, shared with the detectors that cut it), which hold
    ``dataflow.scope_text`` (the exact segment) too, so a word test a detector makes on either
    is implied by the same test here."""
    from npufuse.patterns._site import scope_text as lines_text

    return lines_text(module, scope)


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def gate_folded(module: ModuleInfo, scope: Scope) -> str:
    """``gate_text`` NFKD-decomposed, for a scope with text outside ASCII that lacks the words
    as written. Python reads an identifier as its NFKC form (a fullwidth ``ｒｓｑｒｔ`` is
    ``rsqrt``); every ASCII run of an identifier's NFKC form is an ASCII run of its NFKD form,
    which is the concatenation of its characters' NFKD forms (canonical reordering moves no
    character across an ASCII one, composition makes no ASCII character), so a word an
    identifier holds is in the decomposed text. Only the runs outside ASCII are decomposed:
    the same text (ASCII characters bound every run). Computed once per scope."""
    cached = scope.__dict__.get("_npufuse_gate_folded")
    if cached is None:
        cached = scope.__dict__["_npufuse_gate_folded"] = _NON_ASCII.sub(lambda m: unicodedata.normalize("NFKD", m.group()), gate_text(module, scope))
    return cached


def gated_out(module: ModuleInfo, scope: Scope, words: tuple[str, ...] | None) -> bool:
    """Does the scan skip ``scope`` for a pattern with these ``gate_words``? (The loop in
    ``_analyze_file`` makes the same test inline.) The ``<module>`` scope is not decomposed: its
    text is the whole file, where decomposing the text outside ASCII costs more than the
    detector's own first test: that scope is skipped only in an ASCII file or one whose text
    outside ASCII decomposes to no ASCII character (``folds_to_ascii``)."""
    if words is None:
        return False
    text = gate_text(module, scope)
    top = isinstance(scope.node, ast.Module)
    if any(w in text and (w != "*" or top or multiplies(module, scope, text)) for w in words):
        return False
    if text.isascii() or not folds_to_ascii(module):
        return True
    if isinstance(scope.node, ast.Module):
        return False
    return not any(w in gate_folded(module, scope) for w in words)


def multiplies(module: ModuleInfo, scope: Scope, text: str) -> bool:
    """The ``SCOPE_WORDS`` word ``"*"`` as the gates read it (s40), for a scope whose ``gate_text``
    holds a ``*``: a star that can be an operator (``may_multiply``), or any spelling of a product
    without one -- the text says ``mul`` (``.mul(``, ``torch.mul (``, ``multiply``, ``addcmul_``) or
    names an import alias whose target does (``from torch import mul as m``). A detector declaring
    ``"*"`` finds nothing without a product: a scope whose only stars unpack (``**kwargs``) and that
    never says ``mul`` is not handed to it. Once per scope."""
    cached = scope.__dict__.get("_npufuse_multiplies")
    if cached is None:
        mul_aliases = module.__dict__.get("_npufuse_mul_aliases")
        if mul_aliases is None:
            mul_aliases = module.__dict__["_npufuse_mul_aliases"] = tuple(a for a, t in module.aliases.items() if "mul" in t)
        cached = scope.__dict__["_npufuse_multiplies"] = may_multiply(text) or "mul" in text or any(a in text for a in mul_aliases)
    return cached


class _Words:
    """``SCOPE_WORDS`` of a part of a detector (gate_words reads the attribute)."""

    def __init__(self, words: tuple[str, ...]) -> None:
        self.SCOPE_WORDS = words


def scope_holds_words(module: ModuleInfo, scope: Scope, words: tuple[str, ...]) -> bool:
    """The ``Pattern.SCOPE_WORDS`` test for a part of a detector with words of its own (a
    costly fallback such as the numeric probe): does the scope's text hold one of ``words``, or
    the name of an import alias whose target does (text outside ASCII decomposed as for the
    patterns' gates)? Always True while the gates are switched off (``SCOPE_GATES``)."""
    if not SCOPE_GATES:
        return True
    # s46: gate_words depends on the words and the module's import aliases only (both fixed for the file's
    # analysis): worked out once per module and word tuple, not per scope (the numeric probe's gate asked
    # it twice for each of ~3,600 scopes per quarter corpus, each a walk over the module's aliases)
    memo = module.__dict__.setdefault("_npufuse_part_gates", {})
    try:
        gate = memo[words]
    except KeyError:
        gate = memo[words] = gate_words(module, _Words(words))  # type: ignore[arg-type]
    return not gated_out(module, scope, gate)


def analyze_file(root: Path, rel: str, patterns: Sequence[Pattern], options: ScanOptions) -> FileOutcome:
    """Everything one file contributes to the scan. Never raises for bad input."""
    # The cyclic garbage collector is off while one file is analysed: parsing and detection
    # allocate hundreds of thousands of AST nodes that stay alive until the file is done, and
    # every automatic collection would traverse them again (about a fifth of the scan's time).
    # Nothing here depends on collecting cycles: they are reclaimed once it is back on.
    enabled = gc.isenabled()
    gc.disable()
    kept = len(_KEPT)
    try:
        return _analyze_file(root, rel, patterns, options)
    except LeftToParent:
        # a pool worker stops here: the parent analyses the whole file again anyway, so the
        # rest of this analysis would be thrown away (about 6% of a cold transformers scan)
        return FileOutcome(rel, deferred=True)
    finally:
        if len(_KEPT) != kept:
            # what this file's analysis left alive (its tree, the detectors' caches) is out of
            # the cyclic collector's reach: a kept tree traversed by every later collection
            # would cost more than freeing it did
            gc.freeze()
        if enabled:
            gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (and back on after it, if it was on): a
    scan's parent process. s43: receiving the workers' outcomes, assembling candidates and
    encoding scan.json / report.md allocate hundreds of thousands of objects that all stay
    alive until the scan returns, and each automatic full collection traversed them and
    everything else the process holds (torch's modules, once the numeric probe imported it) for
    nothing: 0.25-0.33 s of the parent's 1.2 s CPU on the transformers corpus, part of it in the
    serial tail after the pool (wall time on every core count). Output never depends on when
    cycles are collected; the few a scan leaves are reclaimed at the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _analyze_file(root: Path, rel: str, patterns: Sequence[Pattern], options: ScanOptions,
                  only: dict[tuple[int, int], list[tuple[int, int]]] | None = None) -> FileOutcome:
    """``only``: run just these (scope index, pattern index) detector calls (the parent finishing
    a worker's outcome, :func:`finish_deferred`); each call's list receives (len(hits),
    len(near_misses)) after its results, where they end."""
    memo = dataflow.WALK_MEMO
    try:
        return _analyze_parsed(root, rel, patterns, options, only)
    finally:
        dataflow.WALK_MEMO = memo  # s50: the file's walks go with it


def _analyze_parsed(root: Path, rel: str, patterns: Sequence[Pattern], options: ScanOptions,
                    only: dict[tuple[int, int], list[tuple[int, int]]] | None) -> FileOutcome:
    """:func:`_analyze_file`'s work (the walk memo is set up here and dropped there)."""
    out = FileOutcome(rel)
    text, sha, failure = read_source(root / rel, rel, options.max_file_bytes)
    out.sha256 = sha
    if failure is not None:
        out.failures.append(failure)
        return out
    assert text is not None
    tree, failure = parse_source(rel, text)
    if failure is not None:
        out.failures.append(failure)
        return out
    out.lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    try:
        module = ModuleInfo.from_source(rel, text, tree)
        repo_facts.attach_root(module, root)  # detectors may resolve a class / function of another file
        facts = repo_search.file_facts(module)
    except RecursionError:  # its text depends on the stack depth at the time: keep it stable
        out.failures.append(Failure(rel, "syntax", "cannot index: RecursionError: code nested too deep"))
        return out
    except Exception as exc:  # a pathological file must not stop the scan
        out.failures.append(Failure(rel, "syntax", f"cannot index: {type(exc).__name__}: {exc}"))
        return out
    out.parsed = True
    _keep_alive(module)
    # s50: the file's walks are kept for its detectors (dataflow.WALK_MEMO); _analyze_file drops them
    dataflow.WALK_MEMO = {}
    out.facts = facts
    n_lines = len(module.lines)
    errors: dict[str, list[Any]] = {}
    fast_lines: list[str] | None = None
    refused: str | None = None  # why apply leaves every site of this file alone ("": it does not)
    indent: str | None = None
    newline = "\n"  # the line end fast_lines were read with ("\r\n": crlf_lines)
    has_cr = "\r" in text

    def fail(pid: str, scope: Scope, message: str) -> None:
        entry = errors.setdefault(pid, [message, scope.qualname, 0, set()])
        entry[2] += 1
        entry[3].add(scope.qualname)

    # Pattern.SCOPE_WORDS: a scope whose text holds none of a pattern's words is not handed to it
    gates = [gate_words(module, p) for p in patterns] if SCOPE_GATES else [None] * len(patterns)
    gated = any(g is not None for g in gates)
    # per pattern: does the file hold one of its words as written (None: not looked yet)? A
    # function's text is a run of the file's lines, so where the file holds none, no function
    # does either: its scopes skip the search (most words of most patterns are in no scope)
    in_file: list[bool | None] = [None] * len(patterns)
    if gated and sum(map(len, module.lines)) != len(module.source):
        in_file = [True] * len(patterns)  # lines not cut from the text as it is: search every scope
    for si, scope in enumerate(module.scopes if _other_array_framework(module) is None else ()):
        # gated_out, inline (it runs for every scope and pattern): the words as written, then
        # the NFKD form of text outside ASCII (not for the <module> scope: kept unless ASCII)
        scope_src = gate_text(module, scope) if gated else None
        plain: bool | None = None
        top = isinstance(scope.node, ast.Module)
        for k, (pattern, words) in enumerate(zip(patterns, gates)):
            ends = None
            if only is not None:
                ends = only.get((si, k))
                if ends is None:
                    continue
            if words is not None and scope_src is not None:
                held = in_file[k]
                if held is None:
                    held = in_file[k] = _file_holds_any(module.source, words)
                if held and not top:
                    for w in words:
                        if w in scope_src and (w != "*" or multiplies(module, scope, scope_src)):
                            break
                    else:
                        held = False
                if not held:
                    if plain is None:
                        plain = scope_src.isascii() or not folds_to_ascii(module)
                    if plain or not (top or any(w in gate_folded(module, scope) for w in words)):
                        continue
            try:
                results = list(pattern.detect(module, scope))
            except LeftToParent:
                # s41: a pool worker leaves this one call to the parent (defer_import) and goes on
                # with the rest of the file; the parent runs only the calls left (finish_deferred),
                # where it analysed the whole file again (~1 s of CPU on transformers)
                out.pending.append((si, k, len(out.hits), len(out.near_misses)))
                continue
            except RecursionError:
                # Where and with what text the recursion limit hits depends on how deep the stack
                # already was (pool worker vs in-process): report it in words that do not vary.
                fail(pattern.id, scope, "raised RecursionError: code nested too deep for this detector")
                continue
            except Exception as exc:
                fail(pattern.id, scope, f"raised {type(exc).__name__}: {exc} (at {_where(exc)})")
                continue
            for r in results:
                if isinstance(r, Finding):
                    problem = _finding_problem(r, pattern, scope, n_lines)
                    if problem:
                        fail(pattern.id, scope, problem)
                        continue
                    already = _inside(facts.npufuse_spans, r.line, r.end_line)
                    if already is not None:
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, f"{ALREADY_REWRITTEN} (inside its guarded `if`)")))
                        continue
                    beside = _inside(facts.fused_spans, r.line, r.end_line)
                    if beside is not None:
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, f"{ALREADY_FUSED_BESIDE} (the `if` at {beside}); this is its fallback")))
                        continue
                    stale = _site_s48r.replaced_later(module, scope)
                    if stale is not None:  # s48: a def replaced later in its body never runs: no site
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, _site_s48r.reason(scope.qualname, stale))))
                        continue
                    try:
                        local = risks.local_risks(module, scope, r, pattern)
                    except (Exception, RecursionError) as exc:  # our own analysis failing must not lose the finding
                        local = [risks.risk("other", f"npufuse could not analyse risks here ({type(exc).__name__}: {exc})")]
                    if refused is None:
                        refused = _apply_refuses(text)
                    if refused:
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, refused)))
                        continue
                    if _shares_line(scope, module.lines, r.line, r.end_line):
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, _SHARED_LINE.format(r.line, r.end_line))))
                        continue
                    if _after_header(scope, module.lines, r.line):
                        out.near_misses.append(_near(rel, NearMiss(r.pattern, r.qualname, r.line, r.end_line, _AFTER_HEADER.format(r.line))))
                        continue
                    r.params = _jsonable(r.params)
                    if has_cr:
                        # code cut from a file with "\r\n" (or "\r") line ends: the same text as
                        # from its "\n" twin; a "\r" left in fused code sent the site to libcst
                        r.fused, r.params = _lf_strings(r.fused), _lf_strings(r.params)
                    r.guard_tensor = _one_line(r.guard_tensor)
                    if fast_lines is None:
                        fast_lines = []
                        if replacement.splitlines_match(text):
                            fast_lines = module.lines
                        elif (crlf := replacement.crlf_lines(text, module.lines)) is not None:
                            # Windows line ends: without this every site of the file went to
                            # libcst (0.6-0.8 s a site on a typical modeling file; the fast path: under 1 ms)
                            fast_lines, newline = crlf, "\r\n"
                        if fast_lines and not _nesting_ok(text, module.lines):
                            fast_lines = []
                        indent = replacement.default_indent(tree, fast_lines) if fast_lines else None
                    # a span starting at a decorated def/class (its decorators lie above the span)
                    decorated = {s.lineno for _b, _i, s in scope.statements() if s.lineno == r.line and getattr(s, "decorator_list", None)}
                    try:
                        body = replacement.fast_body(fast_lines, r, indent, decorated, newline) if fast_lines and indent else None
                    except Exception:  # the fast path declines; render_site will do it
                        body = None
                    if body is None:  # libcst here, in the worker, rather than in the parent one site at a time
                        body = replacement.libcst_body(text, r)
                    # codegen.original_text: module.lines are the file's lines as source_lines splits them
                    out.hits.append(Hit(r, repo_search.site_context(module, scope, r.line), local, "".join(module.lines[r.line - 1 : r.end_line]), body))
                elif isinstance(r, NearMiss):
                    if not isinstance(r.reason, str) or not r.reason.strip() or not isinstance(r.line, int):
                        fail(pattern.id, scope, "yielded a near miss without a reason or line")
                        continue
                    if has_cr:
                        r.reason = _lf_strings(r.reason)
                    out.near_misses.append(_near(rel, r))
                else:
                    fail(pattern.id, scope, f"yielded a {type(r).__name__}, not a Finding or NearMiss")
            if ends is not None:
                ends.append((len(out.hits), len(out.near_misses)))
    for pid in sorted(errors):
        message, qual, count, scopes = errors[pid]
        more = f" (and {count - 1} more problem(s), {len(scopes)} scope(s) in all)" if count > 1 else ""
        out.failures.append(Failure(rel, "detector_error", f"detector {pid} {message} in {qual}{more}; its results for this file are incomplete"))
    if any(h.body is None for h in out.hits):
        out.source = text  # only render_site (libcst) needs the whole file
    out.deferred = bool(module.__dict__.get("_npufuse_deferred"))
    return out


def _nesting_ok(text: str, lines: list[str]) -> bool:
    """``nesting.problem(text) is None`` (apply's refusal of a file libcst must not parse), where
    the fast replacement path needs it: a site of a refused file must go to render_site, whose
    TooDeep makes it a near miss with the reason. The measure runs at ~7 MB/s, half the cost of
    a whole scan, so it runs only where a physical line is at least ``LIMIT`` characters long:
    every level it counts (an indentation step, a bracket, a chain operator, an f-string bracket)
    takes at least one character of the logical line, so a statement on one shorter line cannot
    reach the limit. Not covered: an over-deep expression spread over many short lines (a
    thousand-term sum in brackets); apply still refuses that file, with the reason."""
    from npufuse.rewrite import nesting

    if max(map(len, lines), default=0) < nesting.LIMIT:
        return True
    return nesting.problem(text) is None


# A line holding only a backslash continuation: libcst drops it, so it cannot reproduce the file.
_LONE_BACKSLASH = re.compile(r"(?m)^[ \t\f]*\\(?:\r\n|\r|\n)")


def _apply_refuses(text: str) -> str:
    """Why ``npufuse apply`` would leave every site of this file unchanged, or "" — so the scan
    reports its findings as near misses instead of candidates apply never rewrites. Apply
    refuses a file libcst does not reproduce byte for byte or cannot parse; the one known cause
    of either in a file ``ast`` parses, a line holding only a backslash continuation, is found by
    a regex, and only a file that has one pays for the libcst parse that confirms it."""
    # (s50: a match holds a backslash right before a line end: without one, nothing to search)
    m = _LONE_BACKSLASH.search(text) if ("\\\n" in text or "\\\r" in text) else None
    if m is None:
        return ""
    from npufuse.rewrite.transform import dropped_final_break, parse_module

    line = text.count("\n", 0, m.start()) + 1
    try:
        same = dropped_final_break(text, parse_module(text)) is not None
    except Exception as exc:
        # libcst cannot parse it at all (such a line before an indented block leaves it without
        # the INDENT it expects): apply skips every site of the file, and the fast replacement
        # path never asks libcst, so the scan must say so here
        first = str(exc).splitlines()[0].rstrip(".") if str(exc) else ""
        return (f"apply cannot rewrite this file: libcst cannot parse it ({type(exc).__name__}: {first}; "
                f"line {line} holds only a backslash continuation); remove that line to make the site replaceable")
    if same:
        return ""
    return (f"apply cannot rewrite this file: libcst does not reproduce it byte for byte "
            f"(line {line} holds only a backslash continuation); remove that line to make the site replaceable")


def _finding_problem(f: Finding, pattern: Pattern, scope: Scope, n_lines: int) -> str | None:
    if f.pattern != pattern.id:
        return f"yielded a finding for pattern {f.pattern!r}"
    if not (isinstance(f.line, int) and isinstance(f.end_line, int) and 1 <= f.line <= f.end_line <= n_lines):
        return f"yielded an invalid span {f.line}-{f.end_line}"
    if not isinstance(f.fused, str) or not f.fused.strip() or not isinstance(f.guard_tensor, str) or not f.guard_tensor.strip():
        return f"yielded a finding without fused code or guard tensor (line {f.line})"
    if not _valid_span(scope, f.line, f.end_line):
        return f"yielded span {f.line}-{f.end_line}, which is not whole statements of one block"
    return None


def _near(rel: str, m: NearMiss) -> dict[str, Any]:
    return {"pattern": m.pattern, "file": rel, "qualname": m.qualname, "line": m.line, "end_line": m.end_line, "reason": m.reason}


# -- many files ---------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}

# s42: a forked pool worker keeps what each file's analysis built (the tree, the scopes, the
# detectors' per-file caches) alive instead of freeing it: deallocating them took ~5% of a
# worker's CPU on transformers (~0.36 s per half corpus), and a forked worker ends with
# os._exit, which frees nothing. Bounded by a budget of source bytes (an analysed file holds
# about 36 bytes of memory per byte of source): past it, files are freed as before.
_KEPT: list[ModuleInfo] = []
_KEEP_BUDGET = [0]  # source bytes this process may still keep; 0 outside forked pool workers
_KEPT_PER_SOURCE_BYTE = 40
_KEEP_TOTAL_BYTES = 1 << 30  # memory all workers together may hold this way (at most an eighth of the machine's)


def _keep_budget(jobs: int) -> int:
    """Source bytes each of ``jobs`` forked workers may keep alive (see ``_KEPT``)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0
    return min(_KEEP_TOTAL_BYTES, physical // 8) // (_KEPT_PER_SOURCE_BYTE * max(1, jobs))


def _keep_alive(module: ModuleInfo) -> None:
    """Keep ``module`` (and all its analysis reaches) alive for the life of this process, where
    the budget allows (see ``_KEPT``); the results are the same either way."""
    size = len(module.source)
    if 0 < size <= _KEEP_BUDGET[0]:  # (never with no budget: an empty file would freeze the parent's objects)
        _KEEP_BUDGET[0] -= size
        _KEPT.append(module)


def _init_worker(root: str, patterns: Sequence[Pattern], options: ScanOptions, cache: Any = None, stop: Any = None,
                 keep_budget: int = 0) -> None:
    _WORKER.update(root=Path(root), patterns=patterns, options=options, cache=cache, stop=stop, busy=False, interrupted=False)
    _KEEP_BUDGET[0] = keep_budget
    global _DEFERRING
    _DEFERRING = True
    # Ctrl-C in a terminal signals the whole process group, workers included: the file in hand
    # stops at once and no later one starts (see _analyze_all for a signal to the parent alone).
    # A worker waiting for work only takes note: a KeyboardInterrupt there would print a
    # traceback and break the pool.
    if hasattr(signal, "SIGINT"):
        signal.signal(signal.SIGINT, _worker_sigint)
    # A parent that dies without shutting the pool down (SIGTERM from `timeout` or a CI runner,
    # SIGKILL) would leave the workers waiting for work forever, holding its stdout open (so
    # whoever reads it hangs too): each worker leaves once its parent is gone.
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), name="npufuse-parent-watch", daemon=True).start()
    # Everything the worker holds now (inherited at fork: the detectors' modules, their tables)
    # lives as long as the worker: out of the cyclic collector's reach, a full collection does
    # not traverse it again (about a third of a worker's collector time on a full scan).
    gc.freeze()


def _exit_with_parent(sentinel: int) -> None:
    from multiprocessing.connection import wait

    wait([sentinel])  # readable once the parent process has ended
    os._exit(1)  # nobody is left to read this worker's results; cache entries are whole or absent


def _worker_sigint(signum: int, frame: Any) -> None:
    _WORKER["interrupted"] = True  # only a flag: `stop` takes a lock this thread may hold
    if _WORKER.get("busy"):
        raise KeyboardInterrupt


def _worker_stopped() -> bool:
    stop = _WORKER.get("stop")
    return bool(_WORKER.get("interrupted")) or (stop is not None and stop.is_set())


# A detector about to pay for a heavy import in a pool worker (the numeric probe's torch: about
# 2-3 s of CPU per process, more than the analysis of hundreds of files) leaves that file to the
# parent instead: every worker would otherwise pay the import once, the parent pays it once for
# the scan, and analyses the few such files again while the workers go on with the rest.
_DEFERRING = False  # True in pool workers


class LeftToParent(BaseException):
    """Raised by :func:`defer_import` in a pool worker. Inside a detector call the engine's loop
    catches it: that call is left to the parent (``FileOutcome.pending``) and the rest of the file
    is analysed; anywhere else the analysis of this file stops at once and :func:`analyze_file`
    returns an outcome marked ``deferred`` (nothing else in it). A BaseException, so that the
    detectors' and the engine's ``except Exception`` (which turn a detector's crash into a
    reported problem) let it through."""


def defer_import(module: ModuleInfo, name: str) -> bool:
    """Should a detector skip the part of its work that imports ``name`` in this process? False
    outside pool workers and where ``name`` is imported already. In a pool worker without it the
    file is marked and :class:`LeftToParent` is raised: the worker leaves that detector call (or
    the file) to the parent, where this returns False (:func:`finish_deferred`); such an outcome is
    not cached by the worker."""
    if not _DEFERRING or name in sys.modules:
        return False
    module.__dict__["_npufuse_deferred"] = True
    raise LeftToParent(name)


def finish_deferred(root: Path, outcome: FileOutcome, patterns: Sequence[Pattern], options: ScanOptions) -> FileOutcome:
    """The outcome a worker left to this process (``deferred``), complete: where the worker left
    only some detector calls (``pending``), the file is parsed again and just those calls run,
    their results put where the worker's loop would have put them; otherwise (a deferral outside
    a detector call, a file changed since, a call that fails here) the whole file is analysed."""
    if not outcome.pending:
        return analyze_file(root, outcome.file, patterns, options)
    only: dict[tuple[int, int], list[tuple[int, int]]] = {(si, k): [] for si, k, _h, _n in outcome.pending}
    enabled = gc.isenabled()
    gc.disable()  # as analyze_file
    try:
        part = _analyze_file(root, outcome.file, patterns, options, only)
    finally:
        if enabled:
            gc.enable()
    if part.sha256 != outcome.sha256 or part.failures or part.deferred or any(len(v) != 1 for v in only.values()):
        return analyze_file(root, outcome.file, patterns, options)
    hits, near = list(outcome.hits), list(outcome.near_misses)
    h0 = n0 = 0  # where the previous call's results ended in ``part``
    added_h = added_n = 0
    for si, k, at_h, at_n in outcome.pending:  # in the worker's order: each insertion shifts the later ones
        h1, n1 = only[(si, k)][0]
        hits[at_h + added_h:at_h + added_h] = part.hits[h0:h1]
        near[at_n + added_n:at_n + added_n] = part.near_misses[n0:n1]
        added_h += h1 - h0
        added_n += n1 - n0
        h0, n0 = h1, n1
    outcome.hits, outcome.near_misses = hits, near
    if part.source is not None:
        outcome.source = part.source  # a spliced hit needs render_site (libcst): the whole file
    outcome.deferred, outcome.pending = False, []
    return outcome


def _analyze_and_store(root: Path, rel: str, patterns: Sequence[Pattern], options: ScanOptions, cache: Any,
                       deferred: FileOutcome | None = None) -> FileOutcome:
    """analyze_file, or ``deferred`` finished (:func:`finish_deferred`), cached unless still deferred."""
    outcome = analyze_file(root, rel, patterns, options) if deferred is None else finish_deferred(root, deferred, patterns, options)
    if outcome.deferred and outcome.pending:
        outcome.worker_read_others = repo_facts.reads_other_files(root, rel)  # (this process's record: the parent's lacks it)
    elif cache is not None and not outcome.deferred and not outcome.worker_read_others and not repo_facts.reads_other_files(root, rel):
        # (an outcome that read other files of the repo is not cached: the entry is keyed by this file's content only)
        cache.put(outcome)  # in the worker: writing entries is spread over the cores too
    return outcome


def _analyze_batch(batch: list[str]) -> list[FileOutcome]:
    out: list[FileOutcome] = []
    _WORKER["busy"] = True
    try:
        for rel in batch:
            if _worker_stopped():
                raise KeyboardInterrupt  # the scan was interrupted: the outcomes so far are cached
            out.append(_analyze_and_store(_WORKER["root"], rel, _WORKER["patterns"], _WORKER["options"], _WORKER.get("cache")))
    finally:
        _WORKER["busy"] = False
    return out


@contextlib.contextmanager
def _sigint_noted() -> Iterator[list[int]]:
    """A list that holds SIGINT once one arrived inside the block. Python runs a signal's handler
    at the next bytecode, and when that lies in an at-fork callback (``os.fork`` runs them;
    ``logging`` registers one) the KeyboardInterrupt is printed as "Exception ignored" and
    dropped: a Ctrl-C while the pool forks its workers would be lost and the scan run to the end.
    Only where Python's own handler is in place (and in the main thread, the only one that may
    set handlers); an ignored SIGINT stays ignored."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield noted
        return

    def handler(signum: int, frame: Any) -> None:
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def _pool_context():
    import multiprocessing

    # fork: workers inherit the loaded patterns (also ones registered in-process, e.g. by tests)
    # and skip re-importing; elsewhere the platform default (spawn) pickles them.
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


def _analyze_all(root: Path, files: list[str], patterns: Sequence[Pattern], options: ScanOptions, jobs: int | None, progress: Callable[[int, int], None] | None, cache: Any = None, digests: dict[str, str] | None = None,
                 while_waiting: Callable[[], None] | None = None, reuse: bool = True) -> list[FileOutcome]:
    """Every file's outcome, in ``files`` order: from ``cache`` where it has one, else analysed
    (in a pool for many files) and stored there. ``digests``: the files' content digests already
    taken (:func:`gather_inputs`), so cache lookups need not read the files again. ``reuse``
    False: the cache is known to hold nothing (a cold scan), so it is only written."""
    total = len(files)
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    repo_facts.reset()  # other files of the repo read by detectors: read afresh by each scan
    results: dict[str, FileOutcome] = {}
    done = 0
    if cache is not None and reuse:
        # Hits are looked up here, before any pool starts: a warm scan never forks.
        from npufuse.scan.cache import lookup

        get = cache.get
        for rel in files:
            if digests is None:
                hit = lookup(cache, root, rel, options.max_file_bytes)
            else:
                digest = digests.get(rel)  # absent: unreadable; "size:": too large (analysis reports both)
                hit = get(rel, digest) if digest is not None and not digest.startswith("size:") else None
            if hit is not None:
                results[rel] = hit
                done += 1
                if progress:
                    progress(done, total)
    todo = [rel for rel in files if rel not in results]
    if jobs > 1 and len(todo) >= PARALLEL_MIN_FILES:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed  # only a scan that parses pays for it

        # Small batches, largest files first: both cores stay busy to the end.
        order = sorted(todo, key=lambda r: _size(root / r), reverse=True)
        size = max(1, min(16, len(todo) // (jobs * 12)))
        batches = [order[i:i + size] for i in range(0, len(todo), size)]
        try:
            forked = _pool_context()
            context = forked or multiprocessing.get_context()
            stop = context.Event()  # set when the scan is interrupted: running batches stop after their file in hand
            # only a forked worker ends without freeing what it keeps (os._exit)
            keep = _keep_budget(jobs) if forked is not None else 0
            with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker, initargs=(str(root), patterns, options, cache, stop, keep)) as ex:
                try:
                    with _sigint_noted() as noted:  # the first submit forks the workers
                        futures = [ex.submit(_analyze_batch, b) for b in batches]
                    if noted:
                        raise KeyboardInterrupt  # it landed in a fork callback, which dropped it
                    if while_waiting is not None:
                        try:
                            while_waiting()
                        except Exception:  # only a head start: whoever needs it later does it again
                            pass
                    for fut in as_completed(futures):
                        for outcome in fut.result():
                            if outcome.deferred:  # its costly part left to this process (defer_import)
                                outcome = _analyze_and_store(root, outcome.file, patterns, options, cache, outcome)
                            results[outcome.file] = outcome
                            done += 1
                            if progress:
                                progress(done, total)
                except (KeyboardInterrupt, SystemExit):
                    # Stop soon: the workers finish the file in hand, the batches not handed out
                    # never start (leaving the `with` would otherwise analyse the whole rest of
                    # the tree first). Entries already cached stay: the next scan reuses them.
                    # wait=True: the interpreter's exit joins the pool's manager thread anyway, and
                    # after shutdown(wait=False) that exit raced the thread closing its wakeup pipe
                    # ("Exception ignored in <module 'threading'>: OSError: [Errno 9]" on stderr).
                    stop.set()
                    ex.shutdown(wait=True, cancel_futures=True)
                    raise
        except Exception:  # a broken pool (unpicklable pattern, killed worker): finish in-process
            pass
    for rel in files:
        if rel not in results:
            results[rel] = _analyze_and_store(root, rel, patterns, options, cache)
            done += 1
            if progress:
                progress(min(done, total), total)
    return [results[rel] for rel in files]


def _open_cache(cache_dir: str | os.PathLike[str] | None, patterns: Sequence[Pattern], options: ScanOptions) -> Any:
    if cache_dir is None:
        return None
    from npufuse.scan.cache import ScanCache, fingerprint

    key = fingerprint(patterns, options)
    return ScanCache(cache_dir, key) if key is not None else None  # None: a detector we cannot hash


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# -- the result ----------------------------------------------------------------------------------


@dataclass
class ScanResult:
    root: str
    files_scanned: int
    lines_scanned: int
    files_failed: list[Failure]
    candidates: list[dict[str, Any]]
    near_misses: list[dict[str, Any]]
    existing: list[dict[str, Any]]
    switches: list[dict[str, Any]]
    patterns: list[str]
    patterns_missing: list[str]
    skipped: list[dict[str, str]]
    shape_sources: list[dict[str, Any]]
    training: list[str]
    suggested_order: list[int]
    assumptions: dict[str, Any]
    # Not part of scan.json: how this result was obtained ({"files", "from_cache", "analyzed"}),
    # and the digest of every input (ScanInputs.key) when no file changed while the scan ran.
    stats: dict[str, int] = field(default_factory=dict)
    run_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        """scan.json (DESIGN.md), fields in the documented order, then npufuse's extras."""
        return {
            "tool": "npufuse",
            "version": __version__,
            "root": self.root,
            "files_scanned": self.files_scanned,
            "files_failed": [f.to_json() for f in self.files_failed],
            "candidates": self.candidates,
            "near_misses": self.near_misses,
            "existing": self.existing,
            "switches": self.switches,
            "lines_scanned": self.lines_scanned,
            "patterns": self.patterns,
            "patterns_missing": self.patterns_missing,
            "skipped": self.skipped,
            "shape_sources": self.shape_sources,
            "training": self.training,
            "suggested_order": self.suggested_order,
            "assumptions": self.assumptions,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"


def registry_patterns() -> tuple[Pattern, ...]:
    """The installed detectors (a seam tests replace with fakes)."""
    from npufuse.patterns.registry import all_patterns

    return all_patterns()


def select_patterns(only: Iterable[str] | None, patterns: Sequence[Pattern] | None = None) -> tuple[list[Pattern], list[str]]:
    """(patterns to run, ids asked for that have no detector in this build)."""
    from npufuse.patterns.registry import PATTERN_IDS

    available = list(patterns) if patterns is not None else list(registry_patterns())
    if only is None:
        return available, sorted(set(PATTERN_IDS) - {p.id for p in available}, key=PATTERN_IDS.index) if patterns is None else []
    wanted = [w.strip() for w in only if w.strip()]
    known = set(PATTERN_IDS) | {p.id for p in available}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UnknownPatternError(f"unknown pattern id {', '.join(repr(u) for u in unknown)}; known ids: {', '.join(sorted(known))}")
    chosen = [p for p in available if p.id in wanted]
    missing = [w for w in wanted if w not in {p.id for p in available}]
    return chosen, missing


def with_site_sharers(chosen: list[Pattern], patterns: Sequence[Pattern] | None = None) -> tuple[list[Pattern], list[str] | None]:
    """(the detectors to run, the ids to report or None for all of them): ``chosen`` plus the
    patterns they share sites with (Pattern.SHARES_SITES_WITH), in the registry's order. A gated
    product that swiglu's and geglu's one reader gives to geglu (its activation defaults to GELU) but
    dispatches to npu_swiglu as well is found by ``--only swiglu`` too, as by a scan of every pattern."""
    available = list(patterns) if patterns is not None else list(registry_patterns())
    ids = {p.id for p in chosen}
    wanted = ids | {s for p in chosen for s in p.SHARES_SITES_WITH}
    if wanted == ids:
        return chosen, None
    added = [p for p in available if p.id in wanted - ids]
    run = [p for p in available if p.id in ids or p in added] + [p for p in chosen if p not in available]
    return run, [p.id for p in chosen]


def _root_label(target: Path) -> str:
    base = target if target.is_dir() else target.parent
    text = os.path.normpath(str(base))
    return text.replace(os.sep, "/")


_DATA_FILE_MAX_BYTES = 1 << 20  # config_shapes.load_data_file's default limit


@dataclass
class ScanInputs:
    """Everything a scan reads, gathered before anything is parsed (:func:`gather_inputs`)."""

    target: Path
    walked: WalkResult
    chosen: list[Pattern]
    missing: list[str]
    options: ScanOptions
    switch_mode: str
    overrides: dict[str, Any]
    cache: Any = None  # a ScanCache, or None: no cache
    digests: dict[str, str] = field(default_factory=dict)  # rel -> cache.file_digest, Python and data files (with a cache only)
    key: str | None = None  # cache.run_key over all of the above; None: no cache, or an input that cannot be keyed
    # The cache holds nothing yet (no entry, no run record): nothing can be reused, so the Python
    # files are not hashed up front (the workers hash what they read anyway); run_scan keys the
    # result from the outcomes' digests instead, the same key gather_inputs would have made.
    cold: bool = False
    # s38: the ids ``only`` chose when detectors sharing their sites were added to ``chosen``
    # (with_site_sharers): the result keeps what concerns these; None: every chosen pattern
    asked: list[str] | None = None


def gather_inputs(
    root: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    patterns: Sequence[Pattern] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    switch_mode: str = "auto",
    overrides: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    include_tests: bool = False,
    optimizer_zero_grad_in_place: bool = False,
) -> ScanInputs:
    """Walk (tests/examples/tutorials folders only with ``include_tests``), choose the detectors and, with a cache, hash every file the scan will read and key
    the lot (the run key: equal keys mean equal scan results). Raises like :func:`scan_repo`."""
    target = Path(root)
    if not target.exists() and not target.is_symlink():
        raise FileNotFoundError(f"{root}: no such file or folder")
    chosen, missing = select_patterns(only, patterns)
    chosen, asked = with_site_sharers(chosen, patterns) if only is not None else (chosen, None)
    options = ScanOptions(max_file_bytes=max_file_bytes, optimizer_zero_grad_in_place=optimizer_zero_grad_in_place)
    # a detector's own reading of the options (a configured copy: the registry's instance is shared)
    chosen = [p.with_scan_options(options) if hasattr(p, "with_scan_options") else p for p in chosen]
    walked = walk(target, include_tests=include_tests)
    overrides = dict(overrides or {})
    inputs = ScanInputs(target, walked, chosen, missing, options, switch_mode, overrides, _open_cache(cache_dir, chosen, options), asked=asked)
    if inputs.cache is None:
        return inputs  # nothing to look up: analyze_file hashes what it reads itself
    from npufuse.scan.cache import file_digest

    base = walked.root
    inputs.cold = inputs.cache.is_empty()
    keyable = True
    if not inputs.cold:
        for rel in walked.files:
            digest = file_digest(base / rel, max_file_bytes)
            if digest is None:
                keyable = False  # an unreadable file's error text is not keyed: scan it in full
            else:
                inputs.digests[rel] = digest
    for rel in walked.data_files:
        # over load_data_file's size limit the content is not read: its size stands in (and a
        # changed limit is a changed npufuse source, which the key covers)
        digest = file_digest(base / rel, _DATA_FILE_MAX_BYTES)
        if digest is None:
            keyable = False
        else:
            inputs.digests[rel] = digest
    if keyable and not inputs.cold:
        inputs.key = _run_key(inputs)
    return inputs


def _run_key(inputs: ScanInputs) -> str | None:
    """cache.run_key over every input of the scan, the file digests included."""
    from npufuse.scan.cache import run_key

    walked = inputs.walked
    return run_key(inputs.cache.fingerprint, (
        _root_label(inputs.target), inputs.target.is_dir(), [p.id for p in inputs.chosen], inputs.asked, inputs.missing, inputs.switch_mode,
        sorted(inputs.overrides.items()), walked.files, walked.data_files, [f.to_json() for f in walked.failed], walked.skipped,
        sorted(inputs.digests.items()),
    ))


def _key_from_outcomes(inputs: ScanInputs, outcomes: list[FileOutcome]) -> str | None:
    """For a cold scan (``inputs.cold``): the run key gather_inputs would have made, from the
    digests of what the analysis read (file_digest's: the content sha256, "size:N" for a file
    over the limit). None where gather_inputs would have given none: a file it could not read."""
    from npufuse.scan.cache import file_digest

    base, limit = inputs.walked.root, inputs.options.max_file_bytes
    for o in outcomes:
        if o.sha256 is not None:
            inputs.digests[o.file] = o.sha256
            continue
        digest = file_digest(base / o.file, limit)  # too large or unreadable (rare): as gather_inputs
        if digest is None or not digest.startswith("size:"):
            return None  # unreadable, or readable now but not when analysed: not keyed
        inputs.digests[o.file] = digest
    if any(rel not in inputs.digests for rel in inputs.walked.data_files):
        return None
    return _run_key(inputs)


def scan_repo(
    root: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    patterns: Sequence[Pattern] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    jobs: int | None = None,
    switch_mode: str = "auto",
    overrides: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    include_tests: bool = False,
    optimizer_zero_grad_in_place: bool = False,
) -> ScanResult:
    """Scan a folder or one file. Raises FileNotFoundError for a missing ``root`` and
    :class:`UnknownPatternError` for an unknown id in ``only``; everything else is reported in
    the result. ``overrides`` (e.g. ``{"batch_size": 8}``) beat shapes read from the repo.
    ``cache_dir``: reuse and store per-file results there (:mod:`npufuse.scan.cache`); None: no cache."""
    inputs = gather_inputs(root, only=only, patterns=patterns, max_file_bytes=max_file_bytes, switch_mode=switch_mode, overrides=overrides, cache_dir=cache_dir,
                           include_tests=include_tests, optimizer_zero_grad_in_place=optimizer_zero_grad_in_place)
    return run_scan(inputs, jobs=jobs, progress=progress)


def run_scan(inputs: ScanInputs, *, jobs: int | None = None, progress: Callable[[int, int], None] | None = None,
             while_waiting: Callable[[], None] | None = None) -> ScanResult:
    """The scan of :func:`gather_inputs`' inputs (per-file results from its cache where it has them).
    ``while_waiting``: called once while a process pool analyses the files (this process would
    only wait): the caller's own preparation, e.g. loading the report template, off the tail."""
    target, walked, chosen, missing, options = inputs.target, inputs.walked, inputs.chosen, inputs.missing, inputs.options
    switch_mode, overrides, max_file_bytes = inputs.switch_mode, inputs.overrides, options.max_file_bytes
    cache = inputs.cache
    hits_before = cache.hits if cache is not None else 0
    # a cold cache has nothing to look up: the files go straight to the analysis
    outcomes = _analyze_all(walked.root, walked.files, chosen, options, jobs, progress, cache, inputs.digests if cache is not None else None, while_waiting,
                            reuse=not inputs.cold)
    if inputs.cold and cache is not None:
        inputs.key = _key_from_outcomes(inputs, outcomes)
    from_cache = cache.hits - hits_before if cache is not None else 0

    failed: list[Failure] = list(walked.failed)
    near: list[dict[str, Any]] = []
    existing: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = []
    sources: list[config_shapes.ConfigSource] = []
    training: list[str] = []
    amp: list[str] = []
    bf16 = False
    scanned = lines = 0
    for o in outcomes:
        failed += o.failures
        near += o.near_misses
        if o.parsed:
            scanned += 1
            lines += o.lines
        if o.facts is not None:
            existing += o.facts.existing
            switches += o.facts.switches
            sources += o.facts.config_sources
            training += o.facts.training
            amp += getattr(o.facts, "amp", [])  # a cached FileFacts of an older npufuse has none
            bf16 = bf16 or o.facts.bf16
    for rel in walked.data_files:
        src, found = config_shapes.load_data_file(walked.root, rel)
        if src is not None:
            sources.append(src)
            bf16 = bf16 or str(src.values.get("torch_dtype", "")).lower() in ("bfloat16", "bf16")
        switches += found

    # facts from other files of the repo (a trainer elsewhere driving an optimizer built here)
    try:
        repo_facts.apply(walked.root, walked.files, outcomes, near, max_file_bytes, zero_in_place=options.optimizer_zero_grad_in_place)
    finally:
        repo_symbols.forget()  # the cross-file passes' shared index lives for this scan only
    # s41: a repository that runs code under forward-mode AD / a functorch transform (every fused branch falls back there)
    forward_ad.apply(outcomes, near, walked.root, walked.files)
    existing.sort(key=lambda e: (e["file"], e["line"], e["what"]))
    switches.sort(key=lambda s: (s["file"], s["line"], s["name"], s["kind"]))
    near.sort(key=lambda m: (m["file"], m["line"], m["pattern"], m["reason"]))
    failed.sort(key=lambda f: (f.file, f.kind, f.error))
    sources.sort(key=lambda s: (s.file, s.line, s.kind))
    by_id = {p.id: p for p in chosen}
    if inputs.asked is not None:
        # detectors run only for the sites they share with an asked one: their own reports are left out
        near = [m for m in near if m["pattern"] in inputs.asked]
    candidates = _candidates(outcomes, by_id, switches, existing, sources, training, bf16, switch_mode, overrides or {}, failed, near, walked.root, sorted(amp),
                             asked=inputs.asked)
    failed.sort(key=lambda f: (f.file, f.kind, f.error))
    near.sort(key=lambda m: (m["file"], m["line"], m["pattern"], m["reason"]))
    return ScanResult(
        stats={"files": len(outcomes), "from_cache": from_cache, "analyzed": len(outcomes) - from_cache},
        run_key=inputs.key if inputs.key is not None and _unchanged(inputs, outcomes) else None,
        root=_root_label(target),
        files_scanned=scanned,
        lines_scanned=lines,
        files_failed=failed,
        candidates=candidates,
        near_misses=near,
        existing=existing,
        switches=switches,
        patterns=list(inputs.asked) if inputs.asked is not None else [p.id for p in chosen],
        patterns_missing=missing,
        skipped=walked.skipped,
        shape_sources=[s.to_json() for s in sources],
        training=sorted(training, key=lambda t: (t.rsplit(":", 2)[0], int(t.rsplit(":", 2)[1])))[:5],
        suggested_order=suggested_order(candidates),
        assumptions={
            "defaults": dict(config_shapes.DEFAULT_ASSUMPTIONS),
            "overrides": {k: v for k, v in (overrides or {}).items() if v is not None},
            "hardware": "Atlas A2 (910B) roofline figures (npufuse.scan.value)",
            "switch_mode": switch_mode,
            "max_file_bytes": max_file_bytes,
            # present only when asked for: scans without the option keep their earlier scan.json
            **({"optimizer_zero_grad_in_place": True} if options.optimizer_zero_grad_in_place else {}),
        },
    )


def _unchanged(inputs: ScanInputs, outcomes: list[FileOutcome]) -> bool:
    """Whether the files the scan read are those :func:`gather_inputs` hashed: a file edited in
    between would file this result under a key that names other content."""
    digests = inputs.digests
    for o in outcomes:
        digest = digests.get(o.file)
        if digest is None:
            continue
        if (o.sha256 is not None) if digest.startswith("size:") else (o.sha256 != digest):
            return False  # too large when hashed, read in full now (or the reverse), or new content
    if inputs.walked.data_files:  # load_data_file read them again: they must still be the hashed ones
        from npufuse.scan.cache import file_digest

        base = inputs.walked.root
        return all(file_digest(base / rel, _DATA_FILE_MAX_BYTES) == digests.get(rel) for rel in inputs.walked.data_files)
    return True


def _concerns(finding: Finding, asked: list[str]) -> bool:
    """The finding is of an asked pattern, or its run-time dispatch may run one (``dispatches_to``)."""
    covers = finding.params.get("dispatches_to") if isinstance(finding.params, dict) else None
    return finding.pattern in asked or any(p in asked for p in (covers or ()) if isinstance(p, str))


def _candidates(
    outcomes: list[FileOutcome],
    patterns: dict[str, Pattern],
    switches: list[dict[str, Any]],
    existing: list[dict[str, Any]],
    sources: list[config_shapes.ConfigSource],
    training: list[str],
    bf16: bool,
    switch_mode: str,
    overrides: dict[str, Any],
    failed: list[Failure],
    near: list[dict[str, Any]],
    root: Path,
    amp: list[str] = (),  # type: ignore[assignment]
    asked: list[str] | None = None,
) -> list[dict[str, Any]]:
    order = {pid: i for i, pid in enumerate(patterns)}
    hits = [(o, h) for o in outcomes for h in o.hits if asked is None or _concerns(h.finding, asked)]
    hits.sort(key=lambda oh: (oh[0].file, oh[1].finding.line, oh[1].finding.end_line, order.get(oh[1].finding.pattern, 99), oh[1].finding.pattern))
    wrappers = [e for e in existing if e.get("api")]
    keys: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    shapes_memo: dict[str, dict[str, Any]] = {}
    nearest: _NearestSources | None = None
    # Per pattern, the switches relevant to it at all: choose_switch would rate every switch of
    # the repo for every candidate; it drops the irrelevant ones and sorts the rest with a total
    # key, so giving it only those (in the same order) chooses the same switch.
    relevant_switches: dict[str, list[dict[str, Any]]] = {}
    # A repo switch guards only sites in its scope (repo_search.SwitchSite): torch_npu code in a
    # folder is what lets a bare `enable_fusion` there count as a kernel switch; the prelude of
    # an npufuse-rewritten file (it imports torch_npu) is no such evidence.
    rewritten = {e["file"] for e in existing if e.get("kind") == "npufuse_site"}
    npu_folders = frozenset(e["file"].rpartition("/")[0] for e in existing if e.get("kind") != "npufuse_site" and e["file"] not in rewritten)
    sites: dict[str, repo_search.SwitchSite] = {}
    n = 0
    for o, h in hits:
        f = h.finding
        pattern = patterns[f.pattern]
        usable = relevant_switches.get(f.pattern)
        if usable is None:
            usable = relevant_switches[f.pattern] = [s for s in switches if repo_search.switch_relevance(f.pattern, s["name"])]
        site = sites.get(o.file)
        if site is None:
            site = sites[o.file] = repo_search.SwitchSite(o.file, frozenset(o.facts.imports if o.facts is not None else ()), npu_folders)
        switch, reused, notes = repo_search.choose_switch(f.pattern, h.context, usable, switch_mode, site)
        try:
            # n + 1: the id this candidate gets when it renders (its per-candidate switch)
            text = replacement.render(o.source if o.source is not None else (lambda o=o: _reread(root, o)), f, switch, h.body, n + 1)
        except Exception as exc:  # codegen cannot rewrite this site: a near miss, with the reason
            reason = f"npufuse could not generate the replacement ({type(exc).__name__}: {exc})"
            near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line, "reason": reason})
            failed.append(Failure(o.file, "render_error", f"{f.pattern} at line {f.line}: {reason}"))
            continue
        n += 1
        key = f"{f.pattern}@{o.file}:{f.qualname}"
        keys[key] = keys.get(key, 0) + 1
        if keys[key] > 1:
            key = f"{key}#{keys[key]}"
        folder = o.file.rsplit("/", 1)[0] if "/" in o.file else ""
        if folder not in shapes_memo:  # one lookup per folder: shapes_for sorts sources by distance to the file's folder
            if nearest is None:
                nearest = _NearestSources(sources, overrides)
            shapes_memo[folder] = config_shapes.shapes_for(o.file, nearest.used(o.file) if _NEAREST else sources, overrides)
        shapes = _copy_plain(shapes_memo[folder])
        value = _assess(pattern, f, config_shapes.plain_config(shapes), o.file, failed)
        generic = h.local_risks + risks.repo_risks(f, pattern, training=training, bf16=bf16,
                                                           # a local autocast risk (the site's own region) says it more precisely
                                                           amp=() if any(r.get("kind") == "autocast" for r in h.local_risks) else amp)
        merged = risks.merge(risks.detector_risks(f), generic)
        related = [{"file": e["file"], "line": e["line"], "what": e["what"]} for e in wrappers if e.get("api") == pattern.api]
        out.append({
            "id": n,
            "key": key,
            "pattern": f.pattern,
            # the API this site is rewritten to (a fused optimizer's class follows the constructor: NpuFusedSGD for SGD)
            "api": str(f.params.get("fused_class") or pattern.api),
            "file": o.file,
            "qualname": f.qualname,
            "line": f.line,
            "end_line": f.end_line,
            "confidence": f.confidence,
            "params": f.params,
            "value": value,
            "risks": merged,
            "replacement": text,
            "title": getattr(pattern, "title", f.pattern),
            "variant": f.variant,
            "notes": [str(x) for x in f.notes] + notes,
            "training_ok": bool(f.training_ok and pattern.training_ok),
            "fused": f.fused,
            "guard_tensor": f.guard_tensor,
            "switch": repo_search.switch_json(switch, reused),
            "code": h.code,
            "file_sha256": o.sha256,
            "shapes": shapes,
            "related_existing": related,
            "risk_level": "none",
        })
    _mark_overlaps(out)
    for c in out:
        c["risk_level"] = risks.overall_level(c["risks"])
    return out


_NEAREST = True  # tests switch it off to compare


class _NearestSources:
    """For one folder, the shape sources ``config_shapes.shapes_for`` takes a value from.

    shapes_for sorts every source by (distance of its folder to the file's folder, kind rank,
    file, line) and skips each source whose keys are all set already -- so, handed only the
    sources it does not skip, in any order, it returns the same. Sorting all of a large repo's
    sources once per folder of candidates (hundreds of folders by hundreds of sources) was
    most of the time the scan spent after the pool; here the folder-independent part of the
    order is sorted once, and per folder only the first source holding each key is looked for
    (:meth:`used`) rather than every source sorted by distance (:meth:`used_by_sorting`, which
    it replaces: ties between equal distances keep the folder-independent order in both). The
    distance is shapes_for's own (config_shapes.folder_distance); tests compare all three."""

    def __init__(self, sources: list[config_shapes.ConfigSource], overrides: dict[str, Any]) -> None:
        rank = config_shapes.KIND_RANK
        self.order = sorted(sources, key=lambda s: (rank.get(s.kind, 9), s.file, s.line))
        folders: dict[tuple[str, ...], int] = {}
        self.src_folder = [folders.setdefault(config_shapes._folder(s.file), len(folders)) for s in self.order]
        self.folders = list(folders)
        self.heads = [t[0] if t else None for t in self.folders]
        self.preset = frozenset(k for k, v in overrides.items() if v is not None)
        self.all_keys = set(self.preset).union(*(s.values.keys() for s in self.order))
        # used() takes, for each key, the first source holding it in distance order (see there).
        # A source whose folder starts with another top folder than the file's (most of them, in
        # a repo of many model folders) lies at 100 + len(file's folder) + len(its folder)
        # (config_shapes.folder_distance's first case): for
        # every such file the same order, by its folder's depth, listed here once per key. The
        # few others (the file's own top folder, the root) get their distance worked out per file.
        self.head_of = [self.heads[f] for f in self.src_folder]
        self.depth_of = [len(self.folders[f]) for f in self.src_folder]
        by_depth = sorted(range(len(self.order)), key=lambda i: (self.depth_of[i], i))
        self.holding: dict[str, list[int]] = {}  # key -> the sources that have it, by (depth, index)
        for i in by_depth:
            for k in self.order[i].values:
                self.holding.setdefault(k, []).append(i)
        self.near: dict[str | None, list[int]] = {}  # top folder (None: the root) -> its sources
        for i, h in enumerate(self.head_of):
            self.near.setdefault(h, []).append(i)

    def used(self, file: str) -> list[config_shapes.ConfigSource]:
        """What :meth:`used_by_sorting` returns. Walking the sources in (distance, index) order,
        a source is taken iff it holds a key that neither the overrides nor an earlier source
        hold: exactly the first source holding each key. So the first per key is found, and the
        few found are put in that order."""
        here = config_shapes._folder(file)
        n, head = len(here), (here[0] if here else None)
        order, folders, src_folder = self.order, self.folders, self.src_folder
        preset = self.preset
        first: dict[str, tuple[int, int]] = {}
        for h in {head, None}:
            for i in self.near.get(h, ()):
                rank = (config_shapes.folder_distance(here, folders[src_folder[i]]), i)
                for k in order[i].values:
                    if k not in preset and (k not in first or rank < first[k]):
                        first[k] = rank
        head_of, depth_of = self.head_of, self.depth_of
        for k, holders in self.holding.items():
            if k in preset:
                continue
            for i in holders:
                h = head_of[i]
                if h is not None and h != head:  # the nearest of the foreign sources holding k
                    rank = (100 + n + depth_of[i], i)
                    if k not in first or rank < first[k]:
                        first[k] = rank
                    break
        return [order[i] for _d, i in sorted(set(first.values()))]

    def used_by_sorting(self, file: str) -> list[config_shapes.ConfigSource]:
        """:meth:`used`, the plain way (tests compare both): every source sorted by distance,
        each taken while it adds a key."""
        here = config_shapes._folder(file)
        dist = [config_shapes.folder_distance(here, self.folders[f]) for f in self.src_folder]
        have = set(self.preset)
        out = []
        for i in sorted(range(len(self.order)), key=dist.__getitem__):
            keys = self.order[i].values.keys()
            if have >= keys:
                continue
            have.update(keys)
            out.append(self.order[i])
            if len(have) == len(self.all_keys):
                break  # every key is set: shapes_for skips all the rest
        return out


def _copy_plain(value: Any) -> Any:
    """copy.deepcopy for JSON-like data (dicts, lists, scalars), several times faster; anything
    else is deep-copied as before. Each candidate keeps its own shapes, sharing no dict with
    another candidate's (anyone editing one candidate's data must not change the others')."""
    t = type(value)
    if t is dict:
        return {k: _copy_plain(v) for k, v in value.items()}
    if t is list:
        return [_copy_plain(v) for v in value]
    if t is str or t is int or t is float or t is bool or value is None:
        return value
    return copy.deepcopy(value)


def _reread(root: Path, o: FileOutcome) -> str:
    """The file's text again (for the rare site the fast renderer leaves to libcst)."""
    text, sha, failure = read_source(root / o.file, o.file, 1 << 62)
    if failure is not None or text is None:
        raise OSError(failure.error if failure else "unreadable")
    if sha != o.sha256:
        raise OSError("the file changed during the scan")
    return text


def _assess(pattern: Pattern, finding: Finding, config: dict[str, Any], rel: str, failed: list[Failure]) -> dict[str, Any]:
    try:
        value = pattern.assess(finding, config)
        if not isinstance(value, dict):
            raise TypeError(f"returned {type(value).__name__}, not a dict")
    except Exception as exc:
        failed.append(Failure(rel, "assess_error", f"{pattern.id}.assess raised {type(exc).__name__}: {exc} (at {_where(exc)}) for line {finding.line}"))
        return {"bound": getattr(pattern, "bound", "memory"), "estimate": f"no estimate: the assessment failed ({type(exc).__name__})", "speedup_bound": None, "verdict": "unknown"}
    value = _jsonable(value)
    value.setdefault("bound", getattr(pattern, "bound", "memory"))
    value.setdefault("estimate", "")
    return value


def _mark_overlaps(cands: list[dict[str, Any]]) -> None:
    by_file: dict[str, list[dict[str, Any]]] = {}
    for c in cands:
        by_file.setdefault(c["file"], []).append(c)
    for group in by_file.values():
        for a in group:
            for b in group:
                if a is not b and a["line"] <= b["end_line"] and b["line"] <= a["end_line"]:
                    a["risks"].append(risks.risk("other", f"overlaps candidate {b['id']} ({b['pattern']}, lines {b['line']}-{b['end_line']}): accept only one of them", level="medium"))


def suggested_order(cands: list[dict[str, Any]]) -> list[int]:
    """Low risk first; within a risk level the largest measured time first (when a profile was
    joined), then the largest roofline speed-up bound (symbolic estimates after numeric ones);
    then higher confidence; then id. Stable by construction."""

    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        level = risks.overall_level(c["risks"])
        measured = (c.get("profile") or {}).get("time_us")
        has_time = isinstance(measured, (int, float)) and measured > 0
        bound = c["value"].get("speedup_bound") if isinstance(c.get("value"), dict) else None
        numeric = isinstance(bound, (int, float)) and not isinstance(bound, bool)
        return (
            risks.LEVELS.index(level),
            0 if has_time else 1,
            -(measured if has_time else 0.0),
            0 if numeric else 1,
            -(bound if numeric else 0.0),
            CONFIDENCE_RANK.get(c["confidence"], 3),
            c["id"],
        )

    return [c["id"] for c in sorted(cands, key=key)]


def order_rule(with_profile: bool = False) -> str:
    """The suggested-order rule in words (printed in the report)."""
    measured = "the largest measured time in the joined profile first, then " if with_profile else ""
    return (
        "lowest risk level first (none, low, medium, high); within a level, "
        f"{measured}the largest roofline speed-up bound first (numeric estimates before symbolic ones); "
        "then higher confidence; then id"
    )


ORDER_RULE = order_rule()
