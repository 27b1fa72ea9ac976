"""s46 (helper sweep46a): add_rms_norm forms from the s46 LLM recall sweep, read by class.

1. The residual sum, then a switch whose body saves the sum before normalising it (a hybrid Mamba / xLSTM block,
   nanoGPT-style blocks with an optional MLP)::

       x = residual + x
       if self.use_mlp:                 # a test without effects that does not read the sum
           residual = x                 # aliases of the sum, inside the body
           x = self.norm2(x)            # the norm of the sum
           x = self.mlp(x)

   The add moves into both branches (s33's head form): where the body runs, the fused add + norm with the body's
   aliases, then the body's other statements; elsewhere the add and the aliases made before the ``if`` only (the
   body's aliases never ran there). Near miss kept: a test that reads the sum runs after the add.

2. A norm class whose forward is ``F.rms_norm(x, shape, self.weight.to(x.dtype), self.eps)`` (the weight cast to
   the input's dtype: ``.to(x.dtype)``, ``.to(dtype=x.dtype)``, ``.type_as(x)``): read as the library norm of the
   uncast weight. The fused code casts gamma to the sum's dtype itself (``npu_add_rms_norm`` takes gamma in x1's
   dtype) and the output keeps the input's dtype, as F.rms_norm's does with a weight of the input's dtype.
   Near miss kept: a weight cast to another tensor's dtype (``self.weight.to(y.dtype)``).

3. An inference engine's fused add + norm written out in one method (nano-vLLM's ``RMSNorm.add_rms_forward``,
   often under ``@torch.compile``), in place or not::

       def add_rms_forward(self, x, residual):
           orig_dtype = x.dtype                          # dtype reads of the input only
           x = x.float().add_(residual.float())          # the sum (``x + residual``, ``x.add(residual)``, upcast or not)
           residual = x.to(orig_dtype)                   # the residual handed on: the sum (cast back to x's dtype)
           var = x.pow(2).mean(dim=-1, keepdim=True)     # a norm of the sum, read by the numeric probe as npu_rms_norm
           x.mul_(torch.rsqrt(var + self.eps))
           x = x.to(orig_dtype).mul_(self.weight)        # (an upcast sum must come back to x's dtype by ``.to``)
           return x, residual

   The statements after the alias are evaluated by rms_norm's numeric probe as a function of the sum; proved an
   RMSNorm, the method returns ``npu_add_rms_norm(x, residual, w, eps)``'s (y, sum) at inference where x, residual
   and w share one dtype; elsewhere (training, mixed dtypes) the original body runs. Near misses kept: a norm that
   reads the residual again; an upcast sum whose norm never comes back to x's dtype (the original returns fp32).

4. A norm handed to a helper as a parameter that no call in the file binds (an exported ``fused_add_norm(x,
   residual, norm)``: ``residual = residual + x; normalized = norm(residual)``): s42 reads such a parameter through
   its callers; with none, the fused code runs where the module handed over is PyTorch's own ``nn.RMSNorm`` (an
   instance, its forward, a weight, one normalised dim: checked at run time), the original elsewhere (a plain
   function handed over included). Near miss kept: a parameter
   whose callers in the file hand it something npufuse cannot resolve (s42's reason stands).
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Callable, Iterator

from npufuse.patterns import _site as S
from npufuse.patterns.base import Finding, NearMiss, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted


def head_sites_after_aliases(module: ModuleInfo, scope: Scope) -> Iterator[tuple[ast.stmt, Any]]:
    """Form 1 of the module doc: (norm statement, ``_Site``) or (statement, near-miss reason)."""
    # the detector's readers; imported here because add_rms_norm imports this module
    from npufuse.patterns import add_rms_norm as A

    text = S.scope_text(module, scope)
    if "if " not in text:
        return
    for stmt, ops, s_name, aliases, following in A._sums_and_following(module, scope):
        t = following[0] if following else None
        if not (isinstance(t, ast.If) and len(t.body) >= 2 and A._is_alias(t.body[0], s_name) and A._pure_test(t.test)):
            continue
        k = 0
        while k < len(t.body) - 1 and A._is_alias(t.body[k], s_name):
            k += 1
        inner = t.body[:k]
        written = {s_name} | {a.targets[0].id for a in (*aliases, *inner)}  # type: ignore[attr-defined]
        if S.names_read(t.test) & written:
            continue  # the test reads the sum: it cannot run before the add
        yield from A._norm_of_sum(module, scope, t.body[k], s_name,
                                  lambda nstmt, nc, stmt=stmt, ops=ops, s_name=s_name, aliases=[*aliases, *inner], t=t:
                                  A._Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name, head_if=t))


def _cast_to_input(node: ast.expr, x: str) -> ast.expr | None:
    """The tensor ``node`` casts to the dtype of the input ``x`` (``w.to(x.dtype)``, ``w.to(dtype=x.dtype)``,
    ``w.type_as(x)``); None for anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    args = [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]
    if any(k.arg not in ("dtype",) for k in node.keywords) or len(args) != 1:
        return None
    arg = args[0]
    if node.func.attr == "to" and isinstance(arg, ast.Attribute) and arg.attr == "dtype" \
            and isinstance(arg.value, ast.Name) and arg.value.id == x:
        return node.func.value
    if node.func.attr == "type_as" and not node.keywords and isinstance(arg, ast.Name) and arg.id == x:
        return node.func.value
    return None


