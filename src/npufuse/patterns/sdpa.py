"""sdpa: a call of ``F.scaled_dot_product_attention`` -> ``torch_npu.npu_fusion_attention``.

torch_npu's own SDPA reaches the fused FlashAttention kernel only with a boolean mask (or
``is_causal`` without one) and when grads are required (transformers#41143); otherwise it runs
the decomposed path. Calling npu_fusion_attention directly always takes the fused kernel.

The call is replaced in place inside its statement (``x = <fa>.transpose(1, 2)`` keeps
the rest), with these conversions (spec §5.1, §13):

* **mask**: SDPA's bool mask is True = *keep*, the op's is True = *masked* -> ``~mask``; an
  additive float mask -> ``mask < 0`` (exact for 0/−inf masks; a risk). When the mask's dtype
  cannot be known statically the fused code branches on ``mask.dtype == torch.bool`` at run
  time (metadata only, no host sync). A float *bias* passed as ``attn_mask`` (ALiBi / T5
  position bias) is a near miss. ``[B,1,1,Skv]`` / ``[B,N,1,Skv]`` masks are expanded over the
  query rows (the op does not broadcast them, diffusers#14380).
* **is_causal**: SDPA's causal is top-left aligned (``tril(ones(L, S))``) -> ``sparse_mode=2``
  with the cached 2048×2048 mask; a run-time ``is_causal`` expression selects it at run time.
  ``attn_mask`` together with ``is_causal=True`` is a near miss (backends disagree: the
  documented reference rejects it, the CPU kernel intersects them).
* **scale**: SDPA's default ``1/sqrt(D)`` is written out (the op's default is 1.0); a scale
  that may be None (``scale=scaling``) keeps SDPA's fallback.
* **dropout**: ``keep_prob = 1 - dropout_p`` with the caller's own expression
  (``self.dropout if self.training else 0.0``).
* **GQA**: ``enable_gqa=True`` or ``repeat_kv`` right before the call (dropped: the op groups
  query heads onto kv heads natively).
"""

from __future__ import annotations

import ast
from typing import Any, Iterable

from npufuse.patterns._sdpa_s46audit import guard_operand_name
from npufuse.patterns.attention import (
    VALUE_CHECK_RISK,
    additive_mask_exact,
    bias_reason,
    graded_evidence,
    atom,
    checked_body,
    attention_value,
    causal_cache_lines,
    fa_call,
    head_dim_constant,
    head_dim_problem,
    is_simple,
    mask_rank_lines,
    mask_shape_lines,
    repeat_info,
    repeated_tensor,
    static_rank,
)
from npufuse.patterns import _sdpa_s51n
from npufuse.patterns import _attention_s36, _attention_s39, _attention_s40, _attention_s42, _attention_s43, _attention_s45, _attention_s46, _mask_rows
from npufuse.patterns import _sdpa_s50c
from npufuse.patterns import _attention_s51b
from npufuse.patterns._site import block_source
from npufuse.patterns import _sdpa_s50m
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, fast_walk, keyword, replace_segments, scope_text, segment, text_holds_any

SDPA_NAMES = {
    "torch.nn.functional.scaled_dot_product_attention",
    "torch._C._nn.scaled_dot_product_attention",
}
_BOOL_CALLS = {"torch.tril", "torch.triu", "torch.logical_not", "torch.logical_and", "torch.logical_or", "torch.eq", "torch.ne", "torch.isin"}


_EXITS = (ast.Raise, ast.Return, ast.Continue, ast.Break)


def unconditional_exit_before(scope: Scope, stmt: ast.stmt) -> ast.stmt | None:
    """A ``raise`` / ``return`` / ``continue`` / ``break`` that precedes ``stmt`` in its own block or in a block
    enclosing it (a ``with`` / ``try`` body / loop body holding it): control never reaches ``stmt``.
    An exception handler's body is reached by the raise, so the walk stops at a handler."""
    listing, owners = scope.listing()
    where = {id(st): (blk, j, owner) for (blk, j, st), owner in zip(listing, owners)}
    cur: ast.stmt | None = stmt
    while cur is not None and id(cur) in where:
        blk, j, owner = where[id(cur)]
        exit_stmt = next((b for b in blk[:j] if isinstance(b, _EXITS)), None)
        if exit_stmt is not None:
            return exit_stmt
        if owner is None or isinstance(owner, ast.Try) and blk is not owner.body and blk is not getattr(owner, "orelse", None):
            return None  # a handler / finally body runs however the try body ends
        cur = owner  # reached only if its owner is
    return None


def _resolve(scope: Scope, node: ast.expr) -> ast.expr:
    for _ in range(12):
        if not isinstance(node, ast.Name):
            return node
        value = scope.definition(node.id, getattr(node, "lineno", None))
        if value is None:
            return node
        node = value
    return node


def _changed_in_place(scope: Scope, node: ast.expr) -> bool:
    """Whether a name ``node`` reads (through the names it is bound to, as :func:`_resolve` follows them) is changed in
    place in the scope before ``node``: an element store (``t[:] = v``) or an in-place method (``t.add_(v)``). Read
    only for a masked_fill's base (rare): one walk of the scope."""
    names: set[str] = set()
    chain: set[int] = set()  # the name reads followed here (the fill's receiver, each definition's own read)
    use = getattr(node, "lineno", 0)
    for _ in range(12):
        if not isinstance(node, ast.Name) or node.id in names:
            break
        names.add(node.id)
        chain.add(id(node))
        value = scope.definition(node.id, getattr(node, "lineno", None))
        if value is None:
            break
        node = value
    line = getattr(node, "lineno", 0)
    if not names:
        return False
    for n in fast_walk(scope.node):
        target = n.value if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) else (
            n.func.value if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_")
            and not n.func.attr.startswith("_") else None)
        if target is None and isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in chain:
            # (s45 review) any other read between: a helper that adds into it (``add_into(bias, alibi)``), an alias
            # changed in place (``b = bias; b.add_(..)``), ``torch.add(bias, x, out=bias)``, ``bias += x``
            target = n
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value
        if isinstance(target, ast.Name) and target.id in names and line <= n.lineno <= use:
            return True
    return False


# Tensor methods whose result is a tensor whenever the call succeeds (the original statement would
# fail on None before the mask is read): a mask built with them is never None.
_TENSOR_METHODS = frozenset((
    "to", "float", "half", "bfloat16", "bool", "long", "int", "type", "type_as", "masked_fill", "logical_not",
    "logical_and", "logical_or", "unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "repeat",
    "repeat_interleave", "contiguous", "transpose", "permute", "flatten", "clone", "detach", "eq", "ne", "lt",
    "le", "gt", "ge", "tril", "triu", "new_zeros", "new_ones", "new_full", "masked_fill_", "fill_", "__invert__",
))


#: SDPA keywords whose value changes the result: a ``**`` splat that may carry one of them cannot be
#: dropped from the fused call (``enable_gqa`` alone can: npu_fusion_attention groups heads itself)
_SPLAT_HARMLESS_KEYS = frozenset({"enable_gqa"})


def _dict_keys(node: ast.expr) -> set[str] | None:
    """The string keys of ``{...}`` / ``dict(k=...)`` (a conditional of two such: both arms), else None."""
    if isinstance(node, ast.IfExp):
        a, b = _dict_keys(node.body), _dict_keys(node.orelse)
        return None if a is None or b is None else a | b
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return None  # a ``**other`` inside the literal or a computed key
        return {k.value for k in node.keys}  # type: ignore[union-attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        if any(kw.arg is None for kw in node.keywords):
            return None
        return {kw.arg for kw in node.keywords if kw.arg is not None}
    return None


# builtins that only read a dict handed to them (a helper handed the dict may add keys)
_READS_ONLY = frozenset(("len", "print", "isinstance", "bool", "repr", "str", "dict", "list", "sorted"))


def splat_keys(scope: Scope, node: ast.expr, line: int) -> set[str] | None:
    """The keys a ``**node`` argument of the call on ``line`` can pass, or None where they are not
    visible here (a parameter, a call's result). A local name counts every dict it is bound to before
    the call plus its ``name["key"] = ...`` and ``name.update(key=...)`` writes (audit40b: FastVideo's
    SDPA backend builds ``attn_kwargs = {"attn_mask": ..., "is_causal": ..., "scale": ...}``)."""
    direct = _dict_keys(node)
    if direct is not None or not isinstance(node, ast.Name):
        return direct
    name = node.id
    defs = [v for st, v in scope.assignments.get(name, []) if st.lineno < line]
    if not defs:
        return None
    keys: set[str] = set()
    for v in defs:
        got = _dict_keys(v)
        if got is None:
            return None
        keys |= got
    for n in fast_walk(scope.node):
        if getattr(n, "lineno", line) >= line:
            continue
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            if isinstance(n.value, ast.Name) and n.value.id == name:
                return None  # review40: an alias (``extra = kw``) whose writes are not followed
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                    if not (isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                        return None
                    keys.add(t.slice.value)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
              and n.func.value.id == name and n.func.attr in ("update", "setdefault", "__setitem__")):
            if n.func.attr != "update" or n.args or any(kw.arg is None for kw in n.keywords):
                return None
            keys |= {kw.arg for kw in n.keywords if kw.arg is not None}
        elif isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _READS_ONLY) \
                and any(isinstance(a, ast.Name) and a.id == name for a in
                                             (*(x.value if isinstance(x, ast.Starred) else x for x in n.args), *(k.value for k in n.keywords))):
            return None  # review40: handed to a call (``fill(kw, mask)``), which may add keys to it
        elif isinstance(n, ast.NamedExpr) and isinstance(n.value, ast.Name) and n.value.id == name:
            return None  # review40: an alias (``(extra := kw)``) whose writes are not followed
    return keys


def operand_rank(scope: Scope, node: ast.expr, line: int) -> int | None:
    """The rank of an SDPA operand where the code states it (:func:`static_rank`), also through the
    ``q, k, v = map(lambda t: t....reshape(b * h, n, d), (q, k, v))`` idiom (DiffBIR, LDM forks): the
    lambda's body states the rank of each element. None when it is not evident."""
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Call) and isinstance(value.value.func, ast.Name) \
                and value.value.func.id == "map" and len(value.value.args) == 2 and isinstance(value.value.args[0], ast.Lambda):
            return static_rank(scope, value.value.args[0].body, getattr(value, "lineno", line))
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Lambda):
            # s40: dataflow records a mapped element as ``(lambda t: body)(element)`` (dataflow.applied_lambda)
            return static_rank(scope, value.func.body, getattr(value, "lineno", line))
    return static_rank(scope, node, line)


