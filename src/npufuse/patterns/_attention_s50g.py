"""s50 gaps50: mask terms nothing checks for fully masked query rows (a handed-in boolean padding mask).

mask49 left one class unchecked: a boolean mask handed in (``scores.masked_fill(mask == 0, -1e9)``), a mask built in
view from a handed-in boolean (``zeros.masked_fill(~keep, finfo.min)``), a comparison cast to 0 / 1 -- constructions
``_mask_rows`` does not read (its verdict is None) and whose values no run-time check covers. A key-padding mask
[B, 1, 1, Skv] of that kind masks a whole row only for a sequence that is all padding; eager then gives a row whose
every logit is the same finite fill -- a uniform average of v -- while npu_fusion_attention's value on a fully masked
row is not pinned down (spec 5.1 / 14; the emulator zeroes it): cos 0.77 on such a call (s49).

Two repairs, by what the original computes on such a row:

* ``zero_q`` (no host sync): ONE mask term, a boolean / 0-1 mask applied by REPLACING the masked logits with a finite
  constant (``masked_fill(m, C)``, ``s * m - C * (1 - m)``). A fully masked row is C throughout: softmax is uniform,
  no gradient reaches q or k from it (the fill cuts it), and v gets 1 / Skv of the row's output gradient. The fused
  call computes exactly that where the row is unmasked in ``atten_mask`` and q's row is 0 (every logit 0: uniform,
  dq = dS k (zeroed by the fill of q), dk = dS^T q = 0): ``_npufuse_empty = mask.all(-1, keepdim=True)``,
  ``q.masked_fill(_npufuse_empty, 0)``, ``mask & ~_npufuse_empty``. Dropout then falls on the uniform row as in the
  original (the op's own Philox stream). BNSD only (the rows [B, 1|N, Sq, 1] broadcast against q there), no pse, no
  sink (either would make the eager row something other than uniform).
* ``rows`` (a host sync on the boolean mask): anything else in the class -- an additive bias built from the boolean
  (``s + finfo.min`` keeps a gradient to s through the sum, which the op cannot give), several terms (a causal -inf
  triangle beside finfo.min padding: the row puts all its weight on the finfo.min keys, not uniform), other layouts.
  mask49's combined-rows check: the original runs where a query row of the op's mask keeps no key.

A ``-inf`` fill is left as it was: the original's fully masked row is NaN, so no value of the fused op is less right
(where the original zeroes NaN rows, s33's zeroing already matches).
"""

from __future__ import annotations

import ast
from typing import Any, Optional

ZERO_Q = "zero_q"
ROWS = "rows"
UNCHECKED = "unchecked"


def flag_unread(term: Any) -> None:
    """``_mask_rows`` could not read the term's construction (a handed-in mask): nothing proves its rows keep a key."""
    try:
        term.s50_unread = True
    except AttributeError:
        pass


def flag_finite(term: Any, finite: bool) -> None:
    """The boolean term's fill is a finite value (finfo.min, -1e9), not -inf."""
    try:
        term.s50_finite = finite
    except AttributeError:
        pass


def _finite(term: Any, module: Any, scope: Any) -> bool:
    """True where the fully masked row of the original may be finite (not NaN): a finite fill, a 0 / 1 offset, an
    additive construction (or the helper method / function building it) that writes a finite large negative value
    (``finfo.min``, ``-1e9``, ``-10000``). An additive term built from -inf only gives NaN there: nothing to keep."""
    if term.kind == "keep01":
        return True
    if term.kind != "additive":
        return bool(getattr(term, "s50_finite", True))
    from npufuse.patterns import _attention_s42
    from npufuse.patterns.attention import _deref_value, walk_sym

    nodes = list(walk_sym(_deref_value(term.node)))
    for n in list(nodes):
        if isinstance(n, ast.Call):
            fn = _attention_s42.helper_of_call(module, scope, n)
            if fn is not None:
                nodes += list(ast.walk(fn))
    return any(_finite_fill(n) for n in nodes)


def _finite_fill(n: ast.AST) -> bool:
    if isinstance(n, ast.Attribute) and n.attr in ("min", "max") and isinstance(n.value, ast.Call):
        f = n.value.func  # `torch` may be a symbolic reference here: the attribute's own name decides
        return isinstance(f, ast.Attribute) and f.attr == "finfo" or isinstance(f, ast.Name) and f.id == "finfo"
    return isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool) \
        and 1000 <= abs(n.value) < float("inf")


