"""The scan's fast paths give exactly what the code they replaced gave.

``analyze_file`` and the detectors share helpers that were made faster without changing any
result: ``dataflow.fast_walk``/``child_nodes`` (``ast.walk``/``ast.iter_child_nodes``), the
per-scope statement listing, node index and last reads, the text prefilters that try a regex
only where a match can start (``_site.anchored_search``, ``repo_search._mentions_npu``), the
tokenizer-free line classifier of the replacement fast path, ``const_value`` without
``ast.literal_eval`` for plain names and constants, and file_facts' walk restricted to the node
types it reads. Each is checked against its reference here, piece by piece, and then as a whole:
every registry example (FUSE and KEEP) and a sample of real files is analysed with the fast
paths on and with every one of them swapped back for its reference, and the outcomes must be
identical (findings, replacements, near misses, risks, repo facts, problems).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import io
import random
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npufuse.patterns._site as S
from npufuse.patterns import affinity_index_put, affinity_where, attention, rms_norm, swiglu
from npufuse.patterns.registry import all_patterns
from npufuse.rewrite.codegen import source_lines
from npufuse.scan import dataflow, engine, replacement, repo_search
from npufuse.scan.dataflow import ModuleInfo

FAST_SEGMENT = dataflow.segment
FAST_LINES_WITH = dataflow.lines_with

ROOT = Path(__file__).resolve().parents[1]
_BIG_CORPORA = [ROOT / "bench" / ".data" / "transformers", ROOT / ".venv" / "transformers-site" / "transformers" / "models"]


def _example_codes() -> list[str]:
    codes = []
    for p in all_patterns():
        for ex in [*p.FUSE, *p.KEEP]:
            codes.append(ex.code)
    return codes


def _sample_files(n_big: int = 12) -> list[Path]:
    """The bundled repos' files, plus (where this machine has one) a fixed sample of a
    transformers corpus (never committed: bench/scan.py --fetch-transformers unpacks it)."""
    files = sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "tests" / "fixtures" / "scan_repo").rglob("*.py"))
    for corpus in _BIG_CORPORA:
        if corpus.is_dir():
            big = sorted(p for p in corpus.rglob("modeling_*.py"))
            files += random.Random(7).sample(big, min(n_big, len(big)))
            break
    return files


def _texts() -> list[str]:
    out = _example_codes()
    for p in _sample_files(6):
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return [t for t in out if _parses(t)]


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


# Files where the second round of gates and shortcuts has something to decide: a norm helper
# reached only by name (rms_norm's scope gate), a torch root through an import alias, ``**`` as
# unpacking and as a power, a module-level norm and rsqrt statistic (rms_norm's module lines), an
# index_put near miss (affinity_index_put's statement filter), an upper-case config switch read
# (the lower-cased regex), an HF attention_interface caller passing a bias (caller_bias's lines),
# non-ASCII lines (segment) and identifiers spelled with NFKC-normalised characters (every line
# filter must keep their lines).
GATE_CASES = [
    '''import torch
from torch import nn
from torch import rsqrt as r


class N(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


class M(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _alias(self, x):
        return x * r(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x, **kwargs):
        return self._norm(x.float()).type_as(x) * self.weight

    def other(self, x, **kw):
        y = f(**kw)
        return x * (x ** 2).mean(-1, keepdim=True) ** -0.5


class L(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm = N(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, hidden_states, residual):
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return hidden_states + self.mlp(residual)


def top(x, eps=1e-5):
    v = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(v + eps)


y = top(torch.ones(3))
z = torch.ones(3) / (torch.ones(3).sqrt() + 1e-6)
w = torch.zeros(3).index_put((torch.ones(3).nonzero(),), torch.ones(2))
s = torch.rsqrt(torch.ones(3).pow(2).mean(-1, keepdim=True) + 1e-6)


class Cfg:
    def forward(self, x):
        if self.config.USE_FUSED_NORM:
            return x
        return x


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = torch.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value)


class Attn:
    def forward(self, q, k, v, slopes):
        position_bias = slopes[:, None, None] * torch.arange(q.shape[-2])[None, None, :]  # graded: a bias by its dataflow
        # HF's dispatch through a registry (the caller never names the eager function: found by the word)
        attention_interface = ATTENTION_FUNCTIONS[self.impl]
        return attention_interface(self, q, k, v, position_bias, 0.1)


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward}
''',
    '''import torch
# é non-ASCII: ünïcode lines between the code (segment columns are bytes)
def attn(q, k, v, mask):  # «q» @ kᵀ
    s = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)  # ü
    s = s + mask
    p = torch.softmax(s, dim=-1)
    return p @ v


def a(x, m):
    x[m] = 0.0  # ä
    return x


class B:
    def forward(self, h, g, cond):
        # a blend: where cond holds, h, else g
        if self.config.use_\ufb02ash_attention:  # NFKC-normalised, a config switch read
            h = torch.\uff57here(cond, h.float(), g.float())  # NFKC-normalised, a torch blend
        return h

    def other(self, x):
        return x if self.config.use_fused_norm else -x


class C:
    def forward(self, x, rel_pos_bias):
        # calls attn with a float bias, spelled another way
        return \uff41ttn(x, x, x, rel_pos_bias * torch.arange(4.0))
''',
]

# names an inner scope rebinds after a loop (a comprehension's target, a lambda's / nested def's parameter),
# read in a comprehension's first iterable, in defaults and decorators (outside), and by closures (inside)
_INNER_SCOPES = """
def route(x, experts, gates):
    for e in experts:
        x = e(x)
    outs = [e(x) for e in experts if e is not None]
    firsts = [y for y in e.cache]
    table = {e: f(e) for e in experts for f in gates}
    pick = lambda e, k=e: e(k)
    def apply(e, scale=x):
        return e(scale) + x
    total = sum(g(e) for g in gates)
    return outs, firsts, table, pick, apply, total
