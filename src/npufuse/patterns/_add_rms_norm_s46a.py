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
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Callable, Iterator

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo, Scope


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
