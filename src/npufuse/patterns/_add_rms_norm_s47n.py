"""s47 (helper ho24norm): add_rms_norm norms npufuse could not resolve (HO24a / HO24b misses, judged true).

1. Device branches that never run on an NPU tensor: ``if x.device.type == "privateuseone": ... return`` (DirectML), as
   ``"cuda"`` was (s42): torch_npu renames the privateuse1 backend to ``"npu"``, so an NPU tensor's device type is
   ``"npu"``, never ``"privateuseone"`` / ``"mps"`` / ``"xpu"`` / ``"cpu"``.
2. A norm forward that starts with an input check raising on a trailing shape other than the one its weight is built
   with (``if x.shape[-len(self.normalized_shape):] != self.normalized_shape: raise ...``): npu_rms_norm /
   npu_add_rms_norm refuse a gamma whose shape is not the input's trailing dims, so the fused call raises exactly
   where the check does; the torch path after the check is read.
3. A library RMSNorm class reached through an alias (``from liger_kernel.transformers import LigerRMSNorm as
   LayerNorm``, ``LayerNorm = LigerRMSNorm`` in this file or in the repository file the name is imported from): the
   import decides, not the name the file calls it by; the fused code runs where the run-time class has that name.
4. A closure defined in a method and reading the method's ``self`` (``def _forward_block(x, ...):`` inside
   ``forward``, run directly or through ``torch.utils.checkpoint``): read as code of the method's class, so
   ``self.<norm>`` resolves through that class's ``__init__``.
"""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace
from typing import Any

from npufuse.scan.dataflow import dotted, fast_walk

# device types an NPU tensor never reports (torch_npu: privateuse1 is renamed "npu")
NOT_NPU_DEVICE_TYPES = ("cuda", "privateuseone", "mps", "xpu", "cpu")

_RMS_NAME = re.compile(r"rms_?norm", re.IGNORECASE)
_LAYER_NAME = re.compile(r"layer_?norm", re.IGNORECASE)
_ROOT_TEXT = re.compile(r"\brsqrt\b|\bsqrt\b|\*\*\s*\(?-?0\.5")


def ends_in_return(stmts: list[ast.stmt]) -> bool:
    """Every path through ``stmts`` ends in a ``return``: the last statement is one, or a ``with`` block (DirectML's
    ``with torch.autocast(..., enabled=False):``) whose body ends so, or an ``if`` whose two arms do."""
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, ast.Return):
        return True
    if isinstance(last, ast.With):
        return ends_in_return(last.body)
    if isinstance(last, ast.If):
        return ends_in_return(last.body) and ends_in_return(last.orelse)
    return False


# -- 2: leading input-shape checks -----------------------------------------------------------------------------------

def _trailing_shape_of(node: ast.expr, x: str) -> bool:
    """``x.shape[-k:]`` / ``x.shape[-1]`` / ``x.size(-1)`` / ``x.shape[-len(...):]``: the input's trailing dims."""
    if isinstance(node, ast.Subscript) and dotted(node.value) == f"{x}.shape":
        s = node.slice
        if isinstance(s, ast.Slice) and s.upper is None and s.step is None and isinstance(s.lower, ast.UnaryOp) \
                and isinstance(s.lower.op, ast.USub):
            return True
        return isinstance(s, ast.UnaryOp) and isinstance(s.op, ast.USub) and isinstance(s.operand, ast.Constant) \
            and s.operand.value == 1
    if isinstance(node, ast.Call) and dotted(node.func) == f"{x}.size" and len(node.args) == 1 and not node.keywords:
        a = node.args[0]
        return isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub) and isinstance(a.operand, ast.Constant) \
            and a.operand.value == 1
    return False