def _tensor_valued(module: ModuleInfo, value: ast.expr) -> bool:
    """``value`` is a tensor whenever it evaluates: an operator, a subscript (not of a tuple), a
    torch function or a tensor method. A call of anything else (the repository's own helpers) may
    return None."""
    if isinstance(value, (ast.Compare, ast.UnaryOp, ast.BinOp)):
        return True
    if isinstance(value, ast.Subscript):
        return not isinstance(value.value, ast.Tuple)
    if isinstance(value, ast.Call):
        name = module.canonical(value.func) or ""
        if name.startswith("torch."):
            return True
        return isinstance(value.func, ast.Attribute) and value.func.attr in _TENSOR_METHODS
    return False


class SdpaPattern(Pattern):
    id = "sdpa"
    api = "torch_npu.npu_fusion_attention"
    title = "F.scaled_dot_product_attention as one npu_fusion_attention"
    training_ok = True
    bound = "memory"
    # detect's first test, made once by the scan
    SCOPE_WORDS = ("scaled_dot_product_attention",)

    @staticmethod
    def held_call_words(module: ModuleInfo) -> tuple[str, ...]:
        """s39: the attributes the module sets to ``functools.partial(SDPA, ..)`` (engine.gate_words: the scope calling
        ``self.<attr>(..)`` names no SDPA word)."""
        if not text_holds_any(module, sdpa_call_words(module)):
            return ()
        held = _s40_sdpa_held_attributes(module)
        if not text_holds_any(module, ("partial(",)):
            return held
        return tuple(dict.fromkeys((*_attention_s39.sdpa_partial_attributes(module, SDPA_NAMES), *held)))

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        words = sdpa_call_words(module)
        text = scope_text(module, scope)
        # s39: SDPA through ``functools.partial`` (a local, or ``self.<attr>`` set in __init__): the call site names neither
        partials = text_holds_any(module, ("partial(",)) and text_holds_any(module, words)
        # s40: SDPA held by an attribute or name bound to one of several callables (anemoi: ``self.attention =
        # attn_func``, imported from flash_attn or, under ``except ImportError``, as SDPA's alias)
        held = _s40_sdpa_held_attributes(module) if text_holds_any(module, words) else ()
        if not partials and not any(w in text for w in words) and not any(f"self.{a}(" in text for a in held):
            return
        for block, i, stmt in scope.statements():
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return, ast.Expr)):
                continue
            seg = segment(module, stmt)
            direct = any(w in seg for w in words)
            through_held = bool(held) and any(f"self.{a}(" in seg for a in held)
            if not direct and not partials and not through_held:
                continue
            for node in fast_walk(stmt):
                if not isinstance(node, ast.Call):
                    continue
                chosen = _s40_chosen_sdpa_call(module, scope, node, held) if direct or through_held else None
                if isinstance(chosen, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, chosen)
                elif chosen is not None:
                    res = self._site(module, scope, block, i, stmt, chosen)
                    if res is not None:
                        yield res
                elif direct and (module.call_name(node) in SDPA_NAMES or _sdpa_s50m.alias_call(module, scope, node, SDPA_NAMES)):  # s50
                    res = self._site(module, scope, block, i, stmt, node)
                    if res is not None:
                        yield res
                elif partials and isinstance(node.func, (ast.Name, ast.Attribute)):
                    through = _attention_s39.sdpa_partial_call(module, scope, node, SDPA_NAMES)
                    if isinstance(through, str):
                        yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, through)
                    elif through is not None:
                        res = self._site(module, scope, block, i, stmt, through)
                        if res is not None:
                            yield res

    # ---------------------------------------------------------------------------------------------
    def _site(self, module: ModuleInfo, scope: Scope, block: list[ast.stmt], i: int, stmt: ast.stmt, call: ast.Call) -> Result:
        line, end = stmt.lineno, stmt.end_lineno or stmt.lineno

        def miss(reason: str) -> NearMiss:
            return NearMiss(self.id, scope.qualname, line, end, reason)

        exit_stmt = unconditional_exit_before(scope, stmt)
        if exit_stmt is not None:
            # ``try: raise Exception(); with ...: out = F.sdpa(...)``: the call never runs, a rewrite changes nothing
            return miss(f"the call is unreachable: `{' '.join(segment(module, exit_stmt).split())[:60]}` (line {exit_stmt.lineno}) "
                        "always leaves its block before it, so the SDPA call never runs")

        reference = _attention_s43.closeness_reference(module, scope, stmt)
        if reference is not None:
            return miss(reference)  # s43: the reference of a kernel test
        if any(isinstance(a, ast.Starred) for a in call.args):
            return miss("arguments passed with `*`: which one is the mask / causal flag is not visible")
        q, k, v = (keyword(call, n, p) for n, p in (("query", 0), ("key", 1), ("value", 2)))
        if q is None or k is None or v is None:
            return miss("query/key/value not all visible in the call")
        mask = keyword(call, "attn_mask", 3)
        dropout = keyword(call, "dropout_p", 4)
        causal = keyword(call, "is_causal", 5)
        scale = keyword(call, "scale")
        gqa = keyword(call, "enable_gqa")
        kwargs_passed = [kw for kw in call.keywords if kw.arg is None]
        risks: list[Risk] = []
        notes: list[str] = []
        confidence = "high"
        for kw in kwargs_passed:
            # audit40b: a splat the fused call does not receive must carry nothing that changes the result
            splat = ast.unparse(kw.value)
            keys = splat_keys(scope, kw.value, line)
            if keys is None:
                return miss(f"keywords passed through `**{splat}` are not visible here: it may set attn_mask / is_causal / "
                            "scale / dropout_p, which the fused call would not receive")
            if keys - _SPLAT_HARMLESS_KEYS:
                return miss(f"`**{splat}` passes {', '.join(sorted(keys - _SPLAT_HARMLESS_KEYS))} to SDPA: the fused call "
                            "would not receive them (they are not arguments the rewrite can read)")
        if kwargs_passed:
            confidence = "medium"
            risks.append(Risk("other", f"`**{ast.unparse(kwargs_passed[0].value)}` is not forwarded to the fused call: only enable_gqa is meaningful there and npu_fusion_attention does GQA natively; check it carries nothing else"))
        if mask is not None and const_value(mask) is None and isinstance(mask, ast.Constant):
            mask = None
        causal_v = const_value(causal) if causal is not None else False
        mask_none_guard: str | None = None
        if mask is not None and causal_v is True and _attention_s42.mask_may_be_none(scope, mask, line):
            # s40 (HO16a Zenith): ``attn_mask=attention_mask`` (an optional parameter) with ``is_causal=True``: where the mask
            # is None (the generation paths) the call is a plain causal SDPA; with a mask the original runs
            mask_none_guard, mask = f"{mask.id} is None", None  # type: ignore[attr-defined]
            risks.append(Risk("other", f"`attn_mask={mask_none_guard[:-8]}` together with `is_causal=True`: the fused (causal) call runs "
                                       "where the mask is None; with a mask the original runs (SDPA backends disagree on both set)"))
        if mask is not None and causal_v is True:
            return miss(
                "both attn_mask and is_causal=True are set: SDPA backends disagree (the documented reference "
                "rejects it, the CPU kernel intersects them), so there is no single meaning to convert"
            )
        d = head_dim_constant(module, scope, [scale] if scale is not None else [])
        problem = head_dim_problem(d)
        if problem:
            return miss(problem)

        # GQA: ``k = repeat_kv(k, n)`` right before the call is dropped (the op groups heads itself)
        start = i
        k_src, v_src = segment(module, k), segment(module, v)
        rep_k, rep_v = self._strip_inline_repeat(module, k), self._strip_inline_repeat(module, v)
        n_rep = None
        if rep_k is not None and rep_v is not None:
            k_src, v_src, n_rep = rep_k[0], rep_v[0], rep_k[1]
        elif isinstance(k, ast.Name) and isinstance(v, ast.Name):
            found = self._repeat_before(module, scope, block, i, k.id, v.id, end)
            if found is not None:
                start, k_src, v_src, n_rep = found
        elif self._was_repeated(module, scope, k):
            notes.append("k/v are repeated to the query heads away from the call: the fused op receives the repeated heads (correct, without the GQA memory saving)")

        # layout: all three inline ``x.transpose(1, 2)`` -> pass x as BSND
        q_src = segment(module, q)
        inner = [self._bsnd_inner(module, n) for n in (q, k, v)] if n_rep is None else [None]
        layout = "BNSD"
        if all(x is not None for x in inner) and len(inner) == 3:
            q_src, k_src, v_src = inner  # type: ignore[assignment]
            layout = "BSND"
        # s38 (audit38): SDPA takes q/k/v of any rank >= 2; the op only 4-D. The rank the code states decides:
        # 3-D [B*N, S, D] (DiffBIR's ``.reshape(b * heads, n, d)`` inside ``map(lambda t: ...)``) is passed as
        # BNSD with one head; an unstated rank is checked at run time (``q.dim() == 4``, else the original)
        with _attention_s46.reading_module(module):  # s46: einops / layer ranks
            stated = {tag: operand_rank(scope, n, line) for tag, n in (("q", q), ("k", k), ("v", v))}
        ranks = set(stated.values())
        rank = ranks.pop() if len(ranks) == 1 else None
        if layout == "BNSD" and n_rep is None:
            odd_rank = _attention_s45.sdpa_stated_rank_problem(stated, {"q": q_src, "k": k_src, "v": v_src})
            if odd_rank is not None:  # s45: a 5-D v beside q / k of unstated rank (granite PatchTST-FM)
                return miss(odd_rank)
        # s41 (HO17b drivaerv1): 5-D [A, B, N, S, D] with no mask and no causal flag: the two leading dims merge into the
        # op's batch where q, k and v share them (checked at run time; SDPA would broadcast unequal ones), split after
        five_d = rank == 5 and layout == "BNSD" and n_rep is None and mask is None and causal_v is False
        if rank == 5 and not five_d and layout == "BNSD" and n_rep is None:
            what = "an attn_mask" if mask is not None else "`is_causal`"
            return miss(f"q/k/v are 5-D with {what}: npu_fusion_attention takes 4-D [B,N,S,D]; npufuse merges the two leading dims "
                        f"into the batch only for a call without a mask or causal flag (the mask would have to be merged alike)")
        if rank is not None and rank != 4 and not (rank == 3 and layout == "BNSD" and n_rep is None) and not five_d:
            # another rank, or 3-D beside a dropped repeat / an inner transpose: no one-head form of it here
            return miss(f"q/k/v are {rank}-D: npu_fusion_attention takes 4-D [B,N,S,D] (or 3-D [B*N,S,D] as one head); "
                        "SDPA broadcasts the other leading dims")
        three_d = layout == "BNSD" and n_rep is None and rank == 3
        rank_unknown = layout == "BNSD" and rank is None
        lines: list[str] = []
        names: dict[str, str] = {}
        # operands bound before the run-time check whose text is the call's own: the original run
        # in the check's else reads the bound name (each expression is evaluated once, as written)
        bound: list[tuple[ast.AST, str]] = []
        for tag, text, node in (("q", q_src, q), ("k", k_src, k), ("v", v_src, v)):
            if is_simple(text):
                names[tag] = text
            else:
                names[tag] = f"_npufuse_{tag}"
                lines.append(f"_npufuse_{tag} = {text}")
                if text == segment(module, node):
                    bound.append((node, names[tag]))
        qn, kn, vn = names["q"], names["k"], names["v"]
        # s51b: 3-D operands of no stated rank (SDPA takes them as X independent attentions) go as [1, X, S, D] views
        lift = rank_unknown and n_rep is None and not five_d and all(r is None for r in stated.values()) \
            and (mask is None or self._mask_kind(module, scope, mask) == "bool"
                 or not graded_evidence(module, scope, mask, getattr(mask, "lineno", 10**9)))
        q_orig = qn  # the default scale reads q's last axis on the name as bound (the lifted view has the same)
        if lift:
            lift_lines, (qn, kn, vn) = _attention_s51b.lift_lines(qn, kn, vn, atom)
            lines += lift_lines
            names = {"q": qn, "k": kn, "v": vn}
            notes.append(_attention_s51b.LIFT_NOTE)
        n_qkv = len(lines)  # the lines binding q/k/v: the head-dim check below reads them
        if five_d:
            qa, ka, va = (f"{atom(x)}.flatten(0, 1).contiguous()" for x in (qn, kn, vn))
            head_num, sq, d_expr = f"{atom(qn)}.shape[2]", f"{atom(qn)}.shape[3]", f"{atom(qn)}.shape[-1]"
            notes.append("q/k/v are 5-D [A, B, N, S, D] here: the two leading dims merge into the batch ([A*B, N, S, D], BNSD) where "
                         "q, k and v share them (checked at run time), the output split back to [A, B, N, S, Dv]")
            risks.append(Risk("layout", "q/k/v are 5-D: flattened to [A*B, N, S, D] and made contiguous for the BNSD call (a copy "
                                        "where the permuted views are not contiguous)"))
        elif three_d:
            qa, ka, va = (f"{atom(x)}.unsqueeze(1).contiguous()" for x in (qn, kn, vn))
            head_num, sq, d_expr = "1", f"{atom(qn)}.shape[1]", f"{atom(qn)}.shape[-1]"
            notes.append("q/k/v are 3-D [B*N, S, D] here: passed as BNSD with one head ([B*N, 1, S, D]), the output squeezed back")
        elif layout == "BNSD":
            qa, ka, va = (f"{atom(x)}.contiguous()" for x in (qn, kn, vn))
            head_num, sq, d_expr = f"{atom(qn)}.shape[1]", f"{atom(qn)}.shape[2]", f"{atom(q_orig)}.shape[-1]"
            if rank_unknown:
                risks.append(Risk("layout", "q/k/v's rank is not stated here (SDPA takes any rank >= 2, the op 4-D only): the fused call "
                                            f"runs where `{_attention_s45.sdpa_unstated_rank_test(stated, names, atom)}`, the original otherwise; made "
                                            "contiguous for the BNSD call"))
            else:
                risks.append(Risk("layout", "q/k/v are 4-D [B,N,S,D] and made contiguous for the BNSD call"))
        else:
            qa, ka, va = qn, kn, vn
            head_num, sq, d_expr = f"{atom(qn)}.shape[2]", f"{atom(qn)}.shape[1]", f"{atom(qn)}.shape[-1]"
        # s44 (defects44): the keys' length, where the mask is brought to the [.., Sq, Skv] shape the op takes (SDPA's
        # k is [..., Skv, D]; the BSND call's k is [B, Skv, N, D])
        skv = f"{atom(kn)}.shape[1]" if layout == "BSND" else f"{atom(kn)}.shape[-2]"
        fa_kwargs: list[tuple[str, str]] = []

        # mask / causal
        value_check: str | None = None  # run-time condition for binarising a float mask
        mask_kind = "none"
        sparse: str | None = None
        s50_pse: list[str] | str | None = None  # s50c: the lines building pse from a float bias
        if mask is not None:
            kind = self._mask_kind(module, scope, mask)
            evidence = graded_evidence(module, scope, mask, getattr(mask, "lineno", 10**9)) if kind != "bool" else None
            if evidence:
                # s50c: a float bias (ALiBi, a relative-position table) goes to pse, q pre-scaled and scale=1.0
                s50_pse = _sdpa_s50c.bias_pse_lines(module, scope, mask, line, qn, head_num, sq, skv,
                                                     not (three_d or five_d or rank_unknown))
                if s50_pse is None:
                    return miss(f"attn_mask: {bias_reason(segment(module, mask), evidence)}")
                if isinstance(s50_pse, str):
                    return miss(f"attn_mask: {s50_pse}")
                lines += s50_pse
                mask_kind = "pse"
                risks += _sdpa_s50c.pse_risks()
                # (s50 review) the float reading is the bias's arithmetic; a helper ending in a comparison hands SDPA a
                # bool (True = keep), which pse would add as 0 / 1: the dtype is checked at run time, else the original
                value_check = _sdpa_s50c.PSE_FLOAT_CHECK
                if not is_simple(segment(module, mask)):
                    bound.append((mask, "_npufuse_pse"))  # the fallback reads the bias bound before the check
        if mask is not None and s50_pse is None:
            m_src = segment(module, mask)
            maybe_none = not self._certainly_tensor(module, scope, mask, block)
            if kind in ("float_unverified", "unknown"):
                # the values decide whether `mask < 0` is exact: checked at run time (issue 14, class 3)
                if not is_simple(m_src):
                    lines.append(f"_npufuse_attn_mask = {m_src}")
                    m_src = "_npufuse_attn_mask"
                    bound.append((mask, m_src))
                value_check = additive_mask_exact(m_src, maybe_bool=kind == "unknown", maybe_none=maybe_none)
                risks.append(Risk("host_sync", VALUE_CHECK_RISK))
            if kind == "bool":
                conv = f"~{atom(m_src)}"
                comment = "SDPA's bool mask is True = keep; the op's True = masked"
            elif kind in ("float", "float_unverified"):
                conv = f"{atom(m_src)} < 0"
                comment = "additive 0/-inf mask -> True = masked"
                if kind == "float":
                    risks.append(Risk("numerics", "the additive float mask (built here from -inf/finfo.min) is converted with `mask < 0`: exact for 0/−inf (or large negative) masks"))
            else:
                conv = f"~{atom(m_src)} if {atom(m_src)}.dtype == torch.bool else {atom(m_src)} < 0"
                comment = "bool (True = keep) or additive float: decided on the dtype at run time"
                risks.append(Risk("numerics", "the mask's dtype is not known statically: a bool mask is inverted, a float mask converted with `mask < 0` once its values are checked"))
            mask_kind = "float" if kind == "float_unverified" else kind
            # s40 (wrong40): a mask built here whose construction can leave a query row with no key
            polarity = {"bool": "keep", "float": "additive", "float_unverified": "additive"}.get(kind, "auto")
            rows = _mask_rows.row_verdict(mask, polarity, _mask_rows.Resolver(module, scope, line))
            if rows is not None and rows.kind == "empty":
                none_only = _sdpa_s51n.none_only_guard(m_src, maybe_none, is_simple(m_src), scope.node)  # s51n: VggAE's disabled arm
                if none_only is None:
                    return miss(f"attn_mask `{segment(module, mask)}`: {rows.describe()}")
                value_check = none_only if value_check is None else f"({value_check}) and {none_only}"
                risks.append(_sdpa_s51n.none_only_risk(m_src, rows.describe()))
            if rows is not None and rows.kind == "varies" and kind != "float_unverified":  # s49: its value check has the rows
                if not is_simple(m_src):
                    lines.append(f"_npufuse_attn_mask = {m_src}")
                    conv = conv.replace(m_src, "_npufuse_attn_mask")
                    m_src = "_npufuse_attn_mask"
                    bound.append((mask, m_src))
                row_check = _mask_rows.row_check(m_src, polarity)
                if maybe_none:
                    row_check = f"({m_src} is None or {row_check})"
                value_check = row_check if value_check is None else f"({value_check}) and {row_check}"
                risks.append(Risk("host_sync", _mask_rows.ROW_CHECK_RISK))
            if maybe_none:
                lines.append(f"_npufuse_mask = None if {atom(m_src)} is None else ({conv})  # {comment}")
            else:
                lines.append(f"_npufuse_mask = {conv}  # {comment}")
            lift_split = len(lines) if lift else None  # s51b: the lifted call's mask test goes here
            if three_d:
                # s38: against 3-D scores [B*N, Sq, Skv] a 3-D mask is per batch*head: [B*N, 1, Sq, Skv] for the one-head call
                lines += mask_shape_lines("_npufuse_mask", sq, maybe_none, three_d=True, skv=skv)
            else:
                lines += mask_rank_lines("_npufuse_mask", maybe_none, f"{atom(qn)}.shape[0]")  # s37: 3-D [1|N,Sq,Skv] masks
                lines += mask_shape_lines("_npufuse_mask", sq, maybe_none, skv=skv)
        if causal is not None and causal_v is not False:
            if causal_v is True:
                cache, expr = causal_cache_lines(qn)
                lines += cache
                fa_kwargs.append(("atten_mask", expr))
                sparse = "2"
                mask_kind = "causal"
            else:
                # a run-time flag (HF: ``query.shape[2] > 1 and attention_mask is None and module.is_causal``)
                c_src = segment(module, causal)
                flag = c_src if is_simple(c_src) else "_npufuse_is_causal"
                if flag != c_src:
                    lines.append(f"_npufuse_is_causal = {c_src}")
                cache, expr = causal_cache_lines(qn)
                lines += [f"if {flag}:"] + ["    " + ln for ln in cache]
                other = "_npufuse_mask" if mask is not None and s50_pse is None else "None"
                if mask is not None and s50_pse is None:
                    # (s50 review) with the flag set SDPA applies the mask AND the causal triangle (torch's CPU kernel;
                    # backends disagree: the literal is_causal=True refuses); the fused call would drop the mask, so
                    # it runs where the flag is off or the mask is None, the original otherwise
                    if flag != c_src and any(isinstance(n, ast.Call) for n in ast.walk(causal)):
                        return miss("attn_mask together with a run-time is_causal flag computed by a call: with both set SDPA "
                                    "backends disagree, and npufuse would evaluate the flag a second time to tell them apart")
                    both = f"not ({c_src})" if flag != c_src else f"not {atom(flag)}"
                    if maybe_none:
                        both = f"({m_src} is None or {both})"
                    value_check = both if value_check is None else f"({value_check}) and {both}"
                    risks.append(Risk("other", "attn_mask together with a run-time is_causal flag: the fused call runs where the "
                                               "flag is off (or the mask is None); with both set the original runs (SDPA backends "
                                               "disagree on both set)"))
                fa_kwargs.append(("atten_mask", f"{expr} if {flag} else {other}"))
                sparse = f"2 if {flag} else 0"
                mask_kind = f"causal if {c_src} else {mask_kind}"
                notes.append("is_causal is decided at run time: top-left causal (sparse_mode 2) when it holds")
        if mask is not None and s50_pse is None and not any(a == "atten_mask" for a, _ in fa_kwargs):
            fa_kwargs.append(("atten_mask", "_npufuse_mask"))

        # scale: SDPA's default 1/sqrt(D) made explicit
        default = f"{d_expr} ** -0.5"
        if scale is None or (isinstance(scale, ast.Constant) and scale.value is None):
            scale_text = default
        elif isinstance(const_value(scale), (int, float)):
            scale_text = segment(module, scale)
        else:
            s_src = segment(module, scale)
            if not is_simple(s_src):
                lines.append(f"_npufuse_scale = {s_src}")
                s_src = "_npufuse_scale"
            scale_text = f"{s_src} if {s_src} is not None else {default}"
        if s50_pse is not None:
            # s50c: q carries the scale and the call gets 1.0: scale*(QKᵀ + pse) and scale*QKᵀ + pse are then the same
            # (spec §5.1 leaves pse's placement UNCERTAIN), and both are SDPA's QKᵀ*scale + attn_mask
            fa_kwargs.append(("pse", "_npufuse_pse"))
            qa = f"({qa} * ({scale_text}))"
            scale_text = "1.0"
        fa_kwargs.append(("scale", scale_text))

        # dropout
        dropout_text = "0"
        if dropout is not None and const_value(dropout) not in (0, 0.0):
            d_src = segment(module, dropout)
            fa_kwargs.append(("keep_prob", f"1.0 - {atom(d_src)}"))
            dropout_text = d_src
            if "training" not in d_src and "train" not in d_src:
                risks.append(Risk("other", f"dropout_p `{d_src}` is not gated on the training flag here: check the caller passes 0 in eval (kept as written)"))
            risks.append(Risk("numerics", "dropout masks come from the NPU's Philox stream: statistically equivalent, not bit-identical"))
        if sparse is not None:
            fa_kwargs.append(("sparse_mode", sparse))

        fa = fa_call(qa, ka, va, head_num, layout, fa_kwargs)
        if layout == "BSND":
            fa = f"{fa}.transpose(1, 2)"  # SDPA returns [B, N, S, D]
        if three_d:
            fa = f"{fa}.squeeze(1)"  # SDPA returns [B*N, S, D] for 3-D operands
        if lift:
            fa = _attention_s51b.unlift(fa)
        if five_d:
            fa = f"{fa}.unflatten(0, ({atom(qn)}.shape[0], {atom(qn)}.shape[1]))"  # SDPA returns [A, B, N, S, Dv]
        lines.append(replace_segments(module, stmt, [(call, fa)]))
        # npu_fusion_attention takes Dk >= Dv only (SDPA any Dv): where v's head dim exceeds k's the
        # original runs (two shape reads; a value head wider than the key's is rare but real)
        dv_check = f"{atom(vn)}.shape[-1] <= {atom(kn)}.shape[-1]"
        if d is None:
            # ... and the op's D <= 768 (spec 5.1; Dq == Dk) where no literal head dim bounds it: channel
            # attention has the channel count or the pixels there (audit36), checked at run time
            dv_check = f"{dv_check} <= 768"
        if rank_unknown:
            # s38: the rank is not stated (a 3-D call runs the original); s45: each operand of unstated rank (SDPA takes
            # 3-D keys beside a 4-D query)
            dv_check = f"{_attention_s45.sdpa_unstated_rank_test(stated, names, atom)} and {dv_check}"
        if five_d:
            # every operand 5-D with the same two leading dims (SDPA broadcasts them; the merged batch does not)
            dv_check = (f"{atom(qn)}.dim() == {atom(kn)}.dim() == {atom(vn)}.dim() == 5 and "
                        f"{atom(qn)}.shape[:2] == {atom(kn)}.shape[:2] == {atom(vn)}.shape[:2] and "
                        f"{atom(qn)}.shape[0] * {atom(qn)}.shape[1] <= 2000000 and {dv_check}")  # the op's B: 1..2M (spec 5.1)
        if mask_none_guard is not None:
            dv_check = f"{mask_none_guard} and {dv_check}"
        held_partial = getattr(call, "_npufuse_guard", None)
        if held_partial is not None:
            # s39: SDPA through ``self.<attr> = partial(SDPA, ..)``: the attribute still holds that partial at run time
            dv_check = f"{held_partial} and {dv_check}"
            risks.append(Risk("other", getattr(call, "_npufuse_guard_risk", None) or
                              "SDPA is called through a `functools.partial` held by the module: the fused call runs where the "
                              "attribute still holds that partial with the same flags (checked at run time), the original otherwise"))
        if d is None and _attention_s36.learned_scale(module, scope, scale):
            # s36: a scale read off a learned temperature marks channel attention (MONAI CABlock's SDPA on
            # [b, head, c, (h w)]): the op's D <= 768 is checked at run time (above), the original runs otherwise
            risks.append(Risk("other", "the scale is read off a learned temperature, as in channel attention where the last axis is the "
                                       f"pixels: the fused call runs where `{atom(kn)}.shape[-1] <= 768` (npu_fusion_attention's D limit)"))
        original = block_source(module, block[start : i + 1])
        if bound and start == i:
            # no statement dropped before the call: its operands are what the bindings above hold
            # (a mask built by a module call ran twice on the fallback path, HO8 moe_attention)
            original = replace_segments(module, stmt, bound)
        if lift and mask is not None and s50_pse is None:  # s51b: a mask the eager broadcast leaves 3-D, else the original
            lines = checked_body(lines[:lift_split], lines[lift_split:], _attention_s51b.mask_test(qn, maybe_none), original)
        if value_check is not None:
            head = "_npufuse_pse = " if s50_pse is not None else "_npufuse_mask = "
            split = next(n for n, ln in enumerate(lines) if ln.startswith(head)) + (1 if s50_pse is not None else 0)
            lines = checked_body(lines[:split], lines[split:], f"({value_check}) and {dv_check}", original)
        else:
            lines = checked_body(lines[:n_qkv], lines[n_qkv:], dv_check, original)
        notes.append("npu_fusion_attention needs v's head dim <= k's" + (" <= 768" if d is None else "")
                     + " (SDPA takes any): checked at run time, else the original runs")
        risks.append(Risk("dynamic_shape", "sequence length varying between steps re-tiles the kernel (recompilation under graph mode)"))
        params: dict[str, Any] = {
            "mask_kind": mask_kind,
            "mask": segment(module, mask) if mask is not None else None,
            "is_causal": segment(module, causal) if causal is not None else "False",
            "sparse_mode": sparse or "0",
            "scale": scale_text,
            "dropout": dropout_text,
            "gqa": (segment(module, gqa) if gqa is not None else None) or n_rep,
            "layout": layout,
            "q": q_src, "k": k_src, "v": v_src,
            "head_dim": d,
            "mask_values_checked": value_check is not None,
        }
        variant = "sdpa" + ("+causal" if "causal" in mask_kind else "") + (f"+{mask_kind}" if mask_kind in ("bool", "float", "unknown") else "") + ("+gqa" if params["gqa"] else "")
        guard = guard_operand_name(q_src)  # s46: never the function a query call names (it has no device)
        return Finding(
            pattern=self.id, qualname=scope.qualname, line=block[start].lineno, end_line=end, params=params,
            fused="\n".join(lines), guard_tensor=guard, confidence=confidence, variant=variant, risks=risks, notes=notes,
        )

    # -- helpers ----------------------------------------------------------------------------------
    def _mask_kind(self, module: ModuleInfo, scope: Scope, mask: ast.expr, depth_ok: bool = True) -> str:
        """bool | float | bias | unknown, from how the mask is built in this function."""
        # a bias (graded values) is told by graded_evidence, from the dataflow; here the dtype and, for
        # floats, whether the values are visibly 0/-inf
        node = _resolve(scope, mask)
        for _ in range(8):
            if isinstance(node, ast.Compare) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not))):
                return "bool"
            if isinstance(node, ast.Call):
                name = module.call_name(node) or ""
                if name in _BOOL_CALLS and any(ast.unparse(kw.value) == "torch.bool" for kw in node.keywords) or name in ("torch.logical_not", "torch.logical_and", "torch.logical_or"):
                    return "bool"
                if isinstance(node.func, ast.Attribute):
                    attr = node.func.attr
                    if attr in ("bool", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt", "gt", "le", "ge"):
                        return "bool"
                    if attr == "to" and node.args and ast.unparse(node.args[0]) == "torch.bool" or any(kw.arg == "dtype" and ast.unparse(kw.value) == "torch.bool" for kw in node.keywords):
                        return "bool"
                    if attr in ("masked_fill", "masked_fill_") and node.args and "inf" in ast.unparse(node.args[-1]):
                        # s43 (audit43): the fill proves the masked entries only; the others keep the base's values
                        return self._filled_base_kind(module, scope, node.func.value)
                    if attr in ("float", "half", "bfloat16") or (attr == "to" and node.args and "float" in ast.unparse(node.args[0])):
                        # a cast says the dtype, not that the values are 0/-inf (a 0/1 keep mask cast to float)
                        return "float_unverified"
                    if attr in ("tril", "triu", "view", "reshape", "expand", "unsqueeze", "contiguous", "repeat", "to"):
                        node = _resolve(scope, node.func.value)
                        continue
                if any(kw.arg == "dtype" and ast.unparse(kw.value) == "torch.bool" for kw in node.keywords):
                    return "bool"
                if name == "torch.masked_fill" and len(node.args) == 3 and ("finfo" in ast.unparse(node.args[2]) or "inf" in ast.unparse(node.args[2])):
                    # s43 (audit43, BetterTransformer's bloom: ``torch.masked_fill(alibi, mask, finfo.min)``): the
                    # unmasked entries hold the ALiBi bias, so the values are checked at run time
                    return self._filled_base_kind(module, scope, node.args[0])
                if "finfo" in ast.unparse(node) or (name == "torch.full" and "inf" in ast.unparse(node)):
                    return "float"
                if name in ("torch.full", "torch.zeros"):
                    return "float_unverified"
                if name in ("torch.tril", "torch.triu") and node.args:
                    node = _resolve(scope, node.args[0])
                    continue
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and depth_ok:
                # s37 (fix37): a sum is a 0/-inf mask only when every term is (a -inf causal bias plus the
                # caller's float mask may be graded): else its values are checked at run time
                terms = {self._mask_kind(module, scope, t, depth_ok=False) for t in (node.left, node.right)}
                if terms != {"float"}:
                    return "float_unverified"
            if isinstance(node, ast.BinOp) and ("finfo" in ast.unparse(node) or "inf" in ast.unparse(node) or "10000" in ast.unparse(node)):
                return "float"
            if isinstance(node, ast.Subscript):
                node = _resolve(scope, node.value)
                continue
            break
        return "unknown"

    def _filled_base_kind(self, module: ModuleInfo, scope: Scope, base: ast.expr) -> str:
        """The kind of ``base.masked_fill(m, -inf)``: a 0/-inf mask where ``base`` is zeros or a 0/-inf mask
        itself, else a float whose values are checked at run time (a bias filled at the masked entries)."""
        node = _resolve(scope, base)
        if _changed_in_place(scope, base):
            # s44 review: ``bias = torch.zeros(..); bias.add_(alibi)`` (or ``bias[:] = alibi``) before the fill: the
            # definition no longer says what the unmasked entries hold
            return "float_unverified"
        if isinstance(node, ast.Call):
            name = module.call_name(node) or ""
            if name in ("torch.zeros", "torch.zeros_like") or (isinstance(node.func, ast.Attribute) and node.func.attr in ("new_zeros", "zero_")):
                return "float"
        return "float" if self._mask_kind(module, scope, base, depth_ok=False) == "float" else "float_unverified"

    @staticmethod
    def _certainly_tensor(module: ModuleInfo, scope: Scope, mask: ast.expr, block: list[ast.stmt]) -> bool:
        """False when the mask may be None at run time: a parameter, a name whose last assignment
        is conditional (inside an ``if``) or not a tensor expression, or the result of a call that
        may return None (a repository function or method: diffusers' ``prepare_attention_mask``
        hands a None mask back as it is)."""
        if not isinstance(mask, ast.Name):
            return _tensor_valued(module, mask)
        last = None
        for stmt, value in scope.assignments.get(mask.id, []):
            if stmt.lineno < mask.lineno:
                last = (stmt, value)
        if last is None or not any(last[0] is b for b in block):
            return False
        return _tensor_valued(module, last[1])

    @staticmethod
    def _bsnd_inner(module: ModuleInfo, node: ast.expr) -> str | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transpose" and len(node.args) == 2:
            if {const_value(a) for a in node.args} == {1, 2}:
                return segment(module, node.func.value)
        return None

    @staticmethod
    def _strip_inline_repeat(module: ModuleInfo, node: ast.expr) -> tuple[str, str] | None:
        info = repeat_info(module, node)
        if info is not None and info.grouped and info.head_dim == 1 and isinstance(node, ast.Call):
            inner = repeated_tensor(module, node)
            return (segment(module, inner), info.n_rep) if inner is not None else None
        return None

    def _repeat_before(self, module: ModuleInfo, scope: Scope, block: list[ast.stmt], i: int, kname: str, vname: str, end: int) -> tuple[int, str, str, str] | None:
        """``k = repeat_kv(k0, n); v = repeat_kv(v0, n)`` (or inside an ``if`` holding only those)
        directly before the call: returns (first statement index, k0, v0, n)."""
        j = i - 1
        srcs: dict[str, tuple[str, str]] = {}
        first = i
        while j >= 0 and len(srcs) < 2:
            st = block[j]
            body = st.body if isinstance(st, ast.If) and not st.orelse else [st]
            got = {}
            for b in body:
                if not (isinstance(b, ast.Assign) and len(b.targets) == 1 and isinstance(b.targets[0], ast.Name)):
                    got = {}
                    break
                info = repeat_info(module, b.value)
                if info is None or not info.grouped or info.head_dim != 1 or b.targets[0].id not in (kname, vname):
                    got = {}
                    break
                inner = repeated_tensor(module, b.value) if isinstance(b.value, ast.Call) else None
                if inner is None:
                    got = {}
                    break
                got[b.targets[0].id] = (segment(module, inner), info.n_rep)
            if not got:
                break
            srcs.update(got)
            first = j
            j -= 1
        if set(srcs) != {kname, vname}:
            return None
        # the repeated tensors must not be needed after the site
        if scope.uses_after(kname, end) or scope.uses_after(vname, end):
            return None
        return first, srcs[kname][0], srcs[vname][0], srcs[kname][1]

    @staticmethod
    def _was_repeated(module: ModuleInfo, scope: Scope, k: ast.expr) -> bool:
        node = _resolve(scope, k)
        return repeat_info(module, node) is not None if isinstance(node, ast.Call) else False

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        res = attention_value(finding, config, "SDPA")
        res["note"] = (
            "on NPU, SDPA itself reaches the fused kernel only with a bool mask (or is_causal without one) and "
            "when grads are required (transformers#41143); otherwise it runs decomposed — the estimate is that case"
        )
        return res

    @staticmethod
    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """SDPA's math: softmax(q kᵀ·scale + mask) @ v; bool mask True = keep; causal top-left."""
        # torch only when the reference runs: scanning never imports it
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    FUSE: list = []
    KEEP: list = []


_HF_REPEAT_KV = '''
import torch
import torch.nn.functional as F
from torch import nn


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class _Mod:
    training = False
    is_causal = True
    num_key_value_groups = 2
'''

SdpaPattern.FUSE = [
    Fuse(
        name="gpt_fast_repeat_interleave_method",
        # gpt-fast / metavoice style GQA: the kv heads repeated with the METHOD form right before the call
        # (its first argument is the repeat count, not the tensor: taken for the tensor, the fused call got
        # ints as key and value; audit33)
        code='''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, n_head=4, n_local_heads=2, head_dim=16):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = n_head, n_local_heads, head_dim

    def forward(self, q, k, v, mask):
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return y
''',
        expect={"gqa": "self.n_head // self.n_local_heads", "k": "k", "v": "v"},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
k = torch.randn(2, 2, 8, 16, requires_grad=True)
v = torch.randn(2, 2, 8, 16, requires_grad=True)
keep = torch.ones(8, 8, dtype=torch.bool).tril()
out = Attention()(q, k, v, keep)
leaves = [q, k, v]
''',
    ),
    Fuse(
        name="hf_sdpa_attention_forward",
        # transformers integrations/sdpa_attention.py (simplified): run-time is_causal, scale may be None
        code=_HF_REPEAT_KV + '''

def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if hasattr(module, "num_key_value_groups"):
        key = repeat_kv(key, module.num_key_value_groups)
        value = repeat_kv(value, module.num_key_value_groups)
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    attn_output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
    )
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None
''',
        expect={"mask_kind": "causal if is_causal else unknown", "scale": "scaling if scaling is not None else query.shape[-1] ** -0.5",
                "is_causal": "is_causal", "qualname": "sdpa_attention_forward"},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
k = torch.randn(2, 2, 8, 16, requires_grad=True)
v = torch.randn(2, 2, 8, 16, requires_grad=True)
keep = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
out = (sdpa_attention_forward(_Mod(), q, k, v, None)[0], sdpa_attention_forward(_Mod(), q, k, v, keep)[0])
leaves = [q, k, v]
''',
    ),
    Fuse(
        name="timm_fused_attn",
        code='''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim=64, num_heads=4, attn_drop=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        return x.transpose(1, 2).reshape(B, N, C)
''',
        expect={"mask_kind": "none", "dropout": "self.attn_drop.p if self.training else 0.0", "scale": "q.shape[-1] ** -0.5", "layout": "BNSD"},
        run='''
m = Attention().eval()
x = torch.randn(2, 10, 64, requires_grad=True)
out = m(x)
leaves = [x, m.qkv.weight]
''',
    ),
    Fuse(
        name="nanogpt_flash_causal",
        code='''
import torch
import torch.nn as nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=64, n_head=4, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)
''',
        expect={"mask_kind": "causal", "sparse_mode": "2", "dropout": "self.dropout if self.training else 0"},
        run='''
m = CausalSelfAttention().train()
x = torch.randn(2, 16, 64, requires_grad=True)
out = m(x)
leaves = [x, m.c_attn.weight]
''',
    ),
    Fuse(
        name="gqa_causal_sq_ne_skv",
        # enable_gqa with a causal prefill chunk: SDPA's causal is top-left (sparse_mode 2) when Sq != Skv
        code='''
import torch
import torch.nn.functional as F


def chunk_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
''',
        expect={"gqa": "True", "sparse_mode": "2"},
        run='''
q = torch.randn(2, 8, 4, 32, requires_grad=True)
k = torch.randn(2, 2, 10, 32, requires_grad=True)
v = torch.randn(2, 2, 10, 32, requires_grad=True)
out = chunk_attention(q, k, v)
leaves = [q, k, v]
''',
    ),
    Fuse(
        name="bool_key_padding_mask",
        # ESM / encoder style: bool keep mask [B, 1, 1, S] (True = attend), expanded over the query rows
        code='''
import torch
import torch.nn.functional as F


def encoder_attention(q, k, v, key_padding_mask, scale):
    mask = key_padding_mask[:, None, None, :].bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
''',
        expect={"mask_kind": "bool", "scale": "scale if scale is not None else q.shape[-1] ** -0.5"},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
k = torch.randn(2, 4, 8, 16, requires_grad=True)
v = torch.randn(2, 4, 8, 16, requires_grad=True)
pad = torch.ones(2, 8)
pad[1, 6:] = 0
out = encoder_attention(q, k, v, pad, 0.25)
leaves = [q, k, v]
''',
    ),
    Fuse(
        name="diffusers_attn_processor_float_mask",
        # diffusers AttnProcessor2_0: mask viewed [B, heads, -1, S], float additive, BNSD from view+transpose
        code='''
import torch
import torch.nn.functional as F


class AttnProcessor2_0:
    def __call__(self, attn, hidden_states, attention_mask=None):
        batch_size, sequence_length, _ = hidden_states.shape
        if attention_mask is not None:
            # scaled_dot_product_attention expects attention_mask shape to be (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        return attn.to_out(hidden_states)


class Attn(torch.nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (torch.nn.Linear(dim, dim) for _ in range(4))
''',
        expect={"mask_kind": "unknown", "is_causal": "False", "dropout": "0", "qualname": "AttnProcessor2_0.__call__"},
        run='''
attn = Attn()
h = torch.randn(2, 8, 64, requires_grad=True)
mask = torch.zeros(2, 4, 1, 8)
mask[0, :, :, 5:] = -10000.0
out = AttnProcessor2_0()(attn, h, mask)
leaves = [h, attn.to_q.weight]
''',
    ),
    Fuse(
        name="bsnd_inline_transpose_bf16",
        # q/k/v kept in BSND and transposed inline: fused as BSND without copies
        code='''
import torch
import torch.nn.functional as F


def attend_bsnd(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)
''',
        expect={"layout": "BSND", "q": "q", "sparse_mode": "2"},
        run='''
q = torch.randn(2, 16, 4, 32).bfloat16().requires_grad_()
k = torch.randn(2, 16, 4, 32).bfloat16().requires_grad_()
v = torch.randn(2, 16, 4, 32).bfloat16().requires_grad_()
out = attend_bsnd(q, k, v).float()
leaves = [q, k, v]
''',
    ),
    Fuse(
        name="repeat_kv_before_call",
        # GQA expanded right before the call: dropped, the op groups heads itself
        code=_HF_REPEAT_KV + '''

class Attention(nn.Module):
    def __init__(self, n_rep=2):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, q, k, v, mask=None):
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out
''',
        expect={"gqa": "self.n_rep", "k": "k", "mask_kind": "unknown"},
        run='''
m = Attention()
q = torch.randn(1, 4, 8, 16, requires_grad=True)
k = torch.randn(1, 2, 8, 16, requires_grad=True)
v = torch.randn(1, 2, 8, 16, requires_grad=True)
mask = torch.full((8, 8), float("-inf")).triu(1)
out = (m(q, k, v, mask), m(q, k, v))
leaves = [q, k, v]
''',
    ),
]

SdpaPattern.KEEP = [
    Keep(
        name="mask_and_is_causal",
        code='''
import torch.nn.functional as F


def both(q, k, v, pad_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask, is_causal=True)
''',
        reason="both attn_mask and is_causal",
    ),
    Keep(
        name="t5_position_bias",
        code='''
import torch
import torch.nn.functional as F
from torch import nn


class T5Attention(nn.Module):
    # the bias comes from a learned table (nn.Embedding): graded values, whatever it is called
    def __init__(self, buckets=32, heads=4):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(buckets, heads)

    def forward(self, q, k, v, buckets):
        values = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=values, scale=1.0)
''',
        reason="float bias",
    ),
    Keep(
        name="mask_plus_alibi",
        code='''
import torch
import torch.nn.functional as F


def alibi_sdpa(q, k, v, mask, slopes):
    alibi = slopes[:, None, None] * torch.arange(k.shape[-2], device=k.device)[None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask + alibi)
''',
        reason="float bias",
    ),
    Keep(
        name="head_dim_72_scale",
        code='''
import torch.nn.functional as F


def dit_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=72 ** -0.5)
''',
        reason="not a multiple of 16",
    ),
    Keep(
        name="starred_args",
        code='''
