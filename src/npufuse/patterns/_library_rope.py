"""Rope modules of third-party model libraries, swapped where they are built (s40; the rope side of
``_library_norm.THIRD_PARTY_RMS_NORMS``).

HO15a's mini-llm-brawl builds its attention from ``torchtune.modules.RotaryPositionalEmbeddings``; the rotation
runs in the library's forward, so the site is the construction (the label sets' library-module convention). The
table holds classes whose forward was read at their release tags:

* torchtune ``RotaryPositionalEmbeddings`` (torchtune/modules/position_embeddings.py, read at v0.1.0, v0.2.0 ..
  v0.6.1 and main 2025): x ``[b, s, n_h, h_d]``; ``cache`` a buffer ``[max_seq_len, h_d/2, 2]`` (cos, sin of
  ``pos * theta``, fp32); ``rope_cache = cache[:s]`` when ``input_pos`` is None (else ``cache[input_pos]``), x
  computed in fp32 as lane pairs ``x.float().reshape(.., -1, 2)``: ``(x0 c - x1 s, x1 c + x0 s)`` stacked and
  flattened (interleaved pairs), ``type_as(x)``. Only ``view(1, ..)`` (0.1.0) vs ``view(-1, ..)`` differ, which
  matters with ``input_pos`` only. The forward's code names are the same at every tag read.

The swap replaces the instance's forward where its class is exactly the one read and its forward's code names
are the ones read; it runs ``npu_rotary_mul(x.float(), cos, sin, rotary_mode='interleave')`` with the cache's
cos / sin repeat_interleave'd to the full head dim as ``[1, s, 1, h_d]`` (the op's ``1S1D`` table for BSND),
only where ``input_pos`` is None, x is 4-D with B*N < 1000 and an even h_d < 896 (spec 4.1); else the library's
own forward.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterator

from npufuse.patterns import _site as S
from npufuse.patterns._library_norm import library_table_key
from npufuse.patterns.base import Finding, NearMiss, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted


@dataclass(frozen=True)
class ThirdPartyRope:
    runtime_module: str  # the class's ``__module__`` at run time
    name: str
    forms: tuple[tuple[str, ...], ...]  # the forward's ``co_names`` at the releases read
    semantics: str


THIRD_PARTY_ROPES: dict[str, ThirdPartyRope] = {
    "torchtune.RotaryPositionalEmbeddings": ThirdPartyRope(
        "torchtune.modules.position_embeddings", "RotaryPositionalEmbeddings",
        (("size", "cache", "float", "reshape", "shape", "view", "torch", "stack", "flatten", "type_as"),),
        "x [b, s, n_h, h_d] rotated in fp32 as interleaved lane pairs by the cached cos / sin of the first s positions "
        "(input_pos None), x's dtype out (torchtune 0.1.0 .. 0.6.1, main)"),
}
_PACKAGES = {key.split(".", 1)[0] for key in THIRD_PARTY_ROPES}
_CLASS_NAMES = tuple(dict.fromkeys(spec.name for spec in THIRD_PARTY_ROPES.values()))


def third_party_rope_class(module: ModuleInfo, func: ast.expr) -> str | None:
    """The ``THIRD_PARTY_ROPES`` key of the class a constructor's callee stands for (the library's own
    re-exports, or a re-export of the repository); None for anything else."""
    return library_table_key(module, func, THIRD_PARTY_ROPES, _PACKAGES)


_SWAP = "_npufuse_third_party_rope_swap"


def _swap_helper(T: str) -> str:
    """The local function swapping one verified library rope instance's forward (the table's facts are
    arguments written at the construction)."""
    return "\n".join([
        f"def {_SWAP}(rope, module, name, forms):",
        "    # a third-party rope module's forward through torch_npu.npu_rotary_mul for NPU input, where the instance's",
        "    # class is exactly the one read and its forward has the code names read (else left as it is)",
        "    cls = type(rope)",
        "    if cls.__module__ != module or cls.__name__ != name:",
        "        return rope",
        "    code = getattr(cls.__dict__.get('forward'), '__code__', None)",
        "    if code is None or tuple(code.co_names) not in forms:",
        "        return rope  # a release whose forward was not read: its own forward",
        "    def forward(self, x, *args, **kwargs):",
        "        cache = getattr(self, 'cache', None)",
        f"        if (_npufuse_on_npu(x) and type(self) is cls and not args and kwargs.get('input_pos') is None and x.dim() == 4"
        f" and x.dtype in ({T}.float16, {T}.bfloat16, {T}.float32) and x.shape[-1] % 2 == 0 and x.shape[-1] < 896"
        " and x.shape[0] * x.shape[2] < 1000 and cache is not None and cache.dim() == 3 and cache.shape[0] >= x.shape[1]"
        " and cache.shape[1] * 2 == x.shape[-1]):",
        "            # the library's table: cos / sin of each lane pair, repeated to the full head dim, as [1, s, 1, h_d]",
        "            table = cache[: x.shape[1]].float()",
        "            cos = table[..., 0].repeat_interleave(2, dim=-1).view(1, x.shape[1], 1, x.shape[-1])",
        "            sin = table[..., 1].repeat_interleave(2, dim=-1).view(1, x.shape[1], 1, x.shape[-1])",
        "            return torch_npu.npu_rotary_mul(x.float(), cos, sin, rotary_mode='interleave').type_as(x)",
        "        return cls.forward(self, x, *args, **kwargs)",
        "",
        "    rope.forward = forward.__get__(rope)",
        "    return rope",
        "",
    ])


_RISKS = [
    Risk("numerics", "the library's rotation runs as npu_rotary_mul in fp32 (as the library computes it), the result in x's "
                     "dtype: the same formula, one kernel"),
    Risk("other", "the module is swapped where it is built: every call of it with input_pos None on NPU input runs the fused op; "
                  "calls with input_pos (decoding with a cache) run the library's forward"),
]


def construction_sites(module: ModuleInfo, scope: Scope) -> Iterator[Result]:
    """One finding per statement constructing the table's library rope modules (each construction wrapped in
    the swap: checkpoints and call sites unchanged). Cheap gate: the class name or a local alias of it."""
    gate = module.__dict__.get("_npufuse_library_rope_words")
    if gate is None:
        words = set(_CLASS_NAMES) | {local for local, full in module.aliases.items() if full.rsplit(".", 1)[-1] in _CLASS_NAMES}
        gate = module.__dict__["_npufuse_library_rope_words"] = tuple(sorted(words)) if any(
            full.split(".", 1)[0] in _PACKAGES or full.rsplit(".", 1)[-1] in _CLASS_NAMES for full in module.aliases.values()) else ()
    if not gate:
        return
    text = S.scope_text(module, scope)
    if not any(w in text for w in gate):
        return
    T = S.torch_name(module) or "torch"
    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        if not S.simple_stmt(stmt):
            continue
        ctors = [(n, c) for n in S.iter_exprs_topdown(stmt) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
                 and any(w in ast.unparse(n.func) for w in gate) for c in [third_party_rope_class(module, n.func)] if c is not None]
        if not ctors:
            continue
        done = S.already_fused(module, scope, stmt)
        if done:
            yield NearMiss("rope", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, done)
            continue
        wraps = []
        for n, c in ctors:
            spec = THIRD_PARTY_ROPES[c]
            wraps.append((n, f"{_SWAP}({S.source_of(module, n)}, {spec.runtime_module!r}, {spec.name!r}, {spec.forms!r})"))
        classes = list(dict.fromkeys(c for _, c in ctors))
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        params: dict = {"source": "library", "module": ", ".join(classes), "mode": "interleave", "constructions": len(ctors),
                        "targets": [dotted(target)] if target is not None and dotted(target) else []}
        yield Finding(
            pattern="rope", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params=params, fused=_swap_helper(T) + S.splice(module, stmt, wraps),
            guard_tensor=f"{T}.Tensor", confidence="medium", variant="library_rope", risks=list(_RISKS),
            notes=[f"unfused: {', '.join(classes)} ({'; '.join(THIRD_PARTY_ROPES[c].semantics for c in classes)}); fused: 1"],
            training_ok=True,
        )