"""

TEXTS = _texts() + GATE_CASES + [_INNER_SCOPES]


# -- reference implementations (the code the fast paths replaced) -------------------------------


def ref_walk_blocks(block: list[ast.stmt]) -> Iterator[tuple[list[ast.stmt], int, ast.stmt]]:
    for i, stmt in enumerate(block):
        yield block, i, stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from ref_walk_blocks(inner)
        for handler in getattr(stmt, "handlers", []) or []:
            yield from ref_walk_blocks(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            yield from ref_walk_blocks(case.body)


def ref_parents(body: list[ast.stmt]) -> dict[int, ast.stmt | None]:
    parent: dict[int, ast.stmt | None] = {}

    def walk(block: list[ast.stmt], owner: ast.stmt | None) -> None:
        for stmt in block:
            parent[id(stmt)] = owner
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    walk(inner, stmt)
            for handler in getattr(stmt, "handlers", []) or []:
                walk(handler.body, stmt)
            for case in getattr(stmt, "cases", []) or []:
                walk(case.body, stmt)

    walk(body, None)
    return parent


def ref_statements_bfs(tree: ast.Module) -> Iterator[ast.AST]:
    from collections import deque

    todo: deque[ast.AST] = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        for name in ("body", "handlers", "orelse", "finalbody", "cases"):
            block = getattr(node, name, None)
            if type(block) is list:
                todo.extend(block)


_REF_PARENTS: list[Any] = [None, {}]


def ref_killed(scope: Any, load: ast.Name, line: int) -> bool:
    """Reference of the s39 reaching-definition rule: a plain assignment to the name (``=`` or annotated with a value,
    not ``+=``, which reads the old value itself; tuple / starred targets too) starting after ``line`` stands earlier in a block whose later statements hold the
    read, and the read is not inside a nested function or lambda. "x holds the read" is asked of the read's chain of
    enclosing nodes (one walk of the scope per call), not by walking each x again: the same answers, linear time."""
    if _REF_PARENTS[0] is not scope.node:  # one scope's map at a time: the callers ask of one scope in a row
        _REF_PARENTS[:] = [scope.node, {id(c): n for n in ast.walk(scope.node) for c in ast.iter_child_nodes(n)}]
    parent = _REF_PARENTS[1]
    chain = [load]
    while id(chain[-1]) in parent:
        chain.append(parent[id(chain[-1])])
    holders = {id(n) for n in chain}
    for n in chain[1:]:
        if n is not scope.node and isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    for block, i, stmt in ref_walk_blocks(scope.body):
        if isinstance(stmt, (ast.For, ast.AsyncFor)) and stmt.lineno > line:
            # s42 (moe42): a loop's target is bound before each run of its body, so a read in the body sees
            # that binding (the iterable is evaluated before it: reads there stay uses)
            bound = {t.id for t in ast.walk(stmt.target) if isinstance(t, ast.Name)
                     and not any(isinstance(a, (ast.Attribute, ast.Subscript)) and any(x is t for x in ast.walk(a)) for a in ast.walk(stmt.target))}
            if load.id in bound and any(id(body_stmt) in holders for body_stmt in stmt.body):
                return True
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.lineno <= line:
            continue
        if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        bound = {t.id for tg in targets for t in ast.walk(tg) if isinstance(t, ast.Name)
                 and not any(isinstance(a, (ast.Attribute, ast.Subscript)) and any(x is t for x in ast.walk(a)) for a in ast.walk(tg))}
        if load.id in bound and any(id(later) in holders for later in block[i + 1:]):
            return True
    return False


def ref_outer_loads(scope_node: ast.AST) -> list[ast.Name]:
    """The Name loads of a scope that read its own variables: not a comprehension's target read inside it
    (Python 3 comprehensions have their own scope; their first iterable is evaluated outside), not a nested
    lambda's / def's parameter read in its body (defaults, decorators and annotations are evaluated outside)."""
    out: list[ast.Name] = []
    comps = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)

    def visit(node: ast.AST, shadow: frozenset[str]) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in shadow:
                out.append(node)
            return
        if isinstance(node, comps):
            bound = frozenset(n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name))
            visit(node.generators[0].iter, shadow)
            inner = shadow | bound
            for i, g in enumerate(node.generators):
                visit(g.target, inner)
                if i:
                    visit(g.iter, inner)
                for cond in g.ifs:
                    visit(cond, inner)
            for part in ((node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,)):
                visit(part, inner)
            return
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)) and node is not scope_node:
            a = node.args
            params = frozenset(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None)
            for child in ast.iter_child_nodes(node):
                if child is a:
                    for sub in ast.iter_child_nodes(a):
                        visit(sub, shadow)
            for outside in getattr(node, "decorator_list", []) + ([node.returns] if getattr(node, "returns", None) else []):
                visit(outside, shadow)
            for st_ in (node.body if isinstance(node.body, list) else [node.body]):
                visit(st_, shadow | params)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, shadow)

    visit(scope_node, frozenset())
    return out


def ref_const_value(node: ast.AST | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else ...
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ...


def ref_iter_exprs_topdown(node: ast.AST) -> Iterator[ast.expr]:
    stack: list[ast.AST] = [node]
    while stack:
        n = stack.pop()
        if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.expr):
            yield n
        children = list(ast.iter_child_nodes(n))
        children.reverse()
        stack.extend(children)


def ref_segment(module: ModuleInfo, node: ast.AST) -> str:
    """dataflow.segment before the ASCII shortcut: every line as UTF-8 bytes."""
    cache = module.__dict__.get("_ref_segment_lines")
    if cache is None:
        cache = module.__dict__["_ref_segment_lines"] = [ln.encode("utf-8") for ln in module.lines]
    lineno, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    col, end_col = getattr(node, "col_offset", None), getattr(node, "end_col_offset", None)
    if None in (lineno, end, col, end_col) or end > len(cache):
        return ast.unparse(node)
    if lineno == end:
        return cache[lineno - 1][col:end_col].decode("utf-8")
    parts = [cache[lineno - 1][col:]] + cache[lineno : end - 1] + [cache[end - 1][:end_col]]
    return b"".join(parts).decode("utf-8")


def ref_site_source_of(module: ModuleInfo, node: ast.AST) -> str:
    lines = S.module_lines(module)
    l0, l1 = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    c0, c1 = node.col_offset, node.end_col_offset
    if l0 == l1:
        return lines[l0].encode("utf-8")[c0:c1].decode("utf-8")
    parts = [lines[l0].encode("utf-8")[c0:].decode("utf-8")]
    parts += lines[l0 + 1 : l1]
    parts.append(lines[l1].encode("utf-8")[:c1].decode("utf-8"))
    return "".join(parts)


def ref_module_attr_ctor(self, func):
    """attention._Matcher._module_attr_ctor before its per-class table: one walk per call."""
    if not attention._is_self_attr(func):
        return None
    cls = self.module.classes.get(self.scope.class_name or "")
    if cls is None:
        return None
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and dataflow.dotted(node.targets[0]) == f"self.{func.attr}" and isinstance(node.value, ast.Call):
            return node.value
    return None


def ref_power_in_ast(text: str) -> bool:
    return any(isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Pow) for n in ast.walk(ast.parse(text)))


def ref_root_text(text: str) -> bool:
    return ("sqrt" in text or "0.5" in text or ".5" in text) and bool(rms_norm._TORCH_ROOT.search(text))


# -- the pieces -------------------------------------------------------------------------------------


def _trees() -> list[ast.Module]:
    return [ast.parse(t) for t in TEXTS]


def test_fast_walk_and_child_nodes_are_ast_walk_and_iter_child_nodes() -> None:
    odd = [ast.Name(), ast.Subscript(value=ast.Name("x", ast.Load())), ast.keyword(arg="a"), ast.Constant(value=ast.Name("n"))]
    for tree in [*_trees(), *odd]:
        want = list(ast.walk(tree))
        got = list(dataflow.fast_walk(tree))
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
        for n in want:
            kids = list(ast.iter_child_nodes(n))
            mine = dataflow.child_nodes(n)
            assert len(kids) == len(mine) and all(a is b for a, b in zip(kids, mine))
        assert [id(n) for n in S.iter_exprs_topdown(tree)] == [id(n) for n in ref_iter_exprs_topdown(tree)]


def test_scalar_fields_never_hold_nodes() -> None:
    """fast_walk skips fields named in _SCALAR_FIELDS: in no node class do they hold a node.
    One parse and one walk of every text: each node's own scalar fields are checked (s44 parsed and
    walked every text again for each class and field, 50 s of the suite for the same checks)."""
    node_classes = {c for c in vars(ast).values() if isinstance(c, type) and issubclass(c, ast.AST)}
    for tree in _trees():
        for n in ast.walk(tree):
            cls = type(n)
            if cls not in node_classes:
                continue
            for f in getattr(cls, "_fields", ()):
                if f in dataflow._SCALAR_FIELDS:
                    assert not isinstance(getattr(n, f, None), (ast.AST, list)), (cls.__name__, f)


def test_scope_listing_index_and_reads_match_the_references() -> None:
    for text in TEXTS:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        assert [id(n) for n in dataflow._statements_bfs(module.tree)] == [id(n) for n in ref_statements_bfs(module.tree)]
        for scope in module.scopes:
            want = list(ref_walk_blocks(scope.body))
            got = list(scope.statements())
            assert [(id(b), i, id(s)) for b, i, s in got] == [(id(b), i, id(s)) for b, i, s in want]
            parents = ref_parents(scope.body)
            listing, owners = scope.listing()
            assert [id(o) if o is not None else None for o in owners] == [id(parents[id(s)]) if parents[id(s)] is not None else None for _b, _i, s in listing]
            idx = S.stmt_index(scope)
            assert [id(s) for s in idx.stmts] == [id(s) for _b, _i, s in want]
            loads: dict[str, list[int]] = {}
            for n in ast.walk(scope.node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                    loads.setdefault(n.id, []).append(n.lineno)
            assert {k: [n.lineno for n in v] for k, v in scope.name_loads().items()} == loads
            # s36: reads of a name an inner scope binds (a comprehension's target, a nested lambda's parameter)
            # are not reads of the scope's variable (moe_experts M2): last_loads / uses_after leave them out
            outer: dict[str, list[int]] = {}
            for n in ref_outer_loads(scope.node):
                outer.setdefault(n.id, []).append(n.lineno)
            assert scope.last_loads() == {k: max(v) for k, v in outer.items()}
            calls = [n for n in ast.walk(scope.node) if isinstance(n, ast.Call)]
            assert [id(n) for n in scope.nodes().get(ast.Call, [])] == [id(n) for n in calls]
            outer_nodes = ref_outer_loads(scope.node)
            for name in list(loads)[:5]:
                for line in (0, scope.node.lineno if hasattr(scope.node, "lineno") else 1, 10**6):
                    want_used = any(ln > line for ln in outer.get(name, ()))
                    # s39: by reaching definition: a read that a rebinding made after `line` precedes in its block is not
                    # a use of the value at `line` (reads in nested functions / lambdas always count)
                    live = [n for n in outer_nodes if n.id == name and n.lineno > line and not ref_killed(scope, n, line)]
                    assert scope.uses_after(name, line) == bool(live)
                    assert (name in S._names_used_after(scope, line)) == want_used


def test_const_value_is_literal_eval() -> None:
    for tree in _trees():
        for n in ast.walk(tree):
            if isinstance(n, ast.expr):
                a, b = dataflow.const_value(n), ref_const_value(n)
                assert a == b or (a is ... and b is ...) or (a != a and b != b), ast.dump(n)
    assert dataflow.const_value(None) is ...


# -- text prefilters ---------------------------------------------------------------------------------

_ROOT_BITS = ["rsqrt", "sqrt(", "math.sqrt(", "np.sqrt(", "numpy.sqrt(", "x.sqrt()", "** -0.5", "**(-0.5)", "** 0.5", "**.5", "**-.5x",
              "pow(x, -0.5)", "pow(a(b), -0.5)", "pow(x, - .5 )", "0.5", ".5", " ", "\n", "_", "a", "(", ")", "*", "-", "\\b"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_ROOT_BITS), max_size=12))
def test_root_text_is_the_regex(bits: list[str]) -> None:
    text = "".join(bits)
    assert rms_norm._root_text(text) == ref_root_text(text)


def test_root_text_fast_path_is_on_and_exact_on_real_text() -> None:
    # an edited _TORCH_ROOT switches the fast path off (the anchors are derived from this regex)
    assert rms_norm._ROOT_FAST
    for text in TEXTS:
        for piece in [text, *text.splitlines()]:
            assert rms_norm._root_text(piece) == ref_root_text(piece)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="npuNPUiat_ 1.\n(", max_size=40))
def test_mentions_npu_is_the_regex(text: str) -> None:
    assert repo_search._mentions_npu(text) == (repo_search._NPU_TEXT.search(text) is not None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["foo", "bar", "f", " ", "(", "\n", "xfoo", "foo_", "#", "foo (", "bar\n("]), max_size=10))
def test_anchored_search_is_search(bits: list[str]) -> None:
    text = "".join(bits)
    rx = re.compile(r"\b(?:bar|foo)\s*\(")
    assert S.anchored_search(rx, text, ("bar", "foo")) == (rx.search(text) is not None)


def test_file_facts_reads_the_same_with_the_restricted_walk(monkeypatch) -> None:
    for text in TEXTS + ["import torch_npu\nimport os\nif os.environ.get('USE_NPU_FUSION'):\n    x = torch_npu.npu_rms_norm(a, b)\n"]:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        fast = repo_search.file_facts(module)
        monkeypatch.setattr(repo_search, "_FACT_TYPES", None)
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        slow = repo_search.file_facts(module)
        monkeypatch.undo()
        assert dataclasses.asdict(fast) == dataclasses.asdict(slow)


# -- the replacement's line classifier ----------------------------------------------------------------

_ODD_SPANS = [
    "x = f(a,\n      b)\n", "x = '(' + \"[\"\n", "y = 1  # (\n", "    # c\n    x = 1\n", "x = (\n\n    1)\n", "a = 's\n", "x = )\n",
    "x = (1,\n", "if a:\n        b = 1\n    c = 2\n", 's = """a\nb"""\n', "x = 1\n\n", "  \n", "#only\n", "a = {'k': [1,\n 2]}\n",
    "f(x)[0]\n", "x = 'a' 'b' \"#\"\n", "x = \\\n 1\n", "x = 'é'\n", "x = 1\r\n", "\tx = 1\n", "x = 1\x0c\n",
]


def _spans(text: str, rng: random.Random, n: int) -> Iterator[str]:
    lines = text.splitlines(keepends=True)
    for _ in range(n if lines else 0):
        a = rng.randrange(len(lines))
        yield "".join(lines[a : a + rng.choice([1, 2, 3, 5, 9])])


def test_plain_classifier_agrees_with_the_tokenizer() -> None:
    rng = random.Random(3)
    cases = list(_ODD_SPANS)
    for text in TEXTS:
        cases += list(_spans(text, rng, 40))
    covered = 0
    for case in cases:
        fast = replacement._classify_plain(case)
        if fast is replacement._UNCOVERED:
            continue
        covered += 1
        assert fast == replacement._classify_tokens(case), repr(case)
    assert covered > len(cases) // 2  # the fast path is the common one


# -- the second round: text tests, segment, code lines, line filters -----------------------------------

_CFG_BITS = ["config", "CONFIG", "Cfg", "cfg", ".", " . ", "\n", "_", "use_", "fus", "FUS", "npu", "Ascend", "flash", "liger",
             "x", "é", "\u0130", "\u0131", "\u017f", "\u212a", "conf\u0131g", "f\u016fs", "\u212a", "ſ", "→",
             # outside ASCII and no odd character: the bytes search first (spaces, word letters, marks)
             "\x1c", "\u3000", "\u00a0", "\u2028", "\u0301", "\u00c9", "\u4e2d", "é", "→", "\U0001f600"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_CFG_BITS), max_size=10))
def test_cfg_switch_text_is_the_regex(bits: list[str]) -> None:
    text = "".join(bits)
    assert repo_search._mentions_cfg_switch(text) == (repo_search._CFG_ATTR.search(text) is not None)


def test_cfg_switch_text_outside_ascii() -> None:
    """The bytes search that text outside ASCII goes through first: spaces, letters and marks
    outside ASCII between the parts, and near-misses of them."""
    for text in ("config.\u3000fus \u4e2d", "config\u00a0.\u00a0ascend", "cfg\x1c.\x1cnpu \u00e9", "config.\u00e9fused",
                 "config.a\u0301flash", "CONFIG.\u00c9FUS", "config.\u2028liger", "conf\u4e2dig.fus", "config\u4e2d.fus",
                 "config.hidden \u00e9", "cfg.fu\u00e9s", "\u4e2d config . use_fused"):
        assert repo_search._mentions_cfg_switch(text) == (repo_search._CFG_ATTR.search(text) is not None), text


def test_cfg_switch_text_on_real_files() -> None:
    for text in TEXTS:
        for piece in (text, text.upper(), text.replace("config", "conf\u0131g"), text + " cfg.\u017fus"):
            assert repo_search._mentions_cfg_switch(piece) == (repo_search._CFG_ATTR.search(piece) is not None)


_POW_BITS = ["x", "y", "2", "**", "**", "(", ")", ",", " ", "\n", "lambda ", "lambda", "kw", ":", "{", "}", "[", "]", "f", "=", "a.b", "-", "\\\n", "#c\n", "'s'"]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_POW_BITS), max_size=12))
def test_power_operator_never_misses_a_power(bits: list[str]) -> None:
    """rms_norm's text test may say yes too often, never no where the tree has a power."""
    text = "".join(bits)
    try:
        has = ref_power_in_ast(text)
    except (SyntaxError, ValueError):
        return
    if has:
        assert rms_norm._power_operator(text), text