def _weight_shape_attrs(cls_init: ast.FunctionDef | None, me: str) -> set[str]:
    """The ``self.<attr>`` texts (and the ``__init__`` parameter they copy) a ``self.weight = Parameter(ones(S))``
    of ``__init__`` builds its shape from."""
    if cls_init is None:
        return set()
    copies: dict[str, str] = {}
    shapes: set[str] = set()
    for st in ast.walk(cls_init):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
            continue
        t = dotted(st.targets[0])
        if t is None or not t.startswith(me + "."):
            continue
        if isinstance(st.value, ast.Name):
            copies[st.value.id] = t
        v = st.value
        if isinstance(v, ast.Call) and (dotted(v.func) or "").split(".")[-1] == "Parameter" and v.args:
            v = v.args[0]
        if t == f"{me}.weight" and isinstance(v, ast.Call) and (dotted(v.func) or "").split(".")[-1] in ("ones", "zeros", "empty", "randn") \
                and len(v.args) == 1 and not isinstance(v.args[0], ast.Starred):
            shapes.add(ast.unparse(v.args[0]))
    return shapes | {copies[s] for s in list(shapes) if s in copies}


def _shape_check(st: ast.stmt, me: str, x: str, shapes: set[str]) -> bool:
    """``if <trailing dims of x> != <weight's shape>: ...; raise ...`` (the body may build the message first)."""
    if not (isinstance(st, ast.If) and not st.orelse and st.body and isinstance(st.body[-1], ast.Raise)):
        return False
    if not all(isinstance(b, (ast.Assign, ast.Raise)) and not any(isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store)
               for n in ast.walk(b)) for b in st.body):
        return False
    test = st.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotEq)):
        return False
    sides = [test.left, test.comparators[0]]
    trailing = [s for s in sides if _trailing_shape_of(s, x)]
    other = [s for s in sides if not _trailing_shape_of(s, x)]
    if len(trailing) != 1 or len(other) != 1 or ast.unparse(other[0]) not in shapes:
        return False
    # ``x.shape[-k:]``: k must be the length of the shape it is compared with (else the check is another one)
    sl = trailing[0].slice if isinstance(trailing[0], ast.Subscript) else None
    if isinstance(sl, ast.Slice):
        return ast.unparse(sl.lower) == f"-len({ast.unparse(other[0])})"
    return True


def unread_forward_reason(fwd: ast.FunctionDef, cls: str) -> str | None:
    """A true reason for a norm forward npufuse does not read because of its first statement (an input check that
    raises, other than the trailing-shape check :func:`return_after_checks` drops; an early return under a device test
    an NPU tensor passes) or of its last two (a factor multiplied in after the norm). None for anything else."""
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    body = [s for s in fwd.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(params) < 2 or not body:
        return None
    # only a module that is a norm by its name or its forward's maths (a gated residual module a block happens to call
    # on the sum is no norm, and a reason calling it one would be false)
    if "norm" not in cls.split(" ")[0].lower() and not _ROOT_TEXT.search(ast.unparse(fwd)):
        return None
    if not isinstance(body[0], ast.If) or body[0].orelse:
        scaled = _post_scale(body, params[0])
        if scaled is not None:
            return (f"norm {cls} cannot be fused: its forward multiplies its output by `{scaled[0]}` after the norm "
                    f"(`{scaled[1]}`), a factor npufuse folds into npu_rms_norm's float32 gamma for the norm alone, not "
                    "into npu_add_rms_norm's gamma (taken in x1's dtype: a half-precision x1 would round the product)")  # s48
        return None
    head, x = body[0], params[1]
    test = ast.unparse(head.test)
    if isinstance(head.body[-1], ast.Raise) and any(isinstance(n, ast.Name) and n.id == x for n in ast.walk(head.test)):
        return (f"norm {cls} cannot be fused: its forward first checks `{test}` and raises, a check the fused call would "
                "not make (npufuse drops only a check of the input's trailing dims against the weight's shape, which the "
                "fused op makes itself)")
    t = head.test
    if ends_in_return(head.body) and isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq) \
            and {dotted(t.left), dotted(t.comparators[0])} >= {f"{x}.device.type"} \
            and any(isinstance(n, ast.Constant) and n.value == "npu" for n in (t.left, t.comparators[0])):
        return (f"norm {cls} cannot be fused: its forward returns early under `{test}`, true for an NPU tensor, so the "
                "code that runs on an NPU is that branch, not the rest of the forward")
    return None


