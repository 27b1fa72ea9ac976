"""s46 (moe46b): moe_experts forms read by small hooks in :mod:`npufuse.patterns.moe_experts`.

1. An expert called through a named method of its own (FlashMoE's export path: ``yb = expert.forward_export(xb)``,
   ``expert.infer(rows)``): the loop runs that method on each expert's rows; the fused layer calls the same method
   on each expert's contiguous rows after the permute (:func:`named_expert_method`). The MLP is never read off the
   class's ``forward`` then (another method may compute something else): the experts stay opaque. ``nn.Module``'s own
   methods (``to``, ``apply``, ``get_submodule`` ..) compute no expert output and are not read.
2. A raising check in the expert loop that guards the method the loop calls (``if not hasattr(expert, "m"): raise
   ..`` right before ``expert.m(rows)``): it fires exactly where the call it guards would raise AttributeError (the
   same expert, reached with rows), so it changes no value; the fused text calls ``m`` on the same experts and raises
   there too (another exception type) (:func:`method_guard`). Any other condition, or a guard of a method the loop
   does not call, stays conditional code.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import ModuleInfo

# nn.Module's public methods (torch 2.x): none of them is an expert's computation on its rows
_MODULE_METHODS = frozenset({
    "add_module", "apply", "bfloat16", "buffers", "children", "compile", "cpu", "cuda", "double", "eval", "extra_repr",
    "float", "get_buffer", "get_extra_state", "get_parameter", "get_submodule", "half", "ipu", "load_state_dict",
    "modules", "mtia", "named_buffers", "named_children", "named_modules", "named_parameters", "npu", "parameters",
    "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_module", "register_parameter",
    "requires_grad_", "set_extra_state", "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train",
    "type", "xpu", "zero_grad",
})


def named_expert_method(call: ast.Call) -> Optional[str]:
    """``m`` of ``<expert>.m(rows)`` (one positional argument, no keywords) when ``m`` may be an expert's own
    computation: not ``forward`` (read as the call itself elsewhere), not a dunder, not an ``nn.Module`` method (the
    caller also asks :func:`defined_as_method`)."""
    f = call.func
    if not isinstance(f, ast.Attribute) or len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        return None
    name = f.attr
    if name == "forward" or name.startswith("__") or name in _MODULE_METHODS:
        return None
    return name


def defined_as_method(module: ModuleInfo, name: str) -> bool:
    """A class of this file defines a method ``name`` (``expert.w1(x)`` of a submodule attribute is no such method:
    it is one layer of the expert, not its computation)."""
    return any(isinstance(st, ast.FunctionDef) and st.name == name for cls in module.classes.values() for st in cls.body)


def method_guard(stmt: ast.stmt) -> Optional[tuple[ast.expr, str]]:
    """``(E, m)`` of ``if not hasattr(E, "m"): raise ..`` (no else, the raise alone in the body), ``E`` a name or a
    subscript (the expert as the loop names it)."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Raise)):
        return None
    test = stmt.test
    if not (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Call)):
        return None
    call = test.operand
    if not (isinstance(call.func, ast.Name) and call.func.id == "hasattr" and len(call.args) == 2 and not call.keywords
            and isinstance(call.args[0], (ast.Name, ast.Subscript)) and isinstance(call.args[1], ast.Constant)
            and isinstance(call.args[1].value, str)):
        return None
    return call.args[0], call.args[1].value


def unmet_method_guard(guards: list[tuple[str, str, bool]], called_on: str, method: str, skip_empty: bool,
                       every_expert_hit: bool) -> Optional[str]:
    """Why the loop's ``hasattr`` guards (expert expression dumped, method, whether a skip of experts without rows
    came before it) may change what runs, or None: each must guard the method the loop calls, on the expert it calls
    it on, and be reached only by experts the fused layer calls (after the skip, or in a loop over the experts hit)."""
    for expert, name, after_skip in guards:
        if name != method or expert != called_on:
            return f"the loop raises unless the expert has `{name}`, which it does not call on its rows"
        if skip_empty and not after_skip and not every_expert_hit:
            return (f"the loop checks `{name}` on experts it then skips for want of rows: the fused layer calls only "
                    "the experts with rows")
    return None


def residual_sign(op: ast.operator, left_is_expert: bool) -> Optional[str]:
    """``-`` for ``expert(rows) - rows``, ``+`` for ``expert(rows) + rows`` / ``rows + expert(rows)``: the residual
    expert's output, itself a row-wise function of the expert's rows (the fused layer calls it as such); None for
    ``rows - expert(rows)`` and other operators."""
    if isinstance(op, ast.Add):
        return "+"
    if isinstance(op, ast.Sub) and left_is_expert:
        return "-"
    return None


def clone_start(value: ast.expr) -> Optional[str]:
    """``T`` of ``T.clone()`` (``T`` a name): an accumulator that starts from a copy of ``T``; the experts' sum is added
    into it, rows no expert writes keep ``T``'s values."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "clone" \
            and not value.args and not value.keywords and isinstance(value.func.value, ast.Name):
        return value.func.value.id
    return None


# -- examples (``s46b_*``) ----------------------------------------------------------------------------------------------
# (built on moe46's FlashMoE reproducers; imported here, below the readers, as moe_experts imports this module first)
from npufuse.patterns import _moe_s46  # noqa: E402
from npufuse.patterns.base import Fuse, Keep  # noqa: E402

_CALL = "            yb = self.experts[e](x[toks])\n"
# the expert class gains an export method that computes something else than forward (so the method called matters)
_WITH_EXPORT = ("    def forward(self, x):\n        return self.net(x)\n",
                "    def forward(self, x):\n        return self.net(x)\n\n"
                "    def forward_export(self, x):\n        return 0.5 * self.net(x)\n")


def _export(code: str) -> str:
    return code.replace(*_WITH_EXPORT, 1)


# FlashMoE's export loop (less its co-filter): a named method behind a hasattr check, residual experts added into
# a copy of the tokens, over the experts present in the sorted routes
FLASH_EXPORT = _export(_moe_s46.FLAT_SORTED_UNIQUE).replace("y = torch.zeros_like(x)", "y = x.clone()").replace(_CALL, """\
            xb = x[toks]
            expert = self.experts[e]
            if not hasattr(expert, "forward_export"):
                raise RuntimeError(f"Expert {e} missing 'forward_export'")
            yb = expert.forward_export(xb)
            yb = yb - xb
