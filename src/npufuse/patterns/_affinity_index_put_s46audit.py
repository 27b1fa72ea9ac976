"""affinity_index_put reasons corrected by the s46 precision audit (helper audit46): each named a fact the code did
not hold.

* CDARTS' mmdet ``BaseDetector.show_result``: ``img_show[mask] = img_show[mask] * 0.5 + color_mask * 0.5`` with
  ``color_mask = np.random.randint(0, 256, (1, 3), dtype=np.uint8)``: the reason called ``color_mask`` "a tensor not
  gathered with the mask"; it is a numpy array, and numpy is what rules the rewrite out.
* trl's XPO ``model_scores[~model_contain_eos] -= self.args.missing_eos_penalty``: the reason said "the value is not a
  scalar"; a float from the configuration is one, npufuse only cannot show it (the wording of the plain assignment's
  reason, "is not known to be a scalar").
"""

from __future__ import annotations

import ast
from typing import Callable

from npufuse.scan.dataflow import ModuleInfo, Scope, fast_walk

# how the scalar-or-gather reason of an augmented assignment reads (was "the value is not a scalar and ...")
AUG_NOT_SHOWN = ("the value is not known to be a scalar and not shown to be the same mask's gather element by element: "
                 "it may hold one row per selected element (a masked scatter-add), which no elementwise rewrite reproduces")


# numpy calls that build an array (``np.log(1 + f_max / 700)`` of Python numbers is a numpy scalar, which a torch
# expression takes like a float: not evidence)
_ARRAY_MAKERS = frozenset(("array", "asarray", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "full_like",
                           "arange", "linspace", "stack", "concatenate", "vstack", "hstack", "randint", "rand", "randn",
                           "random", "uniform", "normal", "choice", "permutation", "tile", "repeat", "eye"))


def _numpy_array_call(module: ModuleInfo, value: ast.expr | None) -> bool:
    if not isinstance(value, ast.Call):
        return False
    name = module.canonical(value.func) or ""
    return name.startswith("numpy.") and name.rsplit(".", 1)[-1] in _ARRAY_MAKERS


def numpy_value_operand(module: ModuleInfo, scope: Scope, value: ast.expr, line: int,
                        is_numpy: Callable[[ModuleInfo, Scope, ast.expr, int], bool]) -> str | None:
    """The first plain name read in ``value`` bound from a numpy array constructor (``np.random.randint(0, 256, (1,
    3))``) that this function builds with numpy (``is_numpy``: the target test of affinity_index_put), None otherwise."""
    for n in fast_walk(value):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and _numpy_array_call(module, scope.definition(n.id, line)) \
                and is_numpy(module, scope, n, line):
            return n.id
    return None


def numpy_value_reason(name: str) -> str:
    return (f"`{name}` in the value is a numpy array, not a torch tensor: masked_fill_ / torch.where take tensors only "
            "(the assignment is numpy indexing)")