def test_power_operator_on_real_scopes() -> None:
    cases = ["f(**kw)", "def f(a, **kw): pass", "g = lambda **kw: 0", "d = {**a, 'b': 1}", "x = a ** 2", "x **= 2", "x = (a\n ** 2)", "y = lambda: a ** 2"]
    for text in TEXTS + cases:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        for scope in module.scopes:
            if any(isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Pow) for n in ast.walk(scope.node)):
                assert rms_norm._power_operator(S.scope_text(module, scope))
    assert not rms_norm._power_operator("def f(self, x, **kwargs):\n    return g(x, **kwargs)\n")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="actgelusimhpfwnoyrsq ", max_size=30))
def test_act_search_is_the_word_test(text: str) -> None:
    assert any(w in text for w in swiglu._ACT_SEARCH) == any(w in text for w in swiglu._ACT_WORDS)


def test_segment_and_source_of_are_the_byte_versions() -> None:
    for text in TEXTS:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        for node in ast.walk(module.tree):
            if hasattr(node, "end_col_offset") and getattr(node, "lineno", None) is not None:
                assert FAST_SEGMENT(module, node) == ref_segment(module, node)
                assert S.source_of(module, node) == ref_site_source_of(module, node)
        for scope in module.scopes[1:]:  # a function's scope text is its segment (rope's could_rotate reads it)
            assert dataflow.scope_text(module, scope) == ref_segment(module, scope.node)


