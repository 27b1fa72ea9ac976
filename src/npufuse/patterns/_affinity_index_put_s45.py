"""s45 (helper attn45, audit44's left false reason): a value operand gathered with the mask and sliced on other axes.

TSPulse's ``mask[batch_mask] = mask[batch_mask].scatter(1, random_indices[batch_mask, :num_mask, :], False)``:
``random_indices[batch_mask, :num_mask, :]`` takes the mask's rows (its first index IS the mask), so "a tensor not
gathered with the mask" was false. The true blocker is the one of the neighbouring sites: ``scatter`` on the gathered
rows is not known to act element by element; where every call is elementwise, the slice on the other axes is what the
where form (over the whole tensor) would have to repeat, which npufuse does not do. (Before s45 such an operand could
also reach the where form still gathered: ``mask[bm] = mask[bm] & (idx[bm, :, :] >= n)`` became
``torch.where(bm, mask & (idx[bm, :, :] >= n), mask)``, [k, S, C] beside [B, S, C]: a shape error wherever the
mask selects more than one row and not every row, where the original runs.)
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, fast_walk, segment


def gathered_then_sliced(module: ModuleInfo, value: ast.expr, mask: ast.expr) -> str | None:
    """The text of the first ``X[mask, ...]`` in ``value`` (a tuple index whose first entry is the mask itself)."""
    mask_dump = ast.dump(mask)
    for n in fast_walk(value):
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Tuple) and n.slice.elts \
                and ast.dump(n.slice.elts[0]) == mask_dump:
            return segment(module, n)
    return None


def sliced_reason(text: str) -> str:
    return (f"`{text[:50]}` in the value takes the mask's rows and then indexes other axes: the where form, evaluated over "
            "the whole tensor, would need that indexing repeated on every row, which npufuse does not rewrite")
