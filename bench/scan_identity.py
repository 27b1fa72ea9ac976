"""Whether two versions of npufuse scan the same things: every candidate (with its params, fused code and
replacement text), near miss (with its reason), failure, existing fused call and switch, byte for byte.

    .venv/bin/python bench/scan_identity.py run SRC --out A.json [--corpora transformers,wheel,examples,labelled]
    .venv/bin/python bench/scan_identity.py diff A.json B.json [--show 10]

``run`` scans each corpus with SRC's npufuse (a subprocess with ``PYTHONPATH=SRC``) as ``npufuse scan
--no-cache --jobs 1`` does (``engine.scan_repo``: no pool, no cache; the whole scan.json, so cross-file
facts, switches and replacement text are in it) and writes the scan.json of each corpus into one file,
with the scan's CPU seconds. The corpora:

* ``transformers``: bench/.data/transformers (the 544 modeling files of the speed figure);
* ``wheel``: every other ``.py`` file of the transformers wheel in bench/.data/dl (trainer, optimizers,
  integrations, generation: code unlike the modeling files), extracted into a temporary folder;
* ``examples``: every pattern's FUSE / KEEP examples, one file each, the bundled examples/ model repo and
  tests/fixtures/scan_repo (the code the tests scan);
* ``labelled``: for every labels file in bench/ (blind ones left out: ``--skip``), each repository whose
  git mirror is in ``--mirrors``, the whole repository at the labelled commit as bench/detect_corpus.py
  extracts it. Repositories without a mirror are counted, never fetched; names in ``--avoid`` files
  (repositories being labelled blind) are never read; ``--like A.json`` scans only the repositories an
  earlier run scanned (mirrors arrive while other sessions fetch: both sides see the same set).

``diff`` prints per corpus how many entries of each section differ (0 everywhere: the two versions found
the same things) and the first ``--show`` differences. Prints figures only; asserts nothing (exit 1 when
something differs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# label files that are blind data (never read for development): bench/detect_* names holding these
BLIND = ("heldout28", "ports3_blind", "ports4", "judge_s51")

_CHILD = r'''
import json, sys, time, warnings
from pathlib import Path
from npufuse.scan.engine import scan_repo
out = {}
for name, root in json.loads(sys.argv[1]):
    t = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = scan_repo(root, jobs=1, cache_dir=None)
    cpu = time.process_time() - t
    doc = json.loads(res.dumps())
    doc["root"] = name  # temporary folders differ between runs
    out[name] = {"cpu": cpu, "scan": doc}
    print(f"{name}: {doc['files_scanned']} files, {len(doc['candidates'])} candidates, "
          f"{len(doc['near_misses'])} near misses, {cpu:.2f} s CPU", file=sys.stderr, flush=True)
json.dump(out, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
'''


def _examples(dest: Path) -> None:
    """Every pattern's FUSE / KEEP example as its own file under dest/<pattern>/."""
    sys.path.insert(0, str(REPO / "src"))
    from npufuse.patterns.registry import all_patterns

    for p in all_patterns():
        folder = dest / p.id
        folder.mkdir(parents=True, exist_ok=True)
        for kind, examples in (("fuse", p.FUSE), ("keep", p.KEEP)):
            for i, ex in enumerate(examples):
                (folder / f"{kind}_{i:03d}.py").write_text(ex.code, encoding="utf-8")


def _wheel(dest: Path) -> bool:
    import re
    import zipfile

    wheels = sorted((HERE / ".data" / "dl").glob("transformers-*.whl"))
    if not wheels:
        return False
    modeling = re.compile(r"transformers/models/[^/]+/modeling_[^/]+\.py")
    with zipfile.ZipFile(wheels[-1]) as z:
        for name in z.namelist():
            if name.endswith(".py") and not modeling.fullmatch(name):
                out = dest / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
    return True


def _labelled(dest: Path, mirrors: Path, avoid: set[str], like: set[str] | None) -> list[tuple[str, str]]:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO / "src"))
    from detect_corpus import extract_blobs, git_dir, load_labels, repo_sources

    wanted: dict[tuple[str, str], set[str]] = {}
    for f in sorted(HERE.glob("detect_*.json")):
        if not (f.name.startswith("detect_labels") or f.name.startswith("detect_ports")) or any(b in f.name for b in BLIND):
            continue
        repos, _ = load_labels(f)
        for r in repos:
            wanted.setdefault((r["repo"], str(r.get("commit") or "HEAD")), set()).update(x["path"] for x in r["files"])
    roots: list[tuple[str, str]] = []
    absent = 0
    for (repo, commit), paths in sorted(wanted.items()):
        if repo.lower() in avoid or (like is not None and f"labelled:{repo}@{commit[:12]}" not in like):
            continue
        gd = git_dir(mirrors, repo)
        if gd is None:
            absent += 1
            continue
        blobs, _ = repo_sources(gd, commit, sorted(paths))
        if not blobs:
            continue
        root = dest / f"{repo.replace('/', '+')}@{commit[:12]}"
        root.mkdir(parents=True)
        extract_blobs(gd, blobs, root)
        roots.append((f"labelled:{repo}@{commit[:12]}", str(root)))
    print(f"labelled: {len(wanted)} repository commits in the label files, {len(roots)} with a mirror, {absent} without",
          file=sys.stderr)
    return roots