_LINE_BITS = ["a", "b = 1", " ", "\n", "\r\n", "\r", "\f", "\v", "\x1c", "\x85", "\u2028", "\u2029", "#", "é"]


@settings(max_examples=800, deadline=None)
@given(st.lists(st.sampled_from(_LINE_BITS), max_size=12))
def test_code_lines_are_source_lines(bits: list[str]) -> None:
    # a site's `code` is cut from module.lines (str.splitlines where it agrees): codegen's lines
    text = "".join(bits)
    assert ModuleInfo("m.py", text, ast.Module(body=[], type_ignores=[])).lines == source_lines(text)


def test_lines_with_and_calls_on_lines() -> None:
    for text in TEXTS + ["x = 1\r\ny = f(2)\n"]:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        names = sorted({n.func.id for n in ast.walk(module.tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)})[:6]
        words = tuple(names) or ("nothing",)
        lines = dataflow.lines_with(module, words)
        if "\r" in text:
            assert lines is None
            continue
        rows = text.split("\n")
        # lines outside ASCII are listed where a character of the file decomposes to ASCII
        folds = dataflow.folds_to_ascii(module)
        want = [i for i, row in enumerate(rows, 1) if any(w in row for w in words) or (folds and not row.isascii())]
        assert lines == want
        for scope in module.scopes:
            calls = [n for n in ast.walk(scope.node) if isinstance(n, ast.Call)]
            named = [n for n in calls if isinstance(n.func, ast.Name) and n.func.id in words]
            got = dataflow.calls_on_lines(scope.node, lines)
            order = {id(n): k for k, n in enumerate(calls)}
            assert [order[id(n)] for n in got] == sorted(order[id(n)] for n in got)  # the walk's order
            assert {id(n) for n in named} <= {id(n) for n in got}  # every call by one of the names


