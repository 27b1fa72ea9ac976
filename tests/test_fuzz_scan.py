"""Fuzzing the scanner with generated and mutated Python (issue 7, "Fuzzing").

Inputs start from real-model-shaped seeds — ``tests/fuzz_corpus/*.py``, every pattern's own
``FUSE``/``KEEP`` examples, and (when the wheel is on this machine) transformers' modeling files —
then get token-, line- and byte-level mutations, or are built from scratch as random expression
trees in the detectors' vocabulary. Properties: nothing raises or hangs, every problem is a
per-file ``files_failed`` entry, and what is reported about a site is consistent with the file.

This module also holds the input strategies and the guards the other fuzz modules and
``bench/fuzz_long.py`` reuse, so all of them fuzz exactly the same input space.

CI runs are seeded (``derandomize``) and bounded three ways: ``max_examples``, a per-example
``deadline`` plus a CPU-time guard that turns a hang into a failure, and a module wall-clock
budget after which the remaining examples return at once (a loaded machine then runs fewer,
never longer). ``bench/fuzz_long.py`` runs the same properties unseeded for minutes.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import io
import json
import os
import re
import signal
import tempfile
import textwrap
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npufuse
from npufuse.cli import main
from npufuse.patterns.registry import all_patterns
from npufuse.scan.engine import ScanOptions, analyze_file, scan_repo

# Huge-literal inputs are the point here; hypothesis warning about their repr is noise.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

CORPUS = Path(__file__).parent / "fuzz_corpus"
TRANSFORMERS_WHEELS = "/tmp/tf/transformers-*.whl"

# -- time limits -------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of one module's fuzz run; ``bench/fuzz_long.py`` replaces ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start: float | None = None
        self.skipped = 0

    def exhausted(self) -> bool:
        now = time.monotonic()
        if self.start is None:
            self.start = now
        if now - self.start > self.seconds:
            self.skipped += 1
            return True
        return False


class Hang(Exception):
    """An example used more CPU time than any input of this size should need."""


@contextlib.contextmanager
def cpu_guard(seconds: float):
    """Raise :class:`Hang` inside the code under test after ``seconds`` of CPU time.

    CPU time (ITIMER_VIRTUAL) rather than wall time: a loaded CI machine must not turn slowness
    into failures, and SIGALRM stays free for pytest-timeout, which uses it."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    fired = []

    def on_timer(signum, frame):
        fired.append(frame)
        raise Hang(f"no result after {seconds:g} s of CPU time (a hang?)")

    old = signal.signal(signal.SIGVTALRM, on_timer)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, old)
    if fired:  # npufuse catches Exception per file/detector, so the Hang may have been swallowed
        where = fired[0]
        raise Hang(f"no result after {seconds:g} s of CPU time (a hang?); it was running {where.f_code.co_filename}:{where.f_lineno} {where.f_code.co_name}")


# Per-example wall-clock deadline: generous because the CI machines are shared; the CPU guard
# is the hang detector, the deadline only catches an example that is pathologically slow.
# (Legitimately slow exists: libcst renders one site of a 300 KB file in ~20 s of CPU.)
DEADLINE = timedelta(seconds=20)
HANG_CPU_S = 90.0


