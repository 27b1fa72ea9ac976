"""Bail-reason census of the numeric probe: where it runs, where it stops and why.

    .venv/bin/python bench/probe_census.py CORPUS_DIR [CORPUS_DIR ...] [--repos] [--show N] [--samples TEMPLATE]

Runs the rms_norm detector on every function scope of every ``.py`` file (``--repos``: each
sub-directory of a CORPUS_DIR is a repository root, so cross-file facts resolve inside it; else
the directory itself is the root) and counts what the numeric probe fallback did there: scopes
the probe's text gate let through, how many stopped at the static gate (no torch needed), how
many ran (torch needed) and their outcome (proved / mismatch / other / unknown with its reason).
Reasons are grouped by template (text in backticks replaced by ``…``). ``--samples`` prints the
scopes of one template. Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _template(reason: str) -> str:
    return re.sub(r"`[^`]*`", "`…`", re.sub(r"\d+", "N", reason))


def census(roots: list[tuple[Path, list[Path]]], show: int, sample_of: str | None, qual: str | None = None) -> None:
    from npufuse.patterns import rms_norm
    from npufuse.scan import numeric_probe, repo_facts
    from npufuse.scan.dataflow import ModuleInfo

    pattern = rms_norm.RmsNorm()
    qual_re = re.compile(qual, re.I) if qual else None
    stages: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    samples: dict[str, list[str]] = collections.defaultdict(list)
    proved: list[str] = []
    files_torch = 0
    t0 = time.process_time()
    for root, files in roots:
        for path in files:
            rel = str(path.relative_to(root))
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
                module = ModuleInfo.from_source(rel, text, tree)
                repo_facts.attach_root(module, root)
            except Exception:
                continue
            for scope in module.scopes:
                if isinstance(scope.node, ast.Module):
                    continue
                try:
                    list(pattern.detect(module, scope))
                except Exception as e:  # a detector error is the scan's business; count it
                    stages["detector raised"] += 1
                    samples["detector raised"].append(f"{root.name}/{rel}:{scope.qualname}: {type(e).__name__}")
            stats = module.__dict__.get("_npufuse_probe_stats", [])
            ran_torch = False
            for qual, kind, reason in stats:
                if qual_re is not None and not qual_re.search(qual):
                    continue
                where = f"{root.name}/{rel}:{qual}"
                stage = "static" if kind == "unknown" and getattr(reason, "startswith", None) and _static(reason) else "ran"
                if stage == "ran":
                    ran_torch = True
                stages[f"{stage}:{kind}"] += 1
                key = f"{kind}: {_template(reason)}" if kind != "proved" else "proved"
                reasons[key] += 1
                samples[key].append(where + (f"  ({reason})" if reason else ""))
                if kind == "proved":
                    proved.append(where)
            files_torch += ran_torch
    cpu = time.process_time() - t0
    gated = sum(stages.values())
    print(f"scopes through the probe's text gate: {gated}; files where a probe ran (torch needed): {files_torch}; CPU {cpu:.1f} s")
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:6d}")
    print("reasons (template: count)")
    for k, v in reasons.most_common(show):
        print(f"  {v:6d}  {k}")
    print("reasons as written (top):")
    raw = collections.Counter(r for k, v in samples.items() for r in (s.split("  (", 1)[1][:-1] for s in v if "  (" in s))
    for k, v in raw.most_common(show):
        print(f"  {v:6d}  {k[:150]}")
    print("proved:")
    for p in proved:
        print("  " + p)
    if sample_of:
        for k, v in samples.items():
            if sample_of in k:
                print(f"samples of {k}:")
                for s in v[:40]:
                    print("  " + s)


_STATIC = re.compile(r"^(?:__init__: )?(?:call of |call of method |\w+ in the function)|^(?:argument `[^`]*` has no default"
                     r"|constructor argument|the class does not derive|a static method|a method without self|no input argument"
                     r"|a keyword-only argument has no default)")


def _static(reason: str) -> bool:
    return bool(_STATIC.match(reason))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--repos", action="store_true", help="each sub-directory is a repository root")
    ap.add_argument("--show", type=int, default=40)
    ap.add_argument("--samples", default=None, help="print the scopes of the reason templates holding this text")
    ap.add_argument("--qualname", default=None, help="count only scopes whose qualname matches this regex (case-insensitive), e.g. 'rms'")
    args = ap.parse_args()
    roots: list[tuple[Path, list[Path]]] = []
    for d in args.dirs:
        subs = sorted(p for p in d.iterdir() if p.is_dir()) if args.repos else [d]
        for r in subs:
            roots.append((r, sorted(r.rglob("*.py"))))
    census(roots, args.show, args.samples, args.qualname)


if __name__ == "__main__":
    main()
