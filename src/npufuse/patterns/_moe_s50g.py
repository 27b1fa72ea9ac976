"""s50 gaps50: expert ids that may repeat in a row, combined with an indexed ``out[tok] += y``.

``tok, slot = torch.where(ids == e)`` lists a token once per slot holding e. Where a token holds e in two slots,
``out[tok] += y`` is ``index_put`` without accumulate: the token's two rows are both computed from the same ``out[tok]``
and one of them is written (the other is lost), while npu_moe_token_permute / unpermute add both copies (review49:
cos 0.96 with ``multinomial(..., replacement=True)`` ids). Distinct ids -- a last-dim topk's indices, which npufuse
reads -- make the two equal. Elsewhere (ids handed in as an argument, sampled, hashed) s49 only said so in a risk
line; now the fused text runs under a run-time check that every row of the ids is distinct (one sort of the [T, K]
ids and a host sync), and the original loop runs where one is not. ``index_add_`` / ``index_put_(accumulate=True)``
combines add every copy, as the fused layer does: no check there.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.scan.dataflow import dotted


def distinct_rows_check(ids: str) -> str:
    """True where every row (last dim) of ``ids`` holds distinct values (a [T, 1] row is distinct: an empty diff)."""
    return f"bool((torch.diff(torch.sort({ids}, dim=-1).values, dim=-1) != 0).all())"


def guard(module: Any, scope: Any, ev: Any, site: Any, topk: Callable[..., Any], miss: Callable[[str], Exception]) -> Optional[str]:
    """The run-time check the site needs, or None (ids read as a topk's, or an accumulating combine). Raises
    ``miss`` where the ids are bound inside the fused span (the check before the span cannot read them)."""
    put = getattr(ev, "s49r_put", "")
    indexed = bool(put) and site.token_dims <= 1 and not site.flat_rows or site.token_dims > 1 and site.out_name
    if not indexed or not site.indices or not site.indices.isidentifier():
        return None
    if topk(module, scope, site.indices, site.first_line) is not None:
        return None  # a last-dim topk's indices (a router's included): distinct per row
    for stmt, _ in scope.assignments.get(site.indices, []):
        if site.first_line <= stmt.lineno <= site.last_line:
            raise miss(f"the loop adds rows back with an indexed `+=` (index_put: a token listing one expert in two slots "
                       f"of `{site.indices}` is written once) and `{site.indices}` is not read as a last-dim topk's "
                       f"indices; it is bound inside the loop's span (line {stmt.lineno}), so no check before the fused "
                       "text can show its rows distinct")
    site.s50_distinct = True
    return f"({distinct_rows_check(site.indices)})"


def risk(site: Any) -> str:
    return (f"the loop adds an expert's rows back with an indexed `+=` (index_put, not index_add): a token listing the "
            f"same expert in two slots of `{site.indices}` is written once there and added twice by the fused layer, "
            f"and `{site.indices}` is not read as a last-dim topk's indices (sampled or hashed routing can repeat an "
            "expert): the fused text runs where every row of it is distinct (checked at run time: one sort and a "
            "host sync per call), the original loop otherwise")


# -- 4. a scalar hyperparameter with a numeric default that a caller fills with a tensor -------------------------------
# review49 (b) let a scalar attribute of an expert count as a number where its __init__ argument is annotated int /
# float or has a numeric default. A default says nothing about what the callers pass: `Expert(d, h, 0.0,
# torch.linspace(..)[:, None])` gives the expert a [T, 1] tensor that broadcasts against the loop's [n, T, H] rows and
# not against the [m, H] token rows the fused layer gives it (review49's crash, or silently other values where the
# sizes line up). An argument known only by its default now also needs every constructor call of the class in the repo
# (this file, and the other files of the scanned repo that mention the class) to pass a number there or nothing.

_NUMBER_CALLS = frozenset(("int", "float", "round", "abs", "min", "max", "len", "bool"))


def _number_like(node: ast.AST, assigned: dict[str, list[ast.AST]], depth: int = 0) -> bool:
    """``node`` cannot be a tensor as written: numbers, names / attributes (config fields, arguments passed on) whose
    local assignments are number-like, arithmetic and conditionals of those, int() / float() / math.* calls."""
    if depth > 8:
        return False
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) or node.value is None
    if isinstance(node, ast.UnaryOp):
        return _number_like(node.operand, assigned, depth + 1)
    if isinstance(node, ast.BinOp):
        return _number_like(node.left, assigned, depth + 1) and _number_like(node.right, assigned, depth + 1)
    if isinstance(node, ast.IfExp):
        return _number_like(node.body, assigned, depth + 1) and _number_like(node.orelse, assigned, depth + 1)
    if isinstance(node, ast.Name):
        return all(_number_like(v, {}, depth + 1) for v in assigned.get(node.id, []))  # one level: `s = torch.ones(..)`
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, (ast.Name, ast.Attribute))  # `config.scale`, `self.scale`, `args.s`
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, (ast.Name, ast.Attribute)) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str)  # `cfg["scale"]`
    if isinstance(node, ast.Call):
        name = dotted(node.func) or ""
        return name in _NUMBER_CALLS or name.startswith("math.")
    return False


def _assignments(fn: Optional[ast.AST]) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for n in ast.walk(fn) if fn is not None else ():
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(n.value)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and isinstance(n.target, ast.Name) and n.value is not None:
            out.setdefault(n.target.id, []).append(n.value)
    return out


def _tensor_passed(tree: ast.Module, cls_name: str, params: tuple[str, ...], param: str) -> Optional[tuple[int, str]]:
    """(line, argument) of a call ``cls_name(...)`` in ``tree`` passing ``param`` something not number-like."""
    from npufuse.scan.repo_facts import _arg_for

    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or (dotted(call.func) or "").rpartition(".")[2] != cls_name:
            continue
        arg = _arg_for(call, params, param)
        if arg is None:
            continue  # the default (or a `**kwargs` / starred call npufuse does not follow)
        enclosing = min((f for f in funcs if f.lineno <= call.lineno <= (f.end_lineno or f.lineno)
                         and any(n is call for n in ast.walk(f))), key=lambda f: (f.end_lineno or f.lineno) - f.lineno, default=None)
        if not _number_like(arg, _assignments(enclosing)):
            return call.lineno, ast.unparse(arg)
    return None


def default_only_number(module: Any, cls_name: str, ctor: ast.FunctionDef, param: str) -> bool:
    """``param`` of ``cls_name.__init__`` is a number at every constructor call of the class npufuse can see (see above)."""
    from npufuse.scan import repo_facts

    params = tuple(a.arg for a in [*ctor.args.posonlyargs, *ctor.args.args][1:])
    if _tensor_passed(module.tree, cls_name, params, param) is not None:
        return False
    root = repo_facts.repo_root(module)
    if root is None:
        return True
    repo_facts._depends(root, module.path)  # the answer reads the other files of the repository
    for other in repo_facts._repo_py_files(root):
        if other == module.path:
            continue
        text = repo_facts._repo_text(root, other)
        if text is None or cls_name not in text:
            continue
        tree = repo_facts._parse_repo_file(root, other)
        if tree is not None and _tensor_passed(tree, cls_name, params, param) is not None:
            return False
    return True
