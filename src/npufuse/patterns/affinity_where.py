"""``affinity_where``: ``torch.where(cond, a, b)`` blends of two float tensors → ``torch.lerp``.

The Ascend PyTorch tuning guide gives ``bboxes = torch.where(bboxes < min_xy, min_xy, bboxes)``
→ ``torch.lerp(bboxes, min_xy, (bboxes < min_xy).float())`` as an affinity rewrite (SelectV2
with broadcasting is slow on NPU; Lerp is a plain vector op). With a 0/1 weight, lerp gives
exactly ``a`` or ``b`` for finite inputs (``end - (end - start) * 0`` and ``start + 0 * (...)``);
if ``a``/``b`` can be ±inf/NaN, or ``a - b`` overflows, the weight-0 side turns into NaN, so
branches that are provably infinite are near misses and the rest carry that risk.

The fused statement binds the three operands once and falls back to ``torch.where`` at runtime
when the branches are not two tensors of one floating dtype — so it is exact where lerp cannot
be, and never fails on a dtype the static analysis could not see.
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_left
from typing import Any, Iterable, Optional

from npufuse.patterns.affinity_index_put import _param_annotation, _param_default, is_bool_mask, is_inf, is_scalar
from npufuse.patterns._affinity_where_s45audit import attribute_ratio
from npufuse.patterns._affinity_where_s46audit import sanitised_divisor_reason
from npufuse.patterns._affinity_where_s44audit import constant_number, host_scalar_tensor, missing_values_mask, nonzero_constant_divisor, quoted
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.bound_callee import self_attribute_stores
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword, lines_with, scope_text, segment
from npufuse.scan.value import symbolic

_ID = "affinity_where"
P = "_npufuse_"
_INT_DTYPES = {"long", "int", "int64", "int32", "int16", "int8", "uint8", "short", "bool"}
_INT_METHODS = {"long", "int", "short", "bool", "argmax", "argmin", "argsort", "nonzero"}
_INT_FUNCS = {"torch.arange", "torch.argmax", "torch.argmin", "torch.argsort", "torch.randint", "torch.randperm",
              "torch.bucketize", "torch.searchsorted", "torch.nonzero"}
# dtype-preserving (first argument) and type-promoting (all arguments) calls, for integer evidence
_SAME_DTYPE_FUNCS = {"torch.abs", "torch.neg", "torch.flip", "torch.roll", "torch.cumsum", "torch.take_along_dim",
                     "torch.gather", "torch.nn.functional.pad"}
_PROMOTING_FUNCS = {"torch.minimum", "torch.maximum", "torch.min", "torch.max"}
_INT_NAME = ("_ids", "_idx", "_index", "indices", "_pos", "position_ids", "labels", "_id", "_count", "count", "_mask",
             "bucket", "position", "positions", "_len", "_lens", "lengths", "_type")
_INT_WORDS = ("position", "bucket", "index", "indices", "count", "label")


def _name_parts(name: str) -> list[str]:
    """The lower-case parts of an identifier: split at underscores and at camelCase humps."""
    return [p.lower() for p in re.split(r"_|(?<=[a-z0-9])(?=[A-Z])", name) if p]


class AffinityWhere(Pattern):
    id = _ID
    api = "torch.lerp"
    title = "torch.where blend of two float tensors → torch.lerp (Ascend affinity rewrite)"
    training_ok = True
    bound = "memory"
    # detect's first test, made by the scan (Pattern.SCOPE_WORDS); the test stays for non-ASCII files
    SCOPE_WORDS = ("where",)

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        if "where" not in scope_text(module, scope) or not any(v == "torch" or v.startswith("torch.") for v in module.aliases.values()):
            return  # cheap text pre-filter: no `where` in this scope
        lines = _where_lines(module) if _LINE_FILTER else None
        for _block, _i, stmt in scope.statements():
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Return, ast.AugAssign)) or stmt.value is None:
                continue
            if lines is not None:
                k = bisect_left(lines, stmt.lineno)
                if k == len(lines) or lines[k] > (stmt.end_lineno or stmt.lineno):
                    continue  # no line of the statement can hold a torch.where call
            calls = [n for n in fast_walk(stmt.value) if isinstance(n, ast.Call) and module.canonical(n.func) == "torch.where"]
            written = next((c for c in calls if any(k.arg == "out" for k in c.keywords)), None)
            if written is not None:
                # ChatTTS's torch.where(cond, n, emb, out=emb if inplace else None): callers read `emb`
                # afterwards, and the blend returns a new tensor
                out = next(k.value for k in written.keywords if k.arg == "out")
                yield NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                               f"torch.where writes its result into `out={ast.unparse(out)}` (in place, for whoever holds that "
                               "tensor); the fused blend returns a new tensor: rewrite by hand, copying into it")
                continue
            blends = [c for c in calls if _operands(c) is not None]
            if not blends:
                continue
            if len(blends) > 1:
                yield NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                               "several torch.where blends in one statement: rewrite them one per statement")
                continue
            yield _analyze(module, scope, stmt, blends[0])

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        return symbolic(
            "memory",
            "elementwise and memory-bound either way (same bytes: read cond, a, b, write out; lerp adds a cast of the "
            "condition). The gain is SelectV2's broadcasting overhead on NPU that the Ascend tuning guide reports; "
            "expect little unless the where is large and hot: measure the site before accepting",
        )

    @staticmethod
    def reference(cond: Any, a: Any, b: Any) -> Any:
        """Eager ground truth: ``torch.where(cond, a, b)``."""
        import torch

        return torch.where(cond, a, b)


_LINE_FILTER = True  # tests switch it off to compare


def _where_lines(module: ModuleInfo) -> list[int] | None:
    """The lines where a call whose canonical name is ``torch.where`` can be written, or None.
    Such a call is ``<torch alias>.where(...)`` or ``where(...)`` imported from torch: named
    "where" (lines_with); an import ``from torch import where as w`` turns the shortcut off."""
    if any(v == "torch.where" and k != "where" for k, v in module.aliases.items()):
        return None
    return lines_with(module, ("where",))


def _operands(call: ast.Call) -> Optional[tuple[ast.expr, ast.expr, ast.expr]]:
    cond = keyword(call, "condition", 0)
    a = keyword(call, "input", 1)
    b = keyword(call, "other", 2)
    if cond is None or a is None or b is None or any(isinstance(x, ast.Starred) for x in call.args):
        return None
    return cond, a, b


def _is_integer(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Static evidence of an integer (or bool) tensor."""
    if depth > 10:  # T5's bucket chain is 8 deep (min -> full_like -> name -> + -> name -> //)
        return False
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is not None and _float_evident(module, scope, value, getattr(value, "lineno", line)):
            return False  # TimesFM's inc_count = ((~mask).to(x.dtype)).sum(-1): a float count, whatever its name
        # words at the start or end of a part of the name: ``repositioned_noisy_action_features`` holds no "position"
        # (audit41, VLA-Adapter); camelCase splits too, and a part may end with the word (s41 review: ``tokenPositions``,
        # ``kvcacheindex`` were integer names before audit41's change and lerp candidates after it)
        if node.id.endswith(_INT_NAME) or any(part.startswith(_INT_WORDS) or part.rstrip("s").endswith(_INT_WORDS)
                                              for part in _name_parts(node.id)):
            return True
        return value is not None and _is_integer(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if isinstance(node, ast.Attribute):
        return node.attr.endswith(_INT_NAME) or node.attr in ("max_length", "num_buckets", "max_distance")
    if isinstance(node, ast.UnaryOp):
        return _is_integer(module, scope, node.operand, line, depth + 1)
    if isinstance(node, ast.Call):
        name = module.canonical(node.func) or ""
        if name in _INT_FUNCS:
            return True
        dt = keyword(node, "dtype")
        if dt is not None and (dotted(dt) or "").split(".")[-1] in _INT_DTYPES:
            return True
        if isinstance(node.func, ast.Attribute) and not name.startswith("torch."):  # a method, not torch.abs(x)
            if node.func.attr in _INT_METHODS:
                return True
            if node.func.attr == "to" and any((dotted(a) or "").split(".")[-1] in _INT_DTYPES for a in node.args):
                return True
            if node.func.attr in ("clone", "detach", "contiguous", "view", "reshape", "expand", "expand_as",
                                  "unsqueeze", "squeeze", "flatten", "repeat", "gather", "masked_fill", "abs", "neg",
                                  "flip", "roll", "cumsum", "sum", "t", "transpose", "permute", "narrow", "index_select"):
                return _is_integer(module, scope, node.func.value, line, depth + 1)
        if name in ("torch.zeros_like", "torch.ones_like", "torch.full_like", "torch.empty_like") and node.args and dt is None:
            return _is_integer(module, scope, node.args[0], line, depth + 1)
        # ops that keep their input's dtype: T5's n = torch.abs(relative_position), clvp's F.pad(input_ids, ...)
        if name in _SAME_DTYPE_FUNCS and node.args:
            return _is_integer(module, scope, node.args[0], line, depth + 1)
        # binary ops promote: integer only if every operand is (T5's torch.min(val_if_large, full_like(...)))
        if name in _PROMOTING_FUNCS and node.args:
            return all(_is_integer(module, scope, a, line, depth + 1) or _int_scalar(scope, a) for a in node.args)
        if name == "torch.where" and len(node.args) == 3:
            # blt's torch.where(positive, patch_lengths % max_patch_length, 0): an int tensor blended with an int
            branches = node.args[1:]
            ints = [_is_integer(module, scope, b, line, depth + 1) for b in branches]
            return any(ints) and all(i or _int_scalar(scope, b) for i, b in zip(ints, branches))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)):
        return _is_integer(module, scope, node.left, line, depth + 1) and (
            _is_integer(module, scope, node.right, line, depth + 1) or _int_scalar(scope, node.right)
        )
    return False