def fuzz_settings(max_examples: int, **kw) -> settings:
    """Seeded and bounded; no example database, so CI runs do not depend on earlier runs."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=DEADLINE,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        **kw,
    )


# -- seeds -------------------------------------------------------------------------------------


def _top_level_chunks(text: str) -> tuple[str, list[str]]:
    """(import header, each top-level statement's source with the comments and decorators above it)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    header, chunks = [], []
    prev_end = 0
    for node in tree.body:
        seg = "".join(lines[prev_end : node.end_lineno])
        prev_end = node.end_lineno
        (header if isinstance(node, (ast.Import, ast.ImportFrom)) else chunks).append(seg)
    return "".join(header), chunks


def _pattern_examples() -> list[str]:
    out = []
    for p in all_patterns():
        out += [textwrap.dedent(ex.code) for ex in (*p.FUSE, *p.KEEP)]
    return out


TRANSFORMERS_WHEEL = (sorted(glob.glob(TRANSFORMERS_WHEELS)) or [None])[-1]


@functools.lru_cache(maxsize=1)
def transformers_files() -> tuple[str, ...]:
    """Modeling files from a transformers wheel on this machine (never committed: read here, on
    first use, so collecting the tests stays fast)."""
    if TRANSFORMERS_WHEEL is None:
        return ()
    with zipfile.ZipFile(TRANSFORMERS_WHEEL) as zf:
        names = sorted(n for n in zf.namelist() if re.search(r"models/[^/]+/modeling_[^/]+\.py$", n))
        return tuple(zf.read(n).decode("utf-8", "replace") for n in names)


def _small_seeds(texts: list[str]) -> list[str]:
    """Each file cut into (imports + one top-level definition): small inputs keep libcst-heavy
    properties fast and make failures short."""
    out = []
    for text in texts:
        try:
            header, chunks = _top_level_chunks(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        out += [header + "\n\n" + c for c in chunks if 40 < len(c) < 6000]
    return out


CORPUS_FILES = [p.read_text() for p in sorted(CORPUS.glob("*.py"))]
PATTERN_EXAMPLES = _pattern_examples()
SMALL_SEEDS = _small_seeds(CORPUS_FILES) + PATTERN_EXAMPLES
WHOLE_SEEDS = CORPUS_FILES + PATTERN_EXAMPLES

# -- mutations ---------------------------------------------------------------------------------

NAMES = ["x", "hidden_states", "self", "weight", "self.weight", "torch", "F", "nn", "variance", "eps", "residual",
         "gate", "up", "cos", "sin", "q", "k", "v", "mask", "scale", "idx", "top_x", "expert_layer", "print",
         "match", "case", "type", "_", "None", "True", "lambda", "yield", "await", "async", "global", "nonlocal",
         "class", "return", "torch_npu", "_npufuse_on_npu", "é", "ℌ", "x" * 300]
OPERATORS = ["+", "-", "*", "/", "//", "**", "@", "%", "<", ">", "==", "!=", "&", "|", "^", "~", ".", ",", ":",
             "=", ":=", "->", "(", ")", "[", "]", "{", "}", ";", "\\", "...", " if ", " and ", " not "]
_OP_RX = re.compile(r"\*\*|//|==|!=|:=|->|\.\.\.|[-+*/@%<>&|^~.,:=()\[\]{};]")
_NUM_RX = re.compile(r"(?<![\w.])\d[\d_]*(?:\.\d*)?(?:[eE][-+]?\d+)?j?")
_NAME_RX = re.compile(r"[A-Za-z_]\w*")
CONSTANTS = ["0", "1", "-1", "2", "0.5", "1e-6", "1e-5", "1.0", "1e309", "-0.0", "3j", "0x7fffffff", "1_000",
             "10**400", "9" * 5000, "float('nan')", '"2"', "None", "True", "...", "2.", ".5", "0o17", "00", "0b"]
DECORATORS = ["@torch.no_grad()", "@staticmethod", "@classmethod", "@property", "@torch.jit.script",
              "@functools.lru_cache(maxsize=None)", "@torch.compile", "@decorator(", "@"]
INSERTS = ["pass", "...", "return", "return x", "yield x", "del x", "global x", "nonlocal x", "raise",
           "break", "continue", "x = x", "if x:", "else:", "try:", "except Exception:", "with torch.no_grad():",
           "for i in range(2):", "while True:", "async def f():", "lambda: 0", "import torch_npu",
           "# npufuse: rms_norm", "if _npufuse_on_npu(x):  # npufuse: rms_norm", "'''", '"""unterminated', "\\",
           "x = (", "def inner(x):\n    return x * 2", "class Inner:\n    pass", "match x:\n    case 1:\n        pass",
           "print 'py2'", "exec 'x'", "x <> y", "`x`", "x = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)",
           "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
           "return F.silu(gate) * up", "attn = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)",
           "a, b = x.chunk(2, dim=-1)", "x = torch.cat((-x2, x1), dim=-1)", "\f", "\u2028", "\t", "\x0b"]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True) or [""]


def _pick(draw, n: int) -> int:
    return draw(st.integers(0, max(0, n - 1)))


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def m_delete_line(draw, text):
    ls = _lines(text)
    del ls[_pick(draw, len(ls))]
    return "".join(ls)


def m_duplicate_line(draw, text):
    ls = _lines(text)
    i = _pick(draw, len(ls))
    ls.insert(i, ls[i])
    return "".join(ls)


def m_swap_lines(draw, text):
    ls = _lines(text)
    i, j = _pick(draw, len(ls)), _pick(draw, len(ls))
    ls[i], ls[j] = ls[j], ls[i]
    return "".join(ls)


def m_move_line(draw, text):
    ls = _lines(text)
    line = ls.pop(_pick(draw, len(ls)))
    ls.insert(_pick(draw, len(ls) + 1), line)
    return "".join(ls)


def _sub_one(draw, rx: re.Pattern, text: str, choices) -> str:
    found = list(rx.finditer(text))
    if not found:
        return text
    m = found[_pick(draw, len(found))]
    return text[: m.start()] + draw(choices) + text[m.end() :]


def m_operator(draw, text):
    return _sub_one(draw, _OP_RX, text, st.sampled_from(OPERATORS))


def m_constant(draw, text):
    return _sub_one(draw, _NUM_RX, text, st.sampled_from(CONSTANTS))


def m_rename_one(draw, text):
    return _sub_one(draw, _NAME_RX, text, st.sampled_from(NAMES))


def m_rename_all(draw, text):
    names = sorted(set(_NAME_RX.findall(text)))
    if not names:
        return text
    old = names[_pick(draw, len(names))]
    return re.sub(rf"\b{re.escape(old)}\b", draw(st.sampled_from(NAMES)), text)


def m_insert_line(draw, text):
    ls = _lines(text)
    i = _pick(draw, len(ls) + 1)
    ref = ls[min(i, len(ls) - 1)]
    indent = draw(st.sampled_from([_indent_of(ref), "", "    ", _indent_of(ref) + "    ", " ", "\t"]))
    what = draw(st.sampled_from(INSERTS + DECORATORS))
    ls.insert(i, textwrap.indent(what, indent) + "\n" if what.strip() else indent + what + "\n")
    return "".join(ls)


def m_reindent(draw, text):
    ls = _lines(text)
    i = _pick(draw, len(ls))
    body = ls[i].lstrip(" \t")
    ws = _indent_of(ls[i])
    ls[i] = draw(st.sampled_from([ws + " ", ws[1:], ws + "    ", ws[4:], ws.replace("    ", "\t"), "\t" + ws, ""])) + body
    return "".join(ls)


def m_join_lines(draw, text):
    ls = _lines(text)
    if len(ls) < 2:
        return text
    i = _pick(draw, len(ls) - 1)
    ls[i : i + 2] = [ls[i].rstrip("\r\n") + draw(st.sampled_from(["", " ", "; ", " \\"])) + ls[i + 1].lstrip()]
    return "".join(ls)


def m_split_line(draw, text):
    if not text:
        return text
    i = _pick(draw, len(text))
    return text[:i] + draw(st.sampled_from(["\n", "\\\n", "\n    ", "\r\n", "\r"])) + text[i:]


def m_splice_foreign(draw, text):
    """A line from another seed, at a random place: real statements in the wrong context."""
    other = _lines(draw(st.sampled_from(SMALL_SEEDS)))
    ls = _lines(text)
    ls.insert(_pick(draw, len(ls) + 1), other[_pick(draw, len(other))])
    return "".join(ls)


def m_truncate(draw, text):
    return text[: _pick(draw, len(text) + 1)]


def m_huge_literal(draw, text):
    n = draw(st.sampled_from([5000, 50_000, 300_000]))
    lit = draw(st.sampled_from(['"' + "a" * n + '"', "1" * min(n, 5000), "[" + "0, " * (n // 3) + "]",
                                "'''" + "line\n" * (n // 5) + "'''", "b'" + "\\x00" * (n // 4) + "'"]))
    ls = _lines(text)
    i = _pick(draw, len(ls) + 1)
    ref = ls[min(i, len(ls) - 1)]
    ls.insert(i, f"{_indent_of(ref)}_huge = {lit}\n")
    return "".join(ls)


def m_deep_nesting(draw, text):
    """Deeply nested expressions and blocks around the parser's and the detectors' limits
    (CPython allows 200 nested brackets and 100 indentation levels)."""
    d = draw(st.sampled_from([20, 99, 101, 150, 199, 201, 500, 1000, 3000]))
    kind = draw(st.sampled_from(["paren", "neg", "add", "call", "attr", "pow", "block", "list", "lambda"]))
    expr = {
        "paren": "(" * d + "x" + ")" * d,
        "neg": "-" * d + "x",
        "add": "x" + " + x" * d,
        "call": "torch.rsqrt(" * min(d, 199) + "x" + ")" * min(d, 199),
        "attr": "x" + ".pow(2)" * d,
        "pow": "x" + " ** 2" * d,
        "list": "[" * min(d, 199) + "]" * min(d, 199),
        "lambda": "lambda: " * d + "x",
        "block": None,
    }[kind]
    ls = _lines(text)
    i = _pick(draw, len(ls) + 1)
    ref = ls[min(i, len(ls) - 1)]
    ws = _indent_of(ref)
    if expr is None:
        block = "".join(ws + "    " * k + "if x:\n" for k in range(min(d, 120))) + ws + "    " * min(d, 120) + "x = 1\n"
        ls.insert(i, block)
    else:
        ls.insert(i, f"{ws}y = {expr}\n")
    return "".join(ls)


TEXT_MUTATIONS = [m_delete_line, m_duplicate_line, m_swap_lines, m_move_line, m_operator, m_constant, m_rename_one,
                  m_rename_all, m_insert_line, m_reindent, m_join_lines, m_split_line, m_splice_foreign, m_truncate]
# Mutations that make big inputs: rarer, and kept out of libcst-heavy properties' common path.
HEAVY_MUTATIONS = [m_huge_literal, m_deep_nesting]


def b_random_bytes(draw, data):
    i = _pick(draw, len(data) + 1)
    return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]


def b_nul(draw, data):
    i = _pick(draw, len(data) + 1)
    return data[:i] + b"\x00" + data[i:]


def b_non_utf8(draw, data):
    i = _pick(draw, len(data) + 1)
    return data[:i] + draw(st.sampled_from([b"\xff", b"\xe9", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])) + data[i:]


def b_bom(draw, data):
    return draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xef\xbb\xbf\xef\xbb\xbf"])) + data


def b_cookie(draw, data):
    cookie = draw(st.sampled_from([b"latin-1", b"utf-8", b"utf-16", b"cp1252", b"no-such-codec", b"ascii", b"utf-8-sig", b"euc-jp"]))
    return b"# -*- coding: " + cookie + b" -*-\n" + data


def b_line_ends(draw, data):
    return draw(st.sampled_from([data.replace(b"\n", b"\r\n"), data.replace(b"\n", b"\r"), data.replace(b"\n", b"\n\r")]))


def b_truncate(draw, data):
    return data[: _pick(draw, len(data) + 1)]


def b_utf16(draw, data):
    return data.decode("utf-8", "replace").encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))


BYTE_MUTATIONS = [b_random_bytes, b_nul, b_non_utf8, b_bom, b_cookie, b_line_ends, b_truncate, b_utf16]


# -- generated programs: random but valid expression trees in the patterns' vocabulary ----------

LEAVES = ["x", "hidden_states", "self.weight", "self.eps", "self.variance_epsilon", "residual", "gate", "up", "q", "k",
          "v", "cos", "sin", "mask", "scale", "1e-6", "2", "-1", "0.5", "1.0", "(1 + self.weight)", "x1", "x2"]


def _receiver(expr: str) -> str:
    """``expr`` bracketed where it takes an attribute or subscript (``(x + y).pow(2)``, ``(2).pow``)."""
    node = ast.parse(expr, mode="eval").body
    return expr if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) else f"({expr})"


def _expressions():
    leaf = st.sampled_from(LEAVES)

    def fmt(f: str, a: str, b: str = "") -> str:
        # a bare number cannot take an attribute (`2.pow(2)`); bracket it like a person would
        return f.format(a=_receiver(a) if "{a}." in f or "{a}[" in f else a, b=_receiver(b) if "{b}." in f else b)

    def extend(sub):
        one = st.sampled_from([
            "{a}.pow(2)", "{a} ** 2", "{a}.mean(-1, keepdim=True)", "torch.rsqrt({a})", "torch.sqrt({a})", "-{a}",
            "{a}.float()", "{a}.to(torch.float32)", "{a}.to(input_dtype)", "F.silu({a})", "nn.functional.silu({a})",
            "F.gelu({a})", "F.gelu({a}, approximate='tanh')", "torch.softmax({a}, dim=-1)", "{a}.softmax(-1)",
            "nn.functional.softmax({a}, dim=-1, dtype=torch.float32)", "F.dropout({a}, p=0.1, training=self.training)",
            "{a}.transpose(-1, -2)", "{a}.transpose(2, 3)", "{a}.unsqueeze(1)", "{a}.contiguous()", "rotate_half({a})",
            "{a}[..., : {a}.shape[-1] // 2]", "{a}[..., {a}.shape[-1] // 2 :]", "{a}.chunk(2, dim=-1)[0]",
            "self.act_fn({a})", "self.gate_proj({a})", "self.up_proj({a})", "self.down_proj({a})", "{a}.type_as(x)",
            "torch.where({a} > 0, {a}, x)", "({a})", "{a}.sum(dim=-1, keepdim=True)", "{a}.view(-1, {a}.shape[-1])",
        ])
        two = st.sampled_from([
            "{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / {b}", "{a} @ {b}", "torch.matmul({a}, {b})",
            "torch.cat(({a}, {b}), dim=-1)", "torch.cat((-{b}, {a}), dim=-1)", "torch.where(mask, {a}, {b})",
            "{a} * torch.rsqrt({b}.pow(2).mean(-1, keepdim=True) + 1e-6)", "torch.bmm({a}, {b})",
            "F.scaled_dot_product_attention({a}, {b}, v)", "torch.lerp({a}, {b}, 0.5)",
        ])
        return st.one_of(
            st.builds(fmt, one, sub),
            st.builds(fmt, two, sub, sub),
        )

    return st.recursive(leaf, extend, max_leaves=12)


EXPRESSIONS = _expressions()
TARGETS = ["hidden_states", "x", "variance", "out", "attn_weights", "attn_output", "q_embed", "k_embed", "gate",
           "up", "down_proj", "x1", "x2", "routing_weights", "input_dtype"]

# Templates of the detectors' targets with random holes: most programs are near a real pattern.
TEMPLATES = [
    "input_dtype = hidden_states.dtype\nhidden_states = hidden_states.to(torch.float32)\n"
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)\nhidden_states = hidden_states * torch.rsqrt(variance + {e})\n"
    "return self.weight * hidden_states.to(input_dtype)",
    "variance = {e}.pow(2).mean(-1, keepdim=True)\nx = x * torch.rsqrt(variance + self.eps)\nreturn {e} * x",
    "return self.down_proj(self.act_fn(self.gate_proj({e})) * self.up_proj(x))",
    "gate, up = self.gate_up_proj({e}).chunk(2, dim=-1)\nreturn self.down_proj(F.silu(gate) * up)",
    "x, gate = {e}.chunk(2, dim=-1)\nreturn x * F.gelu(gate)",
    "q_embed = (q * cos) + (rotate_half(q) * {e})\nk_embed = (k * cos) + (rotate_half(k) * sin)\nreturn q_embed, k_embed",
    "attn_weights = torch.matmul(q, k.transpose(2, 3)) * {e}\nif mask is not None:\n    attn_weights = attn_weights + mask\n"
    "attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)\n"
    "attn_weights = nn.functional.dropout(attn_weights, p=0.0, training=self.training)\nreturn torch.matmul(attn_weights, v)",
    "return F.scaled_dot_product_attention(q, k, {e}, attn_mask=mask, is_causal=False)",
    "x = torch.where(x < {e}, {e}, x)\nreturn x",
    "x[x == {e}] = -100\nreturn x",
    "residual = x\nx = residual + {e}\nvariance = x.pow(2).mean(-1, keepdim=True)\nx = x * torch.rsqrt(variance + 1e-6)\nreturn self.weight * x",
    "for expert_idx in range(self.num_experts):\n    idx, top_x = torch.where(expert_mask[expert_idx])\n"
    "    current_state = x[None, top_x].reshape(-1, x.shape[-1])\n    cur = self.experts[expert_idx](current_state) * {e}\n"
    "    out.index_add_(0, top_x, cur.to(x.dtype))\nreturn out",
    "optimizer = torch.optim.AdamW(model.parameters(), lr={e}, weight_decay=0.1)\nreturn optimizer",
]


@st.composite
def statement(draw, depth: int = 0):
    kind = draw(st.integers(0, 9))
    target = draw(st.sampled_from(TARGETS))
    if kind <= 5 or depth >= 2:
        return f"{target} = {draw(EXPRESSIONS)}"
    if kind == 6:
        body = "\n".join(draw(st.lists(statement(depth + 1), min_size=1, max_size=3)))
        head = draw(st.sampled_from(["if self.training:", "if x.dtype == torch.float16:", "for _ in range(2):", "with torch.no_grad():"]))
        return head + "\n" + textwrap.indent(body, "    ")
    if kind == 7:
        return f"{target} += {draw(EXPRESSIONS)}"
    if kind == 8:
        return f"{target}, {draw(st.sampled_from(TARGETS))} = {_receiver(draw(EXPRESSIONS))}.chunk(2, dim=-1)"
    body = draw(st.sampled_from(TEMPLATES)).format(e=_receiver(draw(EXPRESSIONS))).split("\nreturn")[0]
    return "out = " + body[len("return ") :] if body.startswith("return ") else body  # a statement, valid anywhere


@st.composite
def generated_program(draw) -> str:
    """A module of 1-3 functions/methods whose bodies are random statements or filled templates."""
    defs = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            body = draw(st.sampled_from(TEMPLATES)).format(e=_receiver(draw(EXPRESSIONS)))
        else:
            stmts = draw(st.lists(statement(), min_size=1, max_size=6))
            body = "\n".join(stmts) + f"\nreturn {draw(st.sampled_from(TARGETS))}"
        args = "self, x, hidden_states=None, q=None, k=None, v=None, cos=None, sin=None, mask=None, gate=None, up=None"
        fn = f"def forward({args}):\n" + textwrap.indent(body, "    ") + "\n"
        if draw(st.booleans()):
            name = draw(st.sampled_from(["LlamaRMSNorm", "LlamaMLP", "Attention", "MoeBlock", "Block"]))
            defs.append(f"class {name}(nn.Module):\n" + textwrap.indent(fn, "    "))
        else:
            defs.append(fn.replace("def forward(self, ", f"def f{len(defs)}(self, ", 1))
    head = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n"
    return head + "\n\n".join(defs)


@st.composite
def python_text(draw, seeds: list[str] | None = None, heavy: bool = True, max_mutations: int = 4) -> str:
    """A seed (or a generated program) with 0..max_mutations text mutations."""
    pool = seeds if seeds is not None else SMALL_SEEDS
    text = draw(st.one_of(st.sampled_from(pool), generated_program())) if pool else draw(generated_program())
    ops = TEXT_MUTATIONS + (HEAVY_MUTATIONS if heavy else [])
    for _ in range(draw(st.integers(0, max_mutations))):
        text = draw(st.sampled_from(ops))(draw, text)
    return text


@st.composite
def python_bytes(draw, seeds: list[str] | None = None, heavy: bool = True) -> bytes:
    """:func:`python_text` encoded, sometimes with byte-level damage (encodings, NULs, BOMs)."""
    data = draw(python_text(seeds, heavy)).encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 3)) == 0:
        data = draw(st.sampled_from(BYTE_MUTATIONS))(draw, data)
    return data


