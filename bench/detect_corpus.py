"""Detection quality on code npufuse was never tuned on: per-pattern precision and recall against
blind hand labels, with Wilson 95% intervals (issue 14).

    .venv/bin/python bench/detect_corpus.py [--labels bench/detect_labels.json] [--mirrors /work/.mirror] [--list]
                                            [--labelled-only | --context] [--only IDS]

The labels file (committed; labels only, no third-party code) names, per repository, the commit
and the files that were labelled, and per file every site a human judged: ``pattern``, ``qualname``,
``line``/``end_line`` and ``label`` (``fuse``: the pattern's fused op should replace it; ``keep``: a
look-alike that must not be replaced). The code itself is never copied into this repository: each
repository's git mirror (the ``fetch`` tool's ``<mirrors>/<owner>+<name>/``) provides the files at
the recorded commit, extracted into a temporary folder and scanned there with ``npufuse.scan``.
A repository whose mirror or commit is absent is skipped with a message.

What is scanned (only the labelled files are ever scored):

* default, the whole repository, as a user runs ``npufuse scan <repo>``: every tracked ``.py`` file
  and every configuration file the scan reads for shapes (``config.json``, ``configs/*.yaml``), so
  facts the scan resolves across files (a trainer calling ``zero_grad(set_to_none=True)`` on the
  optimizer a model file builds) are there. Like the scan's default, files under tests/, examples/,
  tutorials/, docs/ folders (``walk.NON_MODEL_DIRS``) are left out, except the labelled files
  themselves (a labelled file is the corpus wherever it sits); symlinks and submodules are not
  extracted. Per repository it prints the files scanned, the files left out and the scan's time.
* ``--labelled-only``: only the labelled files (the benchmark's earlier mode: no cross-file facts);
* ``--context``: the labelled files and the other ``.py`` files of their folders.

Matching: a candidate matches a label when the pattern is the same, the file is the same and the
line ranges overlap, or the candidate's function is one of the label's ``alt_qualnames`` (the
label conventions name there the other place a site may be reported: a split norm's helper, a rope's
rotate helper); each label and each candidate is matched at most once. Per pattern:
precision = matched candidates / all candidates in the labelled files (a candidate on a ``keep``
site or on an unlabelled line counts against it: the labelled files are labelled exhaustively),
recall = matched ``fuse`` labels / all ``fuse`` labels. A labels file with a top-level
``"recall_only": true`` (ground truth taken from what engineers replaced in real NPU ports: they do
not replace everything, so an unlabelled candidate is not an error) is scored for recall only.
Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

DEFAULT_LABELS = HERE / "detect_labels.json"
DEFAULT_MIRRORS = Path("/work/.mirror")


class BadLabels(Exception):
    """The labels file is not what this script reads (exit 2, one line)."""


@dataclass
class Site:
    pattern: str
    file: str  # "<owner>/<name>/<path>"
    line: int
    end_line: int
    label: str = ""  # fuse | keep ("" for a candidate)
    qualname: str = ""
    matched: bool = False
    # a candidate whose replacement dispatches at run time to more than one pattern's op
    # (params.dispatches_to: a config-chosen activation runs npu_swiglu or npu_geglu)
    covers: tuple[str, ...] = ()
    # a label's other accepted places (``alt_qualnames``: the helper of a split norm, a rope's
    # rotate helper): a candidate reported in one of those functions of the file is that site
    alt: tuple[str, ...] = ()

    def overlaps(self, other: "Site") -> bool:
        return self.pattern == other.pattern and self.file == other.file and self.line <= other.end_line and other.line <= self.end_line

    def names(self, cand: "Site") -> bool:
        """True when *cand* (a candidate of this label's file) sits in one of this label's alt_qualnames."""
        return bool(cand.qualname) and cand.qualname in self.alt


@dataclass
class Tally:
    tp: int = 0  # candidates matching a fuse label
    fp: int = 0  # other candidates
    fp_on_keep: int = 0  # of fp: on a site labelled keep
    fn: int = 0  # fuse labels no candidate matched
    again: int = 0  # further candidates inside a fuse label another candidate already matched (not scored)
    missed: list[Site] = field(default_factory=list)
    wrong: list[Site] = field(default_factory=list)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (95% with the default z)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def load_labels(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The labelled repositories and whether the file is recall-only."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadLabels(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadLabels(f"{path}: not JSON ({exc})") from None
    repos = data.get("repos") if isinstance(data, dict) else None
    if not isinstance(repos, list):
        raise BadLabels(f"{path}: no 'repos' list")
    recall_only = data.get("recall_only", False)
    if not isinstance(recall_only, bool):
        raise BadLabels(f"{path}: 'recall_only' must be true or false")
    out = []
    for r in repos:
        if not (isinstance(r, dict) and isinstance(r.get("repo"), str) and r["repo"].count("/") == 1 and isinstance(r.get("files"), list)):
            raise BadLabels(f"{path}: a repos[] entry lacks 'repo' (owner/name) or 'files'")
        for f in r["files"]:
            if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sites", []), list)):
                raise BadLabels(f"{path}: {r['repo']}: a files[] entry lacks 'path' or has no 'sites' list")
            if f["path"].startswith("/") or ".." in f["path"].split("/"):
                raise BadLabels(f"{path}: {r['repo']}: file path {f['path']!r} leaves the repository")
            for s in f.get("sites", []):
                ok = isinstance(s, dict) and isinstance(s.get("pattern"), str) and s.get("label") in ("fuse", "keep") \
                    and isinstance(s.get("line"), int) and isinstance(s.get("end_line", s.get("line")), int)
                if not ok:
                    raise BadLabels(f"{path}: {r['repo']}/{f['path']}: a site lacks pattern, line or label fuse|keep")
        out.append(r)
    return out, recall_only


def git_dir(mirrors: Path, repo: str) -> Path | None:
    """The mirror's git directory: ``<mirrors>/<owner>+<name>/`` holds it (as ``repo``, ``.git``
    or itself, bare)."""
    base = mirrors / repo.replace("/", "+")
    for cand in (base / "repo", base / ".git", base, base / "repo" / ".git"):
        if (cand / "HEAD").is_file() and (cand / "objects").is_dir():
            return cand
    return None


def extract(gd: Path, commit: str, paths: list[str], dest: Path) -> list[str]:
    """Write each path at ``commit`` under ``dest``; returns the paths that could not be read."""
    missing = []
    for p in paths:
        res = subprocess.run(["git", "--git-dir", str(gd), "show", f"{commit}:{p}"], capture_output=True)
        if res.returncode != 0:
            missing.append(p)
            continue
        out = dest / p
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(res.stdout)
    return missing


def _non_model(path: str) -> bool:
    """A path the scan skips by default: a folder on it is a test/example/tutorial/docs folder."""
    from npufuse.scan.walk import NON_MODEL_DIRS

    return any(part.lower() in NON_MODEL_DIRS for part in path.split("/")[:-1])


def repo_sources(gd: Path, commit: str, labelled: list[str]) -> tuple[list[tuple[str, str]], int]:
    """The whole repository's scan inputs at ``commit``: (path, blob id) of every tracked ``.py``
    file and shape configuration file, regular files only (no symlink, no submodule), without the
    files of test/example folders that are not labelled; and how many such files were left out."""
    from npufuse.scan.walk import is_data_file

    res = subprocess.run(["git", "--git-dir", str(gd), "ls-tree", "-r", "-z", commit], capture_output=True)
    if res.returncode != 0:
        return [], 0
    wanted = set(labelled)
    out: list[tuple[str, str]] = []
    left_out = 0
    for entry in res.stdout.split(b"\0"):
        if not entry:
            continue
        meta, _, raw = entry.partition(b"\t")
        parts = meta.split()
        path = raw.decode("utf-8", errors="replace")
        if len(parts) != 3 or parts[1] != b"blob" or parts[0] not in (b"100644", b"100755"):
            continue  # a symlink (120000) or a submodule (commit): not extracted
        if not (path.endswith(".py") or is_data_file(path)):
            continue
        if path not in wanted and _non_model(path):
            left_out += path.endswith(".py")
            continue
        if path.startswith("/") or ".." in path.split("/"):
            continue
        out.append((path, parts[2].decode()))
    return out, left_out


def extract_blobs(gd: Path, blobs: list[tuple[str, str]], dest: Path) -> None:
    """Write each (path, blob id) under ``dest``, reading all blobs through one ``git cat-file --batch``."""
    if not blobs:
        return
    proc = subprocess.Popen(["git", "--git-dir", str(gd), "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    # the requests go in from a thread: a pipe full of answers would otherwise block git while we write
    import threading

    def feed() -> None:
        try:
            proc.stdin.write(b"".join(sha.encode() + b"\n" for _, sha in blobs))  # type: ignore[union-attr]
        finally:
            proc.stdin.close()  # type: ignore[union-attr]

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    for path, _ in blobs:
        header = proc.stdout.readline().split()
        if len(header) != 3:  # "<sha> missing"
            continue
        data = proc.stdout.read(int(header[2]))
        proc.stdout.read(1)  # the newline after each object
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    t.join()
    proc.wait()


def sibling_sources(gd: Path, commit: str, paths: list[str]) -> list[str]:
    """The .py files at ``commit`` in the folders of ``paths`` (not below them)."""
    out: list[str] = []
    for folder in sorted({str(Path(p).parent) for p in paths}):
        spec = [] if folder == "." else [folder + "/"]
        res = subprocess.run(["git", "--git-dir", str(gd), "ls-tree", "--name-only", commit, *spec], capture_output=True, text=True)
        if res.returncode == 0:
            out += [ln for ln in res.stdout.splitlines() if ln.endswith(".py")]
    return out


def imported_sources(gd: Path, commit: str, paths: list[str], depth: int = 2) -> list[str]:
    """The repo's .py files at ``commit`` that ``paths`` import (``from a.b import X`` -> a/b.py or
    a/b/__init__.py, also below any parent folder of the importing file, and relative imports), followed
    ``depth`` levels: a softmax class or mask function a labelled file uses from another folder."""
    import ast

    res = subprocess.run(["git", "--git-dir", str(gd), "ls-tree", "-r", "--name-only", commit], capture_output=True, text=True)
    if res.returncode != 0:
        return []
    present = {ln for ln in res.stdout.splitlines() if ln.endswith(".py")}
    seen, frontier = set(paths), list(paths)
    for _ in range(depth):
        nxt: list[str] = []
        for p in frontier:
            src = subprocess.run(["git", "--git-dir", str(gd), "show", f"{commit}:{p}"], capture_output=True)
            try:
                tree = ast.parse(src.stdout)
            except (SyntaxError, ValueError, RecursionError):
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    base = Path(p).parent
                    for _i in range(node.level - 1):
                        base = base.parent
                    mods = [str(base.joinpath(*(node.module or "").split("."))) if node.module else str(base)]
                    bases = [Path(".")]
                else:
                    mods = [str(Path(*(node.module or "").split(".")))] if node.module else []
                    bases = [Path(".")] + list(Path(p).parents)
                for m in mods:
                    for b in bases:
                        for cand in (f"{b / m}.py", str(b / m / "__init__.py")):
                            cand = str(Path(cand))
                            if cand in present and cand not in seen:
                                seen.add(cand)
                                nxt.append(cand)
        frontier = nxt
    return sorted(seen - set(paths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=Path, default=DEFAULT_LABELS, help="labels JSON (default: bench/detect_labels.json)")
    ap.add_argument("--mirrors", type=Path, default=DEFAULT_MIRRORS, help="folder of <owner>+<name>/ git mirrors (default: /work/.mirror)")
    ap.add_argument("--list", action="store_true", help="also list every missed label and every unmatched candidate")
    ap.add_argument("--labelled-only", action="store_true",
                    help="scan only the labelled files (default: the whole repository at the commit, as a user's scan)")
    ap.add_argument("--context", action="store_true",
                    help="scan the labelled files, the other .py files of their folders and the repo modules they import "
                         "(two levels), not the whole repository; only the labelled files are scored")
    ap.add_argument("--miss-classes", action="store_true",
                    help="also count, per pattern, the missed labels the scan never reached (no near miss of any pattern "
                         "there), refused (a near miss of that pattern), left to another pattern, or failed to render: "
                         "counts only, safe on a blind label file")
    ap.add_argument("--only", metavar="IDS", help="comma-separated pattern ids to score (default: every labelled pattern)")
    ap.add_argument("--optimizer-zero-grad-in-place", action="store_true",
                    help="scan as `npufuse scan --optimizer-zero-grad-in-place` does (fused_optimizer zeroes freed grads in place)")
    args = ap.parse_args(argv)
    try:
        repos, recall_only = load_labels(args.labels)
    except BadLabels as exc:
        print(f"detect_corpus: {exc}", file=sys.stderr)
        return 2

    from npufuse.scan.engine import scan_repo

    labels: list[Site] = []
    cands: list[Site] = []
    misses: list[tuple[Site, str]] = []  # near misses the scan reported: why a label was missed
    scanned_repos = 0
    whole = not (args.labelled_only or args.context)
    scan_seconds = 0.0
    scanned_files = 0
    with tempfile.TemporaryDirectory(prefix="npufuse-detect-") as tmp:
        for r in repos:
            repo, commit = r["repo"], str(r.get("commit") or "HEAD")
            gd = git_dir(args.mirrors, repo)
            if gd is None:
                print(f"skipped {repo}: no mirror under {args.mirrors} (fetch github:{repo} first)")
                continue
            paths = [f["path"] for f in r["files"]]
            dest = Path(tmp) / repo.replace("/", "+")
            dest.mkdir(parents=True)
            left_out = 0
            if whole:
                blobs, left_out = repo_sources(gd, commit, paths)
                extract_blobs(gd, blobs, dest)
                missing = [p for p in paths if not (dest / p).is_file()]
            else:
                missing = extract(gd, commit, paths, dest)
            if args.context:
                extract(gd, commit, sorted((set(sibling_sources(gd, commit, paths)) | set(imported_sources(gd, commit, paths))) - set(paths)), dest)
            if len(missing) == len(paths):
                print(f"skipped {repo}: commit {commit[:12]} or its files are not in the mirror")
                continue
            for p in missing:
                print(f"skipped {repo}/{p}: not in the mirror at {commit[:12]}")
            scanned_repos += 1
            for f in r["files"]:
                if f["path"] in missing:
                    continue
                for s in f.get("sites", []):
                    alt = tuple(q for q in s.get("alt_qualnames", ()) if isinstance(q, str))
                    labels.append(Site(s["pattern"], f"{repo}/{f['path']}", s["line"], s.get("end_line", s["line"]), s["label"], s.get("qualname", ""), alt=alt))
            # tests/examples folders: only labelled files are there (repo_sources left the rest out),
            # and those are scanned wherever they sit
            t0 = time.perf_counter()
            result = scan_repo(dest, jobs=1, include_tests=True, optimizer_zero_grad_in_place=args.optimizer_zero_grad_in_place)
            took = time.perf_counter() - t0
            scan_seconds += took
            scanned_files += result.files_scanned
            print(f"scanned {repo}: {result.files_scanned} files in {took:.1f}s"
                  + (f" ({left_out} .py files under tests/examples/docs folders left out)" if left_out else ""), flush=True)
            scored = set(paths)
            for c in result.candidates:
                if c["file"] not in scored:
                    continue  # a --context file: read for its facts, not labelled
                params = c.get("params") if isinstance(c.get("params"), dict) else {}
                covers = tuple(p for p in params.get("dispatches_to", ()) if isinstance(p, str))
                cands.append(Site(c["pattern"], f"{repo}/{c['file']}", c["line"], c["end_line"], "", c.get("qualname", ""), covers=covers))
            for n in result.near_misses:
                misses.append((Site(n["pattern"], f"{repo}/{n['file']}", n["line"], n["end_line"]), n.get("reason", "")))
            for fail in result.files_failed:
                print(f"note {repo}/{fail.file}: {fail.kind}: {fail.error}")

    wanted = set(args.only.split(",")) if args.only else None
    patterns = sorted({s.pattern for s in labels} | {c.pattern for c in cands if any(l.pattern == c.pattern for l in labels)})
    if wanted is not None:
        patterns = [p for p in patterns if p in wanted]
    tallies: dict[str, Tally] = {p: Tally() for p in patterns}
    for c in sorted(cands, key=lambda s: (s.file, s.line)):
        t = tallies.get(c.pattern)
        # the candidate's own pattern, and any other pattern its run-time dispatch may run: each
        # unmatched fuse label of those on the candidate's lines is matched (one TP per label)
        covered = [c.pattern] + [p for p in c.covers if p != c.pattern]
        if not any(p in tallies for p in covered):
            continue
        # s38: a candidate of a pattern left out of the tallies (`--only swiglu`, or a label file
        # without geglu labels) still scores the tallied patterns its dispatch covers (zoology's GLU:
        # a geglu candidate dispatching to swiglu too was dropped, so `--only swiglu` missed it);
        # it is counted false only under its own pattern, as in a run over every pattern
        on_lines = [l for l in labels if l.label == "fuse" and l.file == c.file and l.line <= c.end_line and c.line <= l.end_line]
        # then labels naming the candidate's function as an alternative place (line overlap first)
        on_lines += [l for l in labels if l.label == "fuse" and l.file == c.file and l.names(c) and all(l is not o for o in on_lines)]
        hits = [next((l for l in on_lines if l.pattern == p and not l.matched), None) for p in covered]
        if any(h is not None for h in hits):
            c.matched = True
            for p, hit in zip(covered, hits):
                if hit is not None:
                    hit.matched = True
                    if p in tallies:
                        tallies[p].tp += 1
        elif t is None:
            continue
        elif any(l.pattern == c.pattern and l.matched for l in on_lines):
            # a second site inside one labelled span (both branches of `if half: ... else: ...`):
            # the label is already counted; this candidate is neither a new TP nor a false one
            t.again += 1
            t.wrong.append(c)
        else:
            t.fp += 1
            t.wrong.append(c)
            if any(l.label == "keep" and (l.overlaps(c) or (l.pattern == c.pattern and l.file == c.file and l.names(c))) for l in labels):
                t.fp_on_keep += 1
    for l in labels:
        if l.label == "fuse" and not l.matched and l.pattern in tallies:
            tallies[l.pattern].fn += 1
            tallies[l.pattern].missed.append(l)

    mode = "whole repositories" if whole else ("labelled files and their folders" if args.context else "labelled files only")
    print(f"\n{scanned_repos} of {len(repos)} repositories scanned ({mode}: {scanned_files} files, scan {scan_seconds:.1f}s), "
          f"{sum(len(r['files']) for r in repos)} labelled files, "
          f"{sum(1 for s in labels if s.label == 'fuse')} fuse / {sum(1 for s in labels if s.label == 'keep')} keep labels")
    if recall_only:
        print("recall-only labels (sites replaced in real ports): precision is not measured here")
    print(f"{'pattern':<20} {'TP':>4} {'FP':>4} {'(keep)':>6} {'FN':>4}  {'precision [95% CI]':<24} {'recall [95% CI]':<24}")
    tot = Tally()
    for p in patterns:
        t = tallies[p]
        tot.tp += t.tp
        tot.fp += t.fp
        tot.fp_on_keep += t.fp_on_keep
        tot.fn += t.fn
        print(_row(p, t, recall_only))
    print(_row("all", tot, recall_only))
    # a missed fuse label the scan did reach but left alone because the file already runs a torch_npu branch
    # there (an in-repo port's fallback): the detector found it; the scan rightly proposes nothing. Told
    # apart (counts only), not scored as found: the strict figure above stays the one reported
    from npufuse.scan.engine import ALREADY_FUSED_BESIDE, ALREADY_REWRITTEN

    already = (ALREADY_FUSED_BESIDE, ALREADY_REWRITTEN)
    beside = {}
    for p in patterns:
        n = sum(1 for s in tallies[p].missed
                if any(m.pattern == p and m.overlaps(s) and r.startswith(already) for m, r in misses))
        if n:
            beside[p] = n
    if beside:
        found = tot.tp + sum(beside.values())
        print("missed, but reached and left alone beside an existing torch_npu branch (an in-repo port's fallback): "
              + ", ".join(f"{p} {n}" for p, n in beside.items())
              + f"; recall counting them as found: {_fmt(found, tot.tp + tot.fn)}")
    again = {p: tallies[p].again for p in patterns if tallies[p].again}
    if again:
        print("not scored (further sites inside a fuse label already matched): "
              + ", ".join(f"{p} {n}" for p, n in again.items()))
    if args.miss_classes:
        print(f"{'missed, by class':<20} {'unseen':>7} {'refused':>8} {'other':>6} {'render':>7}")
        for p in patterns:
            counts = miss_classes(tallies[p].missed, misses, cands)
            if tallies[p].missed:
                print(f"{p:<20} " + " ".join(f"{counts[k]:>{w}}" for k, w in (("unseen", 7), ("refused", 8), ("other", 6), ("render", 7))))
    if args.list:
        for p in patterns:
            for s in tallies[p].missed:
                why = next((r for n, r in misses if n.overlaps(s)), "no near miss either")
                print(f"missed  {p:<18} {s.file}:{s.line}-{s.end_line} {s.qualname}: {why[:160]}")
            for s in [] if recall_only else tallies[p].wrong:
                again = any(l.label == "fuse" and l.matched and l.overlaps(s) for l in labels)
                print(f"{'again' if again else 'extra':<7} {p:<18} {s.file}:{s.line}-{s.end_line} {s.qualname}"
                      + (" (a further site inside a fuse label already matched: not scored)" if again else ""))
    return 0




def miss_classes(missed: list[Site], misses: list[tuple[Site, str]], cands: list[Site]) -> dict[str, int]:
    """Why each missed label was missed, as a class: ``render`` (the scan found it but could not write
    the replacement), ``refused`` (a near miss of the label's pattern on its lines: the detector saw it
    and said no), ``other`` (only another pattern's finding or near miss there), ``unseen`` (nothing)."""
    def on_lines(a: Site, b: Site) -> bool:
        return a.file == b.file and a.line <= b.end_line and b.line <= a.end_line

    out = {"unseen": 0, "refused": 0, "other": 0, "render": 0}
    for s in missed:
        near = [(n, r) for n, r in misses if on_lines(n, s)]
        if any("could not generate the replacement" in r for n, r in near if n.pattern == s.pattern):
            out["render"] += 1
        elif any(n.pattern == s.pattern for n, _ in near):
            out["refused"] += 1
        elif near or any(on_lines(c, s) for c in cands):
            out["other"] += 1
        else:
            out["unseen"] += 1
    return out


def _fmt(k: int, n: int) -> str:
    if n == 0:
        return "n/a"
    lo, hi = wilson(k, n)
    return f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]"


def _row(name: str, t: Tally, recall_only: bool = False) -> str:
    fp, precision = ("-", "n/a (recall-only)") if recall_only else (t.fp, _fmt(t.tp, t.tp + t.fp))
    return f"{name:<20} {t.tp:>4} {fp:>4} {t.fp_on_keep:>6} {t.fn:>4}  {precision:<24} {_fmt(t.tp, t.tp + t.fn):<24}"


if __name__ == "__main__":
    sys.exit(main())