import torch.nn.functional as F


def packed(qkv):
    return F.scaled_dot_product_attention(*qkv.unbind(0))
''',
        reason="passed with `*`",
    ),
]

# issue 14 class 3: the bias returned by a method of the class from a learned table (BEiT/Swin's relative position
# bias: ``self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)``): graded values, a near miss that says so
SdpaPattern.KEEP.append(
    Keep(
        name="relative_position_bias_from_method",
        code='''
import torch
import torch.nn.functional as F
from torch import nn


class WindowAttention(nn.Module):
    def __init__(self, n=16, heads=4):
        super().__init__()
        self.n = n
        self.table = nn.Parameter(torch.zeros(2 * n, heads))
        self.register_buffer("index", torch.zeros(n, n, dtype=torch.long))

    def _bias(self):
        bias = self.table[self.index.view(-1)].view(self.n, self.n, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, q, k, v, extra=None):
        rel = self._bias()
        if extra is not None:
            rel = rel + extra
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rel)
''',
        reason="which returns values of `self.table`, a learned Parameter",
    )
)

# --- issue 14 class 3: SDPA calls control never reaches ---
# a ``raise`` (or ``return``) earlier in the call's block or an enclosing with/try/loop body: the call never runs
SdpaPattern.KEEP.append(
    Keep(
        name="sdpa_after_raise_in_try",
        code='''
