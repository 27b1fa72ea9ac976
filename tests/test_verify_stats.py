"""The e2e statistics: smoothed loss comparison, step-time medians, bootstrap CI, verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npufuse.verify import stats


def curve(n: int = 60, scale: float = 1.0, noise: float = 0.0, seed: int = 0) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {s: scale * (2.0 * math.exp(-s / 20) + 0.5) * (1 + noise * rng.standard_normal()) for s in range(1, n + 1)}


def test_ema_starts_at_first_value() -> None:
    assert stats.ema([1.0, 2.0, 2.0], 0.5) == [1.0, 1.5, 1.75]


def test_identical_losses_pass() -> None:
    c = stats.compare_losses(curve(), curve(), min_steps=40)
    assert c.passed and c.max_rel_diff == 0 and c.steps_compared == 50


def test_noisy_but_equal_losses_pass_thanks_to_smoothing() -> None:
    # 2% per-step noise on a real curve: single steps differ by > 1%, the smoothed curves don't
    b, f = curve(noise=0.02, seed=1), curve(noise=0.02, seed=2)
    raw = max(abs(f[s] - b[s]) / b[s] for s in b if s > 10)
    assert raw > 0.01
    assert stats.compare_losses(b, f).passed


def test_drift_past_tolerance_fails_with_step() -> None:
    b = curve()
    f = {s: v * (1.0 + 0.001 * s) for s, v in b.items()}  # 0.1% more per step
    c = stats.compare_losses(b, f)
    assert not c.passed and c.failed_at_step is not None and 11 <= c.failed_at_step <= 30
    assert "diverges" in (c.reason or "")


def test_monitor_stops_at_first_violation_and_on_nan() -> None:
    m = stats.LossMonitor(curve(), skip=5)
    assert m.update(1, float("nan")) == "fused loss is nan at step 1"
    m = stats.LossMonitor(curve(), skip=5)
    reasons = [m.update(s, v * 1.5) for s, v in curve().items()]
    first = next(i for i, r in enumerate(reasons, start=1) if r)
    assert first == 6 and all(r is None for r in reasons[first:])  # reported once


def test_first_steps_are_not_compared() -> None:
    b = curve()
    f = dict(b)
    f[3] = b[3] * 3  # an early spike, inside `skip`, fades out of the EMA
    assert stats.compare_losses(b, f, skip=10, alpha=0.5).passed


def test_bootstrap_ci_contains_true_ratio() -> None:
    rng = np.random.default_rng(7)
    base = 0.100 * rng.lognormal(0, 0.05, 200)
    fused = 0.080 * rng.lognormal(0, 0.05, 200)  # true ratio of medians: 1.25
    lo, hi = stats.bootstrap_ratio_ci(base, fused, seed=0)
    assert lo < 1.25 < hi and hi - lo < 0.05
    res = stats.compare_step_times(dict(enumerate(base, 1)), dict(enumerate(fused, 1)))
    assert res.verdict == "faster" and res.speedup == pytest.approx(1.25, rel=0.02)


def test_bootstrap_is_seeded() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(1, 0.1, 50), rng.normal(1, 0.1, 50)
    assert stats.bootstrap_ratio_ci(a, b, seed=3) == stats.bootstrap_ratio_ci(a, b, seed=3)


def test_identical_distributions_no_measurable_change() -> None:
    rng = np.random.default_rng(11)
    base = dict(enumerate(0.1 * rng.lognormal(0, 0.1, 100), 1))
    fused = dict(enumerate(0.1 * rng.lognormal(0, 0.1, 100), 1))
    res = stats.compare_step_times(base, fused)
    assert res.verdict == "no measurable change" and res.ci_low < 1 < res.ci_high


def test_slower_and_min_effect() -> None:
    rng = np.random.default_rng(5)
    base = dict(enumerate(0.1 * rng.lognormal(0, 0.02, 100), 1))
    slow = {s: t * 1.10 for s, t in base.items()}
    assert stats.compare_step_times(base, slow).verdict == "slower"
    tiny = {s: t / 1.005 for s, t in base.items()}  # significant but below the 1% minimum effect
    assert stats.compare_step_times(base, tiny).verdict == "no measurable change"


def test_warmup_excluded() -> None:
    base = {s: (5.0 if s <= 5 else 0.1) for s in range(1, 40)}
    fused = {s: 0.1 for s in range(1, 40)}
    res = stats.compare_step_times(base, fused, warmup=5)
    assert res.baseline.median == pytest.approx(0.1) and res.baseline.n == 34 and res.verdict == "no measurable change"


def test_too_few_steps() -> None:
    with pytest.raises(ValueError, match="too few timed steps"):
        stats.compare_step_times({1: 0.1, 2: 0.1}, {1: 0.1, 2: 0.1}, warmup=0)
