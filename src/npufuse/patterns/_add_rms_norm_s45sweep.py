"""s45 (helper sweep45): add_rms_norm forms split across the arms of a switch, read by class.

1. The norm of the residual sum inside one arm of a switch right after the add (HO21a's MoE-LLM block)::

       if self.use_rezero:                      # the sum: one add, or one add per arm of a flag (s27)
           x = residual + self.rezero_alpha * attn_out
       else:
           x = residual + attn_out
       residual = x
       if use_checkpoint:                       # a test that does not read the sum
           mlp_out, aux = checkpoint(self._forward_mlp, x, use_reentrant=False)
       else:                                    # the arm the norm heads: directly, or as a fork whose every
           if isinstance(self.mlp, MoE):        # arm normalises the sum first
               mlp_out, aux = self.mlp(self.ln2(x))
           else:
               mlp_out = self.mlp(self.ln2(x))
               aux = torch.tensor(0.0, device=x.device)

   Each arm of the flag adds two tensors (``self.rezero_alpha * attn_out`` is a tensor: npu_add_rms_norm takes
   it evaluated, spec 2.2), so whichever arm runs the norm reads ``x1 + x2``. The add moves into both arms of the
   switch: fused with the norm in the arm the norm heads, as written (then the arm) in the other. The switch's
   test must be free of effects (names, attributes, ``isinstance`` / ``type`` / ``len``) and not read the sum or
   its aliases: it then runs before the add. Near misses kept: a flag arm that scales the whole sum
   (``x = (residual + attn_out) * alpha``, no ``x1 + x2`` left); a switch test reading the sum.
"""

from __future__ import annotations

import ast
from typing import Any, Iterator

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo, Scope


def _sum_of(A: Any, module: ModuleInfo, stmt: ast.stmt) -> tuple[str, tuple, list | None] | None:
    """(sum name, the first operands, each flag arm's operands or None) of a one-name residual add or of a flag whose
    every arm assigns that name a residual add; None for any other statement."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        ops = A._operands(module, stmt.value)
        if ops is None or isinstance(ops, str):
            return None
        return stmt.targets[0].id, ops, None
    found = A._branch_sum(module, stmt)
    if found is None or isinstance(found, str):
        return None
    return found[0], found[1][0], found[1]


def switch_arm_sites(module: ModuleInfo, scope: Scope) -> Iterator[tuple[ast.stmt, Any]]:
    """The sites of the module doc: (norm statement, ``_Site``) or (statement, near-miss reason)."""
    # the detector's readers; imported here because add_rms_norm imports this module
    from npufuse.patterns import add_rms_norm as A

    text = S.scope_text(module, scope)
    if "else" not in text or "if " not in text:
        return
    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        if not isinstance(stmt, (ast.Assign, ast.If)):
            continue
        found = _sum_of(A, module, stmt)
        if found is None:
            continue
        s_name, ops, branches = found
        block, i = idx.block[id(stmt)]
        j = i + 1
        aliases: list[ast.stmt] = []
        while j < len(block) and A._is_alias(block[j], s_name):
            aliases.append(block[j])
            j += 1
        t = block[j] if j < len(block) else None
        if not (isinstance(t, ast.If) and t.body and t.orelse and A._pure_test(t.test)):
            continue
        written = {s_name} | {a.targets[0].id for a in aliases}  # type: ignore[attr-defined]
        if S.names_read(t.test) & written or A._fork(module, scope, t, s_name, multi=True) is not None:
            continue  # a test reading the sum runs after it; both arms normalising it: the fork form (_sites)
        yield from _arm_site(A, module, scope, stmt, t, s_name, ops, branches, aliases)


def _arm_site(A: Any, module: ModuleInfo, scope: Scope, stmt: ast.stmt, t: ast.If, s_name: str, ops: tuple,
              branches: list | None, aliases: list[ast.stmt]) -> Iterator[tuple[ast.stmt, Any]]:
    """The site of the first arm of switch ``t`` that the norm of the sum heads (as a fork of its own, or as its
    first statement), if any."""
    for arm_name, arm in (("body", t.body), ("orelse", t.orelse)):
        fork = A._fork(module, scope, arm[0], s_name, multi=True)
        if fork is not None:
            fork_if, fstmt, fnc, fork_else = fork
            if fnc.kind == "not_rms":
                yield fstmt, fnc.reason
            else:
                yield fstmt, A._Site(stmt, aliases, fstmt, fnc, ops[0], ops[1], s_name, None, fork_if, fork_else,
                                     branches=branches, head_if=t, head_arm=arm_name)
            return
        found = list(A._norm_of_sum(module, scope, arm[0], s_name,
                                    lambda nstmt, nc, arm_name=arm_name: A._Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name,
                                                                                 branches=branches, head_if=t, head_arm=arm_name)))
        if arm_name == "body" and branches is None:
            if found:
                return  # a one-add sum whose norm heads the body: _head_sites reads it (not the else arm too: one site)
            continue
        if found:
            yield from found
            return
