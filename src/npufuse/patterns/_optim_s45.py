"""s45 (helper attn45, audit44's left false reason): a sharding flag whose "on" arm refuses to run.

LAVIS's runner (copied by MiniGPT-4 / InstructBLIP forks) reads ``self.use_fsdp`` where it would wrap the model:
``if self.use_fsdp: assert False, 'Not fully support FSDP ...' else: DDP(..)``. The flag names FSDP, but with it on the
program stops before any parameter is flattened, so FSDP never touches what the optimizer steps: the flag's other
reads (``if self.use_fsdp: return model``) are no cause of sharding either. A flag (a name or dotted attribute) that
some ``if FLAG: <assert False / raise> else: <the other way>`` of the file answers by failing is such a refused
flag (the decision point between two ways to run; a bare failing ``if`` elsewhere, say in an export helper, is not).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, dotted, fast_walk


def _fails(stmt: ast.stmt) -> bool:
    """``assert False[, msg]`` (also ``assert 0``) or a ``raise``: the arm stops the program."""
    if isinstance(stmt, ast.Raise):
        return True
    return isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and not stmt.test.value


def refused_flags(module: ModuleInfo) -> frozenset[str]:
    """Dotted names ``X`` that an ``if X: .. else: ..`` of the file answers only by failing (memoised per file)."""
    cached = module.__dict__.get("_npufuse_s45_refused_flags")
    if cached is None:
        found = set()
        for node in fast_walk(module.tree):
            # the decision point: the flag's arm fails, the other arm runs (wraps the model otherwise: DDP)
            if isinstance(node, ast.If) and isinstance(node.test, (ast.Name, ast.Attribute)) and node.body and node.orelse \
                    and all(_fails(st) for st in node.body):
                name = dotted(node.test)
                if name:
                    found.add(name)
        cached = module.__dict__["_npufuse_s45_refused_flags"] = frozenset(found)
    return cached


def refused_sharding_flag(module: ModuleInfo, node: ast.AST) -> bool:
    """``node`` (a name / attribute naming FSDP or DeepSpeed) is a flag the file refuses to run with."""
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return False
    name = dotted(node)
    return bool(name) and name in refused_flags(module)
