"""Spelling robustness of detection: each pattern's own examples respelled, semantics unchanged.

    .venv/bin/python bench/detect_spellings.py [--only PATTERNS] [--transforms NAMES] [--limit N] [--list]

Issue 14 asks that spelling, not semantics, stop deciding what the scan finds. Blind labels measure
that on unseen repositories, but only a few dozen sites at a time; this bench measures it on every
example the patterns carry. Each ``Fuse`` / ``Keep`` example is rewritten by each transform below (a
change of spelling that keeps what the code computes: an alias, a method for a function, a local
name, a temporary), then:

* the respelled program is run (plain PyTorch, the example's ``run`` script) against the original:
  a transform that changes the outputs is a bug of the transform and the case is dropped (counted
  as ``n/a``), so every counted case is a true equivalent;
* ``found``: the pattern still reports a candidate on the respelled ``Fuse`` example;
* ``wrong``: found, but its replacement, run under the emulator, is not the original's result
  (cosine < 0.9999 on outputs or gradients, other dtype/shape, or the fused branch never ran): a
  precision bug the spelling exposes, the worst outcome;
* ``flipped``: a respelled ``Keep`` example became a candidate (the original's refusal depended on
  spelling; not always wrong, always worth a look).

Prints a table per pattern x transform (found / cases, wrong, flipped) and, with ``--list``, each
lost, wrong or flipped case. Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# bench/ itself off the path: its profile.py would shadow the stdlib module torch._dynamo imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the example harness (detect_all, check_rewrite_runs)


# ---------------------------------------------------------------------------------------------
# Transforms: each takes a module's AST and returns a new one (or None: nothing to respell)
# ---------------------------------------------------------------------------------------------
def _torch_aliases(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name == "torch" and a.asname is None for a in n.names) for n in tree.body)


def _insert_after_imports(tree: ast.Module, stmts: list[ast.stmt]) -> None:
    last = 0
    for i, n in enumerate(tree.body):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            last = i + 1
        elif not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)):
            break
    tree.body[last:last] = stmts


class _Renamer(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.mapping:
            return ast.copy_location(ast.Name(self.mapping[node.id], node.ctx), node)
        return node


def torch_as_th(tree: ast.Module) -> ast.Module | None:
    """``torch.x`` written ``th.x`` (``import torch as th``); ``import torch`` stays for the run scripts."""
    if not _torch_aliases(tree):
        return None
    body_uses = [n for s in tree.body if not isinstance(s, (ast.Import, ast.ImportFrom)) for n in ast.walk(s)]
    if not any(isinstance(n, ast.Name) and n.id == "torch" for n in body_uses) or any(isinstance(n, ast.Name) and n.id == "th" for n in body_uses):
        return None
    new = ast.Module(body=[s if isinstance(s, (ast.Import, ast.ImportFrom)) else _Renamer({"torch": "th"}).visit(s) for s in tree.body],
                     type_ignores=[])
    _insert_after_imports(new, [ast.Import(names=[ast.alias("torch", "th")])])
    return new


def functional_spelled_out(tree: ast.Module) -> ast.Module | None:
    """``F.silu(x)`` written ``torch.nn.functional.silu(x)``."""
    alias = None
    for n in tree.body:
        if isinstance(n, ast.Import):
            alias = next((a.asname for a in n.names if a.name == "torch.nn.functional" and a.asname), alias)
    if alias is None or not _torch_aliases(tree):
        return None

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.value, ast.Name) and node.value.id == alias:
                Spell.hits += 1
                return ast.copy_location(ast.Attribute(ast.parse("torch.nn.functional", mode="eval").body, node.attr, node.ctx), node)
            return node

    new = Spell().visit(tree)
    return new if Spell.hits else None


def _fn_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]}


def renamed_locals(tree: ast.Module) -> ast.Module | None:
    """Every local a function assigns (not its parameters, globals or ``self``) gets a neutral name
    (``v0``, ``v1``, ...): names carry no meaning the scan may rely on."""
    hits = 0

    class PerFunction(ast.NodeTransformer):
        def visit_FunctionDef(self, fn: ast.FunctionDef) -> ast.AST:
            nonlocal hits
            self.generic_visit(fn)  # inner functions first: their own locals
            params = _fn_params(fn)
            declared = {name for n in ast.walk(fn) if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
            inner = {id(x) for n in ast.walk(fn) if n is not fn and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
                     for x in ast.walk(n)}
            stored = []
            for n in ast.walk(fn):
                if id(n) in inner:
                    continue
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in params and n.id not in declared and n.id not in stored:
                    stored.append(n.id)
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            mapping, k = {}, 0
            for name in stored:
                while f"v{k}" in used or f"v{k}" in params:
                    k += 1
                mapping[name] = f"v{k}"
                k += 1
            if not mapping:
                return fn
            hits += len(mapping)
            ren = _Renamer(mapping)
            fn.body = [ren.visit(s) for s in fn.body]
            return fn

        visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    new = PerFunction().visit(tree)
    return new if hits else None


def _pure(node: ast.AST) -> bool:
    """A name or an attribute chain of names: reading it twice reads the same value."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def square_spellings(tree: ast.Module) -> ast.Module | None:
    """``x.pow(2)`` / ``torch.pow(x, 2)`` / ``x ** 2`` / ``torch.square(x)``: each written as the next one in
    that cycle (``x * x`` where x is a plain name)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            two = lambda a: isinstance(a, ast.Constant) and a.value == 2  # noqa: E731
            if isinstance(f, ast.Attribute) and f.attr == "pow" and len(node.args) == 1 and two(node.args[0]) and not node.keywords \
                    and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
                Spell.hits += 1
                if _pure(f.value):
                    return ast.copy_location(ast.BinOp(f.value, ast.Mult(), copy.deepcopy(f.value)), node)
                return ast.copy_location(ast.BinOp(f.value, ast.Pow(), ast.Constant(2)), node)
            if isinstance(f, ast.Attribute) and f.attr == "square" and isinstance(f.value, ast.Name) and f.value.id == "torch" \
                    and len(node.args) == 1 and not node.keywords:
                Spell.hits += 1
                return ast.copy_location(ast.Call(ast.Attribute(node.args[0], "pow", ast.Load()), [ast.Constant(2)], []), node)
            return node

        def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant) and node.right.value == 2:
                Spell.hits += 1
                return ast.copy_location(ast.Call(ast.parse("torch.square", mode="eval").body, [node.left], []), node)
            return node

    new = Spell().visit(tree)
    return new if Spell.hits else None


# tensor methods that have a torch function of the same name taking the tensor first
_METHOD_FUNCS = frozenset(("softmax", "sigmoid", "rsqrt", "sqrt", "exp", "tanh", "matmul", "bmm", "mean", "sum", "cat", "chunk",
                           "split", "transpose", "reshape", "unsqueeze", "masked_fill", "where", "einsum", "baddbmm", "stack",
                           "flatten", "square", "neg", "abs", "pow", "mul", "add", "sin", "cos", "outer", "view_as_complex", "permute", "tile", "flip",
                           "view_as_real", "polar", "clamp", "var", "narrow", "roll", "gather", "topk", "index_select"))
_FUNC_TO_METHOD = frozenset(("softmax", "sigmoid", "rsqrt", "sqrt", "exp", "tanh", "matmul", "bmm", "mean", "sum", "chunk", "split",
                             "transpose", "reshape", "unsqueeze", "masked_fill", "flatten", "neg", "pow", "mul", "add", "sin", "cos",
                             "clamp", "var", "narrow", "roll", "gather", "topk", "index_select"))


def functions_as_methods(tree: ast.Module) -> ast.Module | None:
    """``torch.rsqrt(v)`` written ``v.rsqrt()``, ``torch.matmul(a, b)`` ``a @ b`` (first argument a plain
    expression, no ``out=``)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" and node.args) \
                    or any(k.arg in ("out", "input") or k.arg is None for k in node.keywords) \
                    or any(isinstance(a, ast.Starred) for a in node.args):
                return node
            if f.attr == "matmul" and len(node.args) == 2 and not node.keywords:
                Spell.hits += 1
                return ast.copy_location(ast.BinOp(node.args[0], ast.MatMult(), node.args[1]), node)
            if f.attr in _FUNC_TO_METHOD:
                Spell.hits += 1
                return ast.copy_location(ast.Call(ast.Attribute(node.args[0], f.attr, ast.Load()), node.args[1:], node.keywords), node)
            return node

    new = Spell().visit(tree)
    return new if Spell.hits else None


