"""s44 (helper ho21fix44): rms_norm forms the HO21 blind judge found missed, read by class.

1. The trailing dims written relative to the rank (a LayerNorm-style ``normalized_shape`` tuple)::

       k = len(self.normalized_shape)
       dims = tuple(range(x.ndim - k, x.ndim))
       ms = torch.mean(x.pow(2), dim=dims, keepdim=True)

   ``range(r - k, r)`` with ``r`` the rank of the squared tensor (``x.ndim``, ``x.dim()``, ``len(x.shape)``)
   names the last ``k`` dims. The fused branch runs where ``k == 1`` (the last dim alone, what npu_rms_norm
   normalises with a 1-D gamma), written as the existing run-time check ``-k == -1``; the original runs for any
   other ``k``. The rank must be read from the squared tensor itself (another tensor's rank may differ).
"""

from __future__ import annotations

import ast

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo


def _rank_of(node: ast.expr) -> ast.expr | None:
    """t for ``t.ndim``, ``t.dim()``, ``t.ndimension()``, ``len(t.shape)`` / ``len(t.size())``."""
    if isinstance(node, ast.Attribute) and node.attr == "ndim":
        return node.value
    if isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("dim", "ndimension"):
        return node.func.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and len(node.args) == 1 \
            and not node.keywords:
        inner = node.args[0]
        if isinstance(inner, ast.Attribute) and inner.attr == "shape":
            return inner.value
        if isinstance(inner, ast.Call) and not inner.args and isinstance(inner.func, ast.Attribute) and inner.func.attr == "size":
            return inner.func.value
    return None


def range_call(value: ast.expr) -> ast.Call | None:
    """The ``range(..)`` call a dims value holds: ``tuple(range(..))`` / ``list(range(..))`` / a generator or list
    comprehension that yields its items unchanged; None for anything else."""
    rng = value
    if isinstance(rng, ast.Call) and isinstance(rng.func, ast.Name) and rng.func.id in ("tuple", "list") \
            and len(rng.args) == 1 and not rng.keywords:
        rng = rng.args[0]
    if isinstance(rng, (ast.GeneratorExp, ast.ListComp)) and len(rng.generators) == 1:
        gen = rng.generators[0]
        if gen.ifs or gen.is_async or not (isinstance(gen.target, ast.Name) and isinstance(rng.elt, ast.Name)
                                           and rng.elt.id == gen.target.id):
            return None
        rng = gen.iter
    if not (isinstance(rng, ast.Call) and isinstance(rng.func, ast.Name) and rng.func.id == "range" and not rng.keywords):
        return None
    return rng


def trailing_dims_from_rank(module: ModuleInfo, dim: ast.expr, ctx: S.Ctx, trace: S.Trace,
                            squared_key: str) -> tuple[ast.expr, S.Ctx] | None:
    """For a name (or an expression) holding ``tuple(range(t.ndim - k, t.ndim))`` (``list(...)``, a
    generator over it) with ``t`` the squared tensor: ``(-k, ctx)`` for the run-time check ``-k == -1``.
    None for any other form (a different tensor's rank, a step, a start not ``rank - k``)."""
    value, vctx = dim, ctx
    if isinstance(dim, ast.Name):
        value, vctx, stmt = S.follow(dim, ctx)
        if value is dim or stmt is None:
            return None
    rng = range_call(value)
    if rng is None or len(rng.args) != 2:
        return None
    start, stop = rng.args
    if not (isinstance(start, ast.BinOp) and isinstance(start.op, ast.Sub)):
        return None
    ranks = [_rank_of(start.left), _rank_of(stop)]
    if any(t is None for t in ranks):
        return None
    # both ranks read from the squared tensor (up to dtype casts): the dims are that tensor's last k
    if any(S.key(t, vctx) != squared_key for t in ranks if t is not None):
        return None
    if isinstance(dim, ast.Name):
        S.follow(dim, ctx, trace)
    count = start.right
    if isinstance(count, ast.Constant) and not isinstance(count.value, int):
        return None
    neg = ast.UnaryOp(op=ast.USub(), operand=count)
    ast.copy_location(neg, count)
    ast.fix_missing_locations(neg)
    return neg, vctx


# -- 2. a learnable gain initialised to sqrt(d) (QK-norm's per-head temperature) ----------------------------------------
#
#     self.q_scale = nn.Parameter(torch.full((n_heads, 1, 1), head_dim ** 0.5))
#     q = F.normalize(q, dim=-1, eps=1e-6) * self.q_scale
#
# F.normalize(x) * g == rms_norm(x) * g / sqrt(d) for any g; the reader asks for a sqrt(d) factor only to tell a
# norm layer from a ScaleNorm-style unit vector times a free scalar. A gain parameter whose initial value is
# sqrt(d) carries that factor in its value: the layer starts as an RMSNorm with a unit gamma (the gain per head,
# folded after the norm by the existing per-head path). A gain initialised to ones or to another constant does not.

_PARAMETER_CTORS = ("Parameter",)
_FILLS = ("ones", "ones_like")


def _root_half(module: ModuleInfo, node: ast.AST | None) -> bool:
    from npufuse.scan import canonical

    return canonical.root_power(module, node) == 0.5


def _filled_with_root(module: ModuleInfo, value: ast.AST) -> bool:
    """``torch.full(shape, d ** 0.5)``, ``torch.ones(shape) * math.sqrt(d)`` (either order)."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "full":
        fill = value.args[1] if len(value.args) > 1 else next((k.value for k in value.keywords if k.arg == "fill_value"), None)
        return _root_half(module, fill)
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
        for ones, factor in ((value.left, value.right), (value.right, value.left)):
            if isinstance(ones, ast.Call) and isinstance(ones.func, ast.Attribute) and ones.func.attr in _FILLS \
                    and _root_half(module, factor):
                return True
    return False


def gain_initialised_to_root(module: ModuleInfo, factor: ast.AST, attr_value) -> bool:
    """``self.<g>`` whose ``__init__`` value (``attr_value(name)``) is a Parameter filled with sqrt(d)."""
    if not (isinstance(factor, ast.Attribute) and isinstance(factor.value, ast.Name) and factor.value.id == "self"):
        return False
    value = attr_value(factor.attr)
    if not (isinstance(value, ast.Call) and value.args and (
            (isinstance(value.func, ast.Attribute) and value.func.attr in _PARAMETER_CTORS)
            or (isinstance(value.func, ast.Name) and value.func.id in _PARAMETER_CTORS))):
        return False
    return _filled_with_root(module, value.args[0])
