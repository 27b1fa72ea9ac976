"""Value assessment: a roofline estimate of what fusing a site can buy.

Patterns describe the unfused and fused work in bytes moved, FLOPs and kernel launches; this
module turns that into the bound (memory / compute / launch) and the upper bound on speed-up.
Defaults are Atlas A2 (910B) figures; every estimate prints its assumptions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Hardware:
    name: str = "Atlas A2 (910B)"
    hbm_bytes_per_s: float = 1.6e12  # HBM bandwidth
    fp16_flops_per_s: float = 313e12  # cube peak, fp16/bf16
    launch_s: float = 5e-6  # per-kernel launch + scheduling overhead


A2 = Hardware()


def estimate(
    *,
    bytes_before: float,
    bytes_after: float,
    kernels_before: int,
    kernels_after: int,
    flops: float = 0.0,
    shapes: str = "",
    hw: Hardware = A2,
) -> dict[str, Any]:
    """Roofline estimate of one call of the site, unfused vs fused.

    Time of each side = max(bytes/bandwidth, flops/peak) + kernels*launch. The speed-up bound is
    t_before / t_after. ``bound`` names the term that dominates the unfused time.
    """
    mem_b = bytes_before / hw.hbm_bytes_per_s
    mem_a = bytes_after / hw.hbm_bytes_per_s
    comp = flops / hw.fp16_flops_per_s
    t_before = max(mem_b, comp) + kernels_before * hw.launch_s
    t_after = max(mem_a, comp) + kernels_after * hw.launch_s
    terms = {"memory": mem_b, "compute": comp, "launch": kernels_before * hw.launch_s}
    bound = max(terms, key=terms.get)
    speedup = t_before / t_after if t_after > 0 else 1.0
    intensity = flops / bytes_before if bytes_before else 0.0
    if speedup < 0.95:
        # the site's own estimate is a slowdown: never call it "little gain"
        verdict = f"slower as written ({speedup:.2f}x on this site)"
    elif speedup < 1.05:
        verdict = "likely little gain (< 5% on this site)"
    elif speedup < 1.3:
        verdict = "modest gain"
    else:
        verdict = "worthwhile"
    return {
        "bound": bound,
        "bytes_before": int(bytes_before),
        "bytes_after": int(bytes_after),
        "kernels_before": kernels_before,
        "kernels_after": kernels_after,
        "flops": int(flops),
        "arithmetic_intensity": round(intensity, 3),
        "speedup_bound": round(speedup, 2),
        "verdict": verdict,
        "shapes": shapes,
        "estimate": (
            f"{bound}-bound; ~{bytes_before / 1e6:.1f} MB moved in {kernels_before} kernels before, "
            f"~{bytes_after / 1e6:.1f} MB in {kernels_after} after; speed-up bound {speedup:.2f}x on this site"
            + (f" ({shapes})" if shapes else "")
        ),
        "assumptions": asdict(hw),
    }


def symbolic(bound: str, text: str) -> dict[str, Any]:
    """When no shapes could be read from the repo: the bound and a symbolic statement."""
    return {"bound": bound, "estimate": text, "speedup_bound": None, "verdict": "shapes unknown: estimate is symbolic"}
