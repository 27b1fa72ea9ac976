"""s47 (fix47h): a rotation-matrix rope applied by ``einsum`` over the lane pairs.

HO23a JorgeVanco/LLM-from-scratch (CS336 style)::

    # __init__
    theta_i_k = i / theta ** (2 * (k - 1) / d_k)
    sin, cos = theta_i_k.sin(), theta_i_k.cos()
    R = [cos, -sin, sin, cos]
    R = rearrange(R, "(d1 d2) i k -> i k d1 d2", d1=2, d2=2)
    self.register_buffer("R", R, persistent=False)
    # forward
    position_matrices = self.R[token_positions]
    x = rearrange(x, "... seq (k d1) -> ... seq k d1", d1=2)
    applied = einsum(x, position_matrices, "... seq k d1, ... seq k d2 d1 -> ... seq k d2")
    return rearrange(applied, "... seq k d2 -> ... seq (k d2)")

The einsum is flux's per-pair matrix product ``out[.., i] = sum_j M[.., i, j] * x[.., j]`` (``rope.py``'s
``_match_matrix``) written as one contraction: the pairs' axis contracted with the matrix's LAST axis, the output's
last axis the matrix's second to last, every other axis the same letters in the three operands (``...`` included,
so the einsum broadcasts as the elementwise product does). With M = [[cos, -sin], [sin, cos]] that is the interleaved
rotation (cos = M[.., 0, 0], sin = M[.., 1, 0]). The matrix is proven a rotation by tracing it here: the operand is
``T[idx]`` / ``T`` (casts allowed) with ``T`` a buffer / attribute of this class (or a name of this function) bound to
``rearrange([a, -b, b, a], "(p q) ... -> ... p q", p=2, q=2)`` (or ``torch.stack((a, -b, b, a), -1).view(.., 2, 2)``)
with ``a = t.cos()`` and ``b = t.sin()`` of one tensor. A contraction over the matrix's other axis (the transposed
matrix: the inverse rotation), other letters, or a matrix not traced this way give no candidate (a near miss where
the form is a per-pair einsum).
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword, same_expr, strip_casts


def may_hold(text: str) -> bool:
    """A cheap text gate: the scope may hold an einsum rope (nothing else here is read without it)."""
    return "einsum(" in text


def _is_einsum(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = dotted(node.func) or ""
    return name == "einsum" or name.endswith(".einsum")


def _operands(node: ast.Call) -> Optional[tuple[ast.expr, ast.expr, tuple[str, str, str]]]:
    """(a, b, subscripts) of a two-operand einsum, torch's (equation first) or einops' (equation last)."""
    if len(node.args) != 3 or node.keywords:
        return None
    if isinstance(const_value(node.args[0]), str):
        subs = canonical.einsum_subscripts(node.args[0])
        a, b = node.args[1], node.args[2]
    elif isinstance(const_value(node.args[2]), str):
        subs = canonical.einops_equation_subscripts(node.args[2])
        a, b = node.args[0], node.args[1]
    else:
        return None
    if subs is None:
        return None
    return a, b, subs


def _binding(scope: Scope, name: str, line: int) -> Optional[tuple[int, ast.expr]]:
    """(line, value) of the binding of ``name`` that reaches ``line`` in straight-line code (the last one before it,
    at the function's top level); None for a parameter, no binding, or a last binding in a branch or loop."""
    defs = [(st, v) for st, v in scope.assignments.get(name, []) if st.lineno < line]
    if not defs:
        return None
    st, v = max(defs, key=lambda d: d[0].lineno)
    body = getattr(scope.node, "body", [])
    if not any(s is st for s in body):
        return None
    return st.lineno, v


def _last_binding(scope: Scope, name: str, line: int) -> Optional[ast.expr]:
    found = _binding(scope, name, line)
    return found[1] if found is not None else None


def _pairs_source(scope: Scope, node: ast.expr, line: int) -> bool:
    """Whether ``node`` is x with its last dim cut into lane pairs [.., D/2, 2]: einops
    ``rearrange(x, "... (k d) -> ... k d", d=2)`` (the other axes unchanged), ``x.unflatten(-1, (-1, 2))`` or
    ``x.reshape(*x.shape[:-1], -1, 2)`` / ``view``; through one local name."""
    v = node
    if isinstance(v, ast.Name):
        v = _last_binding(scope, v.id, line)
        if v is None:
            return False
    v = strip_casts(v)[0] if isinstance(v, ast.Call) else v
    if not isinstance(v, ast.Call):
        return False
    f = v.func
    name = dotted(f) or ""
    if name.split(".")[-1] == "rearrange" and len(v.args) == 2 and isinstance(const_value(v.args[1]), str):
        pattern = const_value(v.args[1])
        if pattern.count("->") != 1:
            return False
        lhs, rhs = (side.strip() for side in pattern.split("->"))
        if not lhs.endswith(")") or "(" not in lhs:
            return False
        head, group = lhs[: lhs.rindex("(")].split(), lhs[lhs.rindex("(") + 1 : -1].split()
        if "(" in " ".join(head) or len(group) != 2 or rhs.split() != head + group:
            return False
        size = {k.arg: const_value(k.value) for k in v.keywords}
        return size.get(group[1]) == 2 and set(size) <= set(group)
    if isinstance(f, ast.Attribute) and f.attr == "unflatten" and len(v.args) == 2 and const_value(v.args[0]) == -1:
        shape = v.args[1]
        return isinstance(shape, (ast.Tuple, ast.List)) and len(shape.elts) == 2 and const_value(shape.elts[0]) == -1 \
            and const_value(shape.elts[1]) == 2
    if isinstance(f, ast.Attribute) and f.attr in ("reshape", "view") and len(v.args) == 3 and isinstance(v.args[0], ast.Starred) \
            and const_value(v.args[1]) == -1 and const_value(v.args[2]) == 2:
        lead = v.args[0].value
        return isinstance(lead, ast.Subscript) and isinstance(lead.value, ast.Attribute) and lead.value.attr == "shape" \
            and isinstance(lead.slice, ast.Slice) and lead.slice.lower is None and const_value(lead.slice.upper) == -1 \
            and same_expr(strip_casts(lead.value.value)[0], strip_casts(f.value)[0])
    return False


def einsum_matrix(scope: Scope, node: ast.AST) -> Optional[tuple[ast.expr, ast.expr]]:
    """(pairs, matrix) of ``einsum(pairs, M, "P k j, P k i j -> P k i")`` (either operand order, torch's or einops'
    spelling): the per-pair product out_i = sum_j M_ij x_j over lane pairs; None for anything else."""
    if not _is_einsum(node):
        return None
    ops = _operands(node)  # type: ignore[arg-type]
    if ops is None:
        return None
    a, b, (sa, sb, so) = ops
    line = getattr(node, "lineno", 0)
    for x, m, sx, sm in ((a, b, sa, sb), (b, a, sb, sa)):
        if len(sx) < 2 or len(sm) != len(sx) + 1 or len(so) != len(sx):
            continue
        j, i = sx[-1], sm[-2]
        if sm[-1] != j or so[-1] != i or i == j or sx[:-1] != sm[:-2] or so[:-1] != sx[:-1]:
            continue
        if _pairs_source(scope, x, line):
            return x, m
    return None


def pairs_as_flux_view(x: ast.expr) -> ast.Call:
    """The flux view ``X.reshape(*X.shape[:-1], -1, 1, 2)`` of the tensor X = ``pairs.flatten(-2)`` whose lane pairs
    ``pairs`` holds: what ``rope._match_matrix`` reads (its fused text reads X at the site)."""
    def flat() -> ast.Call:
        return ast.Call(func=ast.Attribute(value=x, attr="flatten", ctx=ast.Load()), args=[ast.Constant(-2)], keywords=[])
    lead = ast.Subscript(value=ast.Attribute(value=flat(), attr="shape", ctx=ast.Load()),
                         slice=ast.Slice(lower=None, upper=ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1)), step=None), ctx=ast.Load())
    return ast.Call(func=ast.Attribute(value=flat(), attr="reshape", ctx=ast.Load()),
                    args=[ast.Starred(value=lead, ctx=ast.Load()), ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1)),
                          ast.Constant(1), ast.Constant(2)], keywords=[])


