"""The two e2e judgements: does the fused loss follow the baseline, and is it faster.

**Loss** (accuracy first). Both loss curves are smoothed with the same exponential moving
average (``ema = a*loss + (1-a)*ema``, started at the first loss; ``a`` = ``alpha``) so single-step
noise of real training does not trip the check. After the first ``skip`` steps (the early,
steep part of the curve, where a tiny shift in the step is a big relative difference) the
relative difference ``|ema_f - ema_b| / |ema_b|`` must stay within ``tolerance`` at every step
both runs have; a non-finite fused loss fails at once. The check is the same online (the
fused run is stopped at the first violation: the maximum can only grow) and offline.

**Step time** (only after the loss passed). Warm-up steps are dropped; the speed-up is
``median(baseline) / median(fused)`` (> 1: fused is faster), with a percentile bootstrap
confidence interval (each run resampled independently, seeded ``numpy`` generator). Verdict:
"faster" when the whole interval is above 1 and the point estimate beats ``1 + min_effect``;
"slower" when the interval is below 1 and the estimate is under ``1 / (1 + min_effect)``;
otherwise "no measurable change".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

DEFAULT_TOLERANCE = 0.01
DEFAULT_SKIP = 10
DEFAULT_ALPHA = 0.1
DEFAULT_WARMUP = 5
DEFAULT_BOOTSTRAP = 2000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_MIN_EFFECT = 0.01


def ema(values: Sequence[float], alpha: float = DEFAULT_ALPHA) -> list[float]:
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


@dataclass
class LossCheck:
    tolerance: float
    skip: int
    alpha: float
    steps_compared: int = 0
    max_rel_diff: float = 0.0
    max_at_step: int | None = None
    final_rel_diff: float | None = None
    mean_rel_diff: float | None = None
    failed_at_step: int | None = None
    reason: str | None = None  # why it failed, None when passing

    @property
    def passed(self) -> bool:
        return self.reason is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        return d


class LossMonitor:
    """The loss check, one fused step at a time, against a finished baseline."""

    def __init__(self, baseline: dict[int, float], tolerance: float = DEFAULT_TOLERANCE, skip: int = DEFAULT_SKIP, alpha: float = DEFAULT_ALPHA) -> None:
        steps = sorted(baseline)
        self.baseline_ema = dict(zip(steps, ema([baseline[s] for s in steps], alpha)))
        self.alpha = alpha
        self.check = LossCheck(tolerance, skip, alpha)
        self._ema: float | None = None
        self._sum = 0.0

    def update(self, step: int, loss: float) -> str | None:
        """Feed one fused step; returns the failure reason the first time the check fails."""
        c = self.check
        if c.reason is not None:
            return None
        if not math.isfinite(loss):
            c.failed_at_step, c.reason = step, f"fused loss is {loss} at step {step}"
            return c.reason
        self._ema = loss if self._ema is None else self.alpha * loss + (1 - self.alpha) * self._ema
        b = self.baseline_ema.get(step)
        if b is None or step <= c.skip:
            return None
        rel = abs(self._ema - b) / max(abs(b), 1e-12)
        c.steps_compared += 1
        self._sum += rel
        c.mean_rel_diff = self._sum / c.steps_compared
        c.final_rel_diff = rel
        if rel > c.max_rel_diff or c.max_at_step is None:
            c.max_rel_diff, c.max_at_step = rel, step
        if rel > c.tolerance:
            c.failed_at_step = step
            c.reason = (
                f"fused loss diverges from the baseline: smoothed relative difference {rel:.2%} at step {step} "
                f"> tolerance {c.tolerance:.2%} (EMA alpha {self.alpha}, first {c.skip} steps not compared)"
            )
            return c.reason
        return None


def compare_losses(baseline: dict[int, float], fused: dict[int, float], tolerance: float = DEFAULT_TOLERANCE, skip: int = DEFAULT_SKIP, alpha: float = DEFAULT_ALPHA, min_steps: int = 0) -> LossCheck:
    """The offline loss check (same rule as :class:`LossMonitor`), plus a minimum of compared steps."""
    mon = LossMonitor(baseline, tolerance, skip, alpha)
    for step in sorted(fused):
        if mon.update(step, fused[step]):
            break
    c = mon.check
    if c.reason is None and c.steps_compared < min_steps:
        c.reason = f"only {c.steps_compared} steps could be compared after the first {skip} (need {min_steps})"
    return c


# -- step time -----------------------------------------------------------------------------------


@dataclass
class RunTimes:
    n: int
    median: float
    q25: float
    q75: float
    iqr: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "RunTimes":
        a = np.asarray(values, dtype=float)
        q25, med, q75 = (float(x) for x in np.percentile(a, [25, 50, 75]))
        return cls(int(a.size), med, q25, q75, q75 - q25, float(a.mean()))


@dataclass
class PerfResult:
    baseline: RunTimes
    fused: RunTimes
    speedup: float  # median(baseline) / median(fused)
    ci_low: float
    ci_high: float
    confidence: float
    verdict: str  # "faster" | "no measurable change" | "slower"
    warmup: int
    n_bootstrap: int
    seed: int
    min_effect: float
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_ratio_ci(baseline: Sequence[float], fused: Sequence[float], n_boot: int = DEFAULT_BOOTSTRAP, confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``median(baseline) / median(fused)``."""
    rng = np.random.default_rng(seed)
    b = np.asarray(baseline, dtype=float)
    f = np.asarray(fused, dtype=float)
    bi = rng.integers(0, b.size, size=(n_boot, b.size))
    fi = rng.integers(0, f.size, size=(n_boot, f.size))
    ratios = np.median(b[bi], axis=1) / np.median(f[fi], axis=1)
    lo, hi = np.percentile(ratios, [(1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100])
    return float(lo), float(hi)


def compare_step_times(
    baseline: dict[int, float],
    fused: dict[int, float],
    warmup: int = DEFAULT_WARMUP,
    n_boot: int = DEFAULT_BOOTSTRAP,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    min_effect: float = DEFAULT_MIN_EFFECT,
) -> PerfResult:
    """Step times keyed by step; steps ``<= warmup`` are excluded. Raises ``ValueError`` when
    fewer than 3 timed steps remain in either run."""
    b = [t for s, t in sorted(baseline.items()) if s > warmup and t is not None and math.isfinite(t)]
    f = [t for s, t in sorted(fused.items()) if s > warmup and t is not None and math.isfinite(t)]
    if len(b) < 3 or len(f) < 3:
        raise ValueError(f"too few timed steps after {warmup} warm-up steps (baseline {len(b)}, fused {len(f)}; need 3 each)")
    rb, rf = RunTimes.of(b), RunTimes.of(f)
    speedup = rb.median / rf.median if rf.median > 0 else math.inf
    lo, hi = bootstrap_ratio_ci(b, f, n_boot, confidence, seed)
    if lo > 1.0 and speedup >= 1.0 + min_effect:
        verdict = "faster"
    elif hi < 1.0 and speedup <= 1.0 / (1.0 + min_effect):
        verdict = "slower"
    else:
        verdict = "no measurable change"
    notes = []
    if len(b) < 20 or len(f) < 20:
        notes.append(f"few timed steps (baseline {len(b)}, fused {len(f)}): the interval is wide")
    return PerfResult(rb, rf, speedup, lo, hi, confidence, verdict, warmup, n_boot, seed, min_effect, notes)


def finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]