import torch
import torch.nn.functional as F


def fast_attend(q, k, v, fallback):
    try:
        raise RuntimeError("disabled")
        with torch.backends.cuda.sdp_kernel(enable_math=False):
            out = F.scaled_dot_product_attention(q, k, v)
    except RuntimeError:
        out = fallback(q, k, v)
    return out
''',
        reason='the call is unreachable: `raise RuntimeError("disabled")`',
    )
)
SdpaPattern.KEEP.append(
    Keep(
        name="sdpa_after_early_return",
        code='''
import torch.nn.functional as F


class Attend:
    def forward(self, q, k, v):
        return self.naive(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out
''',
        reason="the call is unreachable: `return self.naive(q, k, v)`",
    )
)
SdpaPattern.FUSE.append(
    Fuse(
        name="sdpa_after_conditional_raise",
        # a raise inside an ``if`` (or an except handler's body) does not make what follows unreachable
        code='''
import torch
import torch.nn.functional as F


def attend(q, k, v):
    if q.dim() != 4:
        raise ValueError("expected [B, N, S, D]")
    try:
        out = F.scaled_dot_product_attention(q, k, v)
    except RuntimeError:
        raise
    return out
''',
        expect={"mask_kind": "none"},
        run="""
q = torch.randn(2, 4, 5, 16, requires_grad=True)
k = torch.randn(2, 4, 5, 16, requires_grad=True)
v = torch.randn(2, 4, 5, 16, requires_grad=True)
out = attend(q, k, v)
leaves = [q, k, v]
""",
    )
)



# --- s40: SDPA as one of several callables a name or attribute may hold ----------------------------------------------
# ``try: from flash_attn import flash_attn_func as attn_func / except ImportError: from torch.nn.functional import
# scaled_dot_product_attention as attn_func`` then ``self.attention = attn_func`` and ``self.attention(q, k, v, ...)``
# (anemoi-models): the call is SDPA only where the attribute holds it. ``bound_callee.choices`` reads what it may hold;
# the fused call runs under ``<callee> is torch.nn.functional.scaled_dot_product_attention`` (the original otherwise).
# A call passing a keyword SDPA does not take is a call of another member (SDPA would raise there).
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _s40_sdpa_held_attributes(module: ModuleInfo) -> tuple[str, ...]:
    """The attributes ``self.<attr>`` some class of the module sets to a name bound (at module level) to SDPA among
    other callables, or to SDPA's own dotted name (cached per module)."""
    cached = module.__dict__.get("_npufuse_s40_sdpa_held")
    if cached is None:
        found: list[str] = []
        for n in fast_walk(module.tree):
            if not (isinstance(n, ast.Assign) and isinstance(n.value, (ast.Name, ast.Attribute))):
                continue
            attrs = [t.attr for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]
            if attrs and _s40_names_sdpa(module, n.value):
                found += [a for a in attrs if a not in found]
        cached = module.__dict__["_npufuse_s40_sdpa_held"] = tuple(found)
    return cached


def _s40_names_sdpa(module: ModuleInfo, value: ast.expr, bindings: list | None = None) -> bool:
    """``value`` is SDPA's dotted name, or a name one of ``bindings`` (default: its module-level ones) imports SDPA as."""
    if module.canonical(value) in SDPA_NAMES:
        return True
    if bindings is None and isinstance(value, ast.Name):
        bindings = bound_callee.module_bindings(module, value.id)
    return isinstance(value, ast.Name) and any(
        isinstance(st, ast.ImportFrom) and any(f"{st.module}.{a.name}" in SDPA_NAMES and (a.asname or a.name) == value.id for a in st.names)
        for st, _v, _c in bindings or ())


def _s40_chosen_sdpa_call(module: ModuleInfo, scope: Scope, call: ast.Call, held: tuple[str, ...]) -> ast.Call | str | None:
    """The SDPA call ``call`` makes through a callee that may hold SDPA or something else (a held attribute, or a
    module-level name bound more than once), carrying its run-time identity test; a reason where the call cannot be
    SDPA's; None where the callee is no such choice (a plain SDPA call, or not SDPA at all)."""
    f = call.func
    if isinstance(f, ast.Attribute):
        if not (isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in held):
            return None
    else:
        # s41: the bindings the call sees: the function's own imports (``try: from flash_attn import f as attn``
        # inside ``forward``), an enclosing function's, else the module's
        seen = bound_callee.name_bindings(module, scope.node, f.id) if isinstance(f, ast.Name) else None
        only = seen[0][0] if seen and len(seen) == 1 else None
        if isinstance(only, (ast.Import, ast.ImportFrom)) and module.call_name(call) in SDPA_NAMES and not (
                isinstance(only, ast.ImportFrom) and not only.level
                and any(f"{only.module}.{a.name}" in SDPA_NAMES for a in only.names if (a.asname or a.name) == f.id)):
            # the file-wide alias table keeps the file's last import of the name (SDPA, in another function)
            return (f"`{f.id}` is bound here by `{' '.join(ast.unparse(only).split())[:80]}`, not SDPA (another "
                    "import of the file binds SDPA to the same name)")
        if not (isinstance(f, ast.Name) and f.id not in scope.assignments and f.id not in scope.args
                and seen is not None and len(seen) > 1 and _s40_names_sdpa(module, f, seen)):
            return None
    choice = bound_callee.choices(module, scope, f)
    if choice is None:
        return None
    sdpa = [m for m in choice.members if m.name in SDPA_NAMES and m.partial is None and not m.instance]
    if not sdpa:
        return None
    held_text = segment(module, f)
    members = "; ".join(f"`{m.name}`" + (f" ({m.condition})" if m.condition else "") for m in choice.members)
    foreign = [k.arg for k in call.keywords if k.arg is not None and k.arg not in _SDPA_PARAMETERS]
    if foreign or len(call.args) > 6:
        taken = ", ".join(f"`{a}`" for a in foreign) or "more than six positional arguments"
        return (f"`{held_text}` may hold SDPA or another function ({members}); this call passes {taken}, which SDPA does "
                "not take, so it is a call of another one")
    synth = ast.Call(func=f, args=list(call.args), keywords=list(call.keywords))
    ast.copy_location(synth, call)
    synth.end_lineno, synth.end_col_offset = call.end_lineno, call.end_col_offset
    synth._npufuse_guard = f"{held_text} is torch.nn.functional.scaled_dot_product_attention"  # type: ignore[attr-defined]
    synth._npufuse_guard_risk = (  # type: ignore[attr-defined]
        f"`{held_text}` may hold SDPA or another function ({members[:200]}): the fused call runs where it is "
        "torch.nn.functional.scaled_dot_product_attention (checked at run time), the original call otherwise")
    return synth


# --- SDPA imported under another name (issue 14, held-out 4) ---------------------------------------
#
# ``from torch.nn.functional import scaled_dot_product_attention as slow_attn`` (VAR; often in a
# ``try`` with a hand-written fallback under ``except ImportError``): the calls read ``slow_attn(...)``
# and never hold the word. The engine's SCOPE_WORDS gate already passes scopes naming an import alias
# of a word; the detector's own text test takes the same aliases.


def sdpa_call_words(module: ModuleInfo) -> tuple[str, ...]:
    """``scaled_dot_product_attention`` and the module's import aliases of SDPA (cached per module)."""
    cached = module.__dict__.get("_npufuse_sdpa_words")
    if cached is None:
        aliases = [a + "(" for a, full in module.aliases.items() if full in SDPA_NAMES and a != "scaled_dot_product_attention"]
        # s41: ``aliases`` keeps one import per name (the file's last); a name imported as SDPA in one place (a
        # ``try`` arm inside a function) and as another function after it is SDPA's alias too
        if "scaled_dot_product_attention as" in module.source:
            aliases += [f"{a}(" for a in bound_callee.import_aliases(module, SDPA_NAMES) if f"{a}(" not in aliases]
        aliases += [f"{a}(" for a in _sdpa_s50m.assigned_aliases(module, SDPA_NAMES)]  # s50: ``attention = F.sdpa``
        cached = module.__dict__["_npufuse_sdpa_words"] = ("scaled_dot_product_attention", *aliases)
    return cached


_SDPA_ALIAS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from torch.nn.functional import scaled_dot_product_attention as slow_attn
except ImportError:
    def slow_attn(query, key, value, scale: float, attn_mask=None, dropout_p=0.0):
        attn = query.mul(scale) @ key.transpose(-2, -1)
        if attn_mask is not None:
            attn = attn + attn_mask
        return attn.softmax(dim=-1) @ value


class Mixer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.heads = heads
        self.scale = (dim // heads) ** -0.5

    def forward(self, x, bias):
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(dim=0)
        out = slow_attn(query=q, key=k, value=v, scale=self.scale, attn_mask=bias, dropout_p=0.0)
        return out.transpose(1, 2).reshape(B, L, C)
'''

SdpaPattern.FUSE += [
    Fuse(
        name="sdpa_imported_under_another_name",
        code=_SDPA_ALIAS,
        expect={"qualname": "Mixer.forward", "line": 26},
        run='''
m = Mixer(32, 4)
x = torch.randn(2, 6, 32, requires_grad=True)
bias = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
out = (m(x, bias), m(x, None))
leaves = [x]
''',
    ),
]

SdpaPattern.KEEP += [
    Keep(
        _SDPA_ALIAS.replace("dropout_p=0.0)\n        return out", "dropout_p=0.0, is_causal=True)\n        return out"),
        reason="both attn_mask and is_causal=True are set",
        name="sdpa_alias_with_mask_and_is_causal",
    ),
]


# --- s32: a mask (or q/k/v) built by a call, checked at run time: evaluated once ------------------
# The value check binds the mask before the `if`; the original in its else read the call again
# (HO8 moe_attention: `attn_mask=self.get_mask_tensor(n, mask)`, a near miss "called more often").
# The else now reads the bound name: one evaluation on either path.
_S32_MASK_FROM_A_METHOD = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Attn(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def get_mask_tensor(self, n, mask):
        return mask[:, None, None, :n]

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=self.get_mask_tensor(t, mask))
        return res.transpose(1, 2).reshape(b, t, c)
'''

SdpaPattern.FUSE += [
    Fuse(
        _S32_MASK_FROM_A_METHOD,
        name="s32_mask_from_a_method_evaluated_once",
        expect={"qualname": "Attn.forward"},
        run='''
m = Attn(32, 4)
x = torch.randn(2, 6, 32, requires_grad=True)
mask = torch.rand(2, 6) > 0.4
mask[:, 0] = True
out = m(x, mask)
leaves = [x]
''',
    ),
]

SdpaPattern.KEEP += [
    Keep(
        _S32_MASK_FROM_A_METHOD.replace("self.get_mask_tensor(t, mask))", "self.get_mask_tensor(t, mask), is_causal=True)"),
        reason="both attn_mask and is_causal=True are set",
        name="s32_mask_from_a_method_and_is_causal",
    ),
]


# --- s32: a mask returned by the repository's own helper may be None -----------------------------
# diffusers-style processors: ``attention_mask = attn.prepare_attention_mask(attention_mask, ...)``
# hands None back as it is. A call of anything but a torch function or a tensor method is no proof
# of a tensor: the run-time mask check starts with ``is None`` (it read ``.dtype`` of None before,
# an AttributeError on every mask-less call; found by the s32 precision audit).
_S32_MASK_FROM_A_HELPER = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def prepare_attention_mask(self, attention_mask, batch_size):
        if attention_mask is None:
            return attention_mask
        return attention_mask[:batch_size, None, None, :]


class Processor:
    def __call__(self, attn, hidden_states, attention_mask=None):
        b, t, c = hidden_states.shape
        attention_mask = attn.prepare_attention_mask(attention_mask, b)
        q, k, v = attn.qkv(hidden_states).view(b, t, 3, attn.heads, c // attn.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(b, t, c)
'''

SdpaPattern.FUSE += [
    Fuse(
        _S32_MASK_FROM_A_HELPER,
        name="s32_mask_from_a_helper_that_may_return_none",
        expect={"qualname": "Processor.__call__"},
        run='''
attn = Attention(32, 4)
x = torch.randn(2, 6, 32, requires_grad=True)
mask = torch.rand(2, 6) > 0.4
mask[:, 0] = True
out = (Processor()(attn, x), Processor()(attn, x, mask))
leaves = [x]
''',
    ),
]

SdpaPattern.KEEP += [
    Keep(
        _S32_MASK_FROM_A_HELPER.replace("is_causal=False)", "is_causal=True)"),
        reason="both attn_mask and is_causal=True are set",
        name="s32_mask_from_a_helper_and_is_causal",
    ),
]


# s35: a mask built by a function that returns a comparison of positions is a bool pattern, not graded values
# (LLaMA2-Accessory's ``_make_causal_mask``: ``arange(q_len) - q_len`` compared with ``arange(kv_len) - kv_len``; the
# ``sequence_mask`` helpers of VITS / coqui / GPT-SoVITS / audiocraft: ``arange(n)[None, :] < lengths[:, None]``)
_S35_COMPARED_POSITIONS = '''
import torch
import torch.nn.functional as F
from torch import nn


def keep_lengths(lengths, n):
    steps = torch.arange(n, device=lengths.device)
    kept = steps[None, :] < lengths[:, None]
    return kept


class LengthAttention(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def right_aligned(self, q_len, kv_len):
        rows = torch.arange(q_len) - q_len
        cols = torch.arange(kv_len) - kv_len
        return (rows.view(-1, 1) >= cols.view(1, -1))

    def forward(self, x, lengths=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if lengths is None:
            mask = self.right_aligned(n, n).to(x.device)
        else:
            mask = keep_lengths(lengths, n)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, c)
'''

SdpaPattern.FUSE += [
    Fuse(
        _S35_COMPARED_POSITIONS,
        name="s35_bool_masks_from_compared_positions",
        expect={"qualname": "LengthAttention.forward"},
        run='''
m = LengthAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = (m(x), m(x, torch.tensor([6, 3])))
leaves = [x]
''',
    ),
]

SdpaPattern.FUSE += [
    Fuse(
        # the method returns the distances themselves (graded float values): a bias, not a mask. s35 kept it a near
        # miss; s50 (ho27c) passes it as pse (q pre-scaled, scale=1.0), None where no bias is built (lengths given)
        _S35_COMPARED_POSITIONS.replace("        return (rows.view(-1, 1) >= cols.view(1, -1))\n",
                                        "        return -(rows.view(-1, 1) - cols.view(1, -1)).abs().float()\n").replace(
            "        else:\n            mask = keep_lengths(lengths, n)[:, None, None, :]\n", "        else:\n            mask = None\n"),
        name="s35_distances_from_positions_as_attn_mask",
        expect={"qualname": "LengthAttention.forward", "mask_kind": "pse"},
        run='''
m = LengthAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = (m(x), m(x, torch.tensor([6, 3])))
leaves = [x]
''',
    ),
]


# --- s36 (HO12b MONAI CABlock): SDPA whose scale is read off a learned temperature (channel attention on
# [b, head, c, pixels], the layout made by the caller): the op's D <= 768 is checked at run time ---
_S36_TEMPERATURE_SCALE = '''
import torch
import torch.nn.functional as F
from torch import nn


class ChannelSdpa(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.tau = nn.Parameter(torch.ones(heads, 1, 1) * 0.7)
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)

    def attend(self, q, k, v):
        s = float(self.tau.mean())
        return F.scaled_dot_product_attention(q, k, v, scale=s)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        return self.attend(q, k, v).reshape(b, c, h, w)
'''

SdpaPattern.FUSE += [
    Fuse(
        _S36_TEMPERATURE_SCALE,
        name="s36_scale_read_off_a_learned_temperature_checks_the_head_dim",
        expect={"qualname": "ChannelSdpa.attend"},
        run="\nm = ChannelSdpa()\nx = torch.randn(2, 16, 3, 4, requires_grad=True)\nout = m(x)\nleaves = [x]\n",
    ),
]


# -- s37 audit fixes (fix37) ----------------------------------------------------------------------
# F3: a 3-D mask handed to SDPA ([1, S, S] packed-image blocks, a per-head [N, S, S] bias mask) is
# broadcast as [1, 1|N, S, S]; the op takes only [B,N,Sq,Skv], [B,1,Sq,Skv], [1,1,Sq,Skv] and
# [Sq,Skv] (attention.mask_rank_lines).
_S37_PACKED_BLOCKS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class VisionBlocksAttention(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):
        seq = x.shape[0]
        q, k, v = self.qkv(x).reshape(seq, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        blocks = torch.zeros([1, seq, seq], device=x.device, dtype=torch.bool)
        for i in range(1, len(cu_seqlens)):
            blocks[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = True
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), blocks, dropout_p=0.0)
        return self.proj(out.squeeze(0).transpose(0, 1).reshape(seq, -1))
'''

_S37_PER_HEAD_MASK = '''
import torch
import torch.nn.functional as F


def heads_window(q, k, v, keep_per_head):
    # keep_per_head: [N, Sq, Skv] bool, one window per head, broadcast over the batch
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep_per_head.to(torch.bool))
'''

SdpaPattern.FUSE += [
    Fuse(
        _S37_PACKED_BLOCKS,
        name="s37_three_d_block_mask_gets_the_broadcast_leading_dim",
        expect={"qualname": "VisionBlocksAttention.forward"},
        run='''
