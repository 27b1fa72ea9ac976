"""s44 (helper normopt44): add_rms_norm readings of norm modules found on real missed sites.

1. A norm class whose forward returns apex's fused RMSNorm kernel of its input (verl's Megatron
   ``ParallelLlamaRMSNorm``)::

       def forward(self, hidden_states):
           from apex.normalization.fused_layer_norm import fused_rms_norm_affine
           return fused_rms_norm_affine(input=hidden_states, weight=self.weight,
                                        normalized_shape=self.normalized_shape, eps=self.variance_epsilon,
                                        memory_efficient=True)

   apex's ``fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False)`` is
   ``x * rsqrt(mean(x^2) + eps) * weight`` (``FusedRMSNormAffineFunction.apply`` with the same arguments) over
   ``normalized_shape`` (which apex requires to be the weight's shape),
   accumulated in float32 and returned in the input's dtype; ``memory_efficient`` only changes what backward saves.
   That is npu_rms_norm's math with gamma = the weight (whose rank picks the same trailing dims). The kernel is
   CUDA-only, so the class itself has nothing to replace on NPU (rms_norm keeps it); the residual add feeding it
   is what npu_add_rms_norm fuses.
"""

from __future__ import annotations

import ast

from npufuse.patterns import _site as S
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo, const_value, dotted

# the function and the autograd Function it applies (same arguments); apex's ``mixed_dtype_fused_rms_norm_affine``
# returns the weight's dtype, not the input's, and stays out
_APEX_RMS_AFFINE = ("apex.normalization.fused_layer_norm.fused_rms_norm_affine",
                    "apex.normalization.fused_layer_norm.FusedRMSNormAffineFunction.apply")
# the kernel's parameters in order; eps defaults to 1e-6
_APEX_RMS_PARAMS = ("input", "weight", "normalized_shape", "eps", "memory_efficient")


def _local_imports(fwd: ast.FunctionDef) -> dict[str, str] | None:
    """``{local name: dotted origin}`` of the ``from a.b import c [as d]`` statements heading ``fwd``'s body (after a
    docstring); None where another statement comes before its last statement."""
    names: dict[str, str] = {}
    for st in fwd.body[:-1]:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue
        if isinstance(st, ast.ImportFrom) and st.module and st.level == 0:
            for a in st.names:
                names[a.asname or a.name] = f"{st.module}.{a.name}"
            continue
        return None
    return names


def apex_rms_forward(module: ModuleInfo, fwd: ast.FunctionDef, mod: str, foreign: bool) -> tuple[str, str] | None:
    """(gamma, eps) when a norm class's forward returns apex's ``fused_rms_norm_affine`` of its own input with
    ``self.<w>`` as weight and the weight's own shape (``self.<s>``, or ``self.<w>.shape``) as normalized_shape, the
    kernel imported in the forward or by the file; ``self`` read as ``mod``. None otherwise."""
    if not fwd.body or not isinstance(fwd.body[-1], ast.Return) or not isinstance(fwd.body[-1].value, ast.Call):
        return None
    local = _local_imports(fwd)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if local is None or len(params) != 2 or fwd.args.vararg or fwd.args.kwonlyargs:
        return None
    call = fwd.body[-1].value
    func = call.func
    head = func.value if isinstance(func, ast.Attribute) and func.attr == "apply" else func
    name = local.get(head.id) if isinstance(head, ast.Name) and head.id in local else canonical.api(module, head)
    if head is not func and name is not None:
        name += ".apply"
    if name not in _APEX_RMS_AFFINE or any(isinstance(a, ast.Starred) for a in call.args) \
            or any(k.arg is None for k in call.keywords) or len(call.args) > len(_APEX_RMS_PARAMS):
        return None
    given = dict(zip(_APEX_RMS_PARAMS, call.args)) | {k.arg: k.value for k in call.keywords}
    self_name, x_name = params
    x, w, shape, eps = given.get("input"), given.get("weight"), given.get("normalized_shape"), given.get("eps")
    if not (isinstance(x, ast.Name) and x.id == x_name) or w is None or shape is None:
        return None
    wd, sd = dotted(w), dotted(shape)
    if wd is None or sd is None or not wd.startswith(self_name + ".") or not sd.startswith(self_name + "."):
        return None  # weight and shape read on the module: anything else is not the norm's own state
    gamma = mod + wd[len(self_name):]
    if eps is None:
        return gamma, "1e-6"  # the kernel's default
    v = const_value(eps)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return gamma, ast.unparse(eps) if foreign else S.source_of(module, eps)
    ed = dotted(eps)
    if ed is None or not ed.startswith(self_name + "."):
        return None
    return gamma, mod + ed[len(self_name):]