def cast_weight_library_forward(module: ModuleInfo, fwd: ast.FunctionDef, mod: str, foreign: bool,
                                library_forward: Callable[..., Any]) -> Any:
    """Form 2 of the module doc: ``library_forward``'s (gamma, eps) for the forward read with the weight uncast;
    None otherwise."""
    ret = S.helper_return(fwd)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if ret is None or len(params) < 2 or not isinstance(ret.value, ast.Call):
        return None
    call = ret.value
    slot = next((("kw", i) for i, k in enumerate(call.keywords) if k.arg == "weight"), None)
    if slot is None and len(call.args) > 2:
        slot = ("arg", 2)
    if slot is None:
        return None
    weight = call.keywords[slot[1]].value if slot[0] == "kw" else call.args[slot[1]]
    inner = _cast_to_input(weight, params[1])
    if inner is None:
        return None
    bare_call = copy.copy(call)
    if slot[0] == "kw":
        bare_call.keywords = [ast.keyword(arg="weight", value=inner) if i == slot[1] else k for i, k in enumerate(call.keywords)]
    else:
        bare_call.args = [inner if i == slot[1] else a for i, a in enumerate(call.args)]
    bare_ret = ast.copy_location(ast.Return(value=bare_call), ret)
    # the statements before the return stay: the library reading checks they leave the input as given
    bare = ast.FunctionDef(name=fwd.name, args=fwd.args, body=[*fwd.body[:-1], bare_ret], decorator_list=[], returns=None,
                           type_params=getattr(fwd, "type_params", []))
    bare = ast.copy_location(bare, fwd)
    bare.end_lineno = fwd.end_lineno
    return library_forward(module, bare, mod, foreign)


def _upcast_of(node: ast.expr, name: str) -> bool | None:
    """True: ``name.float()`` / ``name.to(torch.float32)``; False: ``name`` itself; None: anything else."""
    if isinstance(node, ast.Name) and node.id == name:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == name and not node.keywords:
        if node.func.attr == "float" and not node.args:
            return True
        if node.func.attr == "to" and len(node.args) == 1 and (dotted(node.args[0]) or "").endswith("float32"):
            return True
    return None


def _sum_of_inputs(value: ast.expr, x: str, r: str) -> bool | None:
    """Whether ``value`` adds the inputs ``x`` and ``r`` (each as is or upcast to float32, both alike) as
    ``x + r`` / ``x.add(r)`` / ``x.add_(r)`` (either order): True where upcast, False where not, None otherwise."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        pair = (value.left, value.right)
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("add", "add_") \
            and len(value.args) == 1 and not value.keywords:
        pair = (value.func.value, value.args[0])
    else:
        return None
    for a, b in ((x, r), (r, x)):
        ua, ub = _upcast_of(pair[0], a), _upcast_of(pair[1], b)
        if ua is not None and ua == ub:
            return ua
    return None


def _dtype_read(stmt: ast.stmt, x: str) -> str | None:
    """The name ``stmt`` binds to ``x.dtype`` (``orig_dtype = x.dtype``), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
            and isinstance(stmt.value, ast.Attribute) and stmt.value.attr == "dtype" \
            and isinstance(stmt.value.value, ast.Name) and stmt.value.value.id == x:
        return stmt.targets[0].id
    return None