m = VisionBlocksAttention()
x = torch.randn(10, 32, requires_grad=True)
out = m(x, [0, 4, 10])
leaves = [x]
''',
    ),
    Fuse(
        _S37_PER_HEAD_MASK,
        name="s37_per_head_three_d_mask_expanded_over_the_batch",
        expect={"qualname": "heads_window"},
        run='''
q = torch.randn(2, 3, 6, 16, requires_grad=True)
k = torch.randn(2, 3, 6, 16, requires_grad=True)
v = torch.randn(2, 3, 6, 16, requires_grad=True)
w = torch.ones(3, 6, 6, dtype=torch.bool).tril()
w[1] = torch.ones(6, 6, dtype=torch.bool).triu()
out = heads_window(q, k, v, w)
leaves = [q, k, v]
''',
    ),
]

# F4: a -inf causal bias plus the caller's float mask handed to SDPA: checked at run time before `< 0`
_S37_SUM_MASK = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, user_mask):
    s = q.shape[-2]
    causal = torch.full((s, s), float("-inf"), device=q.device).triu(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal + user_mask)
'''

SdpaPattern.FUSE += [
    Fuse(
        _S37_SUM_MASK,
        name="s37_causal_bias_plus_caller_mask_values_checked",
        expect={"qualname": "attend", "mask_kind": "float"},
        run='''
q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
pad = torch.zeros(2, 1, 1, 5)
pad[0, ..., 4:] = float("-inf")
graded = -torch.arange(5.0).view(1, 1, 1, 5)
out = (attend(q, k, v, pad), attend(q, k, v, graded))
leaves = [q, k, v]
''',
    ),
]

