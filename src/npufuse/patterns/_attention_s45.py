"""s45 (helper attn45): attention / sdpa precision defects left by s44, read by class.

1. SDPA operands of mixed stated ranks. ``F.scaled_dot_product_attention`` broadcasts its operands' leading dims
   (4-D q with 3-D / 2-D k and v runs: MQA keys shared by every head, B = 1), npu_fusion_attention takes 4-D q, k
   and v only. The fused branch of an SDPA call whose ranks are not stated tested ``q.dim() == 4`` alone, so a 4-D q
   beside 3-D keys reached the op (which rejects the shape where the original ran). Now every operand of unstated
   rank is tested, and an operand whose stated rank is not 4 beside an unstated one is a near miss: the 4-D call
   could never run (granite-tsfm PatchTST-FM: ``v`` 5-D from a 6-D permute's ``unbind(0)``, q / k through a norm
   module): the candidate promised a speed-up the run never had.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

from npufuse.scan.dataflow import ModuleInfo, const_value


def sdpa_stated_rank_problem(ranks: dict[str, int | None], texts: dict[str, str]) -> str | None:
    """The near-miss reason where one SDPA operand's rank is stated and not 4 while another's is not stated (the
    4-D call's run-time rank test could never hold, or would pass operands of another rank); None otherwise."""
    if all(r is not None for r in ranks.values()) or all(r is None for r in ranks.values()):
        return None
    odd = [(tag, r) for tag, r in ranks.items() if r is not None and r != 4]
    if not odd:
        return None
    tag, r = odd[0]
    unstated = ", ".join(t for t, x in ranks.items() if x is None)
    return (f"{tag} (`{texts[tag][:40]}`) is {r}-D while the rank of {unstated} is not stated here: SDPA broadcasts "
            f"operands of different ranks, npu_fusion_attention takes 4-D q, k and v only, so the fused call could not run "
            f"on these operands")


def sdpa_unstated_rank_test(ranks: dict[str, int | None], names: dict[str, str], atom_of) -> str:
    """``q.dim() == k.dim() == 4`` over the operands of unstated rank (SDPA accepts keys of a lower rank than the
    query's: each is tested, not only q)."""
    tested = list(dict.fromkeys(atom_of(names[tag]) for tag, r in ranks.items() if r is None))
    return " == ".join(f"{x}.dim()" for x in tested) + " == 4"


# 2. One head indexed out by a loop variable (MiniMax-M2's memory-saving ``for h in range(self.num_heads): q =
#    query_states[:, h, :, :]``, then ``q_chunk = q[:, i:i + chunk, :]``): the products are 3-D [B, S, D] per head,
#    read as 4-D, so the fused branch's ``q_chunk.dim() == 4`` test never held (a candidate promising a speed-up the
#    run never had). A subscript that names every axis (it ends in a full slice) and takes one of them at an integer
#    (a literal, or the target of a ``for`` over ``range``) states a 3-D tensor where its base has as many axes as the
#    subscript has entries: the one-head (bmm) reading, whose ranks the fused branch checks at run time (s34), takes it.
def _range_targets(scope_node: ast.AST) -> set[str]:
    """Names bound as the plain target of a ``for .. in range(..)`` in the function (integers)."""
    cached = getattr(scope_node, "_npufuse_s45_range_targets", None)
    if cached is not None:
        return cached
    found = {st.target.id for st in ast.walk(scope_node)
             if isinstance(st, ast.For) and isinstance(st.target, ast.Name) and isinstance(st.iter, ast.Call)
             and isinstance(st.iter.func, ast.Name) and st.iter.func.id == "range"}
    try:
        scope_node._npufuse_s45_range_targets = found  # type: ignore[attr-defined]  # memoised per function
    except AttributeError:
        pass
    return found


def _integer_index(entry: ast.AST, loop_ints: set[str]) -> bool:
    """A literal integer, or a name (a symbolic Ref carries ``.name``) that a ``for .. in range`` binds."""
    if isinstance(entry, ast.Constant):
        return isinstance(entry.value, int) and not isinstance(entry.value, bool)
    name = entry.id if isinstance(entry, ast.Name) else getattr(entry, "name", None)
    return isinstance(name, str) and name in loop_ints


def head_indexed_3d(node: Any, scope: Any, line: int, depth: int = 0) -> bool:
    """``X[:, h, :, :]`` (integer entries among full / partial slices, the last a full slice, no ``...`` / None /
    tensor index) with three entries left: 3-D where X has as many axes as the subscript has entries (checked at run
    time by the reading that takes it); also ``Y[:, i:j, :]`` (three slices) of such a Y (a chunk of the head)."""
    node = defined_value(node, scope, line)
    if depth > 4 or not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return False
    entries = node.slice.elts
    last = entries[-1] if entries else None
    if not (isinstance(last, ast.Slice) and last.lower is None and last.upper is None and last.step is None):
        return False
    loop_ints = _range_targets(scope.node)
    ints = 0
    for e in entries:
        if isinstance(e, ast.Slice):
            continue
        if not _integer_index(e, loop_ints):
            return False  # a tensor index, ``...`` or None: the rank is not read off the entries
        ints += 1
    if len(entries) - ints != 3:
        return False
    # slices only keep the base's rank: 3-D where the base is a head taken out the same way
    return ints >= 1 or head_indexed_3d(node.value, scope, getattr(node, "lineno", line), depth + 1)

def defined_value(node: Any, scope: Any, line: int) -> Any:
    """``node`` itself, or for a name known only before the block (a symbolic Ref with no value: a loop's body
    reading a name set around the loop), the one definition the scope records for it."""
    if getattr(node, "idx", None) == -1 and getattr(node, "value", None) is None and isinstance(getattr(node, "name", None), str):
        d = scope.definition(node.name, line)
        return d if d is not None else node
    return node


# 3. 5-D operands with a causal mask under a condition, and GQA written as a 5-D grouped query (qwen3_from_scratch's
#    ``q.reshape(B, Hkv, G, S, D)`` against ``k.unsqueeze(2)`` / ``v.unsqueeze(2)``, the causal triangle applied
#    ``if seq_len_q > 1 and is_causal``). npufuse folds 5-D [B, N, W, S, D] operands' first two axes into the op's
#    batch; a mask had to be folded alike, so only a causal flag (sparse_mode) was allowed. A causal triangle is one
#    [Sq, Skv] plane repeated over every leading axis (each term a tril / triu of the two sequence lengths), so its
#    plane passes as the op's 2-D [Sq, Skv] mask whatever the fold. Keys and values of size 1 on the window / group
#    axis (``k.unsqueeze(2)``) fold to one kv head per batch row, which the op's GQA shares across the G query heads
#    (spec 5.1: query head h uses kv head h // (Nq / Nkv)): exactly the broadcast of the eager matmuls.
def causal_terms_only(masks: list) -> bool:
    """Every term of the chain's mask is a causal triangle (under a condition or not; float biases go to pse)."""
    return bool(masks) and all(getattr(m, "causal", None) is not None or type(m).__name__ == "_S28Bias" for m in masks)


def causal_plane_lines(var: str, maybe_none: bool) -> list[str]:
    """The [Sq, Skv] plane of a causal mask broadcast over the 5-D scores' leading axes (identical on each)."""
    guard = f"{var} is not None and " if maybe_none else ""
    return [f"if {guard}{var}.dim() > 2:",
            f"    {var} = {var}[(0,) * ({var}.dim() - 2)]  # a causal triangle: the same [Sq, Skv] plane on every leading axis"]


def fold_shape_test(q: str, k: str, v: str) -> str:
    """The run-time test under which the first two axes of 5-D q / k / v fold into the op's batch: shared leading
    axes (the eager matmuls would broadcast unequal ones, the fold would not), and a window / group axis of k and v
    equal to q's or 1 (one kv head for the G query heads of the op's GQA)."""
    return (f"{k}.shape[:2] == {q}.shape[:2] == {v}.shape[:2] and {k}.shape[2] == {v}.shape[2] "
            f"and {k}.shape[2] in (1, {q}.shape[2])")


# 4. Tiled online-softmax (FlashAttention-2 style) loops written in PyTorch (elvin-mark's ``EducationalFlashAttention``):
#    ``for i in range(0, Sq, Bq):`` a query tile, a running max ``m`` (-inf), sum ``l`` and accumulator ``acc`` (zeros),
#    ``for j in range(0, Skv, Bk):`` the tile scores ``s = (q_i @ k_jᵀ) * scale`` (+ ``mask[:, :, i:i_end, j:j_end]``),
#    ``m_new = maximum(m, rowmax(s))``, ``acc = exp(m - m_new) * acc + exp(s - m_new) @ v_j``, the same rescale of ``l``
#    plus the tile's row sums, then ``out[:, :, i:i_end] = acc / l``. Exactly softmax(q kᵀ·scale + mask) v (up to
#    rounding): the whole loop nest is one npu_fusion_attention call (no dropout, nothing else returned: only ``out``
#    is written). A key-block skip ``if mask is not None and j >= i_end: continue`` drops keys after the query block,
#    exact only where the mask masks every key after its query (checked at run time, with the mask's values and rows);
#    a skip without that mask, or any other skip (a window), is block-causal / windowed attention: a near miss.
#    The check reads the equations off the loop bodies (each name replaced by its value), in any operand order.
TILED_RISK = ("the hand-written tiled online-softmax loop is replaced by one npu_fusion_attention call: the same softmax "
              "attention up to rounding (the loop accumulates in fp32 tiles, the op in its own tiling)")


class _Tiles(ast.NodeTransformer):
    """Names replaced by their values so far (each value already expanded)."""

    def __init__(self, env: dict[str, ast.expr]) -> None:
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return copy.deepcopy(self.env[node.id]) if isinstance(node.ctx, ast.Load) and node.id in self.env else node


def _expanded(node: ast.expr, env: dict[str, ast.expr]) -> ast.expr:
    return _Tiles(env).visit(copy.deepcopy(node))


def _same(a: Any, b: Any) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def _range0(node: ast.For) -> tuple[str, ast.expr, ast.expr] | None:
    """(target, stop, step) of ``for t in range(0, stop, step)``."""
    it = node.iter
    if not (isinstance(node.target, ast.Name) and isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
            and it.func.id == "range" and len(it.args) == 3 and not it.keywords and not node.orelse):
        return None
    if not (isinstance(it.args[0], ast.Constant) and it.args[0].value == 0):
        return None
    return node.target.id, it.args[1], it.args[2]


def _call_named(module: ModuleInfo, node: Any, torch_name: str, method: str | None = None) -> ast.Call | None:
    if not isinstance(node, ast.Call):
        return None
    if module.canonical(node.func) == torch_name:
        return node
    if method is not None and isinstance(node.func, ast.Attribute) and node.func.attr == method \
            and not (module.canonical(node.func) or "").startswith("torch."):
        return node
    return None


def _kw(call: ast.Call, name: str, pos: int) -> Any:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return call.args[pos] if len(call.args) > pos else None


def _last_axis_keepdim(call: ast.Call, pos: int) -> bool:
    dim, keep = _kw(call, "dim", pos), _kw(call, "keepdim", pos + 1)
    return dim is not None and const_value(dim) == -1 and isinstance(keep, ast.Constant) and keep.value is True


def _row_max_of(module: ModuleInfo, node: Any) -> Any:
    """S for ``S.max(dim=-1, keepdim=True).values`` / ``torch.max(S, -1, True)[0]`` / ``S.amax(-1, keepdim=True)``."""
    if isinstance(node, ast.Attribute) and node.attr == "values":
        node = node.value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
        node = node.value
    elif not isinstance(node, ast.Call):
        return None
    for name, method in (("torch.max", "max"), ("torch.amax", "amax")):
        c = _call_named(module, node, name)
        if c is not None and len(c.args) >= 1 and _last_axis_keepdim(c, 1):
            return c.args[0]
        c = _call_named(module, node, "", method)
        if c is not None and isinstance(c.func, ast.Attribute) and _last_axis_keepdim(c, 0):
            return c.func.value
    return None


def _pair(module: ModuleInfo, node: Any, torch_name: str) -> tuple[Any, Any] | None:
    c = _call_named(module, node, torch_name)
    return (c.args[0], c.args[1]) if c is not None and len(c.args) == 2 and not c.keywords else None


def _exp_arg(module: ModuleInfo, node: Any) -> Any:
    c = _call_named(module, node, "torch.exp", "exp")
    if c is None:
        return None
    return c.args[0] if c.args and module.canonical(c.func) == "torch.exp" else c.func.value if not c.args else None


def _product(module: ModuleInfo, node: Any) -> tuple[Any, Any] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    return _pair(module, node, "torch.matmul")


def _terms(node: Any, op: type) -> list[Any]:
    """The operands of a chain of one commutative operator (``a * b * c``: [a, b, c])."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, op):
        return _terms(node.left, op) + _terms(node.right, op)
    return [node]


def _sum_last(module: ModuleInfo, node: Any, of: Any) -> bool:
    c = _call_named(module, node, "torch.sum", "sum")
    if c is None:
        return False
    if module.canonical(c.func) == "torch.sum":
        return bool(c.args) and _same(c.args[0], of) and _last_axis_keepdim(c, 1)
    return isinstance(c.func, ast.Attribute) and _same(c.func.value, of) and _last_axis_keepdim(c, 0)


def _rescaled(module: ModuleInfo, node: Any, old: str, alpha: Any, new_part: Any) -> bool:
    """``alpha * old + new_part`` in any order."""
    adds = _terms(node, ast.Add)
    if len(adds) != 2:
        return False
    for a, b in ((adds[0], adds[1]), (adds[1], adds[0])):
        muls = _terms(a, ast.Mult)
        if len(muls) == 2 and any(isinstance(x, ast.Name) and x.id == old for x in muls) \
                and any(_same(x, alpha) for x in muls) and (new_part(b) if callable(new_part) else _same(b, new_part)):
            return True
    return False


def _tile(node: Any, base_axis_var: str, end_ok: Any) -> str | None:
    """The tensor ``X`` of ``X[:, :, t:end]`` / ``X[:, :, t:end, :]`` (the third axis tiled by loop variable t)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Tuple)):
        return None
    e = node.slice.elts
    full = lambda s: isinstance(s, ast.Slice) and s.lower is None and s.upper is None and s.step is None  # noqa: E731
    if len(e) not in (3, 4) or not (full(e[0]) and full(e[1])) or (len(e) == 4 and not full(e[3])):
        return None
    t = e[2]
    if not (isinstance(t, ast.Slice) and isinstance(t.lower, ast.Name) and t.lower.id == base_axis_var and t.step is None
            and end_ok(t.upper)):
        return None
    return node.value.id


