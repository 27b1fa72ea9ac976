"""s46 (helper attn46b): wenet / FunASR / CosyVoice / InspireMusic attention split across methods.

``forward`` makes ``scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)`` and returns
``self.forward_attention(v, scores, mask)``; the helper masks, softmaxes and zeroes the masked probabilities under
a test of the mask (``if mask.size(2) > 0:``, the empty ``torch.ones((0, 0, 0))`` sentinel skips masking)::

    mask = mask.unsqueeze(1).eq(0)
    scores = scores.masked_fill(mask, -float('inf'))
    attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
  else:
    attn = torch.softmax(scores, dim=-1)

The s30 reading inlines the helper into the caller; what this module adds to it:

* **the zeroed branch**: ``Cond(test, softmax(S1).masked_fill(m, 0), softmax(S0))`` is read as the softmax of the
  conditional scores with the zeroing recorded under the same condition. Zeroing the positions the scores were
  masked with -inf at changes nothing on a row that keeps a key (those probabilities are already 0) and turns a
  fully masked row (NaN) into zeros; spec 5.1 leaves the fused op's value there open, so the rewrite zeroes the
  rows the mask passed to the op masks entirely (accepted only where that mask is the one term, BNSD). Before,
  the branch with the zeroing ran as written (``if mask is not None``) or the site was a near miss (a call in the
  test: ``mask.size(2) > 0``).
* **inherited helpers**: ``RelPositionMultiHeadedAttention(MultiHeadedAttention)`` overrides ``forward`` and calls
  the base class's ``forward_attention``: methods of the base classes this file defines (single inheritance, the
  nearest definition wins) are inlined too.
* **overrides**: a subclass anywhere may override the helper (a different mask or combine); the inlined body is
  the one this file defines, so the fused branch runs only where ``type(self).<m>`` is that function, the call as
  written otherwise.
"""

from __future__ import annotations

import ast
from typing import Any, Optional


def inlinable_methods(module: Any, cls: ast.ClassDef) -> dict[str, tuple[str, ast.FunctionDef]]:
    """name -> (the class that defines it, the method) for the methods ``self.<m>(..)`` reaches on ``cls``: its own
    and those of its base classes defined at module level in this file, single inheritance only (the nearest
    definition wins, as Python's method resolution does for one base chain)."""
    from npufuse.patterns import _site_s47review

    # s47 review: ``_site_s47review.lookup`` answers per name (the last ``def`` of a class body, not the first; a
    # store of ``self.<m>`` in any method of the chain shadows the method: not inlined); a decorated method's bare
    # body is not what the call runs (compilation markers aside): not inlined
    if cls.name not in module.classes or module.classes[cls.name] is not cls:
        return {}
    table = module.__dict__.setdefault("_npufuse_s47r_inlinable", {})
    found = table.get(id(cls))
    if found is None:
        names = {st.name for c in _site_s47review._chain(module, cls.name) for st in c.body if isinstance(st, ast.FunctionDef)}
        found = table[id(cls)] = {}
        for name in sorted(names):
            got = _site_s47review.lookup(module, cls.name, name)
            if got is not None and _site_s47review.decorators(module, got[1]) == "plain":
                found[name] = got
    return found


def override_test(module: Any, cls: ast.ClassDef, owner: str, method: str) -> Optional[str]:
    """``type(self).<m> is not <Owner>.<m>``: true where a subclass replaced the inlined method (the call then runs
    as written); None where ``cls`` is not a module-level class (no name the test could read)."""
    if not any(st is cls for st in module.tree.body) or owner not in module.classes:
        return None
    return f"type(self).{method} is not {owner}.{method}"