def methods_as_functions(tree: ast.Module) -> ast.Module | None:
    """``x.softmax(-1)`` written ``torch.softmax(x, -1)``, ``a @ b`` ``torch.matmul(a, b)``; only methods that
    are torch functions with the tensor first, on receivers that are not modules or ``torch`` itself."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.op, ast.MatMult):
                Spell.hits += 1
                return ast.copy_location(ast.Call(ast.parse("torch.matmul", mode="eval").body, [node.left, node.right], []), node)
            return node

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if not isinstance(f, ast.Attribute) or f.attr not in _METHOD_FUNCS or f.attr in ("cat", "stack", "einsum", "where", "polar"):
                return node
            recv = f.value
            # module names, ``self``/``self.x`` (may be modules or parameters: both fine for tensor methods, but a
            # Module has no softmax): only receivers that are computed values or plain local names
            root = recv
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "F", "nn", "math", "np", "numpy", "self", "einops"):
                return node
            if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
                return node
            Spell.hits += 1
            args = node.args
            if f.attr in ("reshape", "permute", "tile", "flip") and len(args) > 1:
                args = [ast.Tuple(list(args), ast.Load())]  # x.reshape(a, b) is torch.reshape(x, (a, b))
            return ast.copy_location(ast.Call(ast.Attribute(ast.Name("torch", ast.Load()), f.attr, ast.Load()), [recv, *args], node.keywords), node)

    if not _torch_aliases(tree):
        return None
    new = Spell().visit(tree)
    return new if Spell.hits else None


_DIM_FIRST = {"softmax": 0, "log_softmax": 0, "mean": 0, "sum": 0, "amax": 0, "var": 0, "norm": 1, "cat": 0, "stack": 0}


def dim_as_keyword(tree: ast.Module) -> ast.Module | None:
    """A positional reduction / softmax / cat axis given as ``dim=`` (``x.mean(-1, keepdim=True)`` ->
    ``x.mean(dim=-1, keepdim=True)``; ``torch.cat([a, b], -1)`` -> ``torch.cat([a, b], dim=-1)``)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if not isinstance(f, ast.Attribute) or f.attr not in ("softmax", "log_softmax", "mean", "sum", "amax", "var", "cat", "stack", "chunk"):
                return node
            is_fn = isinstance(f.value, ast.Name) and f.value.id in ("torch", "F")
            pos = 1 if is_fn else 0
            if f.attr == "chunk":
                pos += 1  # chunk(x, n, dim) / x.chunk(n, dim)
            if len(node.args) != pos + 1 or any(k.arg == "dim" for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
                return node
            if f.attr in ("var",):
                return node  # var's second positional is unbiased in some signatures
            Spell.hits += 1
            return ast.copy_location(ast.Call(f, node.args[:pos], [ast.keyword("dim", node.args[pos]), *node.keywords]), node)

    new = Spell().visit(tree)
    return new if Spell.hits else None


def hoisted_temporaries(tree: ast.Module) -> ast.Module | None:
    """``y = f(g(x), z)`` written ``t = g(x); y = f(t, z)``: the first call argument of a call that is itself a
    call or an arithmetic expression becomes its own statement (once per assignment)."""
    hits = 0

    class Hoist(ast.NodeTransformer):
        def _block(self, body: list[ast.stmt], used: set[str]) -> list[ast.stmt]:
            nonlocal hits
            out: list[ast.stmt] = []
            for s in body:
                for field in ("body", "orelse", "finalbody"):
                    if isinstance(getattr(s, field, None), list) and not isinstance(s, (ast.ClassDef,)):
                        setattr(s, field, self._block(getattr(s, field), used))
                if isinstance(s, (ast.Assign, ast.Return)) and s.value is not None:
                    picked = _hoistable(s.value)
                    if picked is not None:
                        parent, field, index = picked
                        k = 0
                        while f"h{k}" in used:
                            k += 1
                        name = f"h{k}"
                        used.add(name)
                        sub = getattr(parent, field) if index is None else getattr(parent, field)[index]
                        out.append(ast.Assign([ast.Name(name, ast.Store())], sub, lineno=0))
                        if index is None:
                            setattr(parent, field, ast.Name(name, ast.Load()))
                        else:
                            getattr(parent, field)[index] = ast.Name(name, ast.Load())
                        hits += 1
                out.append(s)
            return out

        def visit_FunctionDef(self, fn: ast.FunctionDef) -> ast.AST:
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | _fn_params(fn)
            fn.body = self._block(fn.body, used)
            return fn

        visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    new = Hoist().visit(tree)
    return new if hits else None


def _hoistable(value: ast.expr) -> tuple[ast.AST, str, int | None] | None:
    """Where in ``value`` a sub-expression can become a temporary: (parent, field, index in the field's list).
    A call's first argument that is a call or arithmetic, else a method call's receiver that is one; an
    arithmetic expression's operand that is a call."""
    if isinstance(value, ast.Call):
        for i, a in enumerate(value.args):
            if isinstance(a, (ast.Call, ast.BinOp)):
                return value, "args", i
        if isinstance(value.func, ast.Attribute) and isinstance(value.func.value, (ast.Call, ast.BinOp)):
            return value.func, "value", None
    if isinstance(value, ast.BinOp):
        for field in ("left", "right"):
            if isinstance(getattr(value, field), ast.Call):
                return value, field, None
    return None


def view_as_reshape(tree: ast.Module) -> ast.Module | None:
    """``x.view(a, b)`` written ``x.reshape(a, b)`` (same values; reshape copies only where view would fail)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "view" and node.args and not node.keywords \
                    and not any(isinstance(a, ast.Attribute) and a.attr.endswith(("float32", "float16", "bfloat16", "int8", "uint8"))
                                or isinstance(a, ast.Attribute) and a.attr == "dtype" for a in node.args):
                Spell.hits += 1
                node.func = ast.Attribute(f.value, "reshape", ast.Load())
            return node

    new = Spell().visit(tree)
    return new if Spell.hits else None


def softmax_spellings(tree: ast.Module) -> ast.Module | None:
    """``F.softmax(x, dim=d)`` / ``nn.functional.softmax`` written ``torch.softmax(x, dim=d)`` and ``x.softmax(d)``
    written ``torch.softmax(x, d)`` (the same function)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if not (isinstance(f, ast.Attribute) and f.attr == "softmax") or any(k.arg in (None, "_stacklevel") for k in node.keywords):
                return node
            head = ast.unparse(f.value)
            if head in ("F", "nn.functional", "torch.nn.functional") and node.args:
                Spell.hits += 1
                node.func = ast.parse("torch.softmax", mode="eval").body
            return node

    if not _torch_aliases(tree):
        return None
    new = Spell().visit(tree)
    return new if Spell.hits else None


def transpose_axes_swapped(tree: ast.Module) -> ast.Module | None:
    """``x.transpose(-2, -1)`` written ``x.transpose(-1, -2)`` (a transpose of two axes is symmetric)."""

    class Spell(ast.NodeTransformer):
        hits = 0

        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("transpose", "swapaxes") and len(node.args) == 2 and not node.keywords:
                Spell.hits += 1
                node.args = [node.args[1], node.args[0]]
            return node

    new = Spell().visit(tree)
    return new if Spell.hits else None


def unparsed(tree: ast.Module) -> ast.Module | None:
    """The same program, printed by ``ast.unparse`` (the baseline of every other transform's formatting)."""
    return tree


TRANSFORMS: dict[str, Callable[[ast.Module], ast.Module | None]] = {
    "unparsed": unparsed,
    "torch_as_th": torch_as_th,
    "functional_spelled_out": functional_spelled_out,
    "renamed_locals": renamed_locals,
    "square_spellings": square_spellings,
    "functions_as_methods": functions_as_methods,
    "methods_as_functions": methods_as_functions,
    "dim_as_keyword": dim_as_keyword,
    "hoisted_temporaries": hoisted_temporaries,
    "view_as_reshape": view_as_reshape,
    "softmax_spellings": softmax_spellings,
    "transpose_axes_swapped": transpose_axes_swapped,
}


def respell(code: str, name: str) -> str | None:
    """``code`` respelled by transform ``name`` (None: nothing to respell, or the result does not compile)."""
    tree = TRANSFORMS[name](copy.deepcopy(ast.parse(code)))
    if tree is None:
        return None
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n"
    try:
        compile(text, "<respelled>", "exec")
    except SyntaxError:
        return None
    return text


# ---------------------------------------------------------------------------------------------
# Judging one case
# ---------------------------------------------------------------------------------------------
def _same_outputs(code_a: str, code_b: str, run: str) -> bool:
    from pattern_harness import _exec, _run, cosine

    try:
        a_out, a_grad = _run(_exec(code_a, "a"), run)
        b_out, b_grad = _run(_exec(code_b, "b"), run)
    except Exception:  # noqa: BLE001 - a respelling that does not run is the transform's failure: not counted
        return False
    if len(a_out) != len(b_out) or len(a_grad) != len(b_grad):
        return False
    for x, y in zip(a_out, b_out):
        if x.dtype != y.dtype or x.shape != y.shape or cosine(x.float(), y.float()) < 0.99999:
            return False
    return all((x is None) == (y is None) and (x is None or cosine(x.float(), y.float()) >= 0.99999) for x, y in zip(a_grad, b_grad))


def judge(pattern: Any, example: Any, kind: str, transform: str) -> tuple[str, str]:
    """(outcome, detail): outcome one of n/a, found, lost, wrong (fuse); kept, flipped (keep)."""
    from pattern_harness import check_rewrite_runs, detect_all

    code = respell(example.code, transform)
    if code is None:
        return "n/a", "nothing to respell"
    run = getattr(example, "run", "")
    if run and not _same_outputs(example.code, code, run):
        return "n/a", "the respelling changes the outputs (a transform bug)"
    try:
        findings, misses = detect_all(pattern, code)
    except Exception as exc:  # noqa: BLE001 - a detector crash is a finding of this bench
        return ("lost" if kind == "fuse" else "kept"), f"detector raised {type(exc).__name__}: {exc}"
    if kind == "keep":
        return ("flipped", "") if findings else ("kept", "")
    if not findings:
        return "lost", misses[0].reason if misses else "no near miss either"
    if not run:
        return "found", ""
    try:
        facts = check_rewrite_runs(pattern, code, run, findings)
    except Exception as exc:  # noqa: BLE001
        return "wrong", f"the rewritten program failed: {type(exc).__name__}: {exc}"
    ok = (facts["calls"] >= 1 and facts["n_out"][0] == facts["n_out"][1] and all(a == b for a, b in facts["dtypes"])
          and all(a == b for a, b in facts["shapes"]) and min(facts["cos_out"], default=1.0) >= 0.9999
          and min(facts["cos_grad"], default=1.0) >= 0.9999)
    if ok:
        return "found", ""
    return "wrong", f"calls {facts['calls']}, cos out {min(facts['cos_out'], default=1.0):.5f}, cos grad {min(facts['cos_grad'], default=1.0):.5f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated pattern ids")
    ap.add_argument("--transforms", default="", help="comma-separated transform names (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="at most N examples of each kind per pattern")
    ap.add_argument("--no-keep", action="store_true", help="skip the Keep examples")
    ap.add_argument("--list", action="store_true", help="print each lost / wrong / flipped case")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from npufuse.patterns.registry import all_patterns

    names = [t for t in (args.transforms.split(",") if args.transforms else TRANSFORMS) if t]
    unknown = [t for t in names if t not in TRANSFORMS]
    if unknown:
        print(f"unknown transform(s): {', '.join(unknown)}; known: {', '.join(TRANSFORMS)}", file=sys.stderr)
        return 2
    only = {p for p in args.only.split(",") if p}
    patterns = [p for p in all_patterns() if not only or p.id in only]
    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    listed: list[str] = []
    t0 = time.perf_counter()
    for p in patterns:
        kinds = [("fuse", p.FUSE)] + ([] if args.no_keep else [("keep", p.KEEP)])
        for kind, examples in kinds:
            for i, ex in enumerate(examples[: args.limit or None]):
                for t in names:
                    outcome, detail = judge(p, ex, kind, t)
                    counts[(p.id, t)][outcome] += 1
                    if outcome in ("lost", "wrong", "flipped"):
                        listed.append(f"{outcome:8} {p.id:16} {t:22} {ex.name or f'#{i}'}: {detail}")
        print(f"{p.id}: done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)

    print("| pattern | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    total: dict[str, Counter[str]] = defaultdict(Counter)
    for p in patterns:
        cells = []
        for t in names:
            c = counts[(p.id, t)]
            total[t].update(c)
            cells.append(_cell(c))
        print(f"| {p.id} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(_cell(total[t]) for t in names) + " |")
    print("\ncell: found / respelled Fuse examples; `w` wrong replacements; `f` respelled Keep examples that became candidates")
    lost = sum(c["lost"] for c in total.values())
    cases = sum(c["found"] + c["lost"] + c["wrong"] for c in total.values())
    print(f"fuse cases {cases}: found {cases - lost - sum(c['wrong'] for c in total.values())}, lost {lost}, "
          f"wrong {sum(c['wrong'] for c in total.values())}; keep cases flipped {sum(c['flipped'] for c in total.values())}"
          f" of {sum(c['flipped'] + c['kept'] for c in total.values())}; {time.perf_counter() - t0:.0f}s")
    if args.list:
        print("\n" + "\n".join(listed))
    return 0


def _cell(c: Counter[str]) -> str:
    n = c["found"] + c["lost"] + c["wrong"]
    if not n and not c["flipped"]:
        return "—"
    s = f"{c['found']}/{n}"
    if c["wrong"]:
        s += f" **{c['wrong']}w**"
    if c["flipped"]:
        s += f" {c['flipped']}f"
    return s


if __name__ == "__main__":
    raise SystemExit(main())