def _cast_back(value: ast.expr, dtypes: set[str]) -> bool:
    """``<t>.to(D)`` or ``<t>.to(D).mul_(w)`` with ``D`` a dtype read of the input: the value ends in x's dtype."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "mul_":
        value = value.func.value
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to" \
        and len(value.args) == 1 and not value.keywords and isinstance(value.args[0], ast.Name) and value.args[0].id in dtypes


class _Renamer(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(id=self.new, ctx=node.ctx), node) if node.id == self.old else node


def engine_add_norm(module: ModuleInfo, scope: Scope, probe_on: bool) -> Result | None:
    """Form 3 of the module doc: the finding or near miss of the method, None where its shape is not that form."""
    fn = scope.node
    if not isinstance(fn, ast.FunctionDef) or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.defaults:
        return None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    cls = module.classes.get(scope.class_name) if scope.class_name else None
    if scope.class_name is not None:
        if cls is None or fn not in cls.body or not params:
            return None
        params = params[1:]
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    # cheap gates first: two inputs, a two-value return, a root in the text
    if len(params) != 2 or len(body) < 4 or "sqrt" not in S.scope_text(module, scope):
        return None
    ret = body[-1]
    if not (isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple) and len(ret.value.elts) == 2
            and all(isinstance(e, ast.Name) for e in ret.value.elts)):
        return None
    x, r = params
    dtypes: dict[str, ast.stmt] = {}
    i = 0
    while i < len(body) and _dtype_read(body[i], x) is not None:
        dtypes[_dtype_read(body[i], x) or ""] = body[i]
        i += 1
    add = body[i]
    if not (isinstance(add, ast.Assign) and len(add.targets) == 1 and isinstance(add.targets[0], ast.Name)):
        return None
    upcast = _sum_of_inputs(add.value, x, r)
    if upcast is None:
        return None
    s_name = add.targets[0].id
    alias = body[i + 1]
    if not (isinstance(alias, ast.Assign) and len(alias.targets) == 1 and isinstance(alias.targets[0], ast.Name)):
        return None
    a_name = alias.targets[0].id
    a_cast = _cast_back(alias.value, set(dtypes)) and isinstance(alias.value, ast.Call) \
        and isinstance(alias.value.func, ast.Attribute) and alias.value.func.attr == "to" and dotted(alias.value.func.value) == s_name
    if not (a_cast or (isinstance(alias.value, ast.Name) and alias.value.id == s_name)) or a_name == s_name:
        return None
    y_name = ret.value.elts[0].id  # type: ignore[attr-defined]
    if ret.value.elts[1].id != a_name:  # type: ignore[attr-defined]
        return None
    norm = body[i + 2:-1]
    line, end = body[0].lineno, ret.end_lineno or ret.lineno

    def miss(reason: str) -> NearMiss:
        return NearMiss("add_rms_norm", scope.qualname, line, end, reason)

    if not norm or any(n in S.names_read(st) or n in S.names_written(st) for st in norm for n in (r, a_name)):
        return miss("the statements after the residual sum read the residual again: not a norm of the sum alone")
    if upcast and not a_cast:
        return miss("the sum is computed in float32 and handed on as the residual in float32: npu_add_rms_norm returns it "
                    "in the inputs' dtype")
    if upcast:
        last = norm[-1]
        if not (isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
                and last.targets[0].id == y_name and _cast_back(last.value, set(dtypes))):
            return miss("the norm of the float32 sum does not come back to the input's dtype by `.to(<x.dtype>)`: the "
                        "original returns another dtype than npu_add_rms_norm")
    # an in-place norm (``x.mul_(rstd)``) also changes every tensor sharing the sum's storage: the residual handed on
    # is a copy only where ``.to(x.dtype)`` of a float32 sum really converts (x in half precision); a plain alias or
    # a float32 input would hand on the normalised tensor itself, which npu_add_rms_norm does not
    in_place = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_")
                   and not n.func.attr.startswith("_") for st in norm for n in ast.walk(st))
    if in_place and not (upcast and a_cast):
        return miss("the norm writes in place into the sum the residual shares storage with: the original hands on the "
                    "normalised tensor as the residual, npu_add_rms_norm the sum")
    if not probe_on:
        return None
    # the norm as a function of the sum, for the numeric probe: the dtype reads then the norm statements
    pre = [_Renamer(x, s_name).visit(copy.deepcopy(st)) for st in dtypes.values()]
    args = ast.arguments(posonlyargs=[], args=[*([ast.arg(arg=fn.args.args[0].arg)] if cls is not None else []), ast.arg(arg=s_name)],
                         kwonlyargs=[], kw_defaults=[], defaults=[])
    probe_ret = ast.copy_location(ast.Return(value=ast.Name(id=y_name, ctx=ast.Load())), ret)
    synthetic = ast.FunctionDef(name=fn.name, args=args, body=[*pre, *norm, probe_ret], decorator_list=[], returns=None,
                                type_params=[])
    synthetic = ast.copy_location(synthetic, fn)
    synthetic.end_lineno = fn.end_lineno
    ast.fix_missing_locations(synthetic)
    from npufuse.scan import numeric_probe  # imports torch only when a probe runs

    proof = numeric_probe.prove_rms_norm(module, synthetic, cls)
    if proof.kind != "proved":
        return miss(f"the statements after the residual sum are not proved an RMSNorm of it ({proof.kind}: {proof.reason})"
                    if proof.reason else f"the statements after the residual sum are not proved an RMSNorm of it ({proof.kind})")
    if proof.weight_offset or proof.eps_form != "inside" or proof.guards or proof.sampled or proof.dtype_rule == "float32":
        return miss("the norm of the sum is proved with an offset weight, another eps placement, run-time assumptions or a "
                    "float32 output: npufuse fuses the add only into a plain x * rstd * weight norm here")
    T = S.torch_name(module)
    if T is None:
        return None
    W = proof.weight
    kinds = f"({T}.float16, {T}.bfloat16)" if in_place else f"({T}.float16, {T}.bfloat16, {T}.float32)"
    conds = [f"not {T}.is_grad_enabled()", f"{x}.dtype == {r}.dtype", f"{x}.shape == {r}.shape",
             f"{x}.dtype in {kinds}", f"1 <= {x}.dim() <= 8"]
    if W is not None:
        # npu_add_rms_norm takes gamma in x1's dtype: a weight of another dtype would be rounded first
        conds += [f"isinstance({W}, {T}.Tensor)", f"{W}.dim() == 1", f"{W}.dtype == {x}.dtype", f"{x}.shape[-1] == {W}.shape[0]"]
        gamma = W
    else:
        gamma = f"{x}.new_ones({x}.shape[-1])"
    fused = "\n".join([f"if {' and '.join(conds)}:",
                       S.indent(f"_npu_normed, _npu_rstd, _npu_sum = torch_npu.npu_add_rms_norm({x}, {r}, {gamma}, epsilon={proof.eps})\n"
                                "return _npu_normed, _npu_sum"),
                       S.block_source(module, body)])
    risks = [
        Risk("numerics", "the norm of the sum is proved by npufuse's numeric probe on sampled inputs, not by a proof over all inputs"),
        Risk("numerics", "npu_add_rms_norm normalises the sum in float32 and returns it rounded to the inputs' dtype "
                         "(whether y is computed from the rounded sum is open, spec 2.2): <=1-ulp differences"),
    ]
    if any(isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute)
           and st.value.func.attr.endswith("_") for st in body) or isinstance(add.value, ast.Call):
        risks.append(Risk("other", f"the original writes into tensors in place (`{ast.unparse(add.value)[:60]}`, ...): where "
                                   f"such a tensor is the caller's ({x}.float() of a float32 {x} is {x} itself) the caller sees "
                                   "it changed; the fused branch leaves the inputs as they were"))
    return Finding(
        pattern="add_rms_norm",
        qualname=scope.qualname,
        line=line,
        end_line=end,
        params={"x1": x, "x2": r, "sum": s_name, "eps": proof.eps, "weight": W, "weight_offset": 0,
                "upcast": "float32" if upcast else None, "output_dtype": "input", "found_by": "numeric_probe"},
        fused=fused,
        guard_tensor=x,
        confidence="medium",
        variant="engine_add_norm",
        risks=risks,
        notes=["an inference engine's add + norm method: at inference one npu_add_rms_norm returns (y, the sum) as the "
               "method does; training and mixed dtypes run the original body"],
        training_ok=True,
    )


def unbound_parameter_library_norm(module: ModuleInfo, call: ast.Call, param: str) -> Any:
    """Form 4 of the module doc: the ``NormCall`` of ``param(sum)`` read as ``nn.RMSNorm`` under a run-time check."""
    from npufuse.patterns import add_rms_norm as A
    from npufuse.patterns._library_norm import eps_or_default

    T = S.torch_name(module) or "torch"
    return A.NormCall(call, param, "library", cls="nn.RMSNorm", gamma=f"{param}.weight", eps=eps_or_default(f"{param}.eps", T),
                      mod=param,
                      # isinstance first: a parameter may be a plain function, whose type has no ``forward``
                      conditions=[f"isinstance({param}, {T}.nn.RMSNorm)", f"type({param}).forward is {T}.nn.RMSNorm.forward",
                                  f"{param}.weight is not None",
                                  f"len({param}.normalized_shape) == 1"])