# -- the matrix, traced to its construction ----------------------------------------------------------------------------

def _rotation_list(elts: list[ast.expr], scope: Scope, line: int) -> bool:
    """[a, -b, b, a] with a = t.cos() and b = t.sin() (torch.cos(t) / torch.sin(t)) of one tensor t."""
    if len(elts) != 4:
        return False
    a, nb, b, a2 = elts
    if not (isinstance(nb, ast.UnaryOp) and isinstance(nb.op, ast.USub) and same_expr(nb.operand, b) and same_expr(a, a2)):
        return False

    def trig(e: ast.expr, fn: str) -> Optional[ast.expr]:
        if isinstance(e, ast.Name):
            v = _last_binding(scope, e.id, line)
            if v is None:
                return None
            e = v
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == fn and not e.args and not e.keywords:
            return e.func.value
        if isinstance(e, ast.Call) and (dotted(e.func) or "") in (f"torch.{fn}", f"math.{fn}", f"np.{fn}") and len(e.args) == 1:
            return e.args[0]
        return None

    ta, tb = trig(a, "cos"), trig(b, "sin")
    return ta is not None and tb is not None and same_expr(ta, tb)


def _rotation_value(scope: Scope, v: ast.expr, line: int, depth: int = 0) -> bool:
    """``v`` is the stack of 2x2 rotations [[cos, -sin], [sin, cos]] on its last two dims."""
    if depth > 4:
        return False
    v = strip_casts(v)[0] if isinstance(v, ast.Call) else v
    if isinstance(v, ast.Name):
        b = _binding(scope, v.id, line)
        return b is not None and _rotation_value(scope, b[1], b[0], depth + 1)
    if not isinstance(v, ast.Call):
        return False
    name = (dotted(v.func) or "").split(".")[-1]
    if name == "rearrange" and len(v.args) == 2 and isinstance(const_value(v.args[1]), str):
        # rearrange([a, -b, b, a], "(p q) rest -> rest p q", p=2, q=2): the list stacked on a new first axis
        lst, at = v.args[0], line
        if isinstance(lst, ast.Name):
            b = _binding(scope, lst.id, line)
            if b is None:
                return False
            at, lst = b
        if not (isinstance(lst, (ast.List, ast.Tuple)) and _rotation_list(list(lst.elts), scope, at)):
            return False
        pattern = const_value(v.args[1])
        if pattern.count("->") != 1:
            return False
        lhs, rhs = (side.strip() for side in pattern.split("->"))
        if not lhs.startswith("(") or ")" not in lhs:
            return False
        group, rest = lhs[1 : lhs.index(")")].split(), lhs[lhs.index(")") + 1 :].split()
        size = {k.arg: const_value(k.value) for k in v.keywords}
        return len(group) == 2 and rhs.split() == rest + group and "(" not in " ".join(rest) \
            and all(size.get(g) in (2, None) for g in group) and any(size.get(g) == 2 for g in group)
    if isinstance(v.func, ast.Attribute) and v.func.attr in ("view", "reshape", "unflatten"):
        # torch.stack((a, -b, b, a), dim=-1).view(*lead, 2, 2) / .unflatten(-1, (2, 2))
        inner = v.func.value
        if not (isinstance(inner, ast.Call) and (dotted(inner.func) or "").split(".")[-1] == "stack" and inner.args
                and isinstance(inner.args[0], (ast.List, ast.Tuple)) and const_value(keyword(inner, "dim", 1)) == -1
                and _rotation_list(list(inner.args[0].elts), scope, line)):
            return False
        args = v.args
        if v.func.attr == "unflatten":
            return len(args) == 2 and const_value(args[0]) == -1 and isinstance(args[1], (ast.Tuple, ast.List)) \
                and [const_value(e) for e in args[1].elts] == [2, 2]
        return len(args) >= 2 and const_value(args[-1]) == 2 and const_value(args[-2]) == 2
    return False