def zeroed_masked_branch(matcher: Any, node: Any, chain: Any) -> Optional[Any]:
    """``Cond(test, softmax(S1), softmax(S0))`` for ``Cond(test, softmax(S1).masked_fill(m, 0), softmax(S0))`` (either
    arm), the zeroing recorded as ``chain.zero_masked = m`` under that arm's condition (``chain.s46b_zero_cond``);
    :func:`zeroing_condition_holds` later requires ``m`` to be the mask the scores got under the same condition.
    None where the arms are not of that form."""
    from npufuse.patterns.attention import Cond, deref

    if getattr(chain, "zero_masked", None) is not None:
        return None
    for zeroed, plain, neg in ((node.body, node.orelse, False), (node.orelse, node.body, True)):
        if not matcher._last_dim_softmax(deref(plain, chain.seen)):
            continue
        z = deref(zeroed, chain.seen)
        inner = matcher._zeroed_masked_probs(z, chain)
        if inner is None:
            continue
        if getattr(chain, "zero_masked", None) is _nan_rows():
            chain.zero_masked = None
            continue  # ``P.masked_fill(isnan(P), 0)``: not the mask-positions reading this step is about
        chain.s46b_zero_cond = (node.test, neg)
        body, orelse = (inner, plain) if not neg else (plain, inner)
        return Cond(test=node.test, body=body, orelse=orelse)
    return None


def _nan_rows() -> Any:
    from npufuse.patterns import _attention_s33

    return _attention_s33.NAN_ROWS


def zeroing_condition_holds(matcher: Any, chain: Any, layout: str) -> Optional[bool]:
    """For a zeroing recorded by :func:`zeroed_masked_branch`: True where the scores' one mask term is the zeroed mask
    under the same condition (the fused output's fully masked rows are then zeroed from the mask the op gets);
    raises the matcher's Miss where it is not; None where the zeroing is not conditional (the unconditional check
    applies)."""
    from npufuse.patterns import _attention_s38
    from npufuse.patterns.attention import Miss, _S28Bias

    cond = getattr(chain, "s46b_zero_cond", None)
    if cond is None:
        return None
    test, neg = cond
    zeroed = chain.zero_masked
    same = [t for t in chain.masks if t.cond is not None and t.negate_cond == neg
            and (t.cond is test or ast.dump(t.cond) == ast.dump(test))
            and _attention_s38.same_masked_positions(t, zeroed)]
    if not same:
        raise Miss(f"attention probabilities are zeroed after softmax under `if {matcher.src(test)}` where "
                   f"`{matcher.src(zeroed)}`, not the mask the scores were masked with under that test: it would zero kept positions too")
    # a float bias (pse) is finite: it empties no row, the rows are the one mask's
    if len([t for t in chain.masks if not isinstance(t, _S28Bias)]) != 1:
        raise Miss(f"attention probabilities are zeroed after softmax under `if {matcher.src(test)}` beside other mask terms: "
                   "npufuse zeroes the rows of one conditional mask only (rows only the other terms mask entirely would differ)")
    if layout != "BNSD" or chain.heads_in_batch:
        raise Miss(f"attention probabilities are zeroed on masked keys after softmax under `if {matcher.src(test)}` with "
                   f"{layout} scores: npufuse zeroes the fully masked rows of a BNSD result only")
    # rendered from the mask the op gets (None where the test is false: nothing masked, nothing zeroed)
    chain.zero_masked = _attention_s38.FOLDED_MASK_ROWS
    chain.notes.append(f"the probabilities the original zeroes after the softmax under `if {matcher.src(test)}` (the masked keys) "
                       "are 0 already except on fully masked rows (NaN there): the fused output's fully masked rows are zeroed")
    return True


def reads_a_product(value: ast.expr, products: set[str]) -> bool:
    """``value`` is arithmetic over a name that holds a product (``(matrix_ac + matrix_bd) / math.sqrt(self.d_k)``:
    Transformer-XL's content and position terms summed a statement after they are made)."""
    if not products or not isinstance(value, ast.BinOp):
        return False
    return any(isinstance(n, ast.Name) and n.id in products for n in ast.walk(value))


def inlined_near_miss(miss: Any, call_stmt: ast.stmt, method: str) -> Any:
    """The near miss of the caller read with ``self.<method>`` inlined, placed on the caller's lines (from the scores'
    first statement, or the call where the reading stopped inside the inlined body, to the call)."""
    from npufuse.patterns.base import NearMiss

    line = miss.line if miss.line < call_stmt.lineno else call_stmt.lineno
    return NearMiss(miss.pattern, miss.qualname, line, call_stmt.end_lineno or call_stmt.lineno,
                    f"read with `self.{method}` (which gets these scores) inlined at line {call_stmt.lineno}, the inlined body's "
                    f"lines numbered on from there: {miss.reason}")
