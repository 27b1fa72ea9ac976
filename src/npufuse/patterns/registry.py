"""Finds every pattern: each ``patterns/<id>.py`` defines one ``Pattern`` subclass with ``id``."""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from npufuse.patterns.base import Pattern

# The ids of DESIGN.md, in report order.
PATTERN_IDS = (
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "geglu",
    "rope",
    "attention",
    "sdpa",
    "moe_experts",
    "fused_optimizer",
    "affinity_index_put",
    "affinity_where",
)

_NOT_PATTERNS = {"base", "registry"}


@lru_cache(maxsize=1)
def all_patterns() -> tuple[Pattern, ...]:
    """One instance per pattern module found, ordered as PATTERN_IDS (unknown ids last, sorted)."""
    import npufuse.patterns as pkg

    found: dict[str, Pattern] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in _NOT_PATTERNS or info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"npufuse.patterns.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Pattern) and obj is not Pattern and obj.__module__ == mod.__name__:
                if getattr(obj, "id", None):
                    found[obj.id] = obj()
    order = {pid: i for i, pid in enumerate(PATTERN_IDS)}
    return tuple(found[k] for k in sorted(found, key=lambda k: (order.get(k, len(order)), k)))


def get_pattern(pattern_id: str) -> Pattern:
    for p in all_patterns():
        if p.id == pattern_id:
            return p
    raise KeyError(pattern_id)