_FLOAT_DTYPES = {"float", "float32", "float16", "bfloat16", "half", "double", "float64"}


def _float_evident(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Static evidence of a floating tensor: ``.float()``, ``.to(torch.float32)``, ``.to(x.dtype)`` of a
    non-integer ``x``, ``dtype=torch.float*``, through value-keeping methods, names and sums."""
    if depth > 6:
        return False
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        return value is not None and _float_evident(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return isinstance(node.op, ast.Div) or any(_float_evident(module, scope, x, line, depth + 1) for x in (node.left, node.right))
    if not isinstance(node, ast.Call):
        return False
    dt = keyword(node, "dtype")
    if dt is not None:
        return (dotted(dt) or "").split(".")[-1] in _FLOAT_DTYPES
    if (module.canonical(node.func) or "") in ("torch.rand", "torch.randn", "torch.rand_like", "torch.randn_like"):
        return True
    if isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        if attr in ("float", "half", "bfloat16", "double"):
            return True
        if attr == "to" and node.args:
            a = node.args[0]
            if (dotted(a) or "").split(".")[-1] in _FLOAT_DTYPES:
                return True
            if isinstance(a, ast.Attribute) and a.attr == "dtype":  # .to(values.dtype) of non-integer values
                return not _is_integer(module, scope, a.value, line, depth + 1)
            return False
        if attr in ("sum", "mean", "cumsum", "clone", "detach", "contiguous", "view", "reshape", "unsqueeze", "squeeze",
                    "expand", "expand_as", "flatten", "transpose", "permute", "clamp", "clamp_min", "abs"):
            return _float_evident(module, scope, node.func.value, line, depth + 1)
    return False


def _int_scalar(scope: Scope, node: ast.AST) -> bool:
    """A Python int: a literal, ``len(...)``/``int(...)``, ``x.shape[i]``, or a parameter annotated ``int``."""
    v = const_value(node)
    if isinstance(v, int) and not isinstance(v, bool):
        return True
    if isinstance(node, ast.Call) and dotted(node.func) in ("len", "int"):
        return True
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return True
    if isinstance(node, ast.Name) and scope.definition(node.id) is None:
        ann = {a.strip() for a in _param_annotation(scope, node.id).split("|")}
        return "int" in ann and not ann & {"float", "torch.Tensor", "Tensor"}
    return False


# ops whose result can be inf/NaN: a where choosing around them is a guard, and lerp would leak the NaN
_UNSAFE_FUNCS = {"exp", "expm1", "log", "log1p", "log2", "log10", "pow", "sqrt", "rsqrt", "reciprocal", "div",
                 "true_divide", "tan", "atanh", "logit", "erfinv", "divide", "float_power"}


# tensor methods whose result holds the receiver's values (a cast to a float dtype keeps ±inf/NaN)
_SAME_VALUES = ("to", "expand", "expand_as", "float", "double", "half", "bfloat16", "type", "type_as", "cuda", "cpu",
                "npu", "detach", "clone", "contiguous", "repeat", "view", "reshape", "unsqueeze")


# reductions and selections whose result is some entry of the receiver: an extreme fill survives them
_KEEPS_EXTREMES = ("min", "max", "amin", "amax", "cummin", "cummax", "sort", "topk", "gather", "index_select")


def _is_extreme(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """±inf, NaN, the dtype's finfo min/max, or |constant| >= 1e4 (inf in fp16): a - b overflows."""
    if depth > 6:
        return False
    if is_inf(module, scope, node, line):
        return True
    if isinstance(node, ast.UnaryOp):
        return _is_extreme(module, scope, node.operand, line, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        # ``torch.ones_like(x) * -1e9``: the fill value spelled as a product (-inf in fp16 all the same)
        return any(_is_extreme(module, scope, side, line, depth + 1) for side in (node.left, node.right))
    v = const_value(node)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 1e4:
        return True
    if isinstance(node, ast.Attribute) and node.attr in ("min", "max") and isinstance(node.value, ast.Call):
        return (module.canonical(node.value.func) or "") == "torch.finfo"
    if isinstance(node, ast.Attribute) and node.attr == "values" and isinstance(node.value, ast.Call):
        # s41 (audit41, rl4co's FJSP): ``torch.where(busy > t, busy, torch.inf).min(1).values`` is inf in a row
        # where every entry was filled: the reduction keeps the fill
        return _is_extreme(module, scope, node.value, line, depth + 1)
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line) or _module_constant(module, node.id)
        return value is not None and _is_extreme(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        # s43 (audit43, TorchRL's AutoResetTransform: ``self.fill_float = fill_float`` after
        # ``fill_float = float("nan")`` in __init__): what the class stores there
        return any(is_inf(module, where, v, getattr(v, "lineno", line)) for where, v in _attribute_values(module, scope, node.attr))
    if isinstance(node, ast.Call):
        name = module.canonical(node.func) or ""
        if name == "torch.where" and len(node.args) == 3:
            # s41: a blend with an extreme branch holds that value wherever its condition picks it
            return any(_is_extreme(module, scope, a, line, depth + 1) for a in node.args[1:])
        if isinstance(node.func, ast.Attribute) and node.func.attr in _KEEPS_EXTREMES:
            return _is_extreme(module, scope, node.func.value, line, depth + 1)
        if name in ("torch.full", "torch.full_like", "torch.tensor", "torch.as_tensor") or (
            isinstance(node.func, ast.Attribute) and node.func.attr in ("new_full", "fill_", "masked_fill", *_SAME_VALUES)
        ):
            args = [*node.args, *(k.value for k in node.keywords)]
            if isinstance(node.func, ast.Attribute) and node.func.attr in _SAME_VALUES:
                args = [node.func.value]
            return any(_is_extreme(module, scope, a, line, depth + 1) for a in args)
    return False


def _attribute_values(module: ModuleInfo, scope: Scope, attr: str) -> list[tuple[Scope, ast.expr]]:
    """The values the class of ``scope`` assigns to ``self.<attr>`` in its methods, with, for a parameter of that
    method, its default and every rebinding there (``fill = float("nan")``). Indexed once per module and class."""
    # a function nested in a method (TorchRL's ``replace_and_set``) reads the method's ``self``
    cls = scope.class_name or next((s.class_name for s in module.scopes
                                    if s.class_name and scope.qualname.startswith(s.qualname + ".")), None)
    if cls is None:
        return []
    index: dict[str, dict[str, list[tuple[Scope, ast.expr]]]] = module.__dict__.setdefault("_npufuse_where_attr_values", {})
    table = index.get(cls)
    if table is None:
        table = index[cls] = {}
        for method in module.scopes:
            if method.class_name != cls:
                continue
            for stmt in method.body:
                for n in fast_walk(stmt):
                    for t, v in self_attribute_stores(n):
                        table.setdefault(t.attr, []).append((method, v))
    out: list[tuple[Scope, ast.expr]] = []
    for method, value in table.get(attr, []):
        out.append((method, value))
        if isinstance(value, ast.Name):
            out += [(method, v) for _, v in method.assignments.get(value.id, [])]
            default = _param_default(method, value.id)
            if default is not None:
                out.append((method, default))
    return out


def _module_constant(module: ModuleInfo, name: str) -> Optional[ast.expr]:
    return module.scopes[0].definition(name) if module.scopes else None


def _positive_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def _finite_scalar_op(scope: Scope, n: ast.BinOp) -> bool:
    """``x / 2`` (a divisor that is a nonzero literal) or ``2 ** bits`` (a positive literal to an int
    literal or an ``int``-annotated parameter: QuaRot's two's complement, audit40b): neither makes inf/NaN
    out of finite values, so the branch is no guarded computation."""
    if isinstance(n.op, ast.Div):
        v = const_value(n.right)
        # s44 (audit44): ``x / np.log(2.0)``, a math / numpy constant divisor, is a nonzero literal too
        return _positive_number(abs(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None) \
            or nonzero_constant_divisor(n.right)
    if not _positive_number(const_value(n.left)):
        return False
    e = const_value(n.right)
    if isinstance(e, int) and not isinstance(e, bool):
        return abs(e) < 64
    return isinstance(n.right, ast.Name) and _param_annotation(scope, n.right.id) == "int"


_INTEGER_DTYPES = {"torch.long", "torch.int", "torch.int64", "torch.int32", "torch.int16", "torch.int8", "torch.uint8"}


def _nonzero_denominator(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """A denominator that is never 0: clamped to a positive minimum (``n.clamp_min(1e-12)``, ``n.clamp(min=eps)``)
    or a count whose zeros are filled (``bins.masked_fill(bins == 0, 1)``). s43 (audit43, encodec's kmeans, TorchRL's
    quaternions): such a division is no guarded computation."""
    if depth > 4:
        return False
    if isinstance(node, ast.Subscript):
        return _nonzero_denominator(module, scope, node.value, line, depth + 1)
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is None:
            return _asserted_positive(scope, node.id, line)
        return _nonzero_denominator(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if not isinstance(node, ast.Call):
        return False
    name = module.canonical(node.func) or ""
    method = node.func.attr if isinstance(node.func, ast.Attribute) and not name.startswith("torch.") else ""
    if method in _SAME_VALUES or method == "squeeze":
        return _nonzero_denominator(module, scope, node.func.value, line, depth + 1)  # ``den.clamp_min(1e-6).unsqueeze(-1)``
    args = list(node.args) if method else list(node.args[1:])
    low = keyword(node, "min") or (args[0] if args else None)
    if method in ("clamp_min", "clamp", "clip") or name in ("torch.clamp", "torch.clamp_min", "torch.clip"):
        return _positive_number(const_value(low)) if low is not None else False
    if method == "masked_fill" and len(node.args) == 2:
        cond, fill = node.args
        fill_v = const_value(fill)
        zero_test = (isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], ast.Eq)
                     and const_value(cond.comparators[0]) == 0 and ast.dump(cond.left) == ast.dump(node.func.value))
        if isinstance(cond, ast.Name):
            d = scope.definition(cond.id, line)
            zero_test = (isinstance(d, ast.Compare) and len(d.ops) == 1 and isinstance(d.ops[0], ast.Eq)
                         and const_value(d.comparators[0]) == 0 and ast.dump(d.left) == ast.dump(node.func.value))
        return zero_test and isinstance(fill_v, (int, float)) and not isinstance(fill_v, bool) and fill_v != 0
    return False


_NON_FINITE_WORDS = re.compile(r"\b(nan|nans|inf|infs|non-?finite|infinite|infinity)\b", re.IGNORECASE)


def _comment_says_non_finite(module: ModuleInfo, line: int, end: int) -> Optional[str]:
    """A comment in the block directly above the statement (up to three lines) or on its own lines that names NaN /
    inf: s43 (audit43, TorchRL's ``_reduce_loss``: "Select rather than multiply: masked positions may hold non-finite
    values") the author says the where is a guard, which no dataflow of a parameter shows."""
    lines = module.lines
    first = line
    while first > 1 and first > line - 3 and lines[first - 2].lstrip().startswith("#"):
        first -= 1  # the comment block directly above (one on an earlier statement speaks of that one)
    for i in range(first, min(end, len(lines)) + 1):
        text = lines[i - 1]
        if "#" not in text:
            continue
        comment = text[text.index("#") + 1:].strip()
        if _NON_FINITE_WORDS.search(comment):
            return comment
    return None


def _asserted_positive(scope: Scope, name: str, line: int) -> bool:
    """``assert beta > 0`` (or ``>= c`` with c > 0) in the function's own body before ``line``: mmdet's smooth-L1
    ``0.5 * diff * diff / beta`` divides by no zero."""
    for stmt in scope.body:
        if stmt.lineno >= line:
            break
        if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Compare) and len(stmt.test.ops) == 1:
            t = stmt.test
            bound = const_value(t.comparators[0])
            if (isinstance(t.left, ast.Name) and t.left.id == name and isinstance(bound, (int, float)) and not isinstance(bound, bool)
                    and (isinstance(t.ops[0], ast.Gt) and bound >= 0 or isinstance(t.ops[0], ast.GtE) and bound > 0)):
                return True
    return False


def _integer_cast(module: ModuleInfo, node: ast.AST) -> bool:
    """``x.long()`` / ``x.int()`` / ``x.to(torch.long)``: a cast of a computed value to an integer dtype."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr in ("long", "int", "short") and not node.args:
        return True
    return node.func.attr == "to" and len(node.args) == 1 and (module.canonical(node.args[0]) or "") in _INTEGER_DTYPES


def _unsafe_op(module: ModuleInfo, scope: Scope, node: ast.AST, line: int) -> Optional[str]:
    """An op in the branch (or its one-level definition) that can produce inf/NaN."""
    roots = [node]
    if isinstance(node, ast.Name):
        # every earlier assignment, not only the last: an update in an `if` arm
        # (`loss = torch.log(s) - p`, then `if smoothing: loss = (1 - a) * loss + ...`) keeps the
        # first value on the other path (audit42, Liger's vocab-parallel cross entropy)
        roots += [value for stmt, value in scope.assignments.get(node.id, []) if stmt.lineno < line]
    # s42 review: one search per assignment value and scope (every `torch.where` reading a name searches all its
    # earlier assignments: without the memo, N rebindings and N sites walked N * N expressions)
    memo: dict[int, Optional[str]] = scope.__dict__.setdefault("_npufuse_where_unsafe", {})
    for root in roots:
        key = id(root)
        if key not in memo:
            memo[key] = _unsafe_in(module, scope, root)
        if memo[key] is not None:
            return memo[key]
    return None


def _unsafe_in(module: ModuleInfo, scope: Scope, root: ast.AST) -> Optional[str]:
    """The first op under ``root`` that can produce inf/NaN, as source, else None."""
    # an op whose result is cast to an integer dtype leaves no inf/NaN in the branch (T5's
    # `max_exact + (torch.log(rel.float() / max_exact) * k).to(torch.long)`): not searched
    cast = {id(x) for c in fast_walk(root) if _integer_cast(module, c) for x in fast_walk(c.func.value)}
    weak = None  # s45 (audit45): `(self.dim - 1) / self.dim` is quoted only where nothing else is unsafe
    for n in fast_walk(root):
        if id(n) in cast:
            continue
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.Pow)) and not _finite_scalar_op(scope, n) and not (
                isinstance(n.op, ast.Div) and _nonzero_denominator(module, scope, n.right, n.lineno)):
            if attribute_ratio(n):
                weak = weak or ast.unparse(n)
                continue
            return ast.unparse(n)
        if isinstance(n, ast.Call):
            last = (module.canonical(n.func) or dotted(n.func) or (n.func.attr if isinstance(n.func, ast.Attribute) else "")).split(".")[-1]
            if last in _UNSAFE_FUNCS and constant_number(n) is None:  # s44: np.log(2.0) is a finite constant
                return ast.unparse(n)
    return weak


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_literal(node.operand)
    if isinstance(node, ast.Call) and dotted(node.func) in ("float", "int"):
        return True
    if isinstance(node, ast.Attribute) and (dotted(node.value) or "") in ("math", "np", "numpy") :
        return True
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool))


def _tests_non_finite(module: ModuleInfo, cond: ast.AST, scope: Scope | None = None, line: int = 0, depth: int = 0) -> bool:
    """The condition calls isnan/isinf/isfinite..., inline or in the local definitions of the names it
    reads (``bad = torch.isnan(x); torch.where(bad, 0, x)``)."""
    if depth > 6:
        return False
    for n in fast_walk(cond):
        if isinstance(n, ast.Call):
            last = (module.canonical(n.func) or (n.func.attr if isinstance(n.func, ast.Attribute) else "")).split(".")[-1]
            if last in ("isnan", "isinf", "isfinite", "isneginf", "isposinf"):
                return True
        elif scope is not None and isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            value = scope.definition(n.id, line)
            if value is not None and value is not cond and _tests_non_finite(module, value, scope, getattr(value, "lineno", line), depth + 1):
                return True
    return False


def _module_scalar(module: ModuleInfo, node: ast.AST) -> bool:
    """A module-level numeric constant (``NO_OBJ_SCORE = -1024.0``)."""
    if not isinstance(node, ast.Name) or not module.scopes:
        return False
    value = module.scopes[0].definition(node.id)
    return value is not None and _is_literal(value)


def _used_for_indexing(scope: Scope, stmt: ast.stmt, call: ast.Call) -> bool:
    """The blend feeds an index (directly, or through the name it is assigned to)."""
    for n in fast_walk(stmt):
        if isinstance(n, ast.Subscript) and any(m is call for m in fast_walk(n.slice)):
            return True
    names = []
    if isinstance(stmt, ast.Assign) and stmt.value is call:
        names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    for n in fast_walk(scope.node):
        if isinstance(n, ast.Subscript) and getattr(n, "lineno", 0) > stmt.lineno:
            if any(isinstance(m, ast.Name) and m.id in names for m in fast_walk(n.slice)):
                return True
        if isinstance(n, ast.Call) and getattr(n, "lineno", 0) > stmt.lineno and isinstance(n.func, ast.Attribute) and n.func.attr in ("gather", "index_select", "scatter", "scatter_", "take_along_dim"):
            idx = keyword(n, "index", 1)
            if idx is not None and any(isinstance(m, ast.Name) and m.id in names for m in fast_walk(idx)):
                return True
    return False


def _analyze(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call) -> Result:
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno

    def miss(reason: str) -> NearMiss:
        return NearMiss(_ID, scope.qualname, line, end, reason)

    cond, a, b = _operands(call)  # type: ignore[misc]
    # an operand written over several lines (`a -\n b` inside the call's parentheses) is only valid
    # Python inside brackets: the tuple assignment below takes it out of them, so wrap it
    texts = [_bracketed(segment(module, x)) for x in (cond, a, b)]
    for side, text in ((a, texts[1]), (b, texts[2])):
        if _is_literal(side) or is_scalar(module, scope, side, line) or _module_scalar(module, side):
            return miss(f"a branch is the scalar `{text}`: torch.lerp needs two tensors, and a Python scalar branch "
                        "takes its dtype from the other (an int tensor with a float scalar changes dtype); "
                        "masked_fill is the affinity form for a scalar")
    for side, text in ((a, texts[1]), (b, texts[2])):
        if host_scalar_tensor(module, side):
            return miss(f"branch `{quoted(text)}` is a 0-d tensor built on the CPU (no device=): torch.where takes CPU "
                        "scalars beside device tensors, torch.lerp not on every PyTorch / torch_npu version (a device "
                        "mismatch error where the original runs)")
    for side, text in ((a, texts[1]), (b, texts[2])):
        if _is_extreme(module, scope, side, line):
            return miss(f"branch `{text[:40]}` can hold ±inf/NaN or the dtype's extreme value: lerp multiplies (a - b) by a "
                        "zero weight (inf * 0 = NaN; finfo.min overflows a - b in fp16), so the lerp form is not inf-safe")
    for side, text in ((a, texts[1]), (b, texts[2])):
        op = _unsafe_op(module, scope, side, line)
        if op is not None:
            # s46 (audit46): a divisor the code made nonzero with torch.where: say what is not shown, not "can be inf"
            sanitised = sanitised_divisor_reason(module, scope, quoted(text), op, line)
            if sanitised is not None:
                return miss(sanitised)
            return miss(f"branch `{quoted(text)}` computes `{quoted(op)}`, which can be inf/NaN where it is not selected "
                        "(torch.where used as a guard): lerp would turn that into NaN, so it is not inf-safe")
    for side, text in ((a, texts[1]), (b, texts[2])):
        if _is_integer(module, scope, side, line):
            return miss(f"integer tensors (`{text[:40]}`): torch.lerp takes floating point only")
    for side, text in ((a, texts[1]), (b, texts[2])):
        if is_bool_mask(module, scope, side, line):
            return miss(f"integer tensors: branch `{text[:40]}` is a boolean mask; torch.lerp takes floating point only")
    if _tests_non_finite(module, cond, scope, line):
        return miss("the condition tests for NaN/inf, so the other branch is non-finite where it is not selected: lerp "
                    "would return NaN there (not inf-safe)")
    said = _comment_says_non_finite(module, line, end)
    if said is not None:
        return miss(f"a comment at the blend (`{said[:50]}`) says the values it masks may be non-finite: lerp would return "
                    "NaN where they are not selected (torch.where used as a guard, not inf-safe)")
    missing = missing_values_mask(scope, cond, line)
    if missing is not None:
        return miss(f"the condition reads `{missing}`, a mask of missing values: the data it replaces may be NaN there "
                    "(missing observations), and lerp would return NaN (torch.where used as a guard, not inf-safe)")
    if _used_for_indexing(scope, stmt, call):
        return miss("the blend is used for indexing (integer positions): not a float blend")
    if not is_bool_mask(module, scope, cond, line):
        confidence = "medium"  # torch.where requires a bool condition anyway; lerp takes it cast to 0/1
    else:
        confidence = "high"
    guard = next((t for x, t in ((b, texts[2]), (a, texts[1]), (cond, texts[0])) if dotted(x) is not None), None)
    if guard is None:
        return miss("no operand is a plain tensor name to guard on (all are computed expressions)")
    text = _statement_text(module, stmt)
    if text is None:
        return miss("the statement shares its line with other code")
    cv, av, bv = f"{P}cond", f"{P}a", f"{P}b"
    blend = (f"(torch.lerp({bv}, {av}, {cv}.to({bv}.dtype)) if isinstance({av}, torch.Tensor) and isinstance({bv}, torch.Tensor) "
             f"and {av}.dtype == {bv}.dtype and {bv}.is_floating_point() else torch.where({cv}, {av}, {bv}))")
    body = _replace_call(module, stmt, call, blend)
    fused = (
        f"{cv}, {av}, {bv} = {texts[0]}, {texts[1]}, {texts[2]}\n"
        "# lerp(b, a, w) with w = cond as 0/1 is exactly a or b for finite values; other dtypes keep torch.where\n"
        + body
    )
    params = {"cond": texts[0], "a": texts[1], "b": texts[2], "cond_is_bool": confidence == "high",
              "statement": type(stmt).__name__.lower()}
    risks = [
        Risk("numerics", "exact only for finite a and b: where either is ±inf/NaN (or a - b overflows) at a position, "
             "lerp gives NaN there even when the other side is selected"),
        Risk("numerics", "exactness assumes Lerp evaluates end - (end - start) * (1 - w) for w >= 0.5 as PyTorch's CPU "
             "and CUDA kernels do; a kernel computing start + w * (end - start) rounds a by one ulp of (a - b) "
             "(UNCERTAIN for the NPU kernel: verify with npufuse verify op)"),
    ]
    notes = ["the three operands are evaluated once, before the rest of the statement (they are pure expressions here)",
             "gradients match torch.where: d/da = cond, d/db = 1 - cond; the condition gets none"]
    return Finding(pattern=_ID, qualname=scope.qualname, line=line, end_line=end, params=params, fused=fused,
                   guard_tensor=guard, confidence=confidence, variant="where_to_lerp", risks=risks, notes=notes)


def _statement_text(module: ModuleInfo, stmt: ast.stmt) -> Optional[str]:
    lines = module.lines  # numbered as ast numbers them
    head = lines[stmt.lineno - 1]
    indent = len(head) - len(head.lstrip())
    if len(head[:indent].encode()) != stmt.col_offset:
        return None
    tail = lines[(stmt.end_lineno or stmt.lineno) - 1].encode()[stmt.end_col_offset or 0 :].decode(errors="replace").strip()
    if tail and not tail.startswith("#"):
        return None
    return "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno])


def _bracketed(text: str) -> str:
    """``text`` in parentheses when it spans lines (a bare continuation line does not parse)."""
    return f"({text})" if "\n" in text else text


def _replace_call(module: ModuleInfo, stmt: ast.stmt, call: ast.Call, replacement: str) -> str:
    """The statement's text with ``call`` replaced (byte offsets: ast columns are UTF-8), dedented."""
    lines = module.lines  # numbered as ast numbers them
    first = stmt.lineno
    raw = [ln.encode() for ln in lines[first - 1 : (stmt.end_lineno or first)]]

    def offset(lineno: int, col: int) -> int:
        return sum(len(r) for r in raw[: lineno - first]) + col

    blob = b"".join(raw)
    c0 = offset(call.lineno, call.col_offset)
    c1 = offset(call.end_lineno or call.lineno, call.end_col_offset or 0)
    out = (blob[:c0] + replacement.encode() + blob[c1:]).decode()
    head = out.splitlines(keepends=True)
    indent = head[0][: len(head[0]) - len(head[0].lstrip())]
    return "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in head)


# ---------------------------------------------------------------------------------------------
# Examples (they are the tests; tests/test_affinity_rewrites.py executes CHECKS under the emulator)
# ---------------------------------------------------------------------------------------------

_BBOX_CLIP = '''\
import torch


def clip_boxes(bboxes, min_xy, max_xy):
    bboxes = torch.where(bboxes < min_xy, min_xy, bboxes)
    bboxes = torch.where(bboxes > max_xy, max_xy, bboxes)
    return bboxes
'''

_GATED_RESIDUAL = '''\
import torch
from torch import nn


class SkipGate(nn.Module):
    """Per-token choice between the block output and the residual (early-exit / layer skipping)."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, residual, skip_mask):
        out = self.proj(hidden_states)
        return torch.where(skip_mask.unsqueeze(-1), residual, out)
'''

_KV_UPDATE = '''\
import torch


def update_cache(cache, new_values, write_mask):
    # keep the old entries where nothing is written
    cache = torch.where(write_mask[..., None], new_values, cache)
    return cache
'''

_KEYWORDS = '''\
import torch


def choose(condition, x, y):
    result = torch.where(condition=condition > 0, input=x, other=y) * 2.0
    return result
'''

_DIFFUSION_CFG = '''\
import torch


def apply_guidance(noise_pred_uncond, noise_pred_text, guidance_scale, use_cfg):
    guided = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
    noise_pred = torch.where(use_cfg[:, None, None, None], guided, noise_pred_text)
    return noise_pred
'''

_MULTILINE = '''\
import torch


def blend_features(fine, coarse, confidence, threshold=0.5):
    fused = torch.where(
        confidence > threshold,
        fine,
        coarse,
    )
    return fused
'''

_MULTILINE_OPERAND = '''\
import torch


def integrate_fire(integrate, alpha, threshold, batch_size):
    integrate = integrate + alpha
    fire_place = integrate >= threshold
    integrate = torch.where(fire_place, integrate -
                            torch.ones([batch_size], device=integrate.device),
                            integrate)
    return integrate
'''

_KEEP_SCALAR = '''\
import torch


def mask_scores(scores, mask):
    return torch.where(mask, scores, 0.0)
'''

_KEEP_INF = '''\
import torch


def causal_mask_scores(attn_weights, causal_mask):
    mask_value = torch.full([], float("-inf"), dtype=attn_weights.dtype, device=attn_weights.device)
    attn_weights = torch.where(causal_mask, attn_weights, mask_value)
    return attn_weights
'''

_KEEP_INT = '''\
import torch


def shift_labels(input_ids, labels, pad_token_id):
    labels = torch.where(labels == -100, input_ids, labels)
    return labels
'''

_KEEP_GUARD = '''\
import torch


def safe_softplus(g):
    # log(1 + exp(g)) overflows for large g: torch.where picks g there
    return torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
'''

_KEEP_FINFO = '''\
import torch


def masked_logits(logits, keep):
    floor = torch.full_like(logits, torch.finfo(logits.dtype).min)
    return torch.where(keep, logits, floor)
'''

_KEEP_NAN_GUARD = '''\
import torch


def clean_answers(answer):
    return torch.where(torch.isnan(answer), torch.zeros_like(answer), answer)
'''

_KEEP_INDEX = '''\
import torch


def select_tokens(hidden, pos_a, pos_b, use_a):
    positions = torch.where(use_a, pos_a, pos_b)
    return hidden[torch.arange(hidden.shape[0]), positions]
'''

_KEEP_INDICES = '''\
import torch


def nonzero_rows(mask):
    rows, cols = torch.where(mask)
    return rows
'''

_FLOAT_COUNT = '''\
import torch


def safe_counts(new_values, mask):
    # TimesFM 2.5 running stats: a float count despite its name (the mask cast to the values' dtype, summed)
    is_valid = (~mask).to(new_values.dtype)
    inc_count = is_valid.sum(dim=-1)
    inc_count_safe = torch.where(inc_count == 0, torch.ones_like(inc_count), inc_count)
    return (new_values * is_valid).sum(dim=-1) / inc_count_safe
'''

_KEEP_BUCKETS = '''\
import math

import torch


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    # T5 / LayoutLMv2 / MPNet: every tensor here is int64 (bucket ids), reached through abs / min / full_like
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret += (relative_position > 0).long() * num_buckets
        n = torch.abs(relative_position)
    else:
        n = torch.max(-relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    ret += torch.where(is_small, n, val_if_large)
    return ret
'''

_KEEP_PATCH_LENGTHS = '''\
import torch


def split_patch_lengths(patch_lengths: torch.Tensor, max_patch_length: int | None):
    # BLT: lengths % an int stay int64; blended with an int literal they are still int64
    positive = patch_lengths > 0
    remainder = torch.where(positive, patch_lengths % max_patch_length, 0)
    pieces = torch.where(remainder > 1, remainder.unsqueeze(-1), remainder.unsqueeze(-1) + 1)
    return pieces
'''

_KEEP_PADDED_IDS = '''\
import torch


def append_eos(input_ids, pad_token_id, first_pad):
    col = torch.arange(input_ids.shape[1] + 1, device=input_ids.device)
    unshifted = torch.nn.functional.pad(input_ids, (0, 1), value=pad_token_id)
    shifted = torch.nn.functional.pad(input_ids, (1, 0), value=pad_token_id)
    return torch.where(col < first_pad, unshifted, shifted)
'''

_KEEP_OUT = '''\
import torch


class Speaker(torch.nn.Module):
    def apply(self, emb, spk, prompt_mask, inplace=True):
        # ChatTTS: the blend is written into `emb` (out=), and the caller reads `emb`, not the return value
        cond = prompt_mask.unsqueeze(-1)
        out = torch.where(cond, spk.float(), emb, out=emb if inplace else None)
        return out
'''

AffinityWhere.FUSE = [
    Fuse(_BBOX_CLIP, name="ascend_guide_bbox_clip", expect={
        "cond": "bboxes < min_xy", "a": "min_xy", "b": "bboxes", "cond_is_bool": True, "variant": "where_to_lerp"}),
    Fuse(_GATED_RESIDUAL, name="skip_gate_return", expect={
        "cond": "skip_mask.unsqueeze(-1)", "a": "residual", "b": "out", "statement": "return", "confidence": "medium"}),
    Fuse(_KV_UPDATE, name="masked_cache_update", expect={"a": "new_values", "b": "cache"}),
    Fuse(_KEYWORDS, name="keyword_arguments_inside_expression", expect={
        "cond": "condition > 0", "a": "x", "b": "y", "cond_is_bool": True}),
    Fuse(_DIFFUSION_CFG, name="diffusion_per_sample_guidance", expect={"a": "guided", "b": "noise_pred_text"}),
    Fuse(_MULTILINE_OPERAND, name="operand_continued_over_lines", expect={"cond": "fire_place", "b": "integrate"}),
    Fuse(_MULTILINE, name="multiline_call", expect={"cond": "confidence > threshold", "a": "fine", "b": "coarse"}),
    Fuse(_FLOAT_COUNT, name="timesfm_float_count_despite_its_name", expect={
        "cond": "inc_count == 0", "a": "torch.ones_like(inc_count)", "b": "inc_count"}),
]

AffinityWhere.KEEP = [
    Keep(_KEEP_SCALAR, reason="scalar", name="scalar_branch"),
    Keep(_KEEP_INF, reason="not inf-safe", name="gpt2_minus_inf_mask_value"),
    Keep(_KEEP_INT, reason="integer tensors", name="integer_labels"),
    Keep(_KEEP_INDEX, reason="used for indexing", name="positions_for_indexing"),
    Keep(_KEEP_GUARD, reason="not inf-safe", name="where_guards_overflowing_branch"),
    Keep(_KEEP_FINFO, reason="not inf-safe", name="finfo_min_floor_tensor"),
    Keep(_KEEP_NAN_GUARD, reason="tests for NaN/inf", name="tapas_isnan_guard"),
    Keep(_KEEP_INDICES, reason="", name="single_argument_where"),
    Keep(_KEEP_BUCKETS, reason="integer tensors", name="t5_relative_position_bucket_through_abs_min"),
    Keep(_KEEP_PATCH_LENGTHS, reason="integer tensors", name="blt_lengths_modulo_annotated_int"),
    Keep(_KEEP_PADDED_IDS, reason="integer tensors", name="clvp_padded_input_ids"),
    Keep(_KEEP_OUT, reason="writes its result into `out=", name="chattts_where_out_in_place"),
]

CHECKS: dict[str, str] = {
    "ascend_guide_bbox_clip": (
        "b = torch.randn(5, 4, requires_grad=True)\nlo = torch.full((4,), -0.5, requires_grad=True)\n"
        "out = clip_boxes(b, lo, torch.tensor(0.7))\nleaves = [b, lo]"
    ),
    "skip_gate_return": (
        "g = SkipGate(8)\nh = torch.randn(2, 3, 8, requires_grad=True)\nr = torch.randn(2, 3, 8, requires_grad=True)\n"
        "out = g(h, r, torch.rand(2, 3) > 0.5)\nleaves = [h, r, g.proj.weight]"
    ),
    "masked_cache_update": (
        "c = torch.randn(2, 4, 6, dtype=torch.bfloat16)\nnv = torch.randn(2, 4, 6, dtype=torch.bfloat16)\n"
        "out = update_cache(c, nv, torch.rand(2, 4) > 0.3)"
    ),
    # int operands: the runtime check keeps torch.where
    "keyword_arguments_inside_expression": (
        "out = (choose(torch.randn(6), torch.randn(6), torch.randn(6)), "
        "choose(torch.randn(6), torch.arange(6), torch.arange(6, 12)))"
    ),
    "diffusion_per_sample_guidance": (
        "u = torch.randn(3, 4, 8, 8, requires_grad=True)\nt = torch.randn(3, 4, 8, 8, requires_grad=True)\n"
        "out = apply_guidance(u, t, 7.5, torch.tensor([True, False, True]))\nleaves = [u, t]"
    ),
    "multiline_call": "out = blend_features(torch.randn(4, 5), torch.randn(4, 5), torch.rand(4, 5))",
    "operand_continued_over_lines": (
        "i = torch.rand(6, requires_grad=True)\na = torch.rand(6, requires_grad=True)\n"
        "out = integrate_fire(i, a, 0.9, 6)\nleaves = [i, a]"
    ),
    "timesfm_float_count_despite_its_name": (
        "m = torch.rand(3, 6) > 0.5\nm[0] = True\nx = torch.randn(3, 6, requires_grad=True)\nout = safe_counts(x, m)\nleaves = [x]"
    ),
}


# --- s32: an infinite tensor cast before use (ReChorus-style listwise losses, the s32 precision audit) ---
# ``torch.where(m, pred, torch.tensor(float("Inf")).float().to(device))``: the .float() hid the inf from
# the extreme-value check and the lerp form gave NaN everywhere (inf * 0).
_S32_INF_CAST = '''\
import torch


def hard_positive_scores(prediction, pos_mask, mask):
    return torch.where(pos_mask * mask == 1, prediction, torch.tensor(float("Inf")).float().to(prediction.device))
'''

AffinityWhere.KEEP += [
    Keep(_S32_INF_CAST, reason="not inf-safe", name="s32_inf_tensor_cast_before_use"),
    Keep(_S32_INF_CAST.replace(", torch.tensor(", ", -torch.tensor("), reason="not inf-safe", name="s32_minus_inf_tensor_cast_before_use"),
]

AffinityWhere.KEEP += [
    # the NaN test bound to a name first (spelling bench, hoisted temporaries): still a NaN guard
    Keep(_KEEP_NAN_GUARD.replace("return torch.where(torch.isnan(answer),", "bad = torch.isnan(answer)\n    return torch.where(bad,"),
         reason="tests for NaN/inf", name="s32_isnan_guard_bound_to_a_name"),
]