SdpaPattern.KEEP += [
    Keep(
        # a per-head graded bias of rank 3 (ALiBi slopes times distances): a bias, never binarised
        '''
import torch
import torch.nn.functional as F


def alibi_attend(q, k, v, slopes):
    s = q.shape[-2]
    pos = torch.arange(s, device=q.device)
    bias = slopes.view(-1, 1, 1) * (pos.view(1, 1, s) - pos.view(1, s, 1)).abs().neg()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
''',
        reason="bias",
        name="s37_rank_three_alibi_bias_is_not_a_mask",
    ),
]

# s39 (attn38's VisionLLaMA leftover, a shared spelling): SDPA called through ``functools.partial``: the partial's flags
# (dropout_p, is_causal, scale, enable_gqa) merged into the call where their values are constants or names nothing
# rebinds before it; a partial whose arguments the call site cannot hold is a near miss saying so
_S39_SDPA_THROUGH_PARTIAL = '''
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class CausalBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attend = partial(F.scaled_dot_product_attention, is_causal=True, scale=0.25)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v)
        return o.transpose(1, 2).reshape(b, n, c)


def local_attend(q, k, v, p: float):
    fn = partial(F.scaled_dot_product_attention, dropout_p=p)
    return fn(q, k, v)
'''

SdpaPattern.FUSE += [
    Fuse(_S39_SDPA_THROUGH_PARTIAL, expect={"qualname": "CausalBlock.forward", "sparse_mode": "2"}, run='''
m = CausalBlock()
x = torch.randn(2, 5, 32, requires_grad=True)
out = m(x)
leaves = [x]
''', name="s39_sdpa_through_functools_partial"),
]
SdpaPattern.KEEP += [
    Keep(
        # the partial or SDPA itself, chosen by a constructor argument, with a scale bound from it (VisionLLaMA)
        _S39_SDPA_THROUGH_PARTIAL.replace("partial(F.scaled_dot_product_attention, is_causal=True, scale=0.25)",
                                          "partial(F.scaled_dot_product_attention, scale=qk_scale) if qk_scale else F.scaled_dot_product_attention")
        .replace("def __init__(self, dim=32, heads=4):", "def __init__(self, dim=32, heads=4, qk_scale=None):")
        .split("\n\n\ndef local_attend")[0] + "\n",
        reason="decided by constructor arguments the call site does not hold",
        name="s39_sdpa_partial_chosen_in_init",
    ),
    Keep(
        # the dropout bound from a name rebound between the partial and the call: the call's value is the earlier one
        _S39_SDPA_THROUGH_PARTIAL.split("\n\n\nclass CausalBlock")[0] + '''


def local_attend(q, k, v, p: float):
    fn = partial(F.scaled_dot_product_attention, dropout_p=p)
    p = 0.0
    return fn(q, k, v)
''',
        reason="is bound before the call from a value the call site does not hold",
        name="s39_sdpa_partial_flag_rebound_before_the_call",
    ),
    Keep(
        _S39_SDPA_THROUGH_PARTIAL.replace("partial(F.scaled_dot_product_attention, dropout_p=p)",
                                          "partial(F.scaled_dot_product_attention, attn_mask=None, dropout_p=p)").split("\n\n\nclass CausalBlock")[0]
        + "\n\n\ndef local_attend" + _S39_SDPA_THROUGH_PARTIAL.replace("partial(F.scaled_dot_product_attention, dropout_p=p)",
                                          "partial(F.scaled_dot_product_attention, attn_mask=None, dropout_p=p)").split("\n\n\ndef local_attend")[1],
        reason="binds more than SDPA's flags",
        name="s39_sdpa_partial_binding_the_mask",
    ),
]

