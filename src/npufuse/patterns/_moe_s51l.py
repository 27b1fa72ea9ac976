"""s51 late51moe: the out-of-place combine of an expert loop (HO28a GQA-MoE, HO28b miniSeedance class).

The loop reader reads the in-place combine ``acc.index_add_(0, rows, y)``. The functional spellings

    acc = acc.index_add(0, rows, y)                              # a new tensor each expert, rebound to acc
    acc = acc + torch.zeros_like(acc).index_add(0, rows, y)      # y added into zeros, then added to acc

leave ``acc`` with the same values after the loop: ``index_add`` adds ``y``'s rows to a copy of ``acc`` at ``rows``;
``zeros.index_add`` holds ``0 + y`` (exactly y) at those rows and 0 elsewhere, so ``acc + that`` is ``acc[r] + y[r]``
at the rows and ``acc + 0`` (unchanged) elsewhere -- the same sums ``index_add_`` writes, in the same order per row.
Autograd is the same too (both are differentiable adds into a buffer without grad history of its own).

They differ from the in-place form only in aliasing: the in-place form changes the tensor object that ``acc`` named
before the loop, the functional one leaves it alone. The fused text's result goes to ``acc``, so the statement is
read as ``acc.index_add_`` only where nothing else can see the old object: ``acc`` is bound, before the loop in this
function, to a fresh ``torch.zeros`` / ``torch.zeros_like`` / ``.new_zeros`` buffer, and no other name is bound to it
(``out = acc``). Otherwise a true reason is given.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional, Union

from npufuse.scan.dataflow import Scope

_FRESH = ("zeros", "zeros_like", "new_zeros")


def _index_add_call(node: ast.expr) -> Optional[ast.Call]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "index_add":
        return node
    return None


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _zeros_like_of(node: ast.expr, name: str) -> bool:
    """``torch.zeros_like(acc)``: a zeros tensor of acc's shape, dtype and device."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zeros_like" \
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and len(node.args) == 1 \
        and not node.keywords and _is_name(node.args[0], name)


def _fresh_buffer(scope: Scope, name: str, line: int) -> bool:
    value = scope.definition(name, line)
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    f = value.func
    return f.attr in _FRESH and (f.attr == "new_zeros" or isinstance(f.value, ast.Name) and f.value.id == "torch")


def _aliased(scope: Scope, name: str) -> bool:
    """Another name bound to acc's object (``out = acc``, ``a, b = acc, x``)."""
    for node in ast.walk(scope.node):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]
            if any(_is_name(v, name) for v in values):
                return True
    return False


def inplace_combine(s: ast.stmt, scope: Scope, loop: ast.AST) -> Union[None, str, ast.Expr]:
    """``acc.index_add_(...)`` (as an expression statement) for a functional combine of ``acc`` inside the loop;
    a reason string where the spelling is the functional combine but cannot be read as the in-place one; None when
    the statement is not such a combine."""
    if not (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)):
        return None
    acc = s.targets[0].id
    value = s.value
    call = _index_add_call(value)
    if call is not None and _is_name(call.func.value, acc):  # type: ignore[attr-defined]
        pass  # acc = acc.index_add(0, rows, y)
    elif isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        # acc = acc + torch.zeros_like(acc).index_add(0, rows, y)  (either order)
        pair = [(value.left, value.right), (value.right, value.left)]
        call = next((c for a, b in pair if _is_name(a, acc) and (c := _index_add_call(b)) is not None
                     and _zeros_like_of(c.func.value, acc)), None)  # type: ignore[attr-defined]
        if call is None:
            return None
    else:
        return None
    spelled = ast.unparse(s)[:70]
    if not _fresh_buffer(scope, acc, loop.lineno):  # type: ignore[attr-defined]
        return (f"the expert outputs are combined out of place (`{spelled}`) into `{acc}`, which is not a zeros buffer "
                "made in this function before the loop: the fused result would be written into that tensor in place, "
                "which the loop never changes")
    if _aliased(scope, acc):
        return (f"the expert outputs are combined out of place (`{spelled}`) into `{acc}`, whose buffer is also bound "
                "to another name: the fused result would be written into it in place, which that name would see")
    inplace = ast.Call(ast.Attribute(ast.Name(acc, ast.Load()), "index_add_", ast.Load()), call.args, call.keywords)
    out = ast.Expr(inplace)
    ast.copy_location(out, s)
    ast.fix_missing_locations(out)
    return out


