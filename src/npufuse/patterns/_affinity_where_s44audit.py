"""affinity_where fixes of the s44 precision audit (helper audit44), read on code npufuse had never seen.

* R1 (CogACT's guided-diffusion ``_vb_terms_bpd``: ``decoder_nll = mean_flat(decoder_nll) / np.log(2.0)``, then
  ``th.where(t == 0, decoder_nll, kl)``): the reason said the branch "computes `a / np.log(2.0)`, which can be
  inf/NaN". A divisor that is a math / numpy function of positive literals (``np.log(2.0)``, ``math.sqrt(2)``) or
  ``math.pi`` / ``np.e`` is a nonzero constant, like a literal divisor: the division makes no inf/NaN out of finite
  values.
* R2 (GPTQModel's ``_compute_scale_inv``): the reason quoted the first 40 characters of the branch,
  ``torch.full_like(abs_max, float(fp8_max))``, which read as the whole expression (a constant fill, never inf); the
  branch is that fill divided by ``abs_max.clamp_min(eps)``. Quoted source is cut with an ellipsis, never silently.
* D2 (granite-tsfm PatchTST-FM): a where whose condition reads a mask of missing values (see ``missing_values_mask``).
* D3 (GPTQModel EXL3): a branch that is a 0-d CPU tensor ``torch.tensor(1.0)`` (see ``host_scalar_tensor``).
"""

from __future__ import annotations

import ast
import math

from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, keyword

# the value of f(*positive literals) for the math / numpy functions a scale constant is written with
_CONSTANT_FUNCS = {
    "log": math.log, "log2": math.log2, "log10": math.log10, "sqrt": math.sqrt, "exp": math.exp,
}
_CONSTANT_MODULES = ("math", "np", "numpy")
_CONSTANT_NAMES = {"pi": math.pi, "e": math.e, "tau": math.tau}


def constant_number(node: ast.AST) -> float | None:
    """The value of ``np.log(2.0)`` / ``math.sqrt(8)`` / ``math.pi`` (math / numpy of positive literals); None when
    ``node`` is anything else or the value is not a finite number."""
    name = dotted(node.func) if isinstance(node, ast.Call) else dotted(node) if isinstance(node, ast.Attribute) else None
    if not name or "." not in name:
        return None
    owner, _, attr = name.rpartition(".")
    if owner not in _CONSTANT_MODULES:
        return None
    if isinstance(node, ast.Attribute):
        return _CONSTANT_NAMES.get(attr)
    func = _CONSTANT_FUNCS.get(attr)
    if func is None or node.keywords or len(node.args) != 1:  # type: ignore[union-attr]
        return None
    arg = const_value(node.args[0])  # type: ignore[union-attr]
    if not isinstance(arg, (int, float)) or isinstance(arg, bool) or not 0 < arg < 1e6:
        return None
    value = func(arg)
    return value if math.isfinite(value) else None


def nonzero_constant_divisor(node: ast.AST) -> bool:
    """``x / np.log(2.0)``: the divisor is a nonzero finite constant."""
    value = constant_number(node)
    return value is not None and value != 0


def quoted(text: str, limit: int = 80) -> str:
    """Source quoted in a reason: cut with an ellipsis when longer than ``limit``, so a prefix never reads as the
    whole expression."""
    return text if len(text) <= limit else text[:limit].rstrip() + " …"


_MISSING_WORDS = {"miss", "missing", "nan", "nans"}


def _missing_word(identifier: str) -> bool:
    return any(word in _MISSING_WORDS for word in identifier.lower().split("_"))


def missing_values_mask(scope: Scope, cond: ast.AST, line: int) -> str | None:
    """D2 (granite-tsfm PatchTST-FM: ``ts_mask = pred_mask | pad_mask | miss_mask``, then ``torch.where(ts_mask,
    zeros_like(x), x)``): the condition reads a mask named for missing values (``miss_mask``, ``nan_mask``), inline or
    in the local definition of a name it reads. Time-series code keeps missing observations as NaN, and the where
    replaces them: lerp would return NaN there. The name read, else None."""
    names: list[str] = []
    for n in ast.walk(cond):
        if isinstance(n, ast.Name):
            names.append(n.id)
            value = scope.definition(n.id, line)
            if value is not None:
                names += [m.id if isinstance(m, ast.Name) else m.attr for m in ast.walk(value) if isinstance(m, (ast.Name, ast.Attribute))]
        elif isinstance(n, ast.Attribute):
            names.append(n.attr)
    return next((name for name in names if _missing_word(name)), None)


def host_scalar_tensor(module: ModuleInfo, node: ast.AST) -> bool:
    """D3 (GPTQModel's EXL3 ``unpack_bf``: ``torch.where(bits, torch.tensor(-1.0, dtype=torch.float16),
    torch.tensor(1.0, dtype=torch.float16))``): a branch ``torch.tensor(<number>)`` built with no ``device=`` is a 0-d
    CPU tensor. torch.where takes such CPU scalars beside device tensors; torch.lerp does only in recent PyTorch (its
    iterator allows CPU scalars since 2.x) and torch_npu documents no such case: the lerp form may raise a device
    mismatch where the original runs."""
    return isinstance(node, ast.Call) and (module.canonical(node.func) or "") == "torch.tensor" \
        and keyword(node, "device") is None and bool(node.args) and const_value(node.args[0]) is not None