_SRC_FOLDERS = ["", "a", "a/b", "a/b/c", "a/c", "b", "b/a", "x/y/z"]
_SRC_KINDS = ["config_json", "config_yaml", "config_class", "dataclass", "class_defaults", "argparse", "other"]
_SRC_KEYS = ["hidden_size", "num_heads", "vocab", "dim", "eps"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_SRC_FOLDERS), st.sampled_from(["c.py", "config.json", "d.py"]), st.integers(1, 3),
                       st.sampled_from(_SRC_KINDS), st.dictionaries(st.sampled_from(_SRC_KEYS), st.integers(0, 9), max_size=3)), max_size=14),
    st.sampled_from(_SRC_FOLDERS),
    st.sampled_from([{}, {"batch_size": 8, "seq_len": None}, {"hidden_size": 3}]),
)
def test_nearest_sources_give_the_shapes_of_all_sources(raw, folder, overrides) -> None:
    """engine._NearestSources hands shapes_for only the sources it takes a value from; the
    result must be shapes_for's over all of them (ties of equal keys included)."""
    from npufuse.scan import config_shapes

    sources = [config_shapes.ConfigSource(f"{d}/{f}".lstrip("/"), line, kind, f, values) for d, f, line, kind, values in raw]
    file = f"{folder}/m.py".lstrip("/")
    nearest = engine._NearestSources(sources, overrides)
    used = nearest.used(file)
    assert config_shapes.shapes_for(file, used, overrides) == config_shapes.shapes_for(file, sources, overrides)
    # the first source per key, in distance order: the sources the sorted walk takes, in its order
    assert [id(x) for x in used] == [id(x) for x in nearest.used_by_sorting(file)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=4), st.lists(st.sampled_from(["a", "b", "c"]), max_size=4))