# -- the empty-expert branch with an else (HO28a myllm) ----------------------------------------------------------------
#
#     if rows.size(0) == 0:              |   if rows.size(0) == 0:          |   if mask.any():
#         continue                       |       if self.training:          |       <dispatch>
#     else:                              |           <dummy forward>        |   else:
#         <dispatch>                     |       else:                      |       continue
#                                        |           continue               |
#                                        |   else:
#                                        |       <dispatch>
#
# The first and third are `if <empty>: continue` followed by the dispatch, which the loop reader reads already. The
# second runs, for an expert without tokens in training, something else (a zero-row "dummy" forward added into the
# output to keep every expert in the autograd graph under DDP): that adds expert(0) to a row, which is zero only for
# bias-free experts (not proven here). The branch is an option of the whole call, so the fused text is guarded by the
# condition under which the skip branch is the one that runs (`not (self.training)`): in training the original runs.

_Split = tuple[bool, list[ast.stmt], Optional[str]]


def _skips(stmts: list[ast.stmt]) -> bool:
    """Only ``continue`` / ``pass``, with a ``continue``: the rest of the iteration does not run."""
    return bool(stmts) and all(isinstance(b, (ast.Continue, ast.Pass)) for b in stmts) \
        and any(isinstance(b, ast.Continue) for b in stmts)


def _skip_under_option(stmts: list[ast.stmt], is_option: Callable[[ast.expr], bool]) -> Optional[str]:
    """``if <option>: <other> else: continue`` (either order): the run-time condition under which it skips."""
    if len(stmts) != 1 or not isinstance(stmts[0], ast.If) or not is_option(stmts[0].test):
        return None
    inner = stmts[0]
    text = ast.unparse(inner.test)
    if _skips(inner.orelse) and not _skips(inner.body):
        return f"not ({text})"
    if _skips(inner.body):
        return f"({text})"
    return None


def skip_branch(s: ast.If, is_empty: Callable[[ast.expr], bool], is_nonempty: Callable[[ast.expr], bool],
                is_option: Callable[[ast.expr], bool]) -> Optional[_Split]:
    """(whether the test is the empty one, the dispatch statements, a run-time guard or None) for an ``if`` whose one
    branch skips an expert without tokens and whose other branch is the dispatch; None for any other ``if``."""
    if not s.orelse:
        return None
    if is_empty(s.test):
        skip, rest = s.body, s.orelse
    elif is_nonempty(s.test):
        skip, rest = s.orelse, s.body
    else:
        return None
    if _skips(skip):
        return is_empty(s.test), rest, None
    guard = _skip_under_option(skip, is_option)
    if guard is not None:
        return is_empty(s.test), rest, guard
    return None


# -- the weight column taken after the token mask (HO28a myllm) -------------------------------------------------------
#
# ``probs[mask][:, e]`` is ``probs[mask, e]``: the mask (or row index) picks the rows of the leading dims, then the
# column e of the next dim -- with e the loop's scalar expert index (a tensor of indices would pair with the rows in
# ``probs[rows, e]`` but cross with them in ``probs[rows][:, e]``: not read).


def column_after_rows(node: ast.Subscript, is_eidx: Callable[[ast.expr], bool]) -> Optional[ast.Subscript]:
    inner, sl = node.value, node.slice
    if not (isinstance(inner, ast.Subscript) and isinstance(sl, ast.Tuple) and len(sl.elts) == 2):
        return None
    every, col = sl.elts
    if not (isinstance(every, ast.Slice) and every.lower is None and every.upper is None and every.step is None):
        return None
    if not is_eidx(col) or isinstance(inner.slice, (ast.Slice, ast.Tuple)):
        return None
    out = ast.Subscript(inner.value, ast.Tuple([inner.slice, col], ast.Load()), ast.Load())
    ast.copy_location(out, node)
    ast.fix_missing_locations(out)
    return out


# -- experts in a ModuleDict, looped by key (HO28a myllm) ---------------------------------------------------------------
#
# ``for i, key in enumerate(self.experts): ... self.experts[key](rows)``: iterating a ModuleDict yields its keys in
# insertion order, so ``self.experts[key]`` is the i-th module of ``self.experts.values()``. Read only where every use
# of ``key`` in the loop is that subscript (a key compared with the ids, or used otherwise, is not an expert index);
# the fused text lists ``list(self.experts.values())`` under the run-time guard that the container is a ModuleDict
# (for a list, ``experts[module]`` raises: the original runs and raises the same).


def keyed_only(loop: ast.For, container: ast.expr, key: str) -> bool:
    want = ast.dump(container)
    ok: set[int] = set()
    loads = 0
    for n in ast.walk(loop):
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Name) and n.slice.id == key \
                and ast.dump(n.value) == want:
            ok.add(id(n.slice))
        if isinstance(n, ast.Name) and n.id == key and isinstance(n.ctx, ast.Load):
            loads += 1
    if not ok or loads != len(ok):
        return False
    # not rebound inside the loop
    return not any(isinstance(n, ast.Name) and n.id == key and isinstance(n.ctx, ast.Store) for s in loop.body for n in ast.walk(s))