def _tile_end(module: ModuleInfo, var: str, step: ast.expr, stop: ast.expr) -> Any:
    """A predicate for the tile's end: ``min(t + step, stop)`` or ``t + step`` (slicing clamps at the length)."""
    plus = ast.dump(ast.BinOp(left=ast.Name(id=var, ctx=ast.Load()), op=ast.Add(), right=step))
    plus2 = ast.dump(ast.BinOp(left=step, op=ast.Add(), right=ast.Name(id=var, ctx=ast.Load())))

    def ok(node: Any) -> bool:
        if node is None:
            return False
        if ast.dump(node) in (plus, plus2):
            return True
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "min" and len(node.args) == 2 \
            and ast.dump(node.args[0]) in (plus, plus2) and _same(node.args[1], stop)
    return ok


def _strip_loc(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        for a in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            if hasattr(n, a):
                delattr(n, a)
    return node


def tiled_online_softmax(pattern_id: str, module: ModuleInfo, scope: Any) -> list:
    """Findings / near misses for tiled online-softmax loop nests of the function (see the class comment)."""
    from npufuse.patterns.attention import ADDITIVE_MASK_FLOOR, atom, checked_body, fa_call, mask_rank_lines, mask_shape_lines
    from npufuse.patterns.base import Finding, NearMiss, Risk
    from npufuse.patterns._site import block_source

    out: list = []
    for _block, _i, stmt in scope.statements():
        if not isinstance(stmt, ast.For):
            continue
        res = _tiled_site(module, scope, stmt)
        if res is None:
            continue
        if isinstance(res, str):
            out.append(NearMiss(pattern_id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, res))
            continue
        q, k, v, o, sq, sk, bq, bk, scale, mask, skip = res
        lines: list[str] = []
        checks = [f"{q}.dim() == {k}.dim() == {v}.dim() == 4", f"{q}.shape[:2] == {k}.shape[:2] == {v}.shape[:2]",
                  f"{atom(sq)} == {q}.shape[2]", f"{atom(sk)} == {k}.shape[2]", f"{atom(bq)} > 0", f"{atom(bk)} > 0",
                  f"tuple({o}.shape) == (*{q}.shape[:3], {v}.shape[-1])", f"{v}.shape[-1] <= {k}.shape[-1] <= 768",
                  f"{q}.shape[1] <= 256",
                  # (s46 review) a module attribute may hold a tensor (``nn.Parameter``): the op takes a Python number
                  f"isinstance({scale}, (int, float))"]
        kwargs = [("scale", scale)]
        risks = [Risk("numerics", TILED_RISK)]
        if mask is not None:
            m = "_npufuse_m"
            lines.append(f"{m} = None if {mask} is None else {mask}[:, :, :{atom(sq)}, :{atom(sk)}]  # the rows / keys the tiles read")
            exact = f"bool((({m} == 0) | ({m} <= {ADDITIVE_MASK_FLOOR})).all())"
            rows = f"bool(({m} >= 0).any(-1).all())"
            mask_test = f"{m}.dim() == 4 and {exact} and {rows}"
            if skip:
                causal = (f"bool((({m} <= {ADDITIVE_MASK_FLOOR}) | ~torch.ones({atom(sq)}, {atom(sk)}, dtype=torch.bool, "
                          f"device={m}.device).triu(1)).all())")
                mask_test += f" and {causal}"
                risks.append(Risk("host_sync", "the loop skips key blocks after each query block where a mask is given: exact only "
                                               "where that mask masks every later key (checked at run time with its values and rows: "
                                               "a reduction and a host sync per call)"))
            else:
                risks.append(Risk("host_sync", "the additive mask's values (0 or <= -1000) and rows (each keeps a key) are checked at "
                                               "run time: a reduction and a host sync per call"))
            checks.append(f"({m} is None or ({mask_test}))")
            body = [f"_npufuse_mask = None if {m} is None else {m} < 0  # additive 0 / -inf -> True = masked"]
            body += mask_rank_lines("_npufuse_mask", True, f"{q}.shape[0]")
            body += mask_shape_lines("_npufuse_mask", f"{q}.shape[2]", True, skv=f"{k}.shape[2]")
            kwargs.insert(0, ("atten_mask", "_npufuse_mask"))
        else:
            body = []
        body.append(f"{o}[...] = " + fa_call(f"{q}.contiguous()", f"{k}.contiguous()", f"{v}.contiguous()", f"{q}.shape[1]", "BNSD", kwargs)
                    + f"  # the loop nest: softmax(q kᵀ·scale{' + mask' if mask else ''}) v, written into `{o}` (its dtype)")
        lines = checked_body(lines, body, " and ".join(dict.fromkeys(checks)), block_source(module, [stmt]))
        out.append(Finding(
            pattern=pattern_id, qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params={"scale": scale, "mask_kind": "additive_float" if mask else "none", "q": q, "k": k, "v": v,
                    "layout": "BNSD", "tiled": True, "skips_later_keys": skip},
            fused="\n".join(lines), guard_tensor=q, confidence="medium", variant="tiled_online_softmax" + ("+additive_float" if mask else ""),
            risks=risks, notes=["a tiled online-softmax (flash) loop nest computing softmax attention: replaced by one call; its "
                                "loop bounds, tile sizes, shapes and mask are checked at run time (the original loop runs otherwise)"]))
    return out


def _numeric_scale(scope: Any, node: Any, line: int) -> bool:
    """A Python number: a literal, or a name bound to arithmetic of literals / attributes / ``math`` calls."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float))
    if isinstance(node, ast.Name):
        d = scope.definition(node.id, line)
        if d is None:
            return False
        node = d
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float))
    return all(not (isinstance(n, ast.Call) and not (isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                                                    and n.func.value.id == "math") and not (isinstance(n.func, ast.Name) and n.func.id in ("float", "int")))
               for n in ast.walk(node)) and "torch" not in ast.unparse(node)


def _scores_parts(module: ModuleInfo, s: Any) -> tuple[Any, Any, str] | None:
    """(q tile, kᵀ tile, scale text) of ``(q_i @ k_jᵀ) * scale`` / ``scale * (..)`` / ``(..) / c`` / the bare product."""
    prod = _product(module, s)
    if prod is not None:
        return prod[0], prod[1], "1.0"
    if isinstance(s, ast.BinOp) and isinstance(s.op, ast.Div):
        prod = _product(module, s.left)
        return (prod[0], prod[1], f"1.0 / {atom_text(s.right)}") if prod is not None else None
    muls = _terms(s, ast.Mult)
    if len(muls) == 2:
        for a, b in (muls, muls[::-1]):
            prod = _product(module, a)
            if prod is not None:
                return prod[0], prod[1], ast.unparse(b)
    return None


def atom_text(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if isinstance(node, (ast.Name, ast.Constant, ast.Attribute, ast.Call)) else f"({text})"


def _key_transposed(node: Any) -> Any:
    """K for ``K.transpose(-2, -1)`` / ``K.transpose(2, 3)`` / ``K.mT`` (4-D tiles: the last two axes)."""
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("transpose", "swapaxes") \
            and len(node.args) == 2 and all(isinstance(a, (ast.Constant, ast.UnaryOp)) for a in node.args):
        dims = {ast.unparse(a) for a in node.args}
        if dims in ({"-2", "-1"}, {"2", "3"}):
            return node.func.value
    return None


def _fill(module: ModuleInfo, node: Any, minus_inf: bool) -> bool:
    """``torch.full(.., -inf)`` / ``torch.ones(..) * -inf`` (minus_inf) or ``torch.zeros(..)`` / ``zeros_like``."""
    text = ast.unparse(node) if node is not None else ""
    if minus_inf:
        return "inf" in text and "-" in text and ("full" in text or "ones" in text)
    return isinstance(node, ast.Call) and (module.canonical(node.func) or "") in ("torch.zeros", "torch.zeros_like")


_MASKED = "_npufuse_masked_"  # the scores name after the mask block (a marker no source name has)


def _stored_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}


def _names_in(*texts: str) -> set[str]:
    out: set[str] = set()
    for text in texts:
        out |= {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
    return out


def _read_outside(root: ast.AST, block: ast.AST, names: set[str]) -> bool:
    """Whether a name of ``names`` is read in ``root`` outside ``block``."""
    if not names:
        return False
    inside = {id(n) for n in ast.walk(block)}
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in inside for n in ast.walk(root))


def _carried_name(stmts: list[ast.stmt], seen: set[str], assigned: set[str], allowed: set[str]) -> str | None:
    """The first name of ``assigned`` that ``stmts`` (a loop body, in order) read before they assign it in the same
    iteration (a value carried from the previous iteration), other than ``allowed``; None where there is none.
    ``seen``: the names already bound in this iteration (updated)."""
    def loads(node: ast.AST | None) -> list[str]:
        return [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)] if node is not None else []

    for st in stmts:
        if isinstance(st, (ast.For, ast.If, ast.While)):
            head = loads(st.iter) if isinstance(st, ast.For) else loads(st.test)
            bad = next((n for n in head if n in assigned and n not in seen and n not in allowed), None)
            if bad is not None:
                return bad
            if isinstance(st, ast.For):
                seen |= _stored_names(st.target)
            bad = _carried_name(st.body + st.orelse, seen, assigned, allowed)
            if bad is not None:
                return bad
            continue
        if isinstance(st, ast.Assign):
            reads = loads(st.value) + [x for t in st.targets for x in loads(t)]
        else:
            reads = loads(st)
        bad = next((n for n in reads if n in assigned and n not in seen and n not in allowed), None)
        if bad is not None:
            return bad
        seen |= _stored_names(st)
    return None


def _tiled_site(module: ModuleInfo, scope: Any, outer: ast.For) -> Any:
    """None (not this class), a near-miss reason, or (q, k, v, out, Sq, Skv, Bq, Bk, scale, mask, skip) as text."""
    head = _range0(outer)
    if head is None:
        return None
    inner_loops = [st for st in outer.body if isinstance(st, ast.For)]
    if len(inner_loops) != 1:
        return None
    inner = inner_loops[0]
    ihead = _range0(inner)
    if ihead is None:
        return None
    (ivar, sq, bq), (jvar, sk, bk) = head, ihead
    pos = outer.body.index(inner)
    pre, post = outer.body[:pos], outer.body[pos + 1:]
    outer_env: dict[str, ast.expr] = {}
    for st in pre:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            outer_env[st.targets[0].id] = _expanded(st.value, outer_env)
        elif not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            return None
    # the inner body, in order: plain assignments, a key-block skip, the mask added under `if mask is not None`
    env: dict[str, ast.expr] = {}
    unmasked_scores: ast.expr | None = None
    skip_test: ast.expr | None = None
    mask_add: tuple[str, str, ast.expr] | None = None  # (mask name, scores name, the slice added)
    for st in inner.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            env[st.targets[0].id] = _expanded(st.value, env)
        elif isinstance(st, ast.If) and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Continue):
            if skip_test is not None:
                return None
            skip_test = st.test
        elif isinstance(st, ast.If) and not st.orelse and isinstance(st.test, ast.Compare) and isinstance(st.test.left, ast.Name) \
                and len(st.test.ops) == 1 and isinstance(st.test.ops[0], ast.IsNot) and isinstance(st.test.comparators[0], ast.Constant) \
                and st.test.comparators[0].value is None and mask_add is None:
            local = dict(env)
            for b in st.body:
                if not (isinstance(b, ast.Assign) and len(b.targets) == 1 and isinstance(b.targets[0], ast.Name)):
                    return None
                local[b.targets[0].id] = _expanded(b.value, local)
            last = st.body[-1].targets[0].id  # type: ignore[attr-defined]
            adds = _terms(local[last], ast.Add)
            if last not in env or len(adds) != 2:
                return None
            prev = [a for a in adds if _same(a, env[last])]
            added = [a for a in adds if not _same(a, env[last])]
            if len(prev) != 1 or len(added) != 1:
                return None
            # (s46 review) the block's other names live in the block only; after it the scores name holds the
            # MASKED scores, told apart from the unmasked expression another name (``raw = s`` before the block)
            # may still hold: reading that alias in the exponent left the mask out of the loop's softmax
            changed = {n for n in env if n != last and local[n] is not env[n]}
            if changed or _read_outside(outer, st, {b.targets[0].id for b in st.body} - {last}):
                return None
            mask_add = (st.test.left.id, last, added[0])
            unmasked_scores = env[last]
            env[last] = ast.Name(id=_MASKED + last, ctx=ast.Load())
        elif not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            return None
    # the write after the inner loop: out[:, :, i:i_end] = acc / l
    if len(post) != 1 or not isinstance(post[0], ast.Assign) or len(post[0].targets) != 1:
        return None
    target, final = post[0].targets[0], post[0].value
    if not (isinstance(final, ast.BinOp) and isinstance(final.op, ast.Div) and isinstance(final.left, ast.Name)
            and isinstance(final.right, ast.Name)):
        return None
    acc, l_name = final.left.id, final.right.id
    end_q, end_k = _tile_end(module, ivar, bq, sq), _tile_end(module, jvar, bk, sk)
    out_name = _tile(_expanded(target, outer_env), ivar, end_q)
    if out_name is None or acc not in env or l_name not in env:
        return None
    # acc = alpha * acc + exp(s - m_new) @ v_j
    acc_v = env[acc]
    parts = _terms(acc_v, ast.Add)
    if len(parts) != 2:
        return None
    pv = next((p for p in parts if _product(module, p) is not None), None)
    if pv is None:
        return None
    p_node, v_tile = _product(module, pv)  # type: ignore[misc]
    diff = _exp_arg(module, p_node)
    if not (isinstance(diff, ast.BinOp) and isinstance(diff.op, ast.Sub)):
        return None
    s_node, m_new = diff.left, diff.right
    pair = _pair(module, m_new, "torch.maximum") or _pair(module, m_new, "torch.max")
    if pair is None:
        return None
    old_m = next((x for x in pair if isinstance(x, ast.Name)), None)
    rowmax = next((x for x in pair if x is not old_m), None)
    if old_m is None or not _same(_row_max_of(module, rowmax), s_node):
        return None
    # alpha = exp(m - m_new): the factor that rescales the running sum and the accumulator
    alpha_in = lambda node, old: any(  # noqa: E731
        len(_terms(a, ast.Mult)) == 2 and any(isinstance(x, ast.Name) and x.id == old for x in _terms(a, ast.Mult))
        and any(_exp_arg(module, x) is not None and isinstance(_exp_arg(module, x), ast.BinOp)
                and isinstance(_exp_arg(module, x).op, ast.Sub) and isinstance(_exp_arg(module, x).left, ast.Name)
                and _exp_arg(module, x).left.id == old_m.id and _same(_exp_arg(module, x).right, m_new) for x in _terms(a, ast.Mult))
        for a in _terms(node, ast.Add))
    if not alpha_in(acc_v, acc):
        return None
    # l = alpha * l + rowsum(exp(s - m_new)); m = m_new
    l_v = env[l_name]
    l_parts = _terms(l_v, ast.Add)
    if len(l_parts) != 2 or not alpha_in(l_v, l_name) or not any(_sum_last(module, x, p_node) for x in l_parts):
        return None
    if old_m.id not in env or not _same(env[old_m.id], m_new):
        return None
    # the tiles: s = (q[:, :, i:i_end] @ k[:, :, j:j_end]ᵀ) * scale, v[:, :, j:j_end]
    if mask_add is not None:
        # (s46 review) with a mask, the exponent and the row max must read the masked scores (the name the block
        # rebinds), whose unmasked value is the product read here
        if not (isinstance(s_node, ast.Name) and s_node.id == _MASKED + mask_add[1]) or unmasked_scores is None:
            return None
        s_node = unmasked_scores
    sp = _scores_parts(module, s_node)
    if sp is None:
        return None
    q_tile, kt, scale = sp
    k_tile = _key_transposed(kt)
    q_name = _tile(_expanded(q_tile, outer_env), ivar, end_q)
    k_name = _tile(k_tile, jvar, end_k) if k_tile is not None else None
    v_name = _tile(v_tile, jvar, end_k)
    if q_name is None or k_name is None or v_name is None:
        return None
    scale_node = ast.parse(scale, mode="eval").body
    if not _numeric_scale(scope, scale_node if not isinstance(scale_node, ast.BinOp) else ast.Constant(1.0), outer.lineno) \
            and not (isinstance(scale_node, ast.BinOp) and _numeric_scale(scope, scale_node.right, outer.lineno)):
        return None
    # the running statistics start at -inf / 0 for each query tile
    for name, minus_inf in ((old_m.id, True), (l_name, False), (acc, False)):
        if not _fill(module, outer_env.get(name), minus_inf):
            return None
    mask_name = None
    if mask_add is not None:
        m_name, s_name, added = mask_add
        sl = added
        ok = isinstance(sl, ast.Subscript) and isinstance(sl.value, ast.Name) and sl.value.id == m_name \
            and isinstance(sl.slice, ast.Tuple) and len(sl.slice.elts) == 4
        if ok:
            e = sl.slice.elts
            ok = all(isinstance(x, ast.Slice) and x.lower is None and x.upper is None for x in e[:2]) \
                and isinstance(e[2], ast.Slice) and isinstance(e[2].lower, ast.Name) and e[2].lower.id == ivar \
                and end_q(_expanded(e[2].upper, outer_env) if e[2].upper is not None else None) \
                and isinstance(e[3], ast.Slice) and isinstance(e[3].lower, ast.Name) and e[3].lower.id == jvar and end_k(e[3].upper)
        if not ok:
            return None
        mask_name = m_name
    skip = False
    if skip_test is not None:
        flag_ok = isinstance(skip_test, ast.BoolOp) and isinstance(skip_test.op, ast.And) and len(skip_test.values) == 2 \
            and mask_name is not None and ast.unparse(skip_test.values[0]) == f"{mask_name} is not None"
        cmp = skip_test.values[1] if flag_ok else skip_test  # type: ignore[attr-defined]
        # (s46 review) ``j > i_end`` skips fewer of the later blocks (the one starting at i_end is computed, masked):
        # exact under the same check; either side order. Another skip was named windowed, which that one is not
        later = False
        if isinstance(cmp, ast.Compare) and len(cmp.ops) == 1:
            j_side, end_side, op = cmp.left, cmp.comparators[0], cmp.ops[0]
            if isinstance(op, (ast.LtE, ast.Lt)):
                j_side, end_side = end_side, j_side
            later = isinstance(op, (ast.GtE, ast.Gt, ast.LtE, ast.Lt)) and isinstance(j_side, ast.Name) \
                and j_side.id == jvar and end_q(_expanded(end_side, outer_env))
        if not later:
            return (f"the loop skips key blocks under `{ast.unparse(skip_test)[:60]}`, not the blocks after the query block: "
                    "a windowed / block-sparse attention, which no npu_fusion_attention mask npufuse builds reproduces")
        if not flag_ok:
            return (f"the loop skips the key blocks after each query block (`{ast.unparse(skip_test)[:60]}`) with no mask masking "
                    "them inside the diagonal block: block-causal attention, which neither causal mode of npu_fusion_attention computes")
        skip = True
    # (s46 review) the loops' equations are read once per iteration: a name the inner body reads before it assigns
    # it (``xv = xv * 1.5`` at its end) carries a value from the previous key block, which only the running max, sum
    # and accumulator may; nothing may carry from one query block to the next
    nest_assigned = _stored_names(outer)
    carried = _carried_name(outer.body, {ivar}, nest_assigned, set()) \
        or _carried_name(inner.body, {jvar}, _stored_names(inner) - {jvar}, {old_m.id, l_name, acc})
    if carried is not None:
        return None
    # the fused call reads the operands, bounds and scale before the loop: none may be a name the loops set
    if _names_in(ast.unparse(sk), ast.unparse(bk)) & nest_assigned:
        read = sorted(_names_in(ast.unparse(sk), ast.unparse(bk)) & nest_assigned)[0]
        return (f"the key loop's range reads `{read}`, which the query loop sets: each query block reads its own range of "
                "keys (block-causal / windowed by the loop bounds), not every key of k")
    if ({q_name, k_name, v_name, out_name, mask_name} | _names_in(ast.unparse(sq), ast.unparse(bq), scale)) & nest_assigned:
        return None
    # nothing computed in the loops is read after them (the fused branch does not bind the loops' names)
    assigned = set(env) | set(outer_env) | {ivar, jvar}
    end = outer.end_lineno or outer.lineno
    if any(scope.uses_after(name, end) for name in assigned):
        read = next(name for name in assigned if scope.uses_after(name, end))
        return (f"`{read}`, computed in the tiled loop, is read after it (the running max / sum: a log-sum-exp): the fused "
                "call's softmax statistics are not those tensors")
    return q_name, k_name, v_name, out_name, ast.unparse(sq), ast.unparse(sk), ast.unparse(bq), ast.unparse(bk), scale, mask_name, skip