""")
# a named method alone, read through the module list (unsorted flat routes, range loop)
METHOD_ONLY = _export(_moe_s46.FLAT_NONZERO).replace(_CALL, "            yb = self.experts[e].forward_export(x[toks])\n")
# the guard after the skip of experts without rows, in a range loop; the method bound as `expert`
GUARD_AFTER_SKIP = _export(_moe_s46.FLAT_NONZERO).replace(_CALL, """\
            expert = self.experts[e]
            if not hasattr(expert, "forward_export"):
                raise AttributeError("export path needs forward_export")
            yb = expert.forward_export(x[toks])
""")
# the residual added (`expert(xb) + xb`) into a clone of the tokens
RESIDUAL_PLUS = _moe_s46.FLAT_NONZERO.replace("y = torch.zeros_like(x)", "y = x.clone()").replace(_CALL, """\
            xb = x[toks]
            yb = xb + self.experts[e](xb)
""")
# the residual alone (zeros start): `delta = expert(xb) - xb`
RESIDUAL_ZEROS = _moe_s46.FLAT_SORTED.replace(_CALL, """\
            xb = x[toks]
            delta = self.experts[e](xb) - xb
            yb = delta
""")

# (code, name, the parameters expected); every one runs under the emulator, with gradients, on moe46's run
_FUSE_CASES = (
    (FLASH_EXPORT, "flash_export_guarded_method_residual_into_a_clone",
     {"indices": "topk_idx", "tokens": "x", "layout": "expert_modules"}),
    (METHOD_ONLY, "expert_named_method_on_its_rows", {"indices": "topk_idx", "layout": "expert_modules"}),
    (GUARD_AFTER_SKIP, "hasattr_guard_after_the_skip_range_loop", {"indices": "topk_idx", "loop": "range"}),
    (RESIDUAL_PLUS, "residual_expert_plus_rows_into_a_clone", {"indices": "topk_idx", "output": "y"}),
    (RESIDUAL_ZEROS, "residual_expert_minus_rows_from_zeros", {"indices": "topk_idx"}),
)
FUSE = [Fuse(code, name=f"s46b_{name}", run=_moe_s46.FLAT_NONZERO_RUN, expect=expect) for code, name, expect in _FUSE_CASES]
KEEP = [
    # the check names forward_export but the loop calls the expert itself: experts without it raise in the original
    # only; the fused layer would run them
    Keep(FLASH_EXPORT.replace("yb = expert.forward_export(xb)", "yb = expert(xb)"),
         reason="the loop raises unless the expert has `forward_export`, which it does not call on its rows",
         name="s46b_hasattr_guard_of_a_method_not_called"),
    # the check before the skip, in a range loop: an expert without rows and without the method raises in the
    # original; the fused layer never calls it
    Keep(GUARD_AFTER_SKIP.replace("""\
            if pos.numel() == 0:
                continue
            toks = tok_idx[pos]
            ws = w_flat[pos]
            expert = self.experts[e]
            if not hasattr(expert, "forward_export"):
                raise AttributeError("export path needs forward_export")
""", """\
            expert = self.experts[e]
            if not hasattr(expert, "forward_export"):
                raise AttributeError("export path needs forward_export")
            if pos.numel() == 0:
                continue
            toks = tok_idx[pos]
            ws = w_flat[pos]
"""), reason="on experts it then skips for want of rows", name="s46b_hasattr_guard_before_the_skip"),
    # the rows minus the expert (`xb - expert(xb)`): read only as the expert's output plus or minus its rows
    Keep(RESIDUAL_ZEROS.replace("delta = self.experts[e](xb) - xb", "delta = xb - self.experts[e](xb)"),
         reason="is not recognised", name="s46b_rows_minus_the_expert"),
    # a raise under a condition on the rows: a check npufuse does not read (it could fire on some experts only)
    Keep(METHOD_ONLY.replace("            yb = self.experts[e].forward_export(x[toks])\n", """\
            if toks.numel() > 4:
                raise ValueError("too many tokens for the export path")
            yb = self.experts[e].forward_export(x[toks])
"""), reason="conditional code inside the expert loop", name="s46b_raise_under_a_row_count_condition"),
    # a submodule of the expert (`net`, built in __init__), not a method of a class of this file: one layer of the
    # expert, which npufuse does not read as the expert's whole computation
    Keep(METHOD_ONLY.replace("self.experts[e].forward_export(x[toks])", "self.experts[e].net(x[toks])"),
         reason="is not recognised", name="s46b_expert_submodule_call_is_not_a_method"),
    # nn.Module's own `to` is no expert computation: its result is a module
    Keep(METHOD_ONLY.replace("self.experts[e].forward_export(x[toks])", "self.experts[e].to(x[toks])"),
         reason="is not recognised", name="s46b_module_method_is_not_an_expert_call"),
]
