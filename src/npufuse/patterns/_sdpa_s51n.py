"""s51 late51attn2: an SDPA mask that is None on the configured path, whose other arm builds a mask the row analysis
rejects (HO28b VggAE: ``attn_mask = None; if self.causal and L > 1: attn_mask = torch.triu(ones, diagonal=1)`` -- a
bool keep-mask that keeps no key for the last query row).

Before, the whole site was refused for that arm. The fused call is exact where the mask is None, so it now runs under
the run-time requirement ``<mask> is None``; where the arm built a mask, the original SDPA call runs as written (it keeps
whatever that mask does, fully masked rows included)."""

from __future__ import annotations

from typing import Any, Optional

from npufuse.patterns.base import Risk


def none_only_guard(m_src: str, maybe_none: bool, simple: bool) -> Optional[str]:
    """The run-time requirement under which the fused call takes no mask, or None where the mask is never None /
    not a plain name (its expression would be evaluated twice)."""
    if not (maybe_none and simple):
        return None
    return f"{m_src} is None"


def none_only_risk(m_src: str, why: str) -> Any:
    return Risk("other", f"the fused call runs only where `{m_src}` is None; where it is a mask ({why}) the original SDPA call runs")