def _class_of(module: ModuleInfo, scope: Scope) -> Optional[ast.ClassDef]:
    return module.classes.get(scope.class_name or "") if scope.class_name else None


def traced_rotation(module: ModuleInfo, scope: Scope, mat: ast.expr) -> Optional[str]:
    """Where the per-pair matrix ``mat`` is built as rotations (text for the report), None where it is not traced to
    one: ``mat`` is (through local names, casts and one index on the leading dims) ``self.<attr>`` set in a method of
    this class (``register_buffer("<attr>", v)`` / ``self.<attr> = v``, once) or a name of this function, with ``v``
    the stacked rotations."""
    line = getattr(mat, "lineno", 0)
    v: Any = mat
    for _ in range(6):
        if isinstance(v, ast.Name):
            found_b = _binding(scope, v.id, line)
            if found_b is None:
                return None
            line, b = found_b
            if _rotation_value(scope, b, line + 1):
                return f"{scope.qualname} (line {line})"
            v = b
            continue
        if isinstance(v, ast.Call) and strip_casts(v)[0] is not v:
            v = strip_casts(v)[0]
            continue
        if isinstance(v, ast.Subscript) and not isinstance(v.slice, (ast.Tuple, ast.Slice)):
            v = v.value  # T[positions]: rows of the table picked on its leading dim (the last two kept)
            continue
        break
    if not (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"):
        return None
    cls = _class_of(module, scope)
    if cls is None:
        return None
    attr = v.attr
    found: list[tuple[ast.FunctionDef, ast.AST, ast.expr]] = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for n in fast_walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "register_buffer" \
                    and len(n.args) >= 2 and const_value(n.args[0]) == attr:
                found.append((fn, n, n.args[1]))
            elif isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self" and e.attr == attr:
                            if not isinstance(n, ast.Assign) or isinstance(t, ast.Tuple) or n.value is None:
                                return None
                            found.append((fn, n, n.value))
    if len(found) != 1:
        return None
    fn, at, value = found[0]
    fscope = next((s for s in module.scopes if s.node is fn), None)
    if fscope is None or not _rotation_value(fscope, value, getattr(at, "lineno", 0)):
        return None
    return f"{fscope.qualname} (line {getattr(at, 'lineno', 0)})"
