"""Attention constructs of the s39 pass (HO15 development data).

* Scores masked by a write through a boolean index (``scores[mask] = float('-inf')``, ``attn[~keep] =
  torch.finfo(dtype).min``: Quest's evaluation attention, many research repositories). For a bool index of the
  tensor's rank, ``x[m] = v`` is ``x = x.masked_fill(m, v)`` (the write touches exactly the True positions; a bool
  index of the same rank but another shape raises ``IndexError`` in the original), so the mask goes to the fused op
  with masked_fill's polarity (True = masked out, atten_mask's own). Whether the index is a bool tensor of the
  scores' rank is checked at run time (:func:`index_mask_checks`); the original code runs otherwise (an integer
  index tensor selects rows, a lower-rank bool index whole rows). An index that is visibly not a mask (a slice, an
  integer, a tuple of indices) is described in the near miss (:func:`index_write_parts`).
* A mask computed from a matrix product that is not the scores' own (Quest selects pages by an upper-bound estimate
  ``(q * sign) @ chunk_max_keyᵀ``, then masks the scores with it) is still refused, but the reason says so instead of
  "computed from the attention scores themselves" (:func:`heavy_input_reason`).
"""

from __future__ import annotations

import ast
from typing import Any, Union

# index expressions whose value may be a bool tensor (checked at run time): a name, ``~m``, ``m == 0``, ``m & n``,
# ``m.logical_not()``, ``m.bool()``, an attribute
_MASK_LIKE = (ast.Name, ast.Attribute, ast.UnaryOp, ast.Compare, ast.BinOp, ast.Call)