# s40 (HO16a Zenith): ``attn_mask=attention_mask`` (an optional parameter, None when generating) with ``is_causal=True``:
# both set has no single meaning (backends disagree), but where the mask is None the call is a plain causal SDPA: the
# fused call runs under ``attention_mask is None``, the original otherwise
_S40_OPTIONAL_MASK_AND_CAUSAL = '''
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask: Optional[torch.Tensor] = None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=True)
        return out.transpose(1, 2).reshape(b, n, c)
'''

SdpaPattern.FUSE += [
    Fuse(
        name="s40_optional_mask_with_is_causal",
        code=_S40_OPTIONAL_MASK_AND_CAUSAL,
        expect={"qualname": "CausalAttention.forward", "mask_kind": "causal"},
        run='''
m = CausalAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x]
''',
    ),
]
SdpaPattern.KEEP += [
    Keep(
        # the optional mask is filled in before the call: a mask always reaches it together with is_causal=True
        _S40_OPTIONAL_MASK_AND_CAUSAL.replace(
            "        out = F.scaled_dot_product_attention(",
            "        if attention_mask is None:\n            attention_mask = torch.zeros(n, n, device=x.device)\n"
            "        out = F.scaled_dot_product_attention("),
        reason="both attn_mask and is_causal=True are set",
        name="s40_optional_mask_filled_before_the_causal_call",
    ),
]