def _post_scale(body: list[ast.stmt], me: str) -> tuple[str, str] | None:
    """(factor, statement) for a forward that ends ``out.mul_(self.<a>)`` / ``out *= self.<a>`` / ``out = out *
    self.<a>`` then ``return out`` (cast or not): the normalised output scaled by a module attribute afterwards."""
    if len(body) < 2 or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    ret = body[-1].value
    while isinstance(ret, ast.Call) and isinstance(ret.func, ast.Attribute) and ret.func.attr in ("to", "type_as", "type", "float", "half", "bfloat16"):
        ret = ret.func.value
    if not isinstance(ret, ast.Name):
        return None
    out, st = ret.id, body[-2]
    factor: ast.expr | None = None
    if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
            and st.value.func.attr == "mul_" and isinstance(st.value.func.value, ast.Name) and st.value.func.value.id == out \
            and len(st.value.args) == 1 and not st.value.keywords:
        factor = st.value.args[0]
    elif isinstance(st, ast.AugAssign) and isinstance(st.op, ast.Mult) and isinstance(st.target, ast.Name) and st.target.id == out:
        factor = st.value
    elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and st.targets[0].id == out \
            and isinstance(st.value, ast.BinOp) and isinstance(st.value.op, ast.Mult) and isinstance(st.value.left, ast.Name) \
            and st.value.left.id == out:
        factor = st.value.right
    if factor is None or not (dotted(factor) or "").startswith(me + "."):
        return None
    return ast.unparse(factor), ast.unparse(st)