def index_write_parts(stmt: ast.stmt, target: ast.Subscript) -> Union[tuple[ast.expr, ast.expr], str, None]:
    """(index, value) of ``name[index] = value`` where the index may be a bool mask (a name, ``~m``, a comparison,
    a call); a description of the index where it cannot be one (``"a slice"``, ``"an integer"``, ``"a tuple of
    indices"``); None for any other write (an augmented assignment, several targets, a nested subscript)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.targets[0] is target
            and isinstance(target.value, ast.Name)):
        return None
    index = target.slice
    if isinstance(index, ast.Slice):
        return "a slice"
    if isinstance(index, ast.Tuple):
        return "a tuple of indices"
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) and isinstance(index.operand, ast.Constant):
        index = index.operand  # ``x[-1] = ...``
    if isinstance(index, ast.Constant):
        return "an integer" if type(index.value) is int else "a constant"
    if isinstance(index, (ast.List, ast.ListComp)):
        return "a list of indices"
    if isinstance(index, _MASK_LIKE):
        return index, stmt.value
    return None


def index_mask_checks(r: Any, masks: list, rank: int) -> list[str]:
    """Run-time conditions under which each boolean-index write of the scores equals its masked_fill: the index is a
    bool tensor of the scores' rank. Read on the tensor under a ``~`` (its dtype and rank are the index's)."""
    from npufuse.patterns.attention import atom, check_under_term_condition, deref

    checks: list[str] = []
    for m in masks:
        if not getattr(m, "index_write", False):
            continue
        node = deref(m.node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            node = node.operand
        t = atom(r.text(node))
        checks.append(check_under_term_condition(r, m, f"{t}.dtype == torch.bool and {t}.dim() == {rank}"))
    return checks


INDEX_WRITE_RISK = ("the scores are masked by a write through an index (`s[m] = v`): read as `s.masked_fill(m, v)`, which it is "
                    "where m is a bool tensor of the scores' rank (checked at run time; an integer or lower-rank index runs the "
                    "original code)")


def heavy_input_reason(value: Any, allowed: set[int], qk: Any, text: str) -> str:
    """Why an input of the fused call computed from a matrix product is refused, stated truly: from the scores where
    one of its products is the scores' own (``qk``) or computed from it (a top-k of the scores), or where the scores'
    product is not known; from another product otherwise (Quest's page selection ``(q * sign) @ chunk_max_keyᵀ``)."""
    from npufuse.patterns.attention import _s32_products, walk_values

    products = [p for p in _s32_products(value) if id(p) not in allowed]
    if qk is None or any(p is qk or any(n is qk for n in walk_values(p)) for p in products):
        return f"an input of the fused call (mask / scale) is computed from the attention scores themselves (`{text}`)"
    return (f"an input of the fused call (mask / scale) is computed from a matrix product other than the scores (`{text}`): "
            "npufuse does not compute such an input on the fused branch")


# --- SDPA called through ``functools.partial`` ------------------------------------------------------------------
# ``fn = partial(F.scaled_dot_product_attention, dropout_p=0.0, is_causal=True)`` then ``fn(q, k, v)`` (a local), or
# ``self.attn_fn = partial(F.scaled_dot_product_attention, scale=0.125)`` in ``__init__`` then ``self.attn_fn(q, k, v)``:
# the call is SDPA with the partial's keywords merged in. Only the flags SDPA reads after q / k / v / mask are taken
# from the partial, and only where their value is the one the call would see: a constant, or (a local partial) names
# nothing rebinds between the partial and the call.
_PARTIAL_KEYWORDS = frozenset({"dropout_p", "is_causal", "scale", "enable_gqa"})


def _partial_of_sdpa(module: Any, value: Any, sdpa_names: Any) -> Any:
    """``value`` when it is ``functools.partial(<SDPA>, <keywords>)``, else None."""
    if not (isinstance(value, ast.Call) and module.canonical(value.func) in ("functools.partial", "partial") and value.args):
        return None
    return value if module.canonical(value.args[0]) in sdpa_names else None


def _self_partials(module: Any, class_name: Any, sdpa_names: Any) -> dict:
    """``attr -> partial call`` for the ``self.<attr> = partial(SDPA, ..)`` of the class's ``__init__`` that are the
    attribute's only assignment in the class (cached per class)."""
    cache = module.__dict__.setdefault("_npufuse_s39_self_partials", {})
    if class_name in cache:
        return cache[class_name]
    out: dict = {}
    cls = module.classes.get(class_name) if class_name else None
    if cls is not None:
        stores: dict = {}
        for n in ast.walk(cls):
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        stores.setdefault(t.attr, []).append(n)
        for attr, sts in stores.items():
            if len(sts) == 1 and isinstance(sts[0], ast.Assign):
                value = sts[0].value
                p = _partial_of_sdpa(module, value, sdpa_names)
                if p is not None:
                    out[attr] = p
                elif isinstance(value, ast.IfExp) and any(_partial_of_sdpa(module, arm, sdpa_names) is not None for arm in (value.body, value.orelse)) \
                        and all(_partial_of_sdpa(module, arm, sdpa_names) is not None or module.canonical(arm) in sdpa_names for arm in (value.body, value.orelse)):
                    out[attr] = ast.unparse(value)[:80]  # (VisionLLaMA: a partial or SDPA itself, chosen by a constructor argument)
    cache[class_name] = out
    return out


def sdpa_partial_call(module: Any, scope: Any, call: ast.Call, sdpa_names: Any) -> Union[ast.Call, str, None]:
    """The SDPA call ``call`` makes through a ``functools.partial`` (the partial's keywords merged in, located where
    ``call`` is), a reason where the partial binds something npufuse cannot carry to the call, or None where the
    callee is no such partial."""
    f = call.func
    local = isinstance(f, ast.Name)
    if local:
        found = scope.assignments.get(f.id, [])
        if len(found) != 1 or found[0][0].lineno >= call.lineno:
            return None
        part_stmt, value = found[0]
        part = _partial_of_sdpa(module, value, sdpa_names)
    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        part = _self_partials(module, scope.class_name, sdpa_names).get(f.attr)
        part_stmt = None
    else:
        return None
    if part is None:
        return None
    if isinstance(part, str):
        return (f"SDPA is called through `self.{f.attr}`, set in `__init__` to `{part}`: which one the call gets, and the "  # type: ignore[union-attr]
                "flags the partial binds, are decided by constructor arguments the call site does not hold")
    text = ast.unparse(part)[:80]
    if len(part.args) > 1 or any(kw.arg not in _PARTIAL_KEYWORDS for kw in part.keywords):
        return (f"SDPA is called through `{text}`, which binds more than SDPA's flags (dropout_p, is_causal, scale, "
                "enable_gqa): npufuse does not carry bound tensors to the call")
    for kw in part.keywords:
        if isinstance(kw.value, ast.Constant):
            continue
        names = {n.id for n in ast.walk(kw.value) if isinstance(n, ast.Name)}
        rebound = any(part_stmt.lineno < st.lineno <= call.lineno for n in names for st, _v in scope.assignments.get(n, [])) if local else True
        if not local or rebound or any(isinstance(n, ast.Call) for n in ast.walk(kw.value)) or not names <= set(scope.args) | set(scope.assignments):
            where = "in `__init__`" if not local else "before the call"
            return (f"SDPA is called through `{text}`, whose `{kw.arg}` is bound {where} from a value the call site does not "
                    "hold: npufuse does not carry it to the fused call")
    synth = ast.Call(func=part.args[0], args=list(call.args), keywords=list(part.keywords) + list(call.keywords))
    ast.copy_location(synth, call)
    synth.end_lineno, synth.end_col_offset = call.end_lineno, call.end_col_offset
    if not local:
        # a subclass (or anything holding the module) may set the attribute to something else: the fused call runs
        # where it is still this partial of SDPA with these constant flags
        held = ast.unparse(f)
        flags = ", ".join(f"{kw.arg!r}: {ast.unparse(kw.value)}" for kw in part.keywords)
        synth._npufuse_guard = (f"getattr({held}, 'func', None) is {ast.unparse(part.args[0])} and not {held}.args "  # type: ignore[attr-defined]
                                f"and {held}.keywords == {{{flags}}}")
    return synth


def sdpa_partial_attributes(module: Any, sdpa_names: Any) -> tuple:
    """The attribute names ``self.<attr>`` assigned a ``functools.partial`` of SDPA anywhere in the module (directly or
    in an arm of a conditional expression), cached per module."""
    cached = module.__dict__.get("_npufuse_s39_partial_attrs")
    if cached is None:
        found: list = []
        for n in ast.walk(module.tree):
            if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Call, ast.IfExp)):
                arms = [n.value.body, n.value.orelse] if isinstance(n.value, ast.IfExp) else [n.value]
                if any(_partial_of_sdpa(module, arm, sdpa_names) is not None for arm in arms):
                    found += [t.attr for t in n.targets if isinstance(t, ast.Attribute) and t.attr not in found]
        cached = module.__dict__["_npufuse_s39_partial_attrs"] = tuple(found)
    return cached