def test_folder_distance_is_the_common_prefix_rule(here, there) -> None:
    """config_shapes.folder_distance's shortcut for folders with different first parts gives
    the plain rule: levels up to an enclosing folder, else 100 + steps through the common one."""
    from npufuse.scan import config_shapes

    here, there = tuple(here), tuple(there)
    common = 0
    for a, b in zip(here, there):
        if a != b:
            break
        common += 1
    plain = len(here) - len(there) if here[: len(there)] == there else 100 + (len(here) - common) + (len(there) - common)
    assert config_shapes.folder_distance(here, there) == plain


_BYTE_BITS = [b"x = 1", b"\n", b"\r\n", b"\r", b"# -*- coding: latin-1 -*-", b"# coding=utf-8", b"# vim: set fileencoding=cp1252 :",
              b"\xef\xbb\xbf", b"\xe9", b"\xff\xfe", b"#", b" ", b"coding", b"# coding: nope", b"\x00", "é".encode(), b"\\"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_BYTE_BITS), max_size=8))
def test_read_source_decodes_as_with_detect_encoding(tmp_path_factory, bits: list[bytes]) -> None:
    path = tmp_path_factory.mktemp("enc") / "m.py"
    path.write_bytes(b"".join(bits))
    fast = engine.read_source(path, "m.py", 1 << 20)
    ref = engine._detect_encoding
    try:
        engine._detect_encoding = lambda data: tokenize.detect_encoding(io.BytesIO(data).readline)[0]
        slow = engine.read_source(path, "m.py", 1 << 20)
    finally:
        engine._detect_encoding = ref
    assert (fast[0], fast[1], fast[2] and fast[2].to_json()) == (slow[0], slow[1], slow[2] and slow[2].to_json())