# -- oracles -----------------------------------------------------------------------------------

UNPARSED_KINDS = {"binary", "encoding", "syntax", "too_large", "unreadable", "symlink_loop", "broken_symlink"}
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=]", re.MULTILINE)


def plain_text(data: bytes) -> str | None:
    """The text npufuse must read from ``data`` when the answer is unambiguous (plain UTF-8,
    no NUL, no coding cookie); None otherwise."""
    if b"\x00" in data or _CODING.search(b"\n".join(data.split(b"\n", 2)[:2])):
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text[1:] if text.startswith("\ufeff") else text
    return None if text.startswith("\ufeff") else text


def parses(text: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def file_lines(text: str) -> list[str]:
    """Lines as Python counts them (only \\r\\n, \\r, \\n end a line)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", text)


def else_block(block: list[str]) -> list[str]:
    """The statements of the ``else:`` that closes the guarded ``if`` whose lines are ``block``."""
    ws = _indent_of(block[0])
    for k, line in enumerate(block):
        if k and line.rstrip("\r\n") == ws + "else:":
            return block[k + 1 :]
    raise AssertionError(f"no `else:` at the if's indentation in:\n{''.join(block)}")


def check_fallback(original: str, block: list[str], where: str) -> None:
    """The fallback branch is the original statements, byte for byte, one level deeper.

    Lines inside a multi-line string cannot move, so the comparison is per line: each fallback
    line is either the original line or the original line with the added indentation."""
    fallback = else_block(block)
    orig = file_lines(original)
    assert textwrap.dedent("".join(fallback)) == textwrap.dedent("".join(orig)) or (
        len(fallback) == len(orig) and all(f == o or f.endswith(o) and not f[: len(f) - len(o)].strip(" \t") for f, o in zip(fallback, orig))
    ), f"{where}: fallback differs from the original statements\n--- original\n{''.join(orig)}--- fallback\n{''.join(fallback)}"


def check_failure(f, files: set[str]) -> None:
    assert f.file in files, f"failure for a file that was not scanned: {f}"
    assert f.error and f.error.strip(), f"empty failure message: {f}"
    assert "Traceback" not in f.error, f"traceback in a failure message: {f.error[:400]}"


# -- properties --------------------------------------------------------------------------------

PATTERNS = all_patterns()
# Wall-clock seconds per test (24 s for the module); NPUFUSE_FUZZ_BUDGET_SCALE stretches them.
BUDGET_SCALE = float(os.environ.get("NPUFUSE_FUZZ_BUDGET_SCALE", "1"))
BUDGETS = {k: Budget(v * BUDGET_SCALE) for k, v in {"scan_repo": 7, "analyze": 6, "valid": 4, "generated": 4, "transformers": 3}.items()}
CONTROL = next(s for s in SMALL_SEEDS if "class LlamaRMSNorm" in s and "LlamaDecoderLayer" not in s)


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).write_bytes(data)


def _control_candidates() -> list[tuple[str, int, int]]:
    with tempfile.TemporaryDirectory() as d:
        Path(d, "control.py").write_text(CONTROL)
        res = scan_repo(d, jobs=1)
    return [(c["pattern"], c["line"], c["end_line"]) for c in res.candidates]


_CONTROL_EXPECTED: list[tuple[str, int, int]] | None = None


def check_scan_repo(mutants: list[bytes]) -> None:
    """scan_repo over a folder of mutants and one good file: never raises; every file is counted
    as scanned or has a files_failed entry saying why not; the good file's candidates do not
    depend on its neighbours; each candidate's span, code and replacement match its file."""
    global _CONTROL_EXPECTED
    if _CONTROL_EXPECTED is None:
        _CONTROL_EXPECTED = _control_candidates()
    files = {f"m{i}.py": data for i, data in enumerate(mutants)}
    files["control.py"] = CONTROL.encode()
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as out, cpu_guard(HANG_CPU_S):
        repo = Path(d) / "repo"
        repo.mkdir()
        _write(repo, files)
        res = scan_repo(repo, jobs=1)
        plain = json.loads(json.dumps(res.to_json(), ensure_ascii=False))
        # the whole verb (cold cache, markdown report) and then a warm-cache scan: same answers
        state, report = Path(out) / "state", Path(out) / "report.md"
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(["scan", str(repo), "-o", str(report), "--state-dir", str(state), "--no-progress", "-j", "1"])
        assert rc == 0 and "Traceback" not in stderr.getvalue(), (rc, stderr.getvalue()[-3000:])
        assert report.is_file() and report.stat().st_size > 0
        cli = json.loads((state / "scan.json").read_text(encoding="utf-8"))
        warm = json.loads(json.dumps(scan_repo(repo, jobs=1, cache_dir=state / "cache").to_json(), ensure_ascii=False))
    for other, what in ((cli, "npufuse scan (cold cache)"), (warm, "a warm-cache scan")):
        for key in ("files_scanned", "files_failed", "candidates", "near_misses", "existing", "switches"):
            assert other[key] == plain[key], f"{what} differs from an uncached scan_repo in {key!r}: {str(other[key])[:800]} vs {str(plain[key])[:800]}"
    for f in res.files_failed:
        check_failure(f, set(files))
    unparsed = {f.file for f in res.files_failed if f.kind in UNPARSED_KINDS}
    assert res.files_scanned + len(unparsed) == len(files), (res.files_scanned, unparsed)
    for rel, data in files.items():
        text = plain_text(data)
        if text is not None and len(data) <= ScanOptions().max_file_bytes:
            assert (rel in unparsed) == (not parses(text)), f"{rel}: parse verdict differs from ast.parse: {[f for f in res.files_failed if f.file == rel]}"
    got = [(c["pattern"], c["line"], c["end_line"]) for c in res.candidates if c["file"] == "control.py"]
    assert got == _CONTROL_EXPECTED, f"the good file's candidates changed next to the mutants: {got}"
    for c in res.candidates:
        assert 1 <= c["line"] <= c["end_line"], c
        src = plain_text(files[c["file"]])
        if src is not None:
            lines = file_lines(src)
            assert c["end_line"] <= len(lines), c
            assert c["code"] == "".join(lines[c["line"] - 1 : c["end_line"]]), f"{c['file']}:{c['line']}: `code` is not the file's lines"
        rep = file_lines(c["replacement"])
        assert rep[0].rstrip().endswith(f"# npufuse: {c['pattern']}"), rep[0]
        check_fallback(c["code"], rep, f"{c['file']}:{c['line']} ({c['pattern']}) replacement")


def check_analyze(data: bytes) -> None:
    """One file through analyze_file: never raises; problems are per-file entries; a file that
    ast accepts is parsed and its findings are whole statements inside the file."""
    with tempfile.TemporaryDirectory() as d, cpu_guard(HANG_CPU_S):
        Path(d, "m.py").write_bytes(data)
        out = analyze_file(Path(d), "m.py", PATTERNS, ScanOptions())
    for f in out.failures:
        check_failure(f, {"m.py"})
    text = plain_text(data)
    if text is not None and parses(text):
        assert out.parsed or any(f.error.startswith("cannot index") for f in out.failures), out.failures
        n = len(file_lines(text))
        for h in out.hits:
            assert 1 <= h.finding.line <= h.finding.end_line <= n
            assert h.code == "".join(file_lines(text)[h.finding.line - 1 : h.finding.end_line])


def detector_errors(data: bytes) -> list[str]:
    with tempfile.TemporaryDirectory() as d, cpu_guard(HANG_CPU_S):
        Path(d, "m.py").write_bytes(data)
        out = analyze_file(Path(d), "m.py", PATTERNS, ScanOptions())
    return [f.error for f in out.failures if f.kind == "detector_error" or f.error.startswith("cannot index")]


def check_detectors_quiet(text: str) -> None:
    """On Python that ast accepts, no detector (or the indexer) raises: a raise loses that
    detector's results for the whole file, so it is a bug even though the scan goes on."""
    if not parses(text):
        return
    errors = detector_errors(text.encode())
    assert not errors, errors


# -- properties, known bugs, the tests ----------------------------------------------------------


@dataclass(frozen=True)
class Property:
    """A property and the inputs it is checked on: the CI tests and bench/fuzz_long.py share these."""

    strategy: Any
    check: Callable[[Any], None]


@dataclass(frozen=True)
class KnownBug:
    """A bug in npufuse that fuzzing found and that has an ``xfail(strict=True)`` reproducer
    (``test``). Examples that hit it are counted, not failed, so the property keeps looking for
    other bugs meanwhile; when the bug is fixed the reproducer XPASSes and this entry goes."""

    test: str
    exc: type | tuple[type, ...]
    where: str | None = ""  # innermost npufuse frame ("npufuse/profile/trace.py:analyze_trace"); "" = the test's own assert; None = anywhere
    message: str = ""  # regex searched in str(exc)
    input: str = ""  # regex searched in the input's text: the trigger, where it is known

    def matches(self, exc: BaseException, value: Any = None) -> bool:
        if not isinstance(exc, self.exc) or isinstance(exc, Hang):
            return False
        if self.message and not re.search(self.message, str(exc)):
            return False
        if self.input and not re.search(self.input, value_text(value)):
            return False
        return self.where is None or self.where == innermost_npufuse_frame(exc)


def value_text(value: Any) -> str:
    """The source text inside a property's input (bytes, text, or a tuple/list holding them)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        return "\n".join(value_text(v) for v in value)
    if isinstance(value, dict):
        return "\n".join(value_text(v) for v in value.values())
    return ""


PACKAGE_DIR = Path(npufuse.__file__).resolve().parent


def innermost_npufuse_frame(exc: BaseException) -> str:
    """``npufuse/<module path>:<function>`` of the innermost frame inside the npufuse package,
    "" when the exception did not pass through it (a property's own assert)."""
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(f.filename).resolve()
        if PACKAGE_DIR in path.parents:
            return f"npufuse/{path.relative_to(PACKAGE_DIR).as_posix()}:{f.name}"
    return ""


KNOWN_HITS: dict[str, int] = {}


def run_property(props: dict[str, Property], budgets: dict[str, Budget], name: str, value: Any,
                 known: Iterable[KnownBug] = ()) -> None:
    if budgets[name].exhausted():
        return
    try:
        props[name].check(value)
    except Exception as exc:
        bug = next((b for b in known if b.matches(exc, value)), None)
        if bug is None:
            raise
        KNOWN_HITS[bug.test] = KNOWN_HITS.get(bug.test, 0) + 1


def check_generated(text: str) -> None:
    assert parses(text), text  # the generator only builds valid Python
    check_detectors_quiet(text)


@st.composite
def mutated_transformers(draw) -> bytes:
    files = transformers_files()
    text = files[draw(st.integers(0, len(files) - 1))]
    for _ in range(draw(st.integers(1, 3))):
        text = draw(st.sampled_from(TEXT_MUTATIONS))(draw, text)
    return text.encode()


PROPERTIES = {
    "scan_repo": Property(st.lists(python_bytes(WHOLE_SEEDS), min_size=1, max_size=3), check_scan_repo),
    "analyze": Property(python_bytes(), check_analyze),
    "valid": Property(python_text(heavy=False, max_mutations=2), check_detectors_quiet),
    "generated": Property(generated_program(), check_generated),
}
if TRANSFORMERS_WHEEL:
    PROPERTIES["transformers"] = Property(mutated_transformers(), check_analyze)


@fuzz_settings(max_examples=25)
@given(PROPERTIES["scan_repo"].strategy)
def test_scan_repo_reports_every_problem_per_file(value):
    run_property(PROPERTIES, BUDGETS, "scan_repo", value)


@fuzz_settings(max_examples=200)
@given(PROPERTIES["analyze"].strategy)
def test_analyze_file_never_raises(value):
    run_property(PROPERTIES, BUDGETS, "analyze", value)


@fuzz_settings(max_examples=120)
@given(PROPERTIES["valid"].strategy)
def test_detectors_do_not_raise_on_valid_python(value):
    run_property(PROPERTIES, BUDGETS, "valid", value)


@fuzz_settings(max_examples=60)
@given(PROPERTIES["generated"].strategy)
def test_detectors_on_generated_expression_trees(value):
    run_property(PROPERTIES, BUDGETS, "generated", value)


@pytest.mark.skipif(not TRANSFORMERS_WHEEL, reason=f"no transformers wheel at {TRANSFORMERS_WHEELS}")
@fuzz_settings(max_examples=30)
@given(mutated_transformers())
def test_mutated_transformers_modeling_files(value):
    run_property(PROPERTIES, BUDGETS, "transformers", value)


@pytest.fixture(scope="module", autouse=True)
def _report_budget():
    yield
    report_budgets(BUDGETS)


def report_budgets(budgets: dict[str, Budget]) -> None:
    """A run cut short by its budget passes, but says so: it tested less than it was set up to."""
    cut = {k: b.skipped for k, b in budgets.items() if b.skipped}
    if cut:
        warnings.warn(f"fuzz budget used up, examples not run: {cut}", stacklevel=2)


# (15-minute fuzz run) a 500-link call chain: fused_optimizer's ast.unparse of a receiver raised
# RecursionError, with a message that depended on the caller's stack depth (scan_repo in-process
# and `npufuse scan` disagreed on the files_failed entry). No detector may raise on it, at any depth.
def test_bug_long_call_chain_raises_recursion_error_in_a_detector():
    src = ("import torch\n\n\ndef f0(model, x):\n    y = x" + ".pow(2)" * 500 + ".zero_grad()\n"
           "    optimizer = torch.optim.AdamW(model.parameters(), lr=x, weight_decay=0.1)\n    return y\n").encode()

    def nested(depth: int) -> list[str]:
        return nested(depth - 1) if depth else detector_errors(src)

    assert detector_errors(src) == []
    import sys

    assert nested(sys.getrecursionlimit() // 4) == []   # deeper in the stack: the same (empty) answer


# (15-minute fuzz run) a guard tensor cut from two source lines, `torch.cat((a, b), dim\n=-1)`,
# split the replacement's `if` header over two lines: the npufuse marker no longer ended its first
# line (the rescan of a rewritten file reads it there). The guard is now written on one line.
def test_bug_guard_tensor_spanning_lines_splits_the_if_header():
    src = ("import torch\nimport torch.nn.functional as F\n\n\ndef f0(self, x, v=None):\n"
           "    hidden_states = F.scaled_dot_product_attention(torch.cat((1e-6, 1e-6), dim\n=-1), x, v)\n"
           "    return hidden_states\n")
    check_scan_repo([src.encode()])
    with tempfile.TemporaryDirectory() as d:
        Path(d, "m.py").write_text(src)
        (hit,) = analyze_file(Path(d), "m.py", PATTERNS, ScanOptions()).hits
    assert hit.finding.guard_tensor == "torch.cat((1e-06, 1e-06), dim=-1)"
    from npufuse.rewrite.codegen import env_switch, render_site
    from npufuse.scan import replacement

    shown = replacement.render(src, hit.finding, env_switch("sdpa"), hit.body)
    assert shown == render_site(src, hit.finding, env_switch("sdpa"))
    assert shown.splitlines()[0].endswith("# npufuse: sdpa")
