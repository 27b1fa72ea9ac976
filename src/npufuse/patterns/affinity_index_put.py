"""``affinity_index_put``: ``x[bool_mask] = value`` → ``masked_fill_`` / ``torch.where`` (no IndexPut).

On Ascend, assigning through a boolean mask is an IndexPut: the mask is turned into indices
(``nonzero``: a device-to-host sync and a data-dependent shape) and the scatter runs as an
IndexPut kernel, which the Ascend PyTorch tuning guide ("IndexPut算子替换") lists among the ops
to replace with dense elementwise work. The replacements keep the in-place semantics:

* a scalar value: ``x.masked_fill_(mask, value)`` — one AI Core kernel, exact for every value,
  ±inf and NaN included. (The guide's multiply form ``x *= ~mask`` is not used: ``inf * 0`` and
  ``nan * 0`` are NaN, so it is wrong exactly where masks are most used — cleaning non-finite
  values, ``-inf`` logit filters.)
* a value gathered with the same mask, ``x[m] = f(y[m])`` (``inputs[m] = random_words[m]``,
  mmdet's ``assigned[pos] = argmax[pos] + 1``): ``x.copy_(torch.where(m, f(y).to(x.dtype), x))``,
  the form the same guide gives.

A mask whose rank is below ``x``'s (``hidden[attention_mask == 0] = 0`` on ``[B, S, H]``) is
reshaped with trailing singleton dims, because ``masked_fill``/``where`` broadcast from the right
while indexing consumes leading dims.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Iterable, Optional

from npufuse.patterns._affinity_index_put_s46audit import AUG_NOT_SHOWN, numpy_value_operand, numpy_value_reason
from npufuse.patterns._affinity_index_put_s45audit import not_tensor_method_use
from npufuse.patterns import _affinity_index_put_s45
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk, parsed_code
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword, replace_segments, segment
from npufuse.scan.value import symbolic

_ID = "affinity_index_put"
P = "_npufuse_"

# --- shared evidence helpers (also used by affinity_where) -------------------------------------

_BOOL_FUNCS = {
    "torch.isnan", "torch.isinf", "torch.isfinite", "torch.isneginf", "torch.isposinf", "torch.isin",
    "torch.logical_and", "torch.logical_or", "torch.logical_not", "torch.logical_xor",
    "torch.eq", "torch.ne", "torch.gt", "torch.lt", "torch.ge", "torch.le", "torch.greater", "torch.less",
    "torch.greater_equal", "torch.less_equal", "torch.not_equal",
}
_BOOL_METHODS = {"bool", "isnan", "isinf", "isfinite", "isneginf", "isposinf", "logical_not", "logical_and",
                 "logical_or", "logical_xor", "eq", "ne", "gt", "lt", "ge", "le", "any", "all", "greater", "less"}
# shape-only methods: a bool tensor stays bool
_SHAPE_METHODS = {"unsqueeze", "expand", "expand_as", "view", "reshape", "clone", "contiguous", "t", "transpose",
                  "flatten", "squeeze", "permute", "repeat", "repeat_interleave", "detach", "to", "cpu", "cuda", "npu",
                  "flip", "roll", "tril", "triu", "narrow", "view_as", "reshape_as"}
_CREATORS = {"torch.zeros", "torch.ones", "torch.full", "torch.zeros_like", "torch.ones_like", "torch.full_like",
             "torch.empty", "torch.empty_like", "torch.tensor", "torch.as_tensor", "torch.eye"}
_INF_NAMES = {"inf", "Inf", "INF", "infinity"}


def is_bool_mask(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Static evidence that ``node`` is a boolean tensor (comparisons, isnan, ~, &, .bool(), ...)."""
    if depth > 8:
        return False
    if isinstance(node, ast.Compare):
        return not any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return is_bool_mask(module, scope, node.operand, line, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return is_bool_mask(module, scope, node.left, line, depth + 1) and is_bool_mask(module, scope, node.right, line, depth + 1)
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is None:
            return False
        return is_bool_mask(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if isinstance(node, ast.Subscript):
        return is_bool_mask(module, scope, node.value, line, depth + 1)
    if isinstance(node, ast.Call):
        name = module.canonical(node.func) or ""
        if name in _BOOL_FUNCS:
            return True
        if name in _CREATORS:
            dt = keyword(node, "dtype")
            if dt is not None and (dotted(dt) or "").split(".")[-1] == "bool":
                return True
            fill = keyword(node, "fill_value", 1 if name in ("torch.full", "torch.full_like") else None)
            return isinstance(fill, ast.Constant) and isinstance(fill.value, bool)
        if isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            if attr in _BOOL_METHODS:
                return True
            if attr == "to" and any((dotted(a) or "").split(".")[-1] == "bool" for a in [*node.args, *(k.value for k in node.keywords)]):
                return True
            if attr in ("scatter", "scatter_") and len(node.args) >= 3:
                # HF top-p: sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
                return is_bool_mask(module, scope, node.args[2], line, depth + 1)
            if attr in _SHAPE_METHODS and (attr != "to" or _device_only(node)):
                return is_bool_mask(module, scope, node.func.value, line, depth + 1)
            if attr in ("masked_fill", "masked_fill_") and node.args:
                return is_bool_mask(module, scope, node.func.value, line, depth + 1)
    return False


def _device_only(call: ast.Call) -> bool:
    """``x.to(other.device)`` / ``x.to("cuda", non_blocking=True)``: a move that keeps the dtype."""
    for a in call.args:
        if not (isinstance(a, ast.Attribute) and a.attr == "device") and not isinstance(const_value(a), str):
            return False  # x.to(dtype), x.to(other), x.to(torch.float32): may change the dtype
    return bool(call.args or call.keywords) and all(k.arg in ("device", "non_blocking", "copy") for k in call.keywords)


# torch functions that build a tensor on the CPU unless given ``device=`` (the *_like ones follow their input)
_HOST_CREATORS = {"torch.zeros", "torch.ones", "torch.full", "torch.empty", "torch.tensor", "torch.as_tensor", "torch.eye",
                  "torch.arange", "torch.rand", "torch.randn", "torch.randint", "torch.linspace", "torch.from_numpy",
                  "torch.BoolTensor", "torch.LongTensor", "torch.FloatTensor", "torch.ByteTensor"}


def placement_unproved(module: ModuleInfo, scope: Scope, node: ast.AST, line: int) -> str | None:
    """Why the mask may not be a torch tensor on the target's device (None: nothing says so). Indexing
    takes a numpy mask and a CPU mask for a device tensor; ``masked_fill_`` takes neither (TypeError,
    "expected self and mask to be on the same device"): numpy calls anywhere in the mask's making
    (through its local definitions), or a mask that is itself a torch constructor without
    ``device=`` or a ``.cpu()`` result (a CPU tensor combined with a device tensor would already
    fail in the original, so only the mask's own spine counts)."""
    why = _numpy_made(module, scope, node, line, 0)
    return why if why is not None else _host_spine(module, scope, node, line, 0)


def _numpy_made(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int) -> str | None:
    if depth > 6:
        return None
    for n in fast_walk(node):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or dotted(n.func) or ""
            if name.startswith(("numpy.", "np.")) or (isinstance(n.func, ast.Attribute) and n.func.attr == "numpy"):
                return f"`{segment(module, n)[:40]}` is a numpy array"
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            value = scope.definition(n.id, line)
            if value is not None and value is not node:
                why = _numpy_made(module, scope, value, getattr(value, "lineno", line), depth + 1)
                if why is not None:
                    return why
    return None


def _host_spine(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int) -> str | None:
    while depth <= 8:
        depth += 1
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            value = scope.definition(node.id, line)
            if value is None:
                return None
            node, line = value, getattr(value, "lineno", line)
        elif isinstance(node, (ast.BinOp, ast.Compare)):
            # a & b of a host and a device tensor fails in the original too: a host operand makes a host mask
            # (VideoMamba's bernoulli(torch.full(shape, 0.8)).bool() & masked_indices); so does a comparison or
            # arithmetic with a Python number (s38: RF2AA's ``torch.rand(B, L) < self.p_mask`` is a CPU mask
            # for a device ``state``). A 0-dim host operand beside a device tensor gives a device result: the
            # answer is only "may be on the host", which the rewrite checks at run time
            sides = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.left, *node.comparators]
            for side in sides:
                why = _host_spine(module, scope, side, line, depth)
                if why is not None:
                    return why
            return None
        elif isinstance(node, ast.Call):
            name = module.canonical(node.func) or ""
            if name in _HOST_CREATORS:
                return None if keyword(node, "device") is not None else f"`{segment(module, node)[:40]}` is built on the CPU (no device=)"
            if name.startswith("torch.") and keyword(node, "device") is None and node.args \
                    and not isinstance(node.args[0], ast.Starred):
                node = node.args[0]  # torch.bernoulli(p), torch.logical_not(m): made where their input is
                continue
            if not isinstance(node.func, ast.Attribute) or name.startswith("torch."):
                return None
            if node.func.attr == "cpu":
                return f"`{segment(module, node)[:40]}` is moved to the host"
            if node.func.attr in ("to", "cuda", "npu"):
                return None  # moved: to a device (or cast; either way not provably on the host)
            node = node.func.value  # a tensor method keeps its receiver's device
        else:
            return None
    return None


def mask_like(node: ast.AST, scope: Optional[Scope] = None) -> bool:
    """An index that reads as a boolean mask although its dtype is not visible here (a parameter, a
    helper's result): ``~attention_mask``, ``mask_time_indices``, ``self.padding_mask.unsqueeze(-1)``.
    Used only with a run-time ``dtype == torch.bool`` check in the rewrite. A parameter annotated as
    something else (``unmasked_channel_indices: list``, ``torch.LongTensor``) is not one."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return True  # ~ of an index: a bool mask inverted (bitwise-not integer positions would be odd)
    n = node
    while isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _SHAPE_METHODS:
        n = n.func.value
    ident = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
    if isinstance(n, ast.Name) and scope is not None:
        ann = _param_annotation(scope, n.id)
        if ann and ("Tensor" not in ann or any(t in ann for t in ("LongTensor", "IntTensor"))):
            return False
    return "mask" in ident.lower()


def integer_index(module: ModuleInfo, node: ast.AST, scope: Optional[Scope] = None, line: int = 0) -> bool:
    """``torch.nonzero(m)`` / ``m.nonzero()`` / ``torch.where(m)[0]``: integer positions, not a mask."""
    if isinstance(node, ast.Name) and scope is not None:
        value = scope.definition(node.id, line)
        return value is not None and integer_index(module, value)
    inner = node.value if isinstance(node, ast.Subscript) else node
    if isinstance(inner, ast.Call):
        name = module.canonical(inner.func) or ""
        if name == "torch.nonzero" or (isinstance(inner.func, ast.Attribute) and inner.func.attr == "nonzero"):
            return True
        if name == "torch.where" and len(inner.args) == 1:
            return True
        if name in ("torch.argwhere", "torch.arange", "torch.randperm"):
            return True
    return False


def is_inf(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Static evidence that ``node`` is (or fills with) ±inf / NaN."""
    if depth > 6:
        return False
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return is_inf(module, scope, node.operand, line, depth + 1)
    v = const_value(node)
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return True
    if isinstance(node, ast.Call) and dotted(node.func) == "float" and node.args:
        arg = const_value(node.args[0])
        return isinstance(arg, str) and arg.strip().lstrip("+-").lower() in ("inf", "infinity", "nan")
    if isinstance(node, ast.Attribute) and node.attr in _INF_NAMES | {"nan"} and (dotted(node.value) or "") in ("math", "torch", "np", "numpy"):
        return True
    if isinstance(node, ast.Call):
        name = module.canonical(node.func) or ""
        if name in ("torch.full", "torch.full_like", "torch.tensor", "torch.as_tensor") or (
            isinstance(node.func, ast.Attribute) and node.func.attr in ("new_full", "fill_", "masked_fill")
        ):
            return any(is_inf(module, scope, a, line, depth + 1) for a in [*node.args, *(k.value for k in node.keywords)])
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is None:
            default = _param_default(scope, node.id)
            return default is not None and is_inf(module, scope, default, line, depth + 1)
        return is_inf(module, scope, value, getattr(value, "lineno", line), depth + 1)
    return False


def is_scalar(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Static evidence that ``node`` is a Python number (or a 0-d constant): a masked_fill value."""
    if depth > 6:
        return False
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool)) and node.value is not None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return is_scalar(module, scope, node.operand, line, depth + 1)
    if isinstance(node, ast.BinOp):
        return is_scalar(module, scope, node.left, line, depth + 1) and is_scalar(module, scope, node.right, line, depth + 1)
    if isinstance(node, ast.Call) and dotted(node.func) in ("float", "int", "bool", "len", "round", "min", "max", "abs"):
        return dotted(node.func) not in ("min", "max", "abs") or all(is_scalar(module, scope, a, line, depth + 1) for a in node.args)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item":
        return True
    if isinstance(node, ast.Attribute):
        if node.attr in _INF_NAMES | {"nan", "pi", "e"} and (dotted(node.value) or "") in ("math", "torch", "np", "numpy"):
            return True
        base = node.value
        if isinstance(base, ast.Call) and (module.canonical(base.func) or "") in ("torch.finfo", "torch.iinfo", "numpy.finfo", "numpy.iinfo"):
            return node.attr in ("min", "max", "eps", "tiny", "smallest_normal")
        # config / tokenizer ids: self.pad_token_id, tokenizer.mask_token_id, self.ignore_index
        return node.attr.endswith(("_id", "_token_id", "ignore_index", "_index", "_value", "padding_idx"))
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is None and scope.qualname != "<module>" and module.scopes:
            const = module.scopes[0].definition(node.id)  # module-level constant: NO_OBJ_SCORE = -1024.0
            if isinstance(const, (ast.Constant, ast.UnaryOp)):
                return is_scalar(module, module.scopes[0], const, line, depth + 1)
        if value is None:
            if _param_annotation(scope, node.id) in ("float", "int", "bool"):
                return True
            default = _param_default(scope, node.id)
            if default is not None:
                return is_scalar(module, scope, default, line, depth + 1)
            return node.id.endswith(("_id", "_value", "ignore_index", "_index")) or node.id in ("filter_value", "fill_value", "value")
        return is_scalar(module, scope, value, getattr(value, "lineno", line), depth + 1)
    return False


def _param_annotation(scope: Scope, name: str) -> str:
    node = scope.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg == name and arg.annotation is not None:
                return ast.unparse(arg.annotation)
    return ""


def _param_default(scope: Scope, name: str) -> Optional[ast.expr]:
    node = scope.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    pos = [*a.posonlyargs, *a.args]
    for arg, default in zip(pos[len(pos) - len(a.defaults):], a.defaults):
        if arg.arg == name:
            return default
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        if arg.arg == name and default is not None:
            return default
    return None


def same_shape_as(module: ModuleInfo, scope: Scope, mask: ast.AST, target: str, line: int) -> bool:
    """Is the mask computed elementwise from ``target`` (or a tensor of its shape), so it has its rank?"""
    return _same_shape(module, scope, mask, _shape_sources(scope, target, line), line)


def _same_shape(module: ModuleInfo, scope: Scope, mask: ast.AST, sources: set[str], line: int, depth: int = 0) -> bool:
    if depth > 6:
        return False
    if isinstance(mask, ast.Name):
        value = scope.definition(mask.id, line)
        return value is not None and _same_shape(module, scope, value, sources, getattr(value, "lineno", line), depth + 1)
    if isinstance(mask, ast.Compare):
        return any(ast.unparse(side) in sources for side in (mask.left, *mask.comparators))
    if isinstance(mask, ast.UnaryOp):
        return _same_shape(module, scope, mask.operand, sources, line, depth + 1)
    if isinstance(mask, ast.BinOp):
        return any(_same_shape(module, scope, side, sources, line, depth + 1) for side in (mask.left, mask.right))
    if isinstance(mask, ast.Call):
        name = module.canonical(mask.func) or ""
        if name in ("torch.isnan", "torch.isinf", "torch.isfinite", "torch.isneginf", "torch.isposinf", "torch.eq",
                    "torch.ne", "torch.gt", "torch.lt", "torch.ge", "torch.le") and mask.args:
            return any(ast.unparse(a) in sources for a in mask.args[:2])
        if isinstance(mask.func, ast.Attribute) and mask.func.attr in ("isnan", "isinf", "isfinite", "eq", "ne", "gt", "lt", "ge", "le"):
            return ast.unparse(mask.func.value) in sources
    return False


def shape_sources(scope: Scope, node: ast.AST, line: int, depth: int = 0) -> set[str]:
    """Texts of tensors that certainly have ``node``'s shape: ``masked = target.clone() - start`` -> {masked, target}."""
    out = {ast.unparse(node)}
    if depth > 6:
        return out
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if value is not None:
            out |= shape_sources(scope, value, getattr(value, "lineno", line), depth + 1)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        if attr in ("clone", "detach", "contiguous", "to", "float", "half", "bfloat16", "long", "int", "type_as", "abs", "neg"):
            out |= shape_sources(scope, node.func.value, line, depth + 1)
        elif attr in ("view_as", "reshape_as", "expand_as") and node.args:
            out |= shape_sources(scope, node.args[0], line, depth + 1)
    elif isinstance(node, ast.BinOp):
        for side in (node.left, node.right):
            defined = scope.definition(side.id, line) if isinstance(side, ast.Name) else None
            if isinstance(side, (ast.Call, ast.Subscript)) or isinstance(defined, (ast.Call, ast.Subscript, ast.BinOp)):
                out |= shape_sources(scope, side, line, depth + 1)  # `target.clone() - start`: a scalar side adds nothing
    return out


def _shape_sources(scope: Scope, target: str, line: int) -> set[str]:
    try:
        node = ast.parse(target, mode="eval").body
    except SyntaxError:
        return {target}
    return shape_sources(scope, node, line)


# --- the pattern ---------------------------------------------------------------------------------


class AffinityIndexPut(Pattern):
    id = _ID
    api = "torch.Tensor.masked_fill_"
    title = "Boolean-mask assignment (IndexPut) → masked_fill_ / torch.where (Ascend affinity rewrite)"
    training_ok = True
    bound = "launch"
    # Every statement _may_yield lets through writes a subscript (`x[m] = v`, `x[m] += v`, a
    # subscript in a tuple target `a[m], b = ...`: "[") or calls index_put/index_put_; a scope
    # with neither word yields nothing (Pattern.SCOPE_WORDS: checked on examples and files)
    SCOPE_WORDS = ("[", "index_put")

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        if not _relevant(module):
            return
        for _block, _i, stmt in scope.statements():
            if _STMT_FILTER and not _may_yield(stmt):
                continue
            site = _site_parts(stmt)
            if site is None:
                other = _other_form(module, scope, stmt)
                if other is not None:
                    yield other
                continue
            target_node, mask, value, aug = site
            r = _analyze(module, scope, stmt, target_node, mask, value, aug)
            if r is not None:
                yield r

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        return symbolic(
            "launch",
            "launch/sync-bound: a boolean-mask IndexPut runs nonzero (a device-to-host sync and a data-dependent "
            "shape) plus an IndexPut scatter; the replacement is one dense elementwise kernel "
            + ("(MaskedFill)" if finding.params.get("form") == "masked_fill" else "(SelectV2) and a copy")
            + " over the whole tensor. Bytes moved are about the same, so the gain is the sync and the launches: "
            "worthwhile in a hot device-side loop, little on small tensors, and nothing where the code runs on CPU "
            "(data collators)",
        )

    @staticmethod
    def reference(x: Any, mask: Any, value: Any) -> Any:
        """Eager ground truth: ``x[mask] = value`` on a copy."""
        out = x.clone()
        out[mask] = value
        return out


def _relevant(module: ModuleInfo) -> bool:
    # cached on the module (detect runs for every scope of it); a global cache holding the
    # last module would keep its whole tree alive past the file, for the garbage collector to walk
    cached = module.__dict__.get("_npufuse_aip_relevant")
    if cached is None:
        cached = module.__dict__["_npufuse_aip_relevant"] = any(v == "torch" or v.startswith("torch.") for v in module.aliases.values())
    return bool(cached)


_STMT_FILTER = True  # tests switch it off to compare


def _may_yield(stmt: ast.stmt) -> bool:
    """Whether ``_site_parts`` or ``_other_form`` can be anything but None for ``stmt``: their
    first tests, joined (most statements of a scope fail them; two calls each cost more)."""
    if isinstance(stmt, ast.Assign):
        if len(stmt.targets) != 1:
            return False
        if isinstance(stmt.targets[0], (ast.Subscript, ast.Tuple, ast.List)):
            return True
        v = stmt.value
        return isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "index_put"
    if isinstance(stmt, ast.AugAssign):
        return isinstance(stmt.target, ast.Subscript)
    if isinstance(stmt, (ast.Expr, ast.Return)):
        v = stmt.value
        return isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == ("index_put_" if isinstance(stmt, ast.Expr) else "index_put")
    return False


def _site_parts(stmt: ast.stmt) -> Optional[tuple[ast.expr, ast.expr, ast.expr, Optional[ast.operator]]]:
    """(target, mask, value, aug op) of ``x[m] = v`` / ``x[m] op= v`` / ``x.index_put_((m,), v)``."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript):
        t = stmt.targets[0]
        return t.value, t.slice, stmt.value, None
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Subscript) and isinstance(stmt.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return stmt.target.value, stmt.target.slice, stmt.value, stmt.op
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == "index_put_" and len(call.args) >= 2:
            idx = call.args[0]
            acc = keyword(call, "accumulate", 2)
            if isinstance(idx, (ast.Tuple, ast.List)) and len(idx.elts) == 1 and (acc is None or const_value(acc) is False):
                return f.value, idx.elts[0], call.args[1], None
    return None


def _is_maskish(module: ModuleInfo, scope: Scope, node: ast.AST, line: int) -> bool:
    return is_bool_mask(module, scope, node, line) or (mask_like(node, scope) and not integer_index(module, node, scope, line))


def _full_slice(node: ast.AST) -> bool:
    return isinstance(node, ast.Slice) and node.lower is None and node.upper is None and node.step is None


def _split_index(module: ModuleInfo, scope: Scope, index: ast.Tuple, line: int) -> "Optional[tuple[ast.expr, int] | str]":
    """``x[m, :]`` / ``x[:, m, ...]``: (the mask, the number of full slices before it); a reason string
    when a mask is mixed with other indices; None when no element is a mask (``x[i, j]``, ``x[:, :n]``)."""
    masks = [i for i, e in enumerate(index.elts) if _is_maskish(module, scope, e, line)]
    if not masks:
        return None
    if len(masks) > 1:
        return "several boolean masks in one index: not an elementwise rewrite npufuse makes"
    k = masks[0]
    others = [e for i, e in enumerate(index.elts) if i != k]
    if all(_full_slice(e) for e in index.elts[:k]) and all(_full_slice(e) or isinstance(e, ast.Constant) and e.value is Ellipsis for e in index.elts[k + 1 :]):
        return index.elts[k], k
    # name the offending index: an integer / tensor / partial slice before a leading `...`
    bad = next((e for e in others if not _full_slice(e) and not (isinstance(e, ast.Constant) and e.value is Ellipsis)),
               next(e for e in others if not _full_slice(e)))
    return (f"the mask is combined with the index `{segment(module, bad)[:30]}` in one subscript (mixed integer/slice "
            "and mask indexing): not an elementwise rewrite npufuse makes")


def _other_form(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[NearMiss]:
    """Mask assignments npufuse does not rewrite, reported rather than skipped: a tuple target
    (``a[m], b[n] = f(...)``) and the out-of-place ``y = x.index_put(indices, values)``."""
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
    if not isinstance(stmt, (ast.Assign, ast.Return)) or isinstance(stmt, ast.Assign) and len(stmt.targets) != 1:
        return None
    t = stmt.targets[0] if isinstance(stmt, ast.Assign) else None
    if isinstance(t, (ast.Tuple, ast.List)):
        subs = [e for e in t.elts if isinstance(e, ast.Subscript) and not isinstance(e.slice, (ast.Constant, ast.Slice))]
        if any(_is_maskish(module, scope, e.slice, line) for e in subs):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, (ast.Tuple, ast.List)):
                # s43 (audit43, ProteinWorkshop's GVP ``x_[0][m], x_[1][m] = x[0], x[1]``): a tuple, not a call
                return NearMiss(_ID, scope.qualname, line, end,
                                "masked assignments unpacked from a tuple (`a[m], b[n] = x, y`): npufuse rewrites one "
                                "masked assignment per statement, and the values may hold one row per selected element "
                                "(a masked scatter), which no elementwise rewrite reproduces")
            return NearMiss(_ID, scope.qualname, line, end,
                            "masked assignments unpacked from one call (`a[m], b[n] = f(...)`): the values are computed "
                            "for the selected rows only (a masked scatter), which no elementwise rewrite reproduces")
        return None
    v = stmt.value
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "index_put":
        idx = keyword(v, "indices", 0)
        if idx is not None and (integer_index(module, idx, scope, line) or isinstance(idx, (ast.Tuple, ast.List)) and any(integer_index(module, e, scope, line) for e in idx.elts)):
            return NearMiss(_ID, scope.qualname, line, end,
                            f"index_put with `{segment(module, idx)[:40]}`, integer positions, not a boolean mask: a "
                            "scatter to given positions, which masked_fill/where (they take a mask) do not express; where "
                            "the positions come from `mask.nonzero()`, index with the mask itself to allow the rewrite")
    return None


def _analyze(module: ModuleInfo, scope: Scope, stmt: ast.stmt, target_node: ast.expr, mask: ast.expr,
             value: ast.expr, aug: Optional[ast.operator]) -> Optional[Result]:
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
    target = dotted(target_node)
    if target is None and isinstance(target_node, ast.Subscript) and dotted(target_node.value) is not None \
            and isinstance(const_value(target_node.slice), int):
        # ``probs[0][~keep] = 0.0``: a constant-index view of a name; masked_fill_ on the view writes through
        target = segment(module, target_node)
    lead = 0  # full slices before the mask: x[:, m] = v masks dims 1.. of x
    if isinstance(mask, ast.Tuple) and target is not None:
        split = _split_index(module, scope, mask, line)
        if split is None:
            return None  # x[i, j] = v, x[:, :n] = v: not a mask assignment
        if isinstance(split, str):
            return NearMiss(_ID, scope.qualname, line, end, split)
        mask, lead = split
    if isinstance(mask, (ast.Constant, ast.Slice, ast.Tuple)) or target is None:
        return None  # d["key"] = v, x[0] = v, x[:, :n] = v, x[i, j] = v: not a mask assignment
    if integer_index(module, mask, scope, line):
        return NearMiss(_ID, scope.qualname, line, end,
                        f"index `{segment(module, mask)[:50]}` is integer positions (nonzero/where), not a boolean "
                        "mask: index with the mask itself to allow the masked_fill/where rewrite")
    if _constant_key(scope, mask, line):
        return None  # ``row[ATTENTION_MASK_KEY] = ...``: a dict key or a fixed position, not a per-call mask
    listed = _python_list_index(scope, mask, line)
    if listed is not None:
        # s40 (audit40, tango's ``mask_indices = [k for k in range(n) if random.random() < 0.1]``): a list has no
        # ``.dtype``, masked_fill_/where take no list, and a list of ints picks rows by position
        return NearMiss(_ID, scope.qualname, line, end,
                        f"index `{segment(module, mask)[:50]}` is a Python list (line {listed}), not a boolean mask tensor: "
                        "masked_fill/where take a tensor mask (a list of ints selects rows by position)")
    # a mask by name or by `~` whose dtype is not visible here (HF passes attention masks in as parameters):
    # the rewrite checks `dtype == torch.bool` at run time and keeps the IndexPut otherwise
    checked = not is_bool_mask(module, scope, mask, line)
    if checked and not mask_like(mask, scope):
        return None  # cannot tell a mask from an integer index: not reported
    if _is_numpy(module, scope, target_node, line):
        return NearMiss(_ID, scope.qualname, line, end, f"`{target}` is a numpy array, not a torch tensor")
    # s45 (audit45): a numpy method called on the target elsewhere in the function
    not_tensor = not_tensor_method_use(module, scope, target_node, line)
    if not_tensor is not None:
        return NearMiss(_ID, scope.qualname, line, end, f"`{target}` is not a torch tensor: {not_tensor}; "
                        "masked_fill_ / torch.where take tensors only")
    # operands as code: a mask/value written over several lines is bracketed (bare continuation lines do not parse)
    mask_text = _code_text(module, mask)
    value_text = _code_text(module, value)
    target = _bracketed(target)
    gathered = _gathered(module, value, mask)
    if aug is not None:
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(aug)]
        value_elem = f"{target} {op} ({value_text})" if gathered is None else f"{target} {op} ({gathered})"
        if gathered is None and not is_scalar(module, scope, value, line):
            # s43 (audit43b, PLoRA ``res[mask] += lora(x[mask])``): the value may be computed from rows gathered with
            # the mask by row-wise layers, so "not gathered" was not always a fact; what holds is that npufuse does not
            # show it element by element with the target
            # s46 (audit46): "not known to be" a scalar: a configuration float is one, npufuse only cannot show it
            return NearMiss(_ID, scope.qualname, line, end, f"`{target}[mask] {op}= {value_text[:40]}`: {AUG_NOT_SHOWN}")
        form, elem = "where", value_elem
    elif gathered is not None:
        indexed = _gathered_as_index(module, value, mask)
        if indexed is not None:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"`{indexed[:50]}`: the gathered elements index another tensor; the where form would index "
                            "it with the whole tensor, whose rows outside the mask may hold positions out of range "
                            "(-1 / 0 for unassigned entries)")
        sliced = _affinity_index_put_s45.gathered_then_sliced(module, value, mask)
        if sliced is not None:
            # s45 (audit44, TSPulse ``random_indices[batch_mask, :num_mask, :]``): gathered with the mask, then indexed on
            # other axes; the where form kept it gathered ([k, ..] beside the whole tensor: a shape error for 1 < k < B),
            # so a near miss, with the true first blocker
            other = _not_elementwise(module, value)
            return NearMiss(_ID, scope.qualname, line, end, _NOT_ELEMENTWISE.format(other[:50]) if other is not None
                            else _affinity_index_put_s45.sliced_reason(sliced))
        loose = _ungathered_operand(module, scope, value, mask, line)
        if loose is not None:
            numpy_name = numpy_value_operand(module, scope, value, line, _is_numpy)
            if numpy_name is not None:
                # s46 (audit46, mmdet's ``img_show[mask] = img_show[mask] * 0.5 + color_mask * 0.5``): a numpy operand
                return NearMiss(_ID, scope.qualname, line, end, numpy_value_reason(numpy_name))
            # s41 (audit41, InternVL-style ``x[sel] = x[sel] * 0.0 + vit_embeds[:n_token]``): one row per selected element
            return NearMiss(_ID, scope.qualname, line, end,
                            f"`{loose[:50]}` in the value is a tensor not gathered with the mask: it may hold one row per "
                            "selected element (masked scatter, e.g. image features into embeddings), which no elementwise "
                            "rewrite reproduces")
        other = _not_elementwise(module, value)
        if other is not None:
            return NearMiss(_ID, scope.qualname, line, end, _NOT_ELEMENTWISE.format(other[:50]))
        form, elem = "where", gathered
    elif is_scalar(module, scope, value, line):
        form, elem = "masked_fill", value_text
    elif _vector_parameter(module, scope, value):
        # a 1-D nn.Parameter (wav2vec2's masked_spec_embed): broadcast over the selected rows, so where is exact
        form, elem = "where", value_text
    elif not _tensor_evidence(module, scope, value, line):
        return NearMiss(_ID, scope.qualname, line, end,
                        f"value `{value_text[:50]}` is not known to be a scalar, a 1-D parameter or gathered with the "
                        "same mask, so the rewrite cannot be shown exact")
    elif _full_reduction(value):
        # s43 (audit43, TorchRL's ``diff[mask] = diff.max() + 1``): one value for every selected element
        return NearMiss(_ID, scope.qualname, line, end,
                        f"value `{value_text[:50]}` is a 0-d tensor (a full reduction), not a Python number: npufuse "
                        "rewrites only fills by a Python number, a 1-D parameter or values gathered with the same mask")
    else:
        # s43 (audit43b, ``f0[uv] = np.interp(np.where(uv)[0], ...)``): a numpy call's result is an array, not a tensor
        kind = "a numpy array" if isinstance(value, ast.Call) and (module.canonical(value.func) or "").startswith("numpy.") \
            else "a tensor"
        return NearMiss(_ID, scope.qualname, line, end,
                        f"value `{value_text[:50]}` is {kind} not gathered with the same mask: it may hold one row per "
                        "selected element (masked scatter, e.g. image features into embeddings), which no "
                        "elementwise rewrite reproduces")
    same = lead == 0 and same_shape_as(module, scope, mask, target, line)
    # a numpy or host mask: masked_fill_/where reject it where indexing took it (checked at run time)
    placed = placement_unproved(module, scope, mask, line)
    mask_var = mask_text if same and not checked and placed is None else f"{P}mask"  # used once: inline unless aligned or checked
    lines = []
    if mask_var != mask_text:
        lines.append(f"{P}mask = {mask_text}")
    body = []
    if not same:
        if lead:
            # x[:, m] = v: the mask indexes the dims after the leading slices
            body.append(f"# the mask indexes dims {lead}.. of {target}; masked_fill/where broadcast from the right: align them")
            body.append(f"{P}mask = {P}mask.reshape((1,) * {lead} + {P}mask.shape + (1,) * ({target}.dim() - {P}mask.dim() - {lead}))")
        else:
            body.append("# indexing consumes leading dims, masked_fill/where broadcast from the right: align the ranks")
            body.append(f"{P}mask = {P}mask.reshape({P}mask.shape + (1,) * ({target}.dim() - {P}mask.dim()))")
    if form == "masked_fill":
        body.append(f"{target}.masked_fill_({mask_var}, {elem})")
    else:
        body.append(f"{target}.copy_(torch.where({mask_var}, ({elem}).to({target}.dtype), {target}))")
    if checked or placed is not None:
        # the mask's dtype (or kind and device) is only known at run time (a metadata check, no host sync):
        # anything else keeps the original IndexPut, with the index evaluated once
        tests = [f"isinstance({P}mask, torch.Tensor)", f"{P}mask.device == {target}.device"] if placed is not None else []
        if checked:
            # s40: a parameter may be a list of positions (no ``.dtype``): the type is tested first
            tests = tests or [f"isinstance({P}mask, torch.Tensor)"]
            tests.append(f"{P}mask.dtype == torch.bool")
        lines.append(f"if {' and '.join(tests)}:")
        lines += ["    " + b for b in body]
        lines.append("else:  # " + ("integer positions after all" if placed is None else "a numpy or host mask, or integer positions")
                     + ": the original IndexPut")
        lines += ["    " + ln for ln in replace_segments(module, stmt, [(mask, f"{P}mask")]).splitlines()]
    else:
        lines += body
    params = {
        "target": target,
        "mask": mask_text,
        "value": value_text,
        "form": form,
        "mask_rank": "same_as_target" if same else "aligned_at_runtime",
        "augmented": aug is not None,
        "value_is_inf": is_inf(module, scope, value, line),
    }
    if checked:
        params["mask_dtype"] = "checked_at_runtime"
    if placed is not None:
        params["mask_placement"] = "checked_at_runtime"
    if lead:
        params["mask_first_dim"] = lead
    risks = [Risk("other", "if this code runs on CPU tensors (data collators, preprocessing) the guard keeps the "
                  "original and nothing is gained")]
    if form == "where":
        risks.append(Risk("other", "the right-hand side is evaluated over the whole tensor instead of the selected "
                          "elements: more arithmetic (still one dense pass), and any error/NaN it makes at "
                          "unselected positions is discarded by torch.where"))
    notes = ["in place like the original (other references to the tensor see the change); autograd gives the "
             "same gradients (masked positions get none from the old values)"]
    if form == "masked_fill":
        notes.append("masked_fill_ instead of the multiply form x *= ~mask of the Ascend guide: exact for ±inf/NaN values "
                     "and for non-finite x (inf * 0 = NaN), one kernel instead of not + cast + mul")
    if checked:
        notes.append(f"`{mask_text[:40]}` is a mask by its name or `~`, but its dtype is not visible here: the fused "
                     "branch checks `dtype == torch.bool` at run time (no host sync) and keeps the IndexPut otherwise")
    if placed is not None:
        notes.append(f"{placed}: indexing takes it, masked_fill_/where need a torch tensor on {target}'s device, so the "
                     "fused branch checks both at run time (no host sync) and keeps the IndexPut otherwise")
    variant = ("aug_" if aug is not None else "") + form + ("_rank_aligned" if not same else "") + ("_dtype_checked" if checked else "") \
        + ("_placement_checked" if placed is not None else "")
    fused = "\n".join(lines) + "\n"
    if parsed_code(fused) is None:
        # a replacement npufuse cannot write as valid code is no candidate (the renderer would fail on it)
        return NearMiss(_ID, scope.qualname, line, end, "npufuse could not write this assignment's replacement as code "
                        "that parses (an operand's source does not stand on its own): left as is")
    return Finding(
        pattern=_ID, qualname=scope.qualname, line=line, end_line=end, params=params, fused=fused,
        guard_tensor=target, confidence="high" if same and not checked else "medium", variant=variant, risks=risks, notes=notes,
    )


def _bracketed(text: str) -> str:
    """``text`` in parentheses when it spans lines: a continuation line of a multi-line operand only
    parses inside the brackets it was written in (``x[\n  a\n  >= b\n] = 0``'s mask)."""
    return f"({text})" if "\n" in text else text


def _code_text(module: ModuleInfo, node: ast.expr) -> str:
    """The source of ``node`` as an expression that stands on its own in generated code."""
    return _bracketed(segment(module, node))


def _gathered(module: ModuleInfo, value: ast.expr, mask: ast.expr) -> Optional[str]:
    """``f(y[mask], ...)`` with every tensor leaf indexed by the same mask -> ``f(y, ...)`` text, else None."""
    mask_dump = ast.dump(mask)
    found = False
    ok = True

    class Swap(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            nonlocal found
            if ast.dump(node.slice) == mask_dump:
                found = True
                return self.generic_visit(node.value) or node.value  # type: ignore[return-value]
            return self.generic_visit(node)

        def visit_Name(self, node: ast.Name) -> ast.AST:
            return node

    new = Swap().visit(copy.deepcopy(value))
    if not found:
        return None
    # every remaining tensor-ish leaf must have been gathered: reject names/calls left outside the swap
    for n in fast_walk(new):
        if isinstance(n, ast.Call) and (module.canonical(n.func) or "").startswith(("torch.rand", "torch.randint", "torch.randn")):
            ok = False  # a fresh random tensor of the selected size: shape changes without the mask
    return ast.unparse(new) if ok else None


def _has_row_slice(index: ast.expr) -> bool:
    return isinstance(index, ast.Slice) or isinstance(index, ast.Tuple) and any(isinstance(e, ast.Slice) for e in index.elts)


_NOT_ELEMENTWISE = ("`{}` on the gathered elements is not known to act element by element: evaluated over the whole "
                    "tensor (what the where form does) it may differ, fail on rows the mask leaves out (a sampler on all-zero "
                    "rows) or draw other random numbers")


def _ungathered_operand(module: ModuleInfo, scope: Scope, value: ast.expr, mask: ast.expr, line: int) -> Optional[str]:
    """An operand of the value that is not gathered with the mask and may be sized by the selection: a row slice
    (``vit_embeds[:n_token]``) or a name with tensor evidence that is no scalar nor 1-D parameter (``vit_embeds``).
    A gathered element's own subscripts (``x[m][:, :1]``) and constant-index table entries (``factors[0]``) are
    not such operands. None where every operand is gathered or broadcasts alike on both sides."""
    mask_dump = ast.dump(mask)
    stack: list[ast.expr] = [value]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Subscript):
            if ast.dump(n.slice) == mask_dump:
                continue  # gathered
            if isinstance(n.value, ast.Subscript) and ast.dump(n.value.slice) == mask_dump:
                continue  # a part of the gathered elements
            if _has_row_slice(n.slice) or _index_tensor(module, scope, n.slice, line):
                # s43 (audit43, ProteinWorkshop's ``x[m] + centroid[batch_index]``): rows picked by another index
                # tensor follow that index, which the eager sum needs sized like the selection
                return segment(module, n)
            continue
        if isinstance(n, ast.BinOp):
            stack += [n.left, n.right]
        elif isinstance(n, ast.UnaryOp):
            stack.append(n.operand)
        elif isinstance(n, ast.IfExp):
            stack += [n.body, n.orelse]
        elif isinstance(n, ast.Call):
            stack += [a for a in n.args if not isinstance(a, ast.Starred)]
            if isinstance(n.func, ast.Attribute):
                stack.append(n.func.value)
        elif isinstance(n, (ast.Name, ast.Attribute)):
            if isinstance(n, ast.Name) and _bound_to_gathered(scope, n, mask_dump, line):
                # s43 (audit43, ProteinWorkshop's ``values = x[m]; y[m] = values - c[m]``): already selection-sized
                return segment(module, n)
            if is_scalar(module, scope, n, line) or _vector_parameter(module, scope, n):
                continue
            if _tensor_evidence(module, scope, n, line):
                return segment(module, n)
    return None


_FULL_REDUCTIONS = frozenset(("max", "min", "sum", "mean", "amax", "amin", "prod", "norm", "std", "var"))


def _full_reduction(value: ast.expr) -> bool:
    """``t.max() + 1``: a reduction over every element (no dim), alone or with number literals."""
    if isinstance(value, ast.BinOp):
        sides = (value.left, value.right)
        return any(_full_reduction(x) for x in sides) and all(_full_reduction(x) or isinstance(x, ast.Constant) for x in sides)
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _FULL_REDUCTIONS
            and not value.args and not value.keywords)


def _bound_to_gathered(scope: Scope, name: ast.Name, mask_dump: str, line: int) -> bool:
    """``name = y[mask]`` (the last binding before the site): one row per selected element."""
    d = scope.definition(name.id, line)
    return isinstance(d, ast.Subscript) and ast.dump(d.slice) == mask_dump


def _index_tensor(module: ModuleInfo, scope: Scope, index: ast.expr, line: int) -> bool:
    """An index that is a tensor of positions (a name made by a torch call, or a parameter annotated as a Tensor):
    not a scalar, a constant or a slice."""
    if not isinstance(index, ast.Name):
        return False
    if scope.definition(index.id, line) is None and "Tensor" in _param_annotation(scope, index.id):
        return True  # an annotation says more than a name ending in ``_index``
    return not is_scalar(module, scope, index, line) and _tensor_evidence(module, scope, index, line)


def _gathered_as_index(module: ModuleInfo, value: ast.expr, mask: ast.expr) -> Optional[str]:
    """``table[idx[mask] - 1]``: the gathered elements index another tensor. The where form evaluates
    ``table[idx - 1]`` on every row, and the rows the mask leaves out may hold positions out of range."""
    mask_dump = ast.dump(mask)
    for n in fast_walk(value):
        if isinstance(n, ast.Subscript) and ast.dump(n.slice) != mask_dump:
            if any(isinstance(m, ast.Subscript) and ast.dump(m.slice) == mask_dump for m in fast_walk(n.slice)):
                return segment(module, n)
    return None


# calls that act element by element (torch functions and tensor methods by their last name): f(y[m]) equals
# f(y)[m] for these, so the where form may evaluate them over the whole tensor
_ELEMENTWISE = frozenset((
    "abs", "neg", "negative", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square",
    "sigmoid", "tanh", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "erf", "erfc", "reciprocal",
    "relu", "gelu", "silu", "softplus", "elu", "leaky_relu", "mish", "hardtanh", "logit", "sign", "sgn",
    "floor", "ceil", "round", "trunc", "frac", "clamp", "clamp_min", "clamp_max", "clip", "nan_to_num",
    "float", "half", "double", "bfloat16", "long", "int", "bool", "to", "type", "type_as", "detach", "clone",
    "contiguous", "add", "sub", "mul", "div", "true_divide", "pow", "remainder", "fmod", "minimum", "maximum",
    "where", "lerp", "logical_not", "logical_and", "logical_or", "logical_xor", "isnan", "isinf", "isfinite",
    "eq", "ne", "lt", "le", "gt", "ge", "bitwise_not", "bitwise_and", "bitwise_or", "float_power", "xlogy",
))


def _not_elementwise(module: ModuleInfo, value: ast.expr) -> str | None:
    """The first call in ``value`` not known to act element by element (a function of the repository, a
    sampler, a reduction, a matmul), as text; None when every call is elementwise."""
    for n in fast_walk(value):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or ""
            if isinstance(n.func, ast.Attribute):
                # a tensor method (y.exp()), or a function of an imported module: torch's only
                spelled = dotted(n.func) or ""
                imported = spelled.split(".", 1)[0] in module.aliases
                ok = n.func.attr in _ELEMENTWISE and (not imported or name.startswith("torch."))
            else:
                ok = name.startswith("torch.") and name.rsplit(".", 1)[-1] in _ELEMENTWISE
            if not ok:
                return segment(module, n)
    return None


def _is_numpy(module: ModuleInfo, scope: Scope, node: ast.expr, line: int, depth: int = 0) -> bool:
    """The target is built by numpy calls (``np.zeros``, ``np.array(...) + offsets``) in this function."""
    while isinstance(node, ast.Attribute) and node.attr in ("predictions", "label_ids"):
        node = node.value  # ``eval_pred.predictions``: the arrays of an EvalPrediction
    if depth > 6 or not isinstance(node, ast.Name):
        return False
    value = scope.definition(node.id, line)
    if value is None:
        # transformers' Trainer numpifies what it hands compute_metrics: an EvalPrediction holds numpy arrays;
        # a parameter annotated as a numpy array (``input: np.ndarray``, ``np.array``, ``NDArray``) is one
        return _numpy_annotation(module, _param_annotation(scope, node.id))
    if isinstance(value, (ast.Name, ast.Attribute)):
        # ``preds, labels = eval_preds``: the unpacked parameter
        return _is_numpy(module, scope, value, getattr(value, "lineno", line), depth + 1)
    return _numpy_built(module, scope, value, line, depth)


def _numpy_built(module: ModuleInfo, scope: Scope, value: ast.expr, line: int, depth: int) -> bool:
    """``value`` is built by numpy calls: the first library call met is numpy's, or a name it reads is numpy."""
    if isinstance(value, ast.IfExp):
        # s43 (audit43b, ``f0_mel = 1127 * (1 + f0 / 700).log() if is_torch else 1127 * np.log(1 + f0 / 700)``):
        # a torch / numpy dispatch is numpy only when both arms are; otherwise the run-time guard decides
        return _numpy_built(module, scope, value.body, line, depth) and _numpy_built(module, scope, value.orelse, line, depth)
    if isinstance(value, ast.Name):
        return _is_numpy(module, scope, value, line, depth + 1)
    for n in fast_walk(value):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or dotted(n.func) or ""
            if name.startswith(("numpy.", "np.")):
                return True
            if name.startswith("torch."):
                return False
        if isinstance(n, ast.Name) and n is not value and _is_numpy(module, scope, n, getattr(value, "lineno", line), depth + 1):
            return True
    return False


def _numpy_annotation(module: ModuleInfo, annotation: str) -> bool:
    """An annotation naming an EvalPrediction or a numpy array: ``np.ndarray``, ``np.array`` (the function,
    used as a type by some code), ``numpy.typing.NDArray[...]``; a string annotation is read the same way."""
    text = annotation.strip("'\"").split("[", 1)[0]
    if text.rsplit(".", 1)[-1] == "EvalPrediction":
        return True
    head, _, rest = text.partition(".")
    origin = module.aliases.get(head, head)
    full = f"{origin}.{rest}" if rest else origin
    return full in ("numpy.ndarray", "numpy.array", "numpy.typing.NDArray") or (full.endswith(".NDArray") and full.startswith("numpy"))


def _vector_parameter(module: ModuleInfo, scope: Scope, value: ast.expr) -> bool:
    """``self.<p>`` (possibly cast) where ``__init__`` makes ``p`` a 1-D ``nn.Parameter``."""
    node = value
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "type_as", "float", "half", "bfloat16"):
        node = node.func.value
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        return False
    cls = module.classes.get(scope.class_name or "")
    if cls is None:
        return False
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for s in fast_walk(fn):
                if isinstance(s, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == node.attr for t in s.targets):
                    v = s.value
                    if isinstance(v, ast.Call) and (module.canonical(v.func) or "").endswith("nn.Parameter") and v.args:
                        inner = v.args[0]
                        while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in ("uniform_", "normal_", "zero_", "fill_"):
                            inner = inner.func.value
                        if isinstance(inner, ast.Call) and (module.canonical(inner.func) or "") in (
                            "torch.Tensor", "torch.zeros", "torch.ones", "torch.empty", "torch.randn", "torch.rand", "torch.FloatTensor"
                        ):
                            sizes = [a for a in inner.args if not isinstance(a, ast.Starred)]
                            return len(sizes) == 1 and len(inner.args) == 1 and not isinstance(sizes[0], (ast.Tuple, ast.List))
    return False


def _constant_key(scope: Scope, index: ast.expr, line: int) -> bool:
    """``row[ATTENTION_MASK_KEY] = [1] * n`` (open-instruct's dataset maps): an ALL_CAPS name the function does not
    bind is a constant by convention (a module string or an imported one): a dict key or a fixed position, never a
    mask computed per call. (The name test alone: a module-constant table per file cost ~2% of the scan.)"""
    return isinstance(index, ast.Name) and index.id.isupper() and any(c.isalpha() for c in index.id) \
        and scope.definition(index.id, line) is None


def _python_list_index(scope: Scope, index: ast.expr, line: int) -> int | None:
    """The line of a list display / comprehension / ``list(...)`` the index name was last bound to, else None."""
    if not isinstance(index, ast.Name):
        return None
    d = scope.definition(index.id, line)
    if isinstance(d, (ast.List, ast.ListComp)) or isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "list":
        return d.lineno
    return None


def _tensor_evidence(module: ModuleInfo, scope: Scope, value: ast.expr, line: int, depth: int = 0) -> bool:
    """The value is made by a torch call or a method call that returns a tensor. An attribute or a subscript alone
    is not evidence: ``self.num_classes - 1`` and ``order["-"]`` are Python ints (chai-lab's feature generators)."""
    node = value
    if isinstance(node, ast.Name):
        d = scope.definition(node.id, line)
        if d is None:
            return False  # a parameter of unknown type
        node = d
    if isinstance(node, ast.Subscript) and depth < 3:
        # ``feats[i]`` of a tensor (or of torch.split's pieces): what the indexed value is made of
        return _tensor_evidence(module, scope, node.value, line, depth + 1)
    for n in fast_walk(node):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or ""
            # a torch call, a tensor method, or a module looked up and called (``self.adapters[key](x)``)
            if name.startswith("torch.") or isinstance(n.func, ast.Subscript) or (
                    isinstance(n.func, ast.Attribute) and n.func.attr not in _NON_TENSOR_METHODS and not _text_tool(n.func.value)):
                return True
    return False


def _text_tool(receiver: ast.expr) -> bool:
    """A tokenizer / processor object (``tokenizer.convert_tokens_to_ids(...)``, ``self.processor.encode(...)``):
    its methods return Python ints, lists or encodings, not tensors by themselves (s40, caduceus's MLM masking)."""
    name = (dotted(receiver) or "").rpartition(".")[2].lower()
    return any(w in name for w in ("tokenizer", "processor"))


# methods whose result is a Python value (or whatever a container holds), not a tensor by itself
_NON_TENSOR_METHODS = frozenset(("item", "tolist", "numel", "dim", "size", "get", "index", "count", "pop", "keys",
                                 "values", "items", "__len__"))


# ---------------------------------------------------------------------------------------------
# Examples (they are the tests; tests/test_affinity_rewrites.py executes CHECKS under the emulator)
# ---------------------------------------------------------------------------------------------

_HF_LABELS = '''\
import torch


def preprocess_labels(labels, pad_token_id):
    labels = labels.clone()
    # replace padding token id's of the labels by -100 so it's ignored by the loss
    labels[labels == pad_token_id] = -100
    return labels
'''

_HF_TOP_P = '''\
import torch
import torch.nn.functional as F


def top_k_top_p_filtering(logits, top_k=0, top_p=1.0, filter_value=-float("Inf"), min_tokens_to_keep=1):
    if top_k > 0:
        top_k = min(max(top_k, min_tokens_to_keep), logits.size(-1))
        # Remove all tokens with a probability less than the last token of the top-k
        indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
        logits[indices_to_remove] = filter_value
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        sorted_indices_to_remove = cumulative_probs > top_p
        sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
        sorted_indices_to_remove[..., 0] = 0
        indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
        logits[indices_to_remove] = filter_value
    return logits
'''

_MEGATRON_VOCAB = '''\
import torch


def vocab_parallel_target(vocab_parallel_logits, target, vocab_start_index, vocab_end_index):
    # Create a mask of valid vocab ids (1 means it needs to be masked).
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = target.clone() - vocab_start_index
    masked_target[target_mask] = 0
    logits_2d = vocab_parallel_logits.view(-1, vocab_parallel_logits.size(-1))
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
    predicted_logits = predicted_logits_1d.clone().contiguous().view_as(target)
    predicted_logits[target_mask] = 0.0
    return masked_target, predicted_logits
'''

_MMDET_ASSIGN = '''\
import torch


def assign_wrt_overlaps(overlaps, pos_iou_thr=0.5, neg_iou_thr=0.4):
    num_gts, num_bboxes = overlaps.size(0), overlaps.size(1)
    assigned_gt_inds = overlaps.new_full((num_bboxes, ), -1, dtype=torch.long)
    max_overlaps, argmax_overlaps = overlaps.max(dim=0)
    neg_inds = (max_overlaps >= 0) & (max_overlaps < neg_iou_thr)
    assigned_gt_inds[neg_inds] = 0
    pos_inds = max_overlaps >= pos_iou_thr
    assigned_gt_inds[pos_inds] = argmax_overlaps[pos_inds] + 1
    return assigned_gt_inds
'''

_NAN_CLEAN = '''\
import torch


def masked_mean_loss(per_token_loss, attention_mask):
    per_token_loss[torch.isnan(per_token_loss)] = 0.0
    per_token_loss[~torch.isfinite(per_token_loss)] = 0.0
    return (per_token_loss * attention_mask).sum() / attention_mask.sum()
'''

_HIDDEN_PAD = '''\
import torch


def zero_padding(hidden_states, attention_mask):
    hidden_states = hidden_states.clone()
    hidden_states[attention_mask == 0] = 0.0
    return hidden_states
'''

_AUG_SCORES = '''\
import torch


def boost_prompt_tokens(scores, prompt_mask, bonus: float):
    scores = scores.clone()
    scores[prompt_mask.bool()] += bonus
    return scores
'''

_MLM_COLLATOR = '''\
import torch


def torch_mask_tokens(inputs, special_tokens_mask, mask_token_id, vocab_size, mlm_probability=0.15):
    labels = inputs.clone()
    probability_matrix = torch.full(labels.shape, mlm_probability)
    probability_matrix.masked_fill_(special_tokens_mask, value=0.0)
    masked_indices = torch.bernoulli(probability_matrix).bool()
    labels[~masked_indices] = -100  # We only compute loss on masked tokens
    # 80% of the time, we replace masked input tokens with tokenizer.mask_token ([MASK])
    indices_replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked_indices
    inputs[indices_replaced] = mask_token_id
    # 10% of the time, we replace masked input tokens with random word
    indices_random = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked_indices & ~indices_replaced
    random_words = torch.randint(vocab_size, labels.shape, dtype=torch.long)
    inputs[indices_random] = random_words[indices_random]
    return inputs, labels
'''

_SPEC_AUGMENT = '''\
import torch
from torch import nn


class Wav2Vec2LikeModel(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.masked_spec_embed = nn.Parameter(torch.Tensor(hidden_size).uniform_())

    def _mask_hidden_states(self, hidden_states, mask_time_indices):
        # apply SpecAugment along time axis with given mask_time_indices
        mask_time_indices = torch.tensor(mask_time_indices, device=hidden_states.device, dtype=torch.bool)
        hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
        return hidden_states
'''

_KEEP_SCATTER = '''\
import torch


def merge_image_features(inputs_embeds, input_ids, image_features, image_token_id):
    special_image_mask = input_ids == image_token_id
    inputs_embeds = inputs_embeds.clone()
    inputs_embeds[special_image_mask] = image_features.to(inputs_embeds.dtype)
    return inputs_embeds
'''

_KEEP_NONZERO = '''\
import torch


def drop_low_scores(scores, threshold):
    keep = torch.nonzero(scores < threshold, as_tuple=True)
    scores[keep] = 0.0
    return scores
'''

_KEEP_NUMPY = '''\
import numpy as np
import torch


def make_weights(labels):
    weights = np.ones(len(labels), dtype=np.float32)
    weights[labels == 0] = 0.1
    return torch.from_numpy(weights)
'''

_KEEP_RANDOM = '''\
import torch


def jitter_selected(probs, threshold):
    mask = probs > threshold
    # one fresh random draw per selected element: its size is the number of selected elements
    probs[mask] *= torch.rand(int(mask.sum()))
    return probs
'''

_KEEP_UNRELATED = '''\
import torch


def fill(cache, positions, values):
    cache["k"] = values
    cache_tensor = torch.zeros(4, 8)
    cache_tensor[:, :2] = 1.0
    cache_tensor[positions] = values
    return cache_tensor
'''

_WAV2VEC2_ENCODER = '''\
import torch


def zero_padded_frames(hidden_states, attention_mask=None):
    # wav2vec2 / hubert / wavlm encoders: the mask arrives as a parameter (bool, from the feature extractor)
    if attention_mask is not None:
        expand_attention_mask = attention_mask.unsqueeze(-1).repeat(1, 1, hidden_states.shape[2])
        hidden_states[~expand_attention_mask] = 0
    return hidden_states
'''

_RUNTIME_DTYPE = '''\
import torch


def drop_tokens(scores, keep_mask, fill: float):
    # keep_mask may be a bool mask or integer positions: decided at run time
    scores[keep_mask] = fill
    return scores
'''

_LEADING_SLICE = '''\
import torch


def set_bos(audio_tokens, positions, bos_token_id: int):
    current = audio_tokens.clone()
    current[:, positions == 0, :] = bos_token_id
    return current
'''

_MOVED_MASK = '''\
import torch


def mark_padding(labels, pad_token_id):
    labels = labels.clone()
    # .to(device) keeps the comparison's bool dtype: provably a mask, no run-time check needed
    labels[(labels == pad_token_id).to(labels.device)] = -100
    return labels
'''

_VIEW_TARGET = '''\
import torch


def suppress(pred_probs, keep):
    # SAM3 video: zero the suppressed detections of the first frame, through a view
    pred_probs = pred_probs.clone()
    pred_probs[0][~keep] = 0.0
    return pred_probs
'''

_KEEP_DEEPSTACK = '''\
import torch


def deepstack(hidden_states, visual_pos_masks, visual_embeds):
    local_this = hidden_states[visual_pos_masks, :].clone() + visual_embeds
    hidden_states[visual_pos_masks, :] = local_this
    return hidden_states
'''

_KEEP_MIXED_INDEX = '''\
import torch


def rope_positions(position_ids, attention_mask, llm_positions):
    for batch_idx in range(position_ids.shape[1]):
        valid_mask = attention_mask[batch_idx] == 1
        position_ids[:, batch_idx, valid_mask] = llm_positions[batch_idx]
    return position_ids
'''

_KEEP_TUPLE_TARGET = '''\
import torch


def route(hidden_states, is_text, text_moe, vision_moe, final, logits):
    final[~is_text], logits[~is_text] = text_moe(hidden_states[~is_text])
    return final, logits
'''

_KEEP_INDEX_PUT_POSITIONS = '''\
import torch


def merge_images(inputs_embeds, input_ids, image_features, image_token_id):
    positions_tuple = torch.nonzero(input_ids == image_token_id, as_tuple=True)
    return inputs_embeds.index_put(indices=positions_tuple, values=image_features, accumulate=False)
'''

_KEEP_LIST_INDEX = '''\
import torch


def channel_mask(mask, unmasked_channel_indices: list | None = None):
    if unmasked_channel_indices is not None:
        mask[:, unmasked_channel_indices, :, :] = 0
    return mask
'''

# --- s28: a mask (and a value) written over several lines inside the subscript's brackets ---------
# (a synthetic-dataset style: positions past each row's valid count are zeroed). The operand's
# continuation lines parse only inside brackets: the replacement brackets a multi-line operand.
_MULTILINE_MASK = '''\
import torch


def pad_past_valid(idx, n, m, k, valid):
    pos = torch.arange(k).reshape(
        1, 1, -1
    )
    idx[
        pos
        >= valid.reshape(
            n, m, 1
        )
    ] = (
        0
    )
    return idx
'''

AffinityIndexPut.FUSE = [
    Fuse(_HF_LABELS, name="hf_labels_pad_to_ignore_index", expect={
        "target": "labels", "mask": "labels == pad_token_id", "value": "-100", "form": "masked_fill",
        "mask_rank": "same_as_target", "variant": "masked_fill"}),
    Fuse(_HF_TOP_P, name="hf_top_k_top_p_filter_value_inf", expect={
        "target": "logits", "value": "filter_value", "form": "masked_fill", "value_is_inf": True,
        "mask_rank": "same_as_target"}),
    Fuse(_MEGATRON_VOCAB, name="megatron_vocab_parallel_masked_target", expect={
        "target": "masked_target", "mask": "target_mask", "value": "0", "form": "masked_fill",
        "mask_rank": "same_as_target"}),
    Fuse(_MMDET_ASSIGN, name="mmdet_assigned_gt_inds", expect={
        "target": "assigned_gt_inds", "mask": "neg_inds", "form": "masked_fill", "mask_rank": "aligned_at_runtime"}),
    Fuse(_NAN_CLEAN, name="nan_cleaning_isnan_isfinite", expect={
        "target": "per_token_loss", "mask": "torch.isnan(per_token_loss)", "value": "0.0", "form": "masked_fill",
        "mask_rank": "same_as_target"}),
    Fuse(_HIDDEN_PAD, name="hidden_states_rank_aligned_mask", expect={
        "target": "hidden_states", "mask": "attention_mask == 0", "form": "masked_fill",
        "mask_rank": "aligned_at_runtime", "variant": "masked_fill_rank_aligned", "confidence": "medium"}),
    Fuse(_AUG_SCORES, name="augmented_add_through_mask", expect={
        "target": "scores", "mask": "prompt_mask.bool()", "form": "where", "augmented": True}),
    Fuse(_SPEC_AUGMENT, name="wav2vec2_spec_augment_parameter_broadcast", expect={
        "target": "hidden_states", "value": "self.masked_spec_embed.to(hidden_states.dtype)", "form": "where",
        "mask_rank": "aligned_at_runtime", "qualname": "Wav2Vec2LikeModel._mask_hidden_states"}),
    Fuse(_MLM_COLLATOR, name="hf_mlm_collator_labels", expect={
        "target": "labels", "mask": "~masked_indices", "value": "-100", "form": "masked_fill"}),
    Fuse(_WAV2VEC2_ENCODER, name="wav2vec2_encoder_mask_parameter_dtype_checked", expect={
        "target": "hidden_states", "mask": "~expand_attention_mask", "value": "0", "form": "masked_fill",
        "mask_dtype": "checked_at_runtime", "confidence": "medium", "variant": "masked_fill_rank_aligned_dtype_checked"}),
    Fuse(_RUNTIME_DTYPE, name="mask_named_parameter_bool_or_positions", expect={
        "target": "scores", "mask": "keep_mask", "form": "masked_fill", "mask_dtype": "checked_at_runtime"}),
    Fuse(_MOVED_MASK, name="mask_moved_to_device_stays_bool", expect={
        "form": "masked_fill", "variant": "masked_fill_rank_aligned"}),  # no "_dtype_checked": proven bool
    Fuse(_VIEW_TARGET, name="sam3_constant_index_view_target", expect={
        "target": "pred_probs[0]", "mask": "~keep", "value": "0.0", "form": "masked_fill"}),
    Fuse(_LEADING_SLICE, name="kyutai_mask_after_leading_slice", expect={
        "target": "current", "mask": "positions == 0", "form": "masked_fill", "mask_first_dim": 1}),
    # s38: ``pos`` is a CPU ``torch.arange`` compared into the mask: placement-checked at run time
    Fuse(_MULTILINE_MASK, name="mask_over_several_lines_bracketed", expect={
        "target": "idx", "form": "masked_fill", "variant": "masked_fill_rank_aligned_placement_checked"}),
]

AffinityIndexPut.KEEP = [
    Keep(_KEEP_SCATTER, reason="masked scatter", name="llava_image_features_masked_scatter"),
    Keep(_KEEP_NONZERO, reason="integer positions", name="nonzero_index"),
    Keep(_KEEP_NUMPY, reason="numpy", name="numpy_array_weights"),
    Keep(_KEEP_RANDOM, reason="not known to be a scalar and not shown to be the same mask's gather", name="fresh_random_tensor_per_selection"),
    Keep(_KEEP_UNRELATED, reason="", name="dict_slice_and_integer_index"),
    Keep(_KEEP_DEEPSTACK, reason="masked scatter", name="qwen3_vl_deepstack_mask_then_full_slice"),
    Keep(_KEEP_MIXED_INDEX, reason="mixed integer/slice and mask", name="qwen2_vl_rope_index_mixed_subscript"),
    Keep(_KEEP_TUPLE_TARGET, reason="unpacked from one call", name="ernie_moe_tuple_target"),
    Keep(_KEEP_INDEX_PUT_POSITIONS, reason="integer positions", name="phi4_out_of_place_index_put_nonzero"),
    Keep(_KEEP_LIST_INDEX, reason="", name="patchtst_list_annotated_channel_indices"),
]

# What tests/test_affinity_rewrites.py runs for each Fuse example (original vs rewritten, emulated
# NPU): ``out`` is compared, the fused branch's lines must have executed.
CHECKS: dict[str, str] = {
    "hf_labels_pad_to_ignore_index": "out = preprocess_labels(torch.randint(0, 5, (3, 7)), 0)",
    "hf_top_k_top_p_filter_value_inf": "out = top_k_top_p_filtering(torch.randn(2, 50), top_k=10, top_p=0.9)",
    "megatron_vocab_parallel_masked_target": "out = vocab_parallel_target(torch.randn(2, 3, 8), torch.randint(0, 32, (2, 3)), 8, 16)",
    "mmdet_assigned_gt_inds": "out = assign_wrt_overlaps(torch.rand(4, 30))",
    "nan_cleaning_isnan_isfinite": (
        "loss = torch.randn(4, 6)\nloss[0, 1] = float('nan')\nloss[2, 3] = float('inf')\n"
        "out = masked_mean_loss(loss, torch.ones(4, 6))"
    ),
    "hidden_states_rank_aligned_mask": (
        "h = torch.randn(2, 5, 5, requires_grad=True)\nm = torch.randint(0, 2, (2, 5))\n"
        "out = zero_padding(h, m)\nleaves = [h]"
    ),
    "augmented_add_through_mask": (
        "s = torch.randn(3, 9, requires_grad=True)\nout = boost_prompt_tokens(s, torch.rand(3, 9) > 0.5, 2.5)\nleaves = [s]"
    ),
    "wav2vec2_spec_augment_parameter_broadcast": (
        "m = Wav2Vec2LikeModel(8)\nh = torch.randn(2, 6, 8, requires_grad=True)\n"
        "out = m._mask_hidden_states(h * 1.0, (torch.rand(2, 6) > 0.5).tolist())\nleaves = [h, m.masked_spec_embed]"
    ),
    "wav2vec2_encoder_mask_parameter_dtype_checked": (
        "h = torch.randn(2, 5, 4)\nm = torch.ones(2, 5, dtype=torch.bool)\nm[1, 3:] = False\n"
        "out = zero_padded_frames(h, m)"
    ),
    # the same site with a bool mask (masked_fill_) and with integer positions (the IndexPut kept)
    "mask_named_parameter_bool_or_positions": (
        "s = torch.randn(3, 6)\nout = (drop_tokens(s.clone(), s > 0.5, -1.0), drop_tokens(s.clone(), torch.tensor([0, 2]), -1.0))"
    ),
    "mask_moved_to_device_stays_bool": "out = mark_padding(torch.randint(0, 4, (3, 7)), 0)",
    "sam3_constant_index_view_target": "out = suppress(torch.rand(2, 6), torch.rand(6) > 0.4)",
    "mask_over_several_lines_bracketed": (
        "v = torch.randint(1, 5, (3, 2))\nout = pad_past_valid(torch.randint(1, 9, (3, 2, 5)), 3, 2, 5, v)"
    ),
    "kyutai_mask_after_leading_slice": (
        "out = set_bos(torch.randint(0, 9, (2, 5, 3)), torch.tensor([0, 1, 0, 2, 3]), 7)"
    ),
    "hf_mlm_collator_labels": (
        "ids = torch.randint(5, 100, (4, 16))\nspecial = torch.zeros(4, 16, dtype=torch.bool)\nspecial[:, 0] = True\n"
        "out = torch_mask_tokens(ids, special, 4, 100)"
    ),
}


# --- s32: a numpy or host mask (the s32 precision audit) -------------------------------------------
# ``t[:, reset_idx, :] = 0`` with ``reset_idx = np.array(lens) % k == 0`` (a numpy bool array) and
# ``edge_mask[~torch.eye(n, dtype=torch.bool)] = 0`` with edge_mask on the device: indexing takes a
# numpy or CPU mask, masked_fill_ raises (TypeError / "expected self and mask to be on the same
# device"). The fused branch checks the mask is a torch tensor on the target's device at run time.
# (The numpy case never takes the fused branch, so it is tested in tests/test_detect_s32_placement.py
# rather than as a Fuse example, whose CHECKS run must execute the fused branch.)
_S32_HOST_EYE = '''\
import torch


def sequential_edges(n, device):
    edge_mask = torch.ones((n, n), device=device)
    edge_mask[~torch.eye(edge_mask.shape[0], dtype=torch.bool)] = 0
    return edge_mask.flatten()
'''

_S32_NUMPY_MASK = '''\
import numpy as np
import torch


def reset_states(states, search_lens, horizon):
    reset_idx = np.array(search_lens) % horizon == 0
    states[1][:, reset_idx, :] = 0
    return states
'''

AffinityIndexPut.FUSE += [
    Fuse(_S32_HOST_EYE, name="s32_host_eye_mask_placement_checked", expect={
        "form": "masked_fill", "mask_placement": "checked_at_runtime", "variant": "masked_fill_rank_aligned_placement_checked"}),
]

AffinityIndexPut.KEEP += [
    # near miss: the target itself is numpy (no torch kernel at all)
    Keep(_S32_NUMPY_MASK.replace("    states[1][:, reset_idx, :] = 0\n",
                                 "    table = np.zeros((3, len(search_lens)))\n    table[:, reset_idx] = 0\n"),
         reason="is a numpy array, not a torch tensor", name="s32_numpy_target_and_mask"),
]

CHECKS["s32_host_eye_mask_placement_checked"] = "out = sequential_edges(5, 'cpu')"


# --- s34: a host mask made through torch functions and & (the s34 precision audit) ------------------
# An MLM collator on the model's device draws its masks on the CPU: ``torch.bernoulli(torch.full(shape,
# p))`` (bernoulli keeps its input's device) combined with ``&``. Indexing moves a host mask to the
# target's device; masked_fill_/where do not, so the fused branch checks the placement at run time.
_S34_BERNOULLI_HOST_MASK = '''\
import torch


def corrupt_tokens(token_ids, special, mask_id: int, p: float = 0.15):
    masked = torch.bernoulli(torch.full(token_ids.shape, p)).bool() & ~special
    token_ids[masked] = mask_id
    return token_ids
'''

AffinityIndexPut.FUSE += [
    Fuse(_S34_BERNOULLI_HOST_MASK, name="s34_bernoulli_host_mask_placement_checked", expect={
        "form": "masked_fill", "mask_placement": "checked_at_runtime"}),
]

CHECKS["s34_bernoulli_host_mask_placement_checked"] = (
    "torch.manual_seed(0)\nout = corrupt_tokens(torch.randint(5, 50, (3, 9)), torch.zeros(3, 9, dtype=torch.bool), 4)"
)

# x[m] = f(u[m]) with f a sampler of the repository: the where form would run it on every row, rows the
# mask leaves out included (torch.multinomial raises on an all-zero row; any sampler draws other numbers)
_S34_SAMPLER_ON_GATHERED = '''\
import torch


def draw(probs):
    return torch.multinomial(probs.flatten(0, -2), 1).view(probs.shape[:-1])


def jump(x_t, u, mask_jump):
    x_t[mask_jump] = draw(u[mask_jump])
    return x_t
'''

AffinityIndexPut.KEEP += [
    Keep(_S34_SAMPLER_ON_GATHERED, reason="is not known to act element by element", name="s34_sampler_on_gathered_rows"),
]