def return_after_checks(module: Any, cls: str, fwd: ast.FunctionDef, helper_return: Any) -> ast.Return | None:
    """The final ``return`` of a forward that is input-shape checks (:func:`_shape_check`) then a straight-line body
    (``S.helper_return``'s reading of the rest); None otherwise."""
    from npufuse.patterns import _site as S

    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if len(params) < 2:
        return None
    body = [s for s in fwd.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    n = 0
    shapes: set[str] | None = None
    while n < len(body) and isinstance(body[n], ast.If):
        if shapes is None:
            shapes = _weight_shape_attrs(S.method(module, cls, "__init__"), params[0])
        if not _shape_check(body[n], params[0], params[1], shapes):
            return None
        n += 1
    if n == 0:
        return None
    return helper_return(SimpleNamespace(body=body[n:]))


# -- 3: a library RMSNorm reached through an alias ---------------------------------------------------------------------

_LIBRARY_ROOTS = ("liger_kernel", "apex", "flash_attn", "transformer_engine", "torchtune", "timm", "xformers",
                  "megatron", "vllm", "sglang", "unsloth", "mamba_ssm", "fla", "transformers")


def _alias_in(tree: ast.Module, name: str) -> str | None:
    """What a top-level ``from m import A as name`` / ``import`` / ``name = A`` of ``tree`` binds ``name`` to: a dotted
    library path for an import, ``"=A"`` for an assignment of another name, None otherwise."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if (a.asname or a.name) == name:
                    return f"{node.module}.{a.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id == name and isinstance(node.value, ast.Name):
            return "=" + node.value.id
    return None


def _library_target(tree: ast.Module, name: str, depth: int = 0) -> str | None:
    if depth > 3:
        return None
    got = _alias_in(tree, name)
    if got is None:
        return None
    if got.startswith("="):
        return _library_target(tree, got[1:], depth + 1)
    return got


def alias_norm_call(module: Any, call: ast.Call, attr: str, func: ast.expr, make: Any) -> Any:
    """``make(...)`` (add_rms_norm's NormCall) for ``self.<attr> = Name(...)`` where Name is a library norm under another
    name: an RMSNorm fused under a run-time test of the class's name (external kind); a LayerNorm refused."""
    target = library_alias_class(module, func)
    if target is None:
        return None
    real = target.split(".")[-1]
    if _RMS_NAME.search(real):
        return make(call, attr, "external", cls=real, conditions=[f"type(self.{attr}).__name__ == {real!r}"])
    return make(call, attr, "not_rms", cls=real,
                reason=f"norm is not RMSNorm (`{ast.unparse(func)}` is {target}, a LayerNorm: mean subtracted)")


def library_alias_class(module: Any, func: ast.expr) -> str | None:
    """The dotted path (``liger_kernel.transformers.LigerRMSNorm``) of a library RMSNorm / LayerNorm class that
    ``func`` (a bare name the file calls by another name) denotes: imported under an alias, assigned to the name in
    this file, or so in the repository file the name is imported from. None where the name is the class's own, is
    defined here, or is not a library RMSNorm / LayerNorm."""
    if not isinstance(func, ast.Name) or _RMS_NAME.search(func.id):
        return None
    name = func.id
    cache = module.__dict__.setdefault("_npufuse_s47n_alias", {})
    if name in cache:
        return cache[name]
    cache[name] = found = _find_library_alias(module, name)
    return found


def _find_library_alias(module: Any, name: str) -> str | None:
    if name in module.classes or name in module.functions:
        return None
    target = _library_target(module.tree, name)
    if target is None:
        return None
    root = target.split(".")[0]
    if root not in _LIBRARY_ROOTS:
        # a package of the repository: the name may be assigned a library class there (``LayerNorm = LigerRMSNorm``)
        from npufuse.scan import repo_facts

        repo = repo_facts.repo_root(module)
        if repo is None:
            return None
        where = repo_facts._imported(module.tree, module.path, name)
        if where is None:
            return None
        mod, attr = where
        parts = mod.split(".")
        if not mod or any(p in ("", "..") for p in parts):
            return None
        from pathlib import PurePosixPath

        for base in dict.fromkeys([PurePosixPath("."), *PurePosixPath(module.path).parents]):
            for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                tree = repo_facts._parse_repo_file(repo, str(cand))
                if tree is None:
                    continue
                repo_facts._depends(repo, module.path)
                if any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == attr for n in tree.body):
                    return None
                target = _library_target(tree, attr)
                if target is None or target.split(".")[0] not in _LIBRARY_ROOTS:
                    return None
                break
            else:
                continue
            break
        else:
            return None
    real = target.split(".")[-1]
    if real == name or not (_RMS_NAME.search(real) or _LAYER_NAME.search(real)):
        return None
    return target


# -- 4: a closure of a method, reading the method's ``self`` ------------------------------------------------------------

def closure_as_method(module: Any, scope: Any) -> Any:
    """``scope`` itself, or (for a function defined directly in a method's body, not binding ``self`` itself, reading
    ``self.``) a copy of it whose ``class_name`` is the method's class, kept per file so that its identity is stable."""
    fn = scope.node
    if scope.class_name is not None or not isinstance(fn, ast.FunctionDef) or scope.qualname.count(".") < 2:
        return scope
    memo = module.__dict__.setdefault("_npufuse_s47n_closures", {})
    key = id(scope)
    if key in memo and memo[key][0] is scope:
        return memo[key][1]
    memo[key] = (scope, got := _closure_as_method(module, scope))
    return got


def _closure_as_method(module: Any, scope: Any) -> Any:
    import copy

    fn = scope.node
    parent_name = scope.qualname.rsplit(".", 1)[0]
    parent = next((sc for sc in module.scopes if sc.qualname == parent_name), None)
    if parent is None or parent.class_name is None or not isinstance(parent.node, ast.FunctionDef) \
            or fn not in parent.node.body:
        return scope
    pargs = [a.arg for a in (*parent.node.args.posonlyargs, *parent.node.args.args)]
    if not pargs or pargs[0] != "self" or any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod")
                                              for d in parent.node.decorator_list):
        return scope
    own = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    if fn.args.vararg is not None:
        own.add(fn.args.vararg.arg)
    if fn.args.kwarg is not None:
        own.add(fn.args.kwarg.arg)
    if "self" in own or any(isinstance(n, ast.Name) and n.id == "self" and not isinstance(n.ctx, ast.Load) for n in ast.walk(fn)):
        return scope
    # ``self`` rebound in the method after the closure is defined would change what the closure reads
    if any(isinstance(n, ast.Name) and n.id == "self" and not isinstance(n.ctx, ast.Load) for n in fast_walk(parent.node)):
        return scope
    if not any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(fn)):
        return scope
    view = copy.copy(scope)
    view.class_name = parent.class_name
    return view