def test_report_filters_remember_nothing_wrong(tmp_path, monkeypatch) -> None:
    """The report's memoised escaping filters give the plain functions' text, and forget it."""
    import json

    from npufuse.report import markdown

    root = tmp_path / "repo"
    for k, code in enumerate(_example_codes() + GATE_CASES):
        (root / f"d{k % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"d{k % 3}" / f"ex{k}.py").write_text(code, encoding="utf-8")
    scan = json.loads(engine.scan_repo(root, jobs=1).dumps())
    assert scan["candidates"] and scan["near_misses"]
    fast = markdown.render_markdown(scan, order_rule=engine.order_rule())
    assert not any(markdown._MEMOS)  # emptied after the render
    env = markdown._new_env()
    env.filters.update(md=markdown.md, code=markdown.code, tcode=markdown.tcode, cell=markdown.cell, prose=markdown.prose, tprose=markdown.tprose)
    monkeypatch.setattr(markdown, "_ENV", env)
    assert markdown.render_markdown(scan, order_rule=engine.order_rule()) == fast


def test_module_attr_ctor_table_is_the_walk() -> None:
    for text in TEXTS:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        for scope in module.scopes:
            if not scope.class_name or scope.class_name not in module.classes:
                continue  # a class made inside a function (an example's runnable stand-in) has no table entry
            m = attention._Matcher(module, scope, attention.BlockInterp(scope.body))
            attrs = sorted({n.attr for n in ast.walk(module.classes[scope.class_name]) if isinstance(n, ast.Attribute)} | {"nope"})
            for attr in attrs + attrs[::-1]:  # twice, in both orders: the table resumes its walk
                func = ast.Attribute(value=ast.Name("self", ast.Load()), attr=attr, ctx=ast.Load())
                assert m._module_attr_ctor(func) is ref_module_attr_ctor(m, func)


def test_assigned_names_are_computed_on_demand_alike() -> None:
    for text in TEXTS:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        for scope in module.scopes:
            lazy = attention._AssignedNames(scope.body)
            assert len(lazy) == len(scope.body)
            assert [lazy[j] for j in range(len(scope.body))] == [attention._assigned_names([s]) for s in scope.body]


# -- all of it, on and off -------------------------------------------------------------------------------


def _reference_paths(monkeypatch) -> None:
    """Swap every fast path back for the code it replaced (module attributes looked up at call time)."""
    walkers = {"fast_walk": ast.walk, "child_nodes": lambda n: list(ast.iter_child_nodes(n)), "const_value": ref_const_value}
    fast = {attr: getattr(dataflow, attr) for attr in walkers}
    for name, mod in list(sys.modules.items()):
        if name.startswith("npufuse.") and mod is not None:
            for attr, ref in walkers.items():
                if getattr(mod, attr, None) is fast[attr]:
                    monkeypatch.setattr(mod, attr, ref)
    monkeypatch.setattr(dataflow, "_block_list", lambda body: (list(ref_walk_blocks(body)), [ref_parents(body)[id(s)] for _b, _i, s in ref_walk_blocks(body)]))
    monkeypatch.setattr(dataflow, "_statements_bfs", ref_statements_bfs)
    monkeypatch.setattr(S, "iter_exprs_topdown", ref_iter_exprs_topdown)
    monkeypatch.setattr(S, "anchored_search", lambda rx, text, anchors: rx.search(text) is not None)
    monkeypatch.setattr(rms_norm, "_ROOT_FAST", False)
    monkeypatch.setattr(repo_search, "_mentions_npu", lambda src: repo_search._NPU_TEXT.search(src) is not None)
    monkeypatch.setattr(repo_search, "_FACT_TYPES", None)
    monkeypatch.setattr(replacement, "_classify_plain", lambda text: replacement._UNCOVERED)
    import npufuse.patterns.attention as attention

    monkeypatch.setattr(attention, "_shallow_copy", copy.copy)
    # the second round of gates and shortcuts
    monkeypatch.setattr(repo_search, "_mentions_cfg_switch", lambda src: repo_search._CFG_ATTR.search(src) is not None)
    monkeypatch.setattr(rms_norm, "_SCOPE_GATE", False)
    monkeypatch.setattr(rms_norm, "_MODULE_ROOT_LINES", False)
    monkeypatch.setattr(affinity_index_put, "_STMT_FILTER", False)
    monkeypatch.setattr(swiglu, "_ACT_SEARCH", swiglu._ACT_WORDS)
    monkeypatch.setattr(attention, "_AssignedNames", lambda block: [attention._assigned_names([s]) for s in block])
    monkeypatch.setattr(attention._Matcher, "_module_attr_ctor", ref_module_attr_ctor)
    monkeypatch.setattr(dataflow, "segment", ref_segment)
    for name, mod in list(sys.modules.items()):
        if name.startswith("npufuse.") and mod is not None and getattr(mod, "segment", None) is FAST_SEGMENT:
            monkeypatch.setattr(mod, "segment", ref_segment)
    monkeypatch.setattr(S, "source_of", ref_site_source_of)
    monkeypatch.setattr(ModuleInfo, "lines", property(lambda self: source_lines(self.source)))
    monkeypatch.setattr(engine, "_detect_encoding", lambda data: tokenize.detect_encoding(io.BytesIO(data).readline)[0])
    monkeypatch.setattr(repo_search, "_PRUNE", False)
    monkeypatch.setattr(affinity_where, "_LINE_FILTER", False)
    monkeypatch.setattr(attention, "_CALLER_LINES", False)


def _outcome(o: engine.FileOutcome) -> dict[str, Any]:
    return {
        "parsed": o.parsed, "lines": o.lines, "failures": [f.to_json() for f in o.failures], "near": o.near_misses,
        "hits": [(h.finding.to_json(), h.context, h.local_risks, h.code, h.body) for h in o.hits],
        "facts": dataclasses.asdict(o.facts) if o.facts is not None else None, "source": o.source is not None,
    }


def _analyze_all(paths: list[tuple[Path, str]]) -> list[dict[str, Any]]:
    patterns = all_patterns()
    return [_outcome(engine.analyze_file(root, rel, patterns, engine.ScanOptions())) for root, rel in paths]


def test_every_example_and_sample_file_analyses_the_same_with_the_fast_paths_off(tmp_path, monkeypatch) -> None:
    paths: list[tuple[Path, str]] = []
    for k, code in enumerate(_example_codes() + GATE_CASES):
        (tmp_path / f"ex{k}.py").write_text(code, encoding="utf-8")
        paths.append((tmp_path, f"ex{k}.py"))
    for p in _sample_files():
        paths.append((p.parent, p.name))
    fast = _analyze_all(paths)
    assert sum(len(o["hits"]) for o in fast) > 10  # the sample does exercise the detectors
    _reference_paths(monkeypatch)
    slow = _analyze_all(paths)
    for (root, rel), a, b in zip(paths, fast, slow):
        assert a == b, f"{root / rel}: the fast paths change the outcome"


_BROKEN = {
    # each a plausible but wrong shortcut: the on/off comparison above must notice it
    "rms_norm scope gate without helper names": (rms_norm, "_reaches_root", lambda module, scope: "sqrt" in S.scope_text(module, scope)),
    "rms_norm module lines: the first only": (rms_norm, "_module_root_lines", lambda module, scope, lines: [i for i in [rms_norm._first_root_line(lines)] if i]),
    "affinity_index_put statements: no index_put forms": (affinity_index_put, "_may_yield", lambda stmt: isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Subscript)),
    "config-switch lines without the non-ASCII ones": (repo_search, "_NON_ASCII", re.compile(r"(?!)")),
    "lines_with without the non-ASCII lines": (dataflow, "_NON_ASCII", re.compile(r"(?!)")),
    "caller_bias lines: the eager function's name only": (attention, "lines_with", lambda module, words: FAST_LINES_WITH(module, words[:1]) if len(words) == 2 else FAST_LINES_WITH(module, words)),
    "config switch text: the regex without IGNORECASE": (repo_search, "_mentions_cfg_switch", lambda src: re.search(repo_search._CFG_ATTR.pattern, src) is not None),
}