# s40 (wrong40): a mask built here whose construction can leave a query row with no key. A band that excludes the
# query itself keeps a key in every row once the sequence has two positions (the fused call runs under a run-time check
# that every row keeps one); a strict causal triangle leaves row 0 empty at every length (torch: NaN there; the fused
# op's value on a fully masked row is not pinned down): a near miss
_S40_BAND_WITHOUT_SELF = '''
import torch
import torch.nn.functional as F
from torch import nn


class NeighbourAttention(nn.Module):
    def __init__(self, dim=32, heads=4, window=2):
        super().__init__()
        self.heads, self.hd, self.window = heads, dim // heads, window
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=x.device)
        keep = ((i[:, None] - i[None, :]).abs() <= self.window) & (i[:, None] != i[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, c)
'''

SdpaPattern.FUSE += [
    Fuse(
        name="s40_band_mask_without_the_query_itself",
        code=_S40_BAND_WITHOUT_SELF,
        expect={"qualname": "NeighbourAttention.forward"},
        run='''
m = NeighbourAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x]
''',
    ),
]
SdpaPattern.KEEP += [
    Keep(
        _S40_BAND_WITHOUT_SELF.replace(
            "        keep = ((i[:, None] - i[None, :]).abs() <= self.window) & (i[:, None] != i[None, :])\n",
            "        keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(diagonal=-1)\n"),
        reason="leaves query row 0 without any key at every size",
        name="s40_strict_causal_mask_leaves_the_first_row_empty",
    ),
]