def unread_terms(chain: Any, module: Any, scope: Any, line: int) -> list[Any]:
    """The chain's non-causal terms no check covers. ``_row_checks`` flags them; where it returns early (the original
    zeroes NaN rows) the verdicts are read here."""
    from npufuse.patterns import _attention_s33, _mask_rows
    from npufuse.patterns.attention import _row_ref_value

    zeroed = getattr(chain, "zero_masked", None)
    if zeroed is not None and zeroed is not _attention_s33.NAN_ROWS:
        return []  # the original zeroes the mask's masked positions: a fully masked row is 0 on both sides
    if zeroed is _attention_s33.NAN_ROWS:
        polarity = {"masked": "masked", "keep": "keep", "additive": "additive", "keep01": "keep01"}
        resolve = _mask_rows.Resolver(module, scope, line, _row_ref_value(scope, line))
        for m in chain.masks:
            if m.causal or m.kind not in polarity or getattr(m, "s50_value_rows", False):
                continue
            if _mask_rows.row_verdict(m.node, polarity[m.kind], resolve) is None:
                flag_unread(m)
    return [m for m in chain.masks if getattr(m, "s50_unread", False) and not m.causal and _finite(m, module, scope)]


def plan(chain: Any, module: Any, scope: Any, line: int, *, combined: bool, layout: str, three_d: bool, folded: bool,
         pse: bool, text_of: Any) -> Optional[str]:
    """ZERO_Q, ROWS, UNCHECKED (a ROWS case whose mask a method / repository function builds: the fallback would call
    it a second time, which s41 refuses; the candidate stays with a risk line saying so) or None (nothing to repair,
    or the combined rows are checked already)."""
    if combined:
        return None
    unread = unread_terms(chain, module, scope, line)
    if not unread:
        return None
    if (len(chain.masks) == 1 and unread[0].kind in ("masked", "keep", "keep01") and layout == "BNSD" and not three_d
            and not folded and not pse and chain.s44_sink is None and not chain.heads_in_batch
            and chain.s43_score_axes is None):
        return ZERO_Q
    from npufuse.patterns import _mask_rows
    from npufuse.patterns.attention import Miss

    for m in chain.masks:
        try:
            text = text_of(m.node)
        except Miss:
            continue
        if _repeats_a_builder(module, text):
            return UNCHECKED  # the original, run where a row is empty, would call the helper building the mask again
    return ROWS


def _repeats_a_builder(module: Any, text: str) -> bool:
    """The mask's text calls a method of the object or a repository function (``_mask_rows.repeated_call``), other
    than an einops function (``repeat`` / ``rearrange``: pure reshapes of the handed-in mask, free to evaluate again)."""
    from npufuse.patterns import _mask_rows

    for _ in range(8):
        again = _mask_rows.repeated_call(text)
        if again is None:
            return False
        try:
            call = ast.parse(again, mode="eval").body
        except SyntaxError:
            return True
        if not isinstance(call, ast.Call) or not (module.canonical(call.func) or "").startswith("einops."):
            return True
        text = text.replace(again, f"({ast.unparse(call.args[0])})" if call.args else "0")  # look past it
    return True


def zero_q_lines(maybe_none: bool, q_text: str) -> list[str]:
    """Rows the mask masks throughout: unmasked for the op, with q's row zeroed (see the module doc)."""
    why = "  # query rows masked throughout: eager fills them with one finite value (a uniform average of v); the op gets them unmasked with q's row 0, the same row"
    if maybe_none:
        return [f"_npufuse_empty = _npufuse_mask.all(-1, keepdim=True) if _npufuse_mask is not None else "
                f"torch.zeros((), dtype=torch.bool, device={q_text}.device){why}",
                "if _npufuse_mask is not None:",
                "    _npufuse_mask = _npufuse_mask & ~_npufuse_empty"]
    return [f"_npufuse_empty = _npufuse_mask.all(-1, keepdim=True){why}",
            "_npufuse_mask = _npufuse_mask & ~_npufuse_empty"]


def zeroed_q(q_arg: str) -> str:
    from npufuse.patterns.attention import atom

    return f"{atom(q_arg)}.masked_fill(_npufuse_empty, 0)"


ZERO_Q_RISK = ("the mask is handed in (or built from a tensor handed in), so a query row may have every key masked (a "
               "sequence that is all padding): the original fills such a row with one finite value, a uniform average "
               "of v, while npu_fusion_attention's value on a fully masked row is not pinned down (spec 5.1 / 14); the "
               "fused branch unmasks those rows and zeroes q there (every logit 0: the same uniform row, the same "
               "gradients), one reduction on the boolean mask and a masked_fill of q per call, no host sync")

ROWS_RISK = ("the mask is handed in (or built from a tensor handed in), so a query row may have every key masked (a "
             "sequence that is all padding, left padding beside a causal triangle): the original's row there is what "
             "its finite fill leaves (a uniform average, or the weight of the finite keys), npu_fusion_attention's value "
             "is not pinned down (spec 5.1 / 14); the rows of the boolean mask the op gets are checked once it is "
             "built and the original code runs where one keeps no key: a reduction and a host sync per call")

UNCHECKED_RISK = ("the mask is built by a method / function of the repository from a tensor handed in, so a query row may have "
                  "every key masked (a sequence that is all padding): the original's row there is what its finite fill leaves "
                  "(a uniform average of v), npu_fusion_attention's value is not pinned down (spec 5.1 / 14); NOT checked at run "
                  "time (the original code, run where a row is empty, would call the mask's builder a second time): exact for "
                  "batches in which every sequence keeps a key")