@pytest.mark.parametrize("name", sorted(_BROKEN))
def test_a_broken_shortcut_is_caught(name: str, tmp_path, monkeypatch) -> None:
    """The comparison can fail: with one shortcut deliberately broken, the gate cases analyse
    differently from the reference paths."""
    paths = []
    for k, code in enumerate(GATE_CASES):
        (tmp_path / f"g{k}.py").write_text(code, encoding="utf-8")
        paths.append((tmp_path, f"g{k}.py"))
    owner, attr, broken = _BROKEN[name]
    with monkeypatch.context() as m:
        m.setattr(owner, attr, broken)
        wrong = _analyze_all(paths)
    _reference_paths(monkeypatch)
    assert _analyze_all(paths) != wrong, name


def test_reference_switch_reaches_the_detectors(monkeypatch) -> None:
    """The on/off comparison above is only worth something if the swap reaches the modules
    that call the helpers: every npufuse module binding fast_walk gets the reference."""
    import npufuse.patterns.attention as attention
    import npufuse.patterns.swiglu as swiglu

    _reference_paths(monkeypatch)
    assert attention.fast_walk is ast.walk and swiglu.fast_walk is ast.walk and S.fast_walk is ast.walk
    assert replacement._classify("x = 1\n") == ["logical"]  # through the tokenizer now


def test_tokenizer_classify_reference_is_unchanged() -> None:
    # _classify_tokens is the original _classify: spot-check it against tokenize directly
    kinds = replacement._classify_tokens("x = (\n    1)\n\n# c\ny = 2\n")
    assert kinds == ["logical", "cont", "blank", "comment", "logical"]
    assert list(tokenize.generate_tokens(io.StringIO("x = 1\n").readline))


def test_lone_backslash_files_are_near_misses_not_candidates(tmp_path) -> None:
    body = "import torch\n\n\ndef f(self, x):\n    variance = x.pow(2).mean(-1, keepdim=True)\n    x = x * torch.rsqrt(variance + self.eps)\n    return self.weight * x\n"
    (tmp_path / "ok.py").write_text(body)
    (tmp_path / "bad.py").write_text(body.replace("import torch\n", "import torch\n\\\nimport os\n", 1))
    (tmp_path / "str.py").write_text(body + "s = 'a\\\\'\n")  # a backslash in a string: nothing to refuse
    # a lone backslash before a blank line: libcst reproduces that file, so apply rewrites it
    (tmp_path / "blank.py").write_text(body.replace("import torch\n", "import torch\n\\\n", 1))
    patterns = all_patterns()
    out = {name: engine.analyze_file(tmp_path, f"{name}.py", patterns, engine.ScanOptions()) for name in ("ok", "bad", "str", "blank")}
    for name in ("ok", "str", "blank"):
        assert [h.finding.pattern for h in out[name].hits] == ["rms_norm"], name
    assert not out["bad"].hits
    assert [(m["pattern"], m["line"]) for m in out["bad"].near_misses] == [("rms_norm", 7)]
    assert "line 2 holds only a backslash continuation" in out["bad"].near_misses[0]["reason"]


@pytest.mark.parametrize("text", ["x = 1\n", "s = '\\\\'\n", "x = (1 +\n     2)\n"])
def test_apply_refuses_only_files_libcst_cannot_reproduce(text: str) -> None:
    assert engine._apply_refuses(text) == ""
    assert engine._apply_refuses("\\\n" + text).startswith("apply cannot rewrite this file")