def run(args: argparse.Namespace) -> int:
    corpora = args.corpora.split(",")
    avoid: set[str] = set()
    for f in args.avoid:
        if f.is_file():
            avoid |= {ln.strip().lower() for ln in f.read_text().splitlines() if ln.strip()}
    with tempfile.TemporaryDirectory(prefix="npufuse-identity-") as tmp:
        roots: list[tuple[str, str]] = []
        if "transformers" in corpora:
            roots.append(("transformers", str(HERE / ".data" / "transformers")))
        if "wheel" in corpora and _wheel(Path(tmp) / "wheel"):
            roots.append(("wheel", str(Path(tmp) / "wheel")))
        if "examples" in corpora:
            _examples(Path(tmp) / "examples")
            roots.append(("examples:patterns", str(Path(tmp) / "examples")))
            roots.append(("examples:demo", str(REPO / "examples")))
            roots.append(("examples:fixture", str(REPO / "tests" / "fixtures" / "scan_repo")))
        if "labelled" in corpora:
            # --like: the repositories an earlier run scanned (mirrors arrive while sessions fetch)
            like = set(json.loads(args.like.read_text(encoding="utf-8"))) if args.like else None
            roots += _labelled(Path(tmp) / "labelled", args.mirrors, avoid, like)
        env = {**os.environ, "PYTHONPATH": str(args.src.resolve()), "PYTHONHASHSEED": "0"}
        subprocess.run([sys.executable, "-c", _CHILD, json.dumps(roots), str(args.out)], check=True, env=env)
    return 0


def _entries(doc: dict, section: str) -> dict[str, list[str]]:
    """A section's entries grouped by file, each as canonical JSON (the id left out: it numbers the
    candidates of the whole scan, so one extra candidate renumbers every later one)."""
    out: dict[str, list[str]] = {}
    for e in doc.get(section) or []:
        e = dict(e) if isinstance(e, dict) else {"value": e}
        e.pop("id", None)
        out.setdefault(str(e.get("file", "")), []).append(json.dumps(e, sort_keys=True, ensure_ascii=False))
    return out


def diff(args: argparse.Namespace) -> int:
    a = json.loads(args.a.read_text(encoding="utf-8"))
    b = json.loads(args.b.read_text(encoding="utf-8"))
    differ = 0
    shown = 0
    cpu_a = cpu_b = 0.0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'A' if name in a else 'B'}")
            differ += 1
            continue
        da, db = a[name]["scan"], b[name]["scan"]
        cpu_a += a[name]["cpu"]
        cpu_b += b[name]["cpu"]
        counts = []
        for section in sorted(set(da) | set(db)):
            if section in ("candidates", "near_misses", "files_failed", "existing", "switches"):
                ea, eb = _entries(da, section), _entries(db, section)
                bad = [f for f in sorted(set(ea) | set(eb)) if ea.get(f) != eb.get(f)]
                if bad:
                    counts.append(f"{section} {len(bad)} file(s)")
                    for f in bad:
                        if shown < args.show:
                            shown += 1
                            only_a = [x for x in ea.get(f, []) if x not in eb.get(f, [])]
                            only_b = [x for x in eb.get(f, []) if x not in ea.get(f, [])]
                            print(f"  {name} {section} {f}:\n    A only: {only_a[:2]}\n    B only: {only_b[:2]}")
            elif da.get(section) != db.get(section):
                counts.append(section)
        n_cand = len(da.get("candidates") or [])
        n_near = len(da.get("near_misses") or [])
        state = "identical" if not counts else "DIFFERS: " + ", ".join(counts)
        if counts:
            differ += 1
        if counts or not name.startswith("labelled:") or args.verbose:
            print(f"{name}: {da.get('files_scanned')} files, {n_cand} candidates, {n_near} near misses; "
                  f"CPU A {a[name]['cpu']:.2f} s, B {b[name]['cpu']:.2f} s; {state}")
    labelled = [n for n in a if n.startswith("labelled:")]
    print(f"{len(set(a) | set(b))} corpora ({len(labelled)} labelled repositories), {differ} differ; "
          f"CPU A {cpu_a:.2f} s, B {cpu_b:.2f} s ({(cpu_b - cpu_a) / cpu_a * 100 if cpu_a else 0:+.1f}%)")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("src", type=Path, help="a checkout's src folder")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--corpora", default="transformers,wheel,examples,labelled")
    r.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    r.add_argument("--like", type=Path, help="scan only the labelled repositories an earlier run's output holds")
    r.add_argument("--avoid", type=Path, nargs="*", default=[Path(f"/work/wt/HO28{x}_REPOS.txt") for x in "abc"],
                   help="files naming repositories (owner/name, one a line) whose mirrors are never read")
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--show", type=int, default=10)
    d.add_argument("--verbose", action="store_true", help="a line for every labelled repository, not only those that differ")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else diff(args)


if __name__ == "__main__":
    raise SystemExit(main())
