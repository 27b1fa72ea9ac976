"""The mutation table of `verify op` (issue 5, first acceptance item), printed as Markdown.

    .venv/bin/python bench/mutations.py [--sweep] [--census]

For every mutant of ``tests/mutation_support.py`` (wrong replacements of each registered
pattern's own fused code): whether verify rejects it, whether the seed criterion alone
(cosine > 0.999 or max-abs < 1e-4 per tensor) would have passed it, and verify's first reason.
``fused_optimizer`` mutants have no op check (nothing to call); they are judged by the e2e loss
rule (1% of the smoothed loss curve), and the seed column does not apply. Then the correct
replacements of the same examples: false alarms across their own dtypes and fp32/fp16/bf16, two
seeds.

``--sweep`` also checks every op-level mutant cast to fp32/fp16/bf16 with two seeds and lists
where it is not rejected (a mutant can be equivalent at one precision: a dropped cast when every
tensor has one dtype, tanh vs erf GELU below bf16 rounding). ``--census`` runs the op check on
the correct replacement of every FUSE example of every pattern (own dtypes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/ itself off the path: its profile.py would shadow the stdlib module torch._dynamo imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "tests"))  # the mutant catalogue and the verify test helpers


def _short(text: str, n: int = 110) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= n else text[: n - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also check every mutant at fp32/fp16/bf16, seeds 0 and 1")
    ap.add_argument("--census", action="store_true", help="also check the correct replacement of every FUSE example")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    import torch

    torch.set_num_threads(1)  # tiny shapes: threads only contend
    import mutation_support as ms
    from npufuse.verify.opcheck import NOT_OP_LEVEL

    t0 = time.time()
    ws = ms.Workspace(Path(tempfile.mkdtemp(prefix="npufuse-mutants-")))
    unexpected = 0
    print("| pattern | mutation | example (precision) | rejected? | seed-only would pass? | verify's first reason |")
    print("|---|---|---|---|---|---|")
    seed_blind = []
    for m in ms.MUTANTS:
        ex = ms.EXAMPLE[m.example]
        fused = ms.mutate(ms.finding_of(ex).fused, m)
        where = f"{m.example} ({m.dtype or 'own dtypes'})"
        if m.pattern in NOT_OP_LEVEL:
            r = ms.optimizer_check(ex, fused)
            rejected, seed_only, reason = not r.passed, "n/a (no op check)", "e2e loss rule: " + r.reason
            unexpected += rejected == (m.key in ms.E2E_BLIND)
        else:
            rep = ws.op_check(ex, fused, m.dtype)
            rejected, passes = not rep.passed, ms.seed_alone_passes(rep)
            seed_only, reason = ("**yes**" if passes else "no"), (rep.reasons[0] if rep.reasons else "")
            unexpected += (not rejected) + (passes != (m.key in ms.SEED_BLIND))
            if passes:
                seed_blind.append(f"{m.pattern}: {m.name}")
        mark = "yes" if rejected else "**NO**"
        print(f"| {m.pattern} | {m.name} | {where} | {mark} | {seed_only} | {_short(reason)} |")
    print()
    print("Seed criterion alone would have let through: " + ("; ".join(seed_blind) if seed_blind else "none"))
    blind = [f"{p}: {n}" for p, n in sorted(ms.E2E_BLIND)]
    print("e2e loss rule lets through (fused_optimizer, no op check): " + ("; ".join(blind) if blind else "none"))

    print("\n## Correct replacements (no false alarm)\n")
    print("| pattern | example | checks | false alarms |")
    print("|---|---|---|---|")
    for ex in ms.EXAMPLES:
        combos = [(None, s) for s in (0, 1)] + ([(d, s) for d in ("float32", "float16", "bfloat16") for s in (0, 1)] if ex.sweep else [])
        alarms = []
        for dtype, seed in combos:
            if ex.pattern in NOT_OP_LEVEL:
                r = ms.optimizer_check(ex, seed=seed)
                ok, why = r.passed, r.reason
            else:
                rep = ws.op_check(ex, dtype=dtype, seed=seed)
                ok, why = rep.passed, "; ".join(rep.reasons[:2])
            if not ok:
                alarms.append(f"{dtype or 'own'}/seed {seed}: {_short(why, 80)}")
        combos = combos if ex.pattern not in NOT_OP_LEVEL else [c for c in combos if c[0] is None]
        unexpected += bool(alarms)
        label = "e2e rule, seeds 0-1" if ex.pattern in NOT_OP_LEVEL else f"{len(combos)} (own{' + fp32/fp16/bf16' if ex.sweep else ''} × seeds 0-1)"
        print(f"| {ex.pattern} | {ex.name} | {label} | {'; '.join(alarms) or 'none'} |")

    if args.sweep:
        print("\n## Mutants at every precision (fp32/fp16/bf16 × seeds 0-1): where not rejected\n")
        for m in ms.MUTANTS:
            if m.pattern in NOT_OP_LEVEL:
                continue
            ex = ms.EXAMPLE[m.example]
            fused = ms.mutate(ms.finding_of(ex).fused, m)
            missed = [f"{d}/seed {s}" for d in ("float32", "float16", "bfloat16") for s in (0, 1) if ws.op_check(ex, fused, d, s).passed]
            if missed:
                print(f"- {m.pattern}: {m.name} [{m.example}]: not rejected at {', '.join(missed)}")

    if args.census:
        from npufuse.patterns.registry import all_patterns
        from pattern_harness import detect_all

        print("\n## Census: the correct replacement of every FUSE example (own dtypes)\n")
        for p in all_patterns():
            if p.id in NOT_OP_LEVEL:
                continue
            for fx in p.FUSE:
                for i in range(len(detect_all(p, fx.code)[0])):
                    ex = ms.Example(p.id, fx.name, finding=i)
                    try:
                        rep = ws.op_check(ex)
                        verdict = "pass" if rep.passed else "FAIL: " + _short("; ".join(rep.reasons[:2]), 160)
                    except Exception as exc:  # no run snippet, inputs that do not capture, ...
                        verdict = f"not checkable: {_short(f'{type(exc).__name__}: {exc}', 160)}"
                    print(f"- {p.id} / {fx.name}{f' #{i}' if i else ''}: {verdict}")

    print(f"\n{ws.n} op checks in {time.time() - t0:.1f} s; {unexpected} unexpected result(s)")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
