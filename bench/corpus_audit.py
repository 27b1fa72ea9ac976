"""A reproducible hand audit of the scan's precision and recall on a real corpus.

    .venv/bin/python bench/corpus_audit.py draw --pattern rms_norm [--seed 0]
    .venv/bin/python bench/corpus_audit.py score [--pattern rms_norm]
    .venv/bin/python bench/corpus_audit.py show --pattern rms_norm [--section candidates] [--unjudged]
    .venv/bin/python bench/corpus_audit.py judge --pattern rms_norm --section candidates --index 0,3 --verdict correct [--note "..."]

``draw`` scans the corpus (default ``bench/.data/transformers``: the ``models/*/modeling_*.py``
files of transformers 5.25.0; ``bench/scan.py --fetch-transformers`` makes it) and writes or
extends ``bench/audit/<pattern>.yaml`` with three seeded samples, to be judged by hand:

* ``candidates``: min(40, all) candidates of the pattern. Verdict ``correct`` (the site computes
  the pattern AND the recorded params/variant and the rendered replacement are right) or
  ``wrong`` (note why: not the pattern, wrong eps, wrong order...);
* ``near_misses``: min(20, all) near misses. Verdict ``right_reason`` (a look-alike that must not
  be replaced, for the stated reason), ``wrong_reason`` (a look-alike that must not be replaced,
  but the stated reason is not why), ``should_be_candidate`` (replaceable as it stands) or
  ``not_the_pattern`` (not even a look-alike; reporting it is noise);
* ``unfound_suspects``: min(60, all) functions with the pattern's tell-tale tokens
  (``corpus_findings.SUSPECTS``) that hold no candidate and no near miss of it. Verdict
  ``not_the_pattern`` or ``missed`` (a site that computes the pattern: it should have been a
  candidate or a near miss).

Entries are named by file + qualname + the first characters of the site's first source line
(``snippet``; the line number is only a hint), so they survive small shifts in the file. Re-drawing
keeps every judged entry and tops each sample up from the current population with the same seed.

``score`` re-scans and re-resolves every entry against the current code, so a verdict stays a
statement about the code while the found-status (candidate / near miss / nothing) is always the
current one. An entry judged against other detector output than today's (its params, variant and
fused code, or its near-miss reason, changed: ``sig`` differs) is reported stale and not counted;
re-judge it and copy the current ``sig`` in. Exit status: 0 ok, 1 when a judged entry no longer
resolves to code in the corpus or carries an unknown verdict, 2 usage error.

Scans use npufuse's per-file cache (``bench/.data/audit_cache``), so only files or detectors that
changed are analysed again; ``--scan FILE`` reads an existing scan.json instead.

Each pattern is audited on one corpus (``CORPORA``): ``transformers`` (the default) or, for
``fused_optimizer``, which no modeling file exercises, ``optimizer``: the ``.py`` files of six
pinned PyPI source distributions that construct optimizers in library code, examples and tests
(``OPTIM_SDISTS``; ``--fetch-optimizer-corpus`` pip-downloads and unpacks them into
``bench/.data/optim_corpus``). ``draw`` records the corpus's name and versions in the yaml
(``corpus_name``, ``corpus_sources``) and ``score`` / ``show`` / ``judge`` use the corpus each
yaml names (none named: transformers). ``--corpus NAME|DIR`` overrides that for every pattern.

    .venv/bin/python bench/corpus_audit.py --fetch-optimizer-corpus
    .venv/bin/python bench/corpus_audit.py draw --pattern fused_optimizer     # on the optimizer corpus
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _load_sibling(name: str):
    """Import bench/<name>.py by path, never by putting bench/ on sys.path: bench/profile.py
    would shadow the standard library's ``profile`` module for the whole process."""
    import importlib.util

    module_name = f"npufuse_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_cf = _load_sibling("corpus_findings")
CORPUS, SUSPECTS, Function, functions, is_suspect, unflagged_suspects = (
    _cf.CORPUS, _cf.SUSPECTS, _cf.Function, _cf.functions, _cf.is_suspect, _cf.unflagged_suspects)

AUDIT_DIR = HERE / "audit"
CACHE_DIR = HERE / ".data" / "audit_cache"

# The optimizer corpus: pinned source distributions whose library code, examples and tests
# construct torch optimizers (about 100 sites in all; transformers' only ones are in tests/).
OPTIM_CORPUS = HERE / ".data" / "optim_corpus"
OPTIM_SDISTS: tuple[tuple[str, str], ...] = (
    ("accelerate", "1.16.0"),
    ("peft", "0.21.2"),
    ("lightning", "2.6.6"),
    ("timm", "1.0.31"),
    ("transformers", "5.25.0"),
    ("diffusers", "0.42.1"),
)


@dataclass(frozen=True)
class CorpusSpec:
    """A named corpus: where it lives, what it was made from (recorded in the yaml, checked
    against the ``SOURCE`` file its fetch writes) and how to make it."""

    name: str
    path: Path
    sources: tuple[str, ...]
    fetch_hint: str


CORPORA: dict[str, CorpusSpec] = {
    "transformers": CorpusSpec("transformers", CORPUS, ("transformers==5.25.0",), "bench/scan.py --fetch-transformers"),
    "optimizer": CorpusSpec("optimizer", OPTIM_CORPUS, tuple(f"{n}=={v}" for n, v in OPTIM_SDISTS),
                            "bench/corpus_audit.py --fetch-optimizer-corpus"),
}
DEFAULT_CORPUS = "transformers"
# Patterns audited on another corpus than the default: no transformers modeling file builds an
# optimizer, so fused_optimizer has nothing to measure there.
PATTERN_CORPUS = {"fused_optimizer": "optimizer"}


def fetch_optimizer_corpus(dest: Path = OPTIM_CORPUS, download_dir: Path = HERE / ".data" / "dl") -> Path:
    """pip download the pinned sdists of OPTIM_SDISTS (no deps) and unpack only their ``.py``
    files into ``dest/<name>-<version>/...``; writes ``dest/SOURCE`` (one ``name==version`` a
    line, then the files unpacked per archive)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    archives: list[tuple[str, Path]] = []
    for name, version in OPTIM_SDISTS:
        spec = f"{name}=={version}"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec,
                        "-d", str(download_dir)], check=True)
        # sdist names normalise the project name (PEP 625: lower case, `_` for `-`); older ones kept it
        found = [p for p in download_dir.glob("*.tar.gz")
                 if p.name.lower().replace("-", "_") == f"{name}_{version}.tar.gz".lower().replace("-", "_")]
        if not found:
            raise SystemExit(f"pip download produced no sdist for {spec} in {download_dir}")
        archives.append((spec, found[0]))
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    lines = [spec for spec, _ in archives]
    for spec, archive in archives:
        n = _unpack_py(archive, dest)
        lines.append(f"# {archive.name}: {n} .py files")
        print(f"unpacked {n} .py files from {archive.name}")
    (dest / "SOURCE").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"optimizer corpus in {dest}")
    return dest


def _unpack_py(archive: Path, dest: Path) -> int:
    """Regular ``.py`` members of a tar archive, under ``dest`` at their archive path; members
    with an absolute path or a ``..`` part are skipped (an archive must not write outside)."""
    n = 0
    with tarfile.open(archive, "r:*") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or not m.name.endswith(".py") or m.name.startswith("/") or ".." in parts:
                continue
            data = tar.extractfile(m)
            if data is None:
                continue
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data.read())
            n += 1
    return n


def corpus_sources_on_disk(path: Path) -> list[str] | None:
    """The ``name==version`` lines of a corpus's SOURCE file (None: no SOURCE file)."""
    try:
        text = (path / "SOURCE").read_text(encoding="utf-8")
    except OSError:
        return None
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#") and "==" in ln]


def corpus_for(pattern: str, audit: dict[str, Any] | None, asked: str | None) -> tuple[CorpusSpec | None, Path]:
    """The corpus a pattern is audited on: ``asked`` (a name of CORPORA or a folder) for every
    pattern, else the one its yaml names, else PATTERN_CORPUS's, else the default. Returns the
    spec (None: a plain folder) and the folder."""
    if asked is not None:
        if asked in CORPORA:
            return CORPORA[asked], CORPORA[asked].path
        return None, Path(asked)
    name = str((audit or {}).get("corpus_name") or PATTERN_CORPUS.get(pattern, DEFAULT_CORPUS))
    spec = CORPORA.get(name)
    if spec is None:
        raise ValueError(f"{pattern}: unknown corpus_name {name!r} (one of {', '.join(CORPORA)})")
    return spec, spec.path
SECTIONS = ("candidates", "near_misses", "unfound_suspects")
SIZES = {"candidates": 40, "near_misses": 20, "unfound_suspects": 60}
VERDICTS = {
    "candidates": ("correct", "wrong"),
    "near_misses": ("right_reason", "wrong_reason", "should_be_candidate", "not_the_pattern"),
    "unfound_suspects": ("not_the_pattern", "missed"),
}
UNJUDGED = "?"
SNIPPET_CHARS = 72
Z95 = 1.959963984540054

HEADER = """\
# Hand audit of npufuse's {pattern} detector on {corpus}.
# Written by bench/corpus_audit.py draw (seed {seed}); judge each entry by opening the site and
# reading it, then run bench/corpus_audit.py score. Verdicts:
#   candidates:       correct | wrong               (wrong: say why in note)
#   near_misses:      right_reason | wrong_reason | should_be_candidate | not_the_pattern
#   unfound_suspects: not_the_pattern | missed      (missed: the site computes the pattern)
# file + qualname + snippet name the site (line is a hint); found/sig/shown are what the scan
# reported when the entry was drawn: a judged entry whose current sig differs is stale.
"""


# -- the scan and the corpus -----------------------------------------------------------------


def load_scan(corpus: Path, scan_file: Path | None = None, cache_dir: Path | None = CACHE_DIR,
              only: list[str] | None = None) -> dict[str, Any]:
    """scan.json of ``corpus``: read from ``scan_file``, else scanned in-process (all patterns, or
    ``only`` these, with npufuse's per-file cache so an unchanged corpus and detector re-scans in
    about a second)."""
    if scan_file is not None:
        return json.loads(scan_file.read_text(encoding="utf-8"))
    from npufuse.scan.engine import scan_repo

    return scan_repo(corpus, only=only, cache_dir=cache_dir).to_json()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(path)
    except OSError:  # a cache that cannot be written only costs time
        pass


def _snippet(text: str) -> str:
    return text.strip()[:SNIPPET_CHARS]


MODULE = "<module>"
_BLOCKS = ("body", "orelse", "finalbody")


def deep_functions(root: Path, files: list[str]) -> Iterator[Function]:
    """Every function of ``files`` as the scanner names its scopes, also those defined inside
    ``if``/``try``/``with``/``for`` blocks (``if is_megatron_available(): class Test...``: a block
    adds nothing to the qualname), plus one ``<module>`` entry per file holding the module-level
    lines outside any class or function (scripts and ``if __name__ == "__main__":`` bodies build
    optimizers there). The ``<module>`` entry's ``line`` is its first line with code; its span is
    the whole file. Unreadable files are skipped."""
    for rel in files:
        try:
            src = (root / rel).read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        covered: set[int] = set()  # lines of module-level (through blocks) classes and functions

        def walk(body: list[ast.stmt], prefix: str, top: bool) -> Iterator[Function]:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    if top:
                        covered.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                    yield from walk(node.body, f"{prefix}{node.name}.", False)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    end = node.end_lineno or node.lineno
                    if top:
                        covered.update(range(node.lineno, end + 1))
                    qual = f"{prefix}{node.name}"
                    text = "\n".join(ln.split("#", 1)[0] for ln in lines[node.lineno - 1 : end])
                    yield Function(rel, qual, node.lineno, end, text)
                    yield from walk(node.body, f"{qual}.", False)
                else:
                    parts: list[list[ast.stmt]] = [getattr(node, f, None) or [] for f in _BLOCKS]
                    parts += [h.body for h in getattr(node, "handlers", None) or []]
                    parts += [c.body for c in getattr(node, "cases", None) or []]
                    for part in parts:
                        yield from walk(part, prefix, top)

        yield from walk(tree.body, "", True)
        rest = [n for n in range(1, len(lines) + 1) if n not in covered]
        code = [n for n in rest if lines[n - 1].split("#", 1)[0].strip()]
        if code:
            text = "\n".join(lines[n - 1].split("#", 1)[0] for n in rest)
            yield Function(rel, MODULE, code[0], len(lines), text)


def unflagged(funcs: Iterable[Function], pattern: str, scan: dict[str, Any]) -> list[Function]:
    """corpus_findings.unflagged_suspects, but a ``<module>`` entry (whose span is the whole
    file) is held only by a finding in module-level code, not by one in any function of the file."""
    funcs = list(funcs)
    out = unflagged_suspects([f for f in funcs if f.qualname != MODULE], pattern, scan)
    at_module = {f["file"] for f in list(scan["candidates"]) + list(scan["near_misses"])
                 if f["pattern"] == pattern and f["qualname"] == MODULE}
    out += [f for f in funcs if f.qualname == MODULE and is_suspect(pattern, f.text) and f.file not in at_module]
    return out


class Corpus:
    """The corpus files as the scan saw them: their lines, their functions by qualname and, per
    pattern, the suspect functions (with their text). The function index is cached in
    ``index_file`` (JSON), keyed by the files' sizes and mtimes and the SUSPECTS table, since
    parsing 544 large files costs more than the whole cached scan. ``deep``: functions come from
    :func:`deep_functions` (block-nested definitions and module-level code too) instead of
    ``corpus_findings.functions`` (the default corpus keeps the latter, so its figures stay)."""

    def __init__(self, root: Path, files: Iterable[str], index_file: Path | None = None, deep: bool = False) -> None:
        self.root = root
        self.files = sorted(files)
        self.deep = deep
        self._lines: dict[str, list[str] | None] = {}
        self._spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
        self.suspects: dict[str, list[Function]] = {}
        key = self._fingerprint()
        cached = _read_json(index_file) if index_file is not None else None
        if cached is not None and cached.get("key") == key:
            spans = [tuple(x) for x in cached["spans"]]
            self.suspects = {p: [Function(*f) for f in fs] for p, fs in cached["suspects"].items()}
        else:
            funcs = list((deep_functions if deep else functions)(root, self.files))
            spans = [(f.file, f.qualname, f.line, f.end_line) for f in funcs]
            self.suspects = {p: [f for f in funcs if is_suspect(p, f.text)] for p in SUSPECTS}
            if index_file is not None:
                _write_json(index_file, {"key": key, "spans": spans, "suspects": {p: [list(f) for f in fs] for p, fs in self.suspects.items()}})
        for rel, qual, line, end in spans:
            self._spans.setdefault((rel, qual), []).append((line, end))

    def _fingerprint(self) -> str:
        h = hashlib.sha1(json.dumps(SUSPECTS, sort_keys=True).encode())
        if self.deep:  # another function list: never the shallow index's key
            h.update(b"deep\n")
        for code in (Path(__file__), HERE / "corpus_findings.py"):  # they decide the index's content
            h.update(code.read_bytes())
        for rel in self.files:
            try:
                st = (self.root / rel).stat()
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{rel}\0gone\n".encode())
        return h.hexdigest()

    @classmethod
    def of(cls, corpus: Path, index_file: Path | None = None, deep: bool = False) -> "Corpus":
        from npufuse.scan.walk import walk

        walked = walk(corpus)
        return cls(walked.root, walked.files, index_file, deep)

    def lines(self, rel: str) -> list[str] | None:
        if rel not in self._lines:
            try:
                self._lines[rel] = (self.root / rel).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError):
                self._lines[rel] = None
        return self._lines[rel]

    def spans(self, rel: str, qualname: str) -> list[tuple[int, int]]:
        if qualname == MODULE:
            lines = self.lines(rel)
            return [(1, len(lines))] if lines else []
        return self._spans.get((rel, qualname), [])

    def function_lines(self, rel: str) -> set[int]:
        """Lines of ``rel`` inside some function or method (classes' own statements excluded)."""
        out: set[int] = set()
        for (file, qual), spans in self._spans.items():
            if file == rel and qual != MODULE:
                for lo, hi in spans:
                    out.update(range(lo, hi + 1))
        return out

    def snippet_at(self, rel: str, line: int) -> str:
        lines = self.lines(rel) or []
        return _snippet(lines[line - 1]) if 0 < line <= len(lines) else ""

    def resolve(self, entry: dict[str, Any]) -> tuple[int, tuple[int, int]] | None:
        """(current line of the entry's snippet, span of its function), or None when the file,
        the function or the snippet inside it is gone. Several matches: the one nearest the hint."""
        lines = self.lines(str(entry.get("file", "")))
        snippet = str(entry.get("snippet", "")).strip()
        if lines is None or not snippet:
            return None
        hint = int(entry.get("line") or 0)
        best: tuple[int, int, tuple[int, int]] | None = None
        for span in self.spans(entry["file"], str(entry.get("qualname", ""))):
            for ln in range(span[0], min(span[1], len(lines)) + 1):
                if lines[ln - 1].strip().startswith(snippet):
                    cand = (abs(ln - hint), ln, span)
                    if best is None or cand < best:
                        best = cand
        return None if best is None else (best[1], best[2])


# -- what the scan says about a site ---------------------------------------------------------


@dataclass
class Found:
    status: str  # candidate | near_miss | nothing
    item: dict[str, Any] | None = None

    @property
    def sig(self) -> str:
        """A short hash of what a judge looked at: a candidate's params, variant and fused code;
        a near miss's reason."""
        if self.item is None:
            return ""
        if self.status == "candidate":
            blob = json.dumps([self.item.get("params"), self.item.get("variant"), self.item.get("fused")], sort_keys=True, default=str)
        else:
            blob = str(self.item.get("reason", ""))
        return hashlib.sha1(blob.encode("utf-8")).hexdigest()[:10]

    def shown(self) -> str:
        """One line for the judge: variant and params, or the reason."""
        if self.item is None:
            return ""
        if self.status == "near_miss":
            return str(self.item.get("reason", ""))
        params = {k: v for k, v in (self.item.get("params") or {}).items() if k != "unfused_ops"}
        return f"variant={self.item.get('variant', '')} params={json.dumps(params, sort_keys=True, default=str)}"


class ScanIndex:
    """The scan's findings of one pattern by file, for status look-ups."""

    def __init__(self, scan: dict[str, Any], pattern: str) -> None:
        self.pattern = pattern
        self.cands: dict[str, list[dict[str, Any]]] = {}
        self.near: dict[str, list[dict[str, Any]]] = {}
        for c in scan["candidates"]:
            if c["pattern"] == pattern:
                self.cands.setdefault(c["file"], []).append(c)
        for m in scan["near_misses"]:
            if m["pattern"] == pattern:
                self.near.setdefault(m["file"], []).append(m)

    def all_candidates(self) -> list[dict[str, Any]]:
        return [c for v in self.cands.values() for c in v]

    def all_near(self) -> list[dict[str, Any]]:
        return [m for v in self.near.values() for m in v]

    @staticmethod
    def _at(items: list[dict[str, Any]], qualname: str, line: int) -> dict[str, Any] | None:
        hits = [i for i in items if i["qualname"] == qualname and i["line"] <= line <= i.get("end_line", i["line"])]
        hits.sort(key=lambda i: (i["line"] != line, i["line"]))  # one starting at the line first
        return hits[0] if hits else None

    def site(self, rel: str, qualname: str, line: int) -> Found:
        """What the scan reports for the site whose span holds ``line``."""
        c = self._at(self.cands.get(rel, []), qualname, line)
        if c is not None:
            return Found("candidate", c)
        m = self._at(self.near.get(rel, []), qualname, line)
        return Found("near_miss", m) if m is not None else Found("nothing")

    def function(self, rel: str, span: tuple[int, int], qualname: str | None = None) -> Found:
        """What the scan reports anywhere inside a function (first line of a finding in its span;
        for the ``<module>`` entry: a finding in module-level code)."""
        for kind, items in (("candidate", self.cands.get(rel, [])), ("near_miss", self.near.get(rel, []))):
            inside = [i for i in items if span[0] <= i["line"] <= span[1] and (qualname != MODULE or i["qualname"] == MODULE)]
            if inside:
                return Found(kind, min(inside, key=lambda i: i["line"]))
        return Found("nothing")


def current(entry: dict[str, Any], section: str, corpus: Corpus, index: ScanIndex) -> tuple[tuple[int, tuple[int, int]] | None, Found]:
    """(resolution, found-status now) of one entry."""
    where = corpus.resolve(entry)
    if where is None:
        return None, Found("nothing")
    line, span = where
    return where, (index.function(entry["file"], span, str(entry.get("qualname"))) if section == "unfound_suspects"
                   else index.site(entry["file"], entry["qualname"], line))


# -- draw ------------------------------------------------------------------------------------


def _entry(file: str, qualname: str, line: int, snippet: str, found: Found) -> dict[str, Any]:
    return {"file": file, "qualname": qualname, "line": line, "snippet": snippet, "found": found.status,
            "sig": found.sig, "shown": found.shown(), "verdict": UNJUDGED, "note": ""}


def populations(scan: dict[str, Any], pattern: str, corpus: Corpus) -> dict[str, list[dict[str, Any]]]:
    """Every entry each section could hold, in a stable order."""
    index = ScanIndex(scan, pattern)
    cands = sorted(index.all_candidates(), key=lambda c: (c["file"], c["line"]))
    near = sorted(index.all_near(), key=lambda m: (m["file"], m["line"], m["reason"]))
    suspects = sorted(unflagged(corpus.suspects.get(pattern, []), pattern, scan), key=lambda f: (f.file, f.line))
    return {
        "candidates": [_entry(c["file"], c["qualname"], c["line"], corpus.snippet_at(c["file"], c["line"]), Found("candidate", c)) for c in cands],
        "near_misses": [_entry(m["file"], m["qualname"], m["line"], corpus.snippet_at(m["file"], m["line"]), Found("near_miss", m)) for m in near],
        "unfound_suspects": [_entry(f.file, f.qualname, f.line, corpus.snippet_at(f.file, f.line), Found("nothing")) for f in suspects],
    }


def _key(file: str, qualname: str, line: int) -> tuple[str, str, int]:
    return (file, qualname, line)


def draw(pattern: str, scan: dict[str, Any], corpus: Corpus, old: dict[str, Any] | None, seed: int, corpus_label: str,
         corpus_meta: CorpusSpec | None = None) -> dict[str, Any]:
    """The audit file's content: judged entries of ``old`` kept, each sample topped up to its
    size from the current population in a seeded order; unjudged entries that left the
    population are dropped (they would not be a sample of it any more). ``corpus_meta``: the
    named corpus drawn from, recorded (name, versions) so score uses it again."""
    pops = populations(scan, pattern, corpus)
    out: dict[str, Any] = {"pattern": pattern, "corpus": corpus_label}
    if corpus_meta is not None:
        out["corpus_name"] = corpus_meta.name
        out["corpus_sources"] = list(corpus_meta.sources)
    out.update({"seed": seed, "population": {s: len(pops[s]) for s in SECTIONS}})
    for section in SECTIONS:
        pop = pops[section]
        by_key = {_key(e["file"], e["qualname"], e["line"]): e for e in pop}
        kept: list[dict[str, Any]] = []
        taken: set[tuple[str, str, int]] = set()
        for e in (old or {}).get(section) or []:
            where = corpus.resolve(e)
            key = _key(e.get("file", ""), e.get("qualname", ""), where[0]) if where else None
            judged = str(e.get("verdict", UNJUDGED)) != UNJUDGED
            if key is not None and key in by_key:
                taken.add(key)
            elif not judged:
                continue
            if not judged and key is not None:  # still unjudged: show what the scan says now
                e = {**by_key[key], "note": e.get("note", "")}
            kept.append(e)
        want = min(SIZES[section], len(pop))
        order = list(pop)
        random.Random(f"{seed}:{pattern}:{section}").shuffle(order)
        for e in order:
            if len(taken) >= want:
                break
            key = _key(e["file"], e["qualname"], e["line"])
            if key not in taken:
                taken.add(key)
                kept.append(dict(e))
        kept.sort(key=lambda e: (e["file"], int(e.get("line") or 0)))
        out[section] = kept
    return out


def audit_path(audit_dir: Path, pattern: str) -> Path:
    return audit_dir / f"{pattern}.yaml"


def read_audit(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an audit file (expected a mapping)")
    return data


def write_audit(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = HEADER.format(pattern=data["pattern"], corpus=data["corpus"], seed=data["seed"])
    text += yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10_000)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# -- score -----------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (n == 0: the uninformative (0, 1))."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def _ratio(k: int, n: int) -> float | None:
    return k / n if n else None


@dataclass
class Tally:
    """Judged counts of one pattern, current found-status taken into account."""

    n_candidates: int = 0  # population sizes now
    n_near: int = 0
    n_unfound: int = 0
    correct: int = 0
    wrong: int = 0
    right_reason: int = 0
    wrong_reason: int = 0
    should_be_candidate: int = 0
    not_the_pattern_near: int = 0
    missed: int = 0
    not_the_pattern_unfound: int = 0
    unjudged: int = 0
    stale: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # judged entries whose found-status changed
    unresolved: list[str] = field(default_factory=list)
    bad_verdicts: list[str] = field(default_factory=list)


@dataclass
class Estimate:
    precision: float | None
    near_accuracy: float | None
    q: float | None
    recall: float | None  # the true sites reported at all (candidate or near miss)
    recall_candidates: float | None  # the replaceable sites reported as (correct) candidates
    recall_bounds: tuple[float | None, float | None]
    recall_candidates_bounds: tuple[float | None, float | None]


def _recalls(nc: int, nn: int, u: int, p: float, r: float, s: float, q: float) -> tuple[float | None, float | None]:
    """Both recall figures from population sizes and judged fractions (see estimate)."""
    found = p * nc + r * nn
    missed = q * u
    recall = found / (found + missed) if found + missed > 0 else None
    good = p * nc
    lost = s * nn + q * u
    recall_c = good / (good + lost) if good + lost > 0 else None
    return recall, recall_c


def _near_judged(t: Tally) -> int:
    return t.right_reason + t.wrong_reason + t.should_be_candidate + t.not_the_pattern_near


def estimate(t: Tally) -> Estimate:
    """Precision P = correct/judged candidates; near-miss accuracy A = right_reason/judged near
    misses; r = (right_reason + wrong_reason + should_be_candidate)/judged, the near misses that
    are the pattern or a look-alike it must name; s = should_be_candidate/judged; q =
    missed/judged unfound suspects.

    recall = F / (F + q·U) with F = P·Nc + r·Nn: of the sites that compute the pattern (or are
    look-alikes it must name), the share the scan reports at all — the brief's P·F/(P·F + q·U),
    each reported population discounted by its own judged share of true sites.
    recall_candidates = P·Nc / (P·Nc + s·Nn + q·U): of the replaceable sites, the share reported as
    correct candidates; conservative, as every missed suspect counts as a missed candidate.
    A fraction with nothing judged counts as 1 for P and r and 0 for s and q when its population
    is empty, else the figure is unknown (None). Bands: the recalls at the Wilson 95% ends of
    each fraction taken the unfavourable (low) and favourable (high) way — a rough band, not an
    exact interval."""
    nc, nn, u = t.n_candidates, t.n_near, t.n_unfound
    jc, jn, ju = t.correct + t.wrong, _near_judged(t), t.missed + t.not_the_pattern_unfound
    reported = t.right_reason + t.wrong_reason + t.should_be_candidate
    p = _ratio(t.correct, jc)
    a = _ratio(t.right_reason, jn)
    r = _ratio(reported, jn)
    s = _ratio(t.should_be_candidate, jn)
    q = _ratio(t.missed, ju)

    def known(x: float | None, pop: int, empty: float) -> float | None:
        return x if x is not None else (empty if pop == 0 else None)

    pk, rk, sk, qk = known(p, nc, 1.0), known(r, nn, 1.0), known(s, nn, 0.0), known(q, u, 0.0)
    if pk is None or rk is None or sk is None or qk is None:
        return Estimate(p, a, q, None, None, (None, None), (None, None))
    rec, rec_c = _recalls(nc, nn, u, pk, rk, sk, qk)
    pl, ph = wilson(t.correct, jc) if jc else (pk, pk)
    rl, rh = wilson(reported, jn) if jn else (rk, rk)
    sl, sh = wilson(t.should_be_candidate, jn) if jn else (sk, sk)
    ql, qh = wilson(t.missed, ju) if ju else (qk, qk)
    # a higher s lowers recall_candidates only; each band takes every fraction its own worst/best way
    lo_r = _recalls(nc, nn, u, pl, rl, sk, qh)[0]
    hi_r = _recalls(nc, nn, u, ph, rh, sk, ql)[0]
    lo_c = _recalls(nc, nn, u, pl, rk, sh, qh)[1]
    hi_c = _recalls(nc, nn, u, ph, rk, sl, ql)[1]
    return Estimate(p, a, q, rec, rec_c, (lo_r, hi_r), (lo_c, hi_c))


def tally(data: dict[str, Any], scan: dict[str, Any], corpus: Corpus) -> Tally:
    """Counts of one audit file against the current scan and corpus."""
    pattern = data["pattern"]
    index = ScanIndex(scan, pattern)
    t = Tally(n_candidates=len(index.all_candidates()), n_near=len(index.all_near()),
              n_unfound=len(unflagged(corpus.suspects.get(pattern, []), pattern, scan)))
    for section in SECTIONS:
        for e in data.get(section) or []:
            verdict = str(e.get("verdict", UNJUDGED)).strip()
            label = f"{section}: {e.get('file')}:{e.get('line')} {e.get('qualname')} [{e.get('snippet', '')[:40]}]"
            if verdict == UNJUDGED:
                t.unjudged += 1
                continue
            if verdict not in VERDICTS[section]:
                t.bad_verdicts.append(f"{label}: unknown verdict {verdict!r} (one of {', '.join(VERDICTS[section])})")
                continue
            where, now = current(e, section, corpus, index)
            if where is None:
                t.unresolved.append(label)
                continue
            drawn = {"candidates": "candidate", "near_misses": "near_miss", "unfound_suspects": "nothing"}[section]
            if now.status != drawn:
                t.moved.append(f"{label}: judged {verdict} as {drawn}, now {now.status}" + (f" ({now.shown()})" if now.item else ""))
                continue
            if section != "unfound_suspects" and str(e.get("sig", "")) != now.sig:
                t.stale.append(f"{label}: judged sig {e.get('sig')}, now {now.sig}: {now.shown()}")
                continue
            if section == "candidates":
                t.correct += verdict == "correct"
                t.wrong += verdict == "wrong"
            elif section == "near_misses":
                t.right_reason += verdict == "right_reason"
                t.wrong_reason += verdict == "wrong_reason"
                t.should_be_candidate += verdict == "should_be_candidate"
                t.not_the_pattern_near += verdict == "not_the_pattern"
            else:
                t.missed += verdict == "missed"
                t.not_the_pattern_unfound += verdict == "not_the_pattern"
    return t


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _band(b: tuple[float | None, float | None]) -> str:
    return "n/a" if None in b else f"[{b[0]:.3f}, {b[1]:.3f}]"


def report(pattern: str, t: Tally, e: Estimate) -> list[str]:
    jc, jn, ju = t.correct + t.wrong, _near_judged(t), t.missed + t.not_the_pattern_unfound
    out = [f"== {pattern} ==",
           f"population now: candidates Nc={t.n_candidates}, near misses Nn={t.n_near}, unfound suspects U={t.n_unfound}",
           f"precision        P = {_pct(e.precision)}  ({t.correct} correct / {jc} judged; Wilson 95% {_band(wilson(t.correct, jc)) if jc else 'n/a'})",
           f"near-miss reason A = {_pct(e.near_accuracy)}  ({t.right_reason} right_reason, {t.wrong_reason} wrong_reason, {t.should_be_candidate} should_be_candidate, "
           f"{t.not_the_pattern_near} not_the_pattern / {jn} judged; Wilson 95% {_band(wilson(t.right_reason, jn)) if jn else 'n/a'})",
           f"unfound true     q = {_pct(e.q)}  ({t.missed} missed / {ju} judged; Wilson 95% {_band(wilson(t.missed, ju)) if ju else 'n/a'})",
           f"recall (reported)   = {_pct(e.recall)}  band {_band(e.recall_bounds)}",
           f"recall (candidates) = {_pct(e.recall_candidates)}  band {_band(e.recall_candidates_bounds)}",
           f"unjudged {t.unjudged}, stale {len(t.stale)}, moved {len(t.moved)}, unresolved {len(t.unresolved)}"]
    for title, items in (("stale (re-judge, then copy the current sig)", t.stale), ("moved since judged", t.moved),
                         ("UNRESOLVED (no longer in the corpus)", t.unresolved), ("bad verdicts", t.bad_verdicts)):
        if items:
            out.append(f"  {title}:")
            out += [f"    {x}" for x in items]
    return out


COVERAGE = ("Recall covers only the suspect pool: functions with the pattern's tell-tale tokens "
            "(corpus_findings.SUSPECTS). Sites spelled without those tokens are not sampled, so "
            "their misses are not counted.")


# -- show: the judge's reading view -----------------------------------------------------------


def show(data: dict[str, Any], scan: dict[str, Any], corpus: Corpus, sections: Iterable[str], only_unjudged: bool,
         max_lines: int = 80, context: int | None = None) -> list[str]:
    """Each entry with its code now: a candidate's span and the fused branch npufuse would write;
    a near miss's or a suspect's whole function (capped; ``context``: a suspect's lines with a
    tell-tale token and ``context`` lines around them). An entry whose code and scan output
    are identical to an earlier one's says so (transformers copies modules verbatim)."""
    index = ScanIndex(scan, data["pattern"])
    seen: dict[str, str] = {}
    out: list[str] = []
    for section in sections:
        for i, e in enumerate(data.get(section) or []):
            if only_unjudged and str(e.get("verdict", UNJUDGED)) != UNJUDGED:
                continue
            where, now = current(e, section, corpus, index)
            head = f"--- {section}[{i}] {e['file']}:{e.get('line')} {e['qualname']}  now: {now.status}  verdict: {e.get('verdict')}"
            if where is None:
                out += [head, "    UNRESOLVED"]
                continue
            lines = corpus.lines(e["file"]) or []
            line, span = where
            if section == "candidates" and now.item is not None:
                lo, hi = now.item["line"], now.item["end_line"]
            else:
                lo, hi = span
                if hi - lo + 1 > max_lines and not (section == "unfound_suspects" and context is not None):
                    lo, hi = max(lo, line - max_lines // 4), min(hi, line + 3 * max_lines // 4)
            numbers = list(range(lo, hi + 1))
            if section == "unfound_suspects" and e["qualname"] == MODULE:
                # module-level code only: the file's functions are entries of their own
                inside = corpus.function_lines(e["file"])
                numbers = [n for n in numbers if n == line or n not in inside]
            if section == "unfound_suspects" and context is not None:
                # only the lines with a tell-tale token (and their neighbours), plus the def line
                rxs = [re.compile(r) for r in SUSPECTS.get(data["pattern"], [])]
                hot = {n for n in numbers if any(r.search(lines[n - 1].split("#", 1)[0]) for r in rxs)}
                numbers = [n for n in numbers if n == lo or any(abs(n - h) <= context for h in hot)]
            text = [lines[n - 1] for n in numbers]
            body = [f"{n:5d}  {t}" for n, t in zip(numbers, text)]
            extra = [f"    shown: {now.shown()}"] if now.item is not None else []
            if section == "candidates" and now.item is not None:
                extra += ["    fused:"] + [f"      {x}" for x in str(now.item.get("fused", "")).splitlines()]
            key = "\n".join(text + extra)
            if key in seen:
                out += [head, f"    identical code and scan output to {seen[key]}"]
                continue
            seen[key] = f"{section}[{i}]"
            out += [head] + body + extra
    return out


def judge(data: dict[str, Any], scan: dict[str, Any], corpus: Corpus, section: str, indexes: list[int] | None, verdict: str, note: str) -> list[str]:
    """Set a verdict on entries of one section and record what the judge saw: the found-status
    and sig of now, so a re-judged stale entry counts again. Returns one line per entry."""
    if verdict not in VERDICTS[section] + (UNJUDGED,):
        raise ValueError(f"unknown verdict {verdict!r} for {section} (one of {', '.join(VERDICTS[section])})")
    items = data.get(section) or []
    chosen = range(len(items)) if indexes is None else indexes
    index = ScanIndex(scan, data["pattern"])
    out = []
    for i in chosen:
        if not 0 <= i < len(items):
            raise ValueError(f"{section} has no entry {i} (0..{len(items) - 1})")
        e = items[i]
        where, now = current(e, section, corpus, index)
        if where is None:
            raise ValueError(f"{section}[{i}] ({e.get('file')} {e.get('qualname')}) does not resolve to code in the corpus")
        e.update({"line": where[0], "found": now.status, "sig": now.sig, "shown": now.shown(), "verdict": verdict})
        if note:
            e["note"] = note
        out.append(f"{section}[{i}] {e['file']}:{e['line']} {e['qualname']} -> {verdict} (now {now.status})")
    return out


# -- command line ----------------------------------------------------------------------------


def _patterns(asked: list[str] | None, audit_dir: Path) -> list[str]:
    if asked:
        return asked
    return sorted(p.stem for p in audit_dir.glob("*.yaml"))


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


@dataclass
class _Loaded:
    """One corpus as the run uses it: its scan, its files and functions, its label."""

    spec: CorpusSpec | None
    path: Path
    label: str
    scan: dict[str, Any]
    corpus: Corpus


def _load(spec: CorpusSpec | None, path: Path, args: argparse.Namespace, patterns: list[str]) -> _Loaded:
    # The default corpus (and a plain folder) is scanned with every detector, as it always was
    # (same cache entries). Another named corpus only with the detectors audited on it: the
    # optimizer corpus is ~5,100 files, and a pattern's findings do not depend on the others'.
    only = None if spec is None or spec.name == DEFAULT_CORPUS else patterns
    scan = load_scan(path, args.scan, args.cache_dir, only)
    # the default corpus (and a plain folder) keep the original index file; another named corpus
    # gets its own, so switching between them does not rebuild either index each time
    index_name = "functions.json" if spec is None or spec.name == DEFAULT_CORPUS else f"functions-{spec.name}.json"
    # another named corpus (sdists: scripts, tests) also indexes block-nested definitions and
    # module-level code; the default keeps corpus_findings.functions, so its figures stay
    deep = spec is not None and spec.name != DEFAULT_CORPUS
    corpus = Corpus.of(path, args.cache_dir / index_name, deep)
    if scan.get("files_failed"):
        print(f"note: {len(scan['files_failed'])} file problem(s) in the scan: " + "; ".join(f"{f['file']}: {f['error']}" for f in scan["files_failed"][:5]))
    return _Loaded(spec, path, _label(path), scan, corpus)


def _source_mismatch(audit: dict[str, Any] | None, loaded: _Loaded) -> str | None:
    """Why the corpus on disk is not the one the yaml's verdicts were judged on (None: it is,
    or the yaml names no versions)."""
    want = (audit or {}).get("corpus_sources")
    if not want:
        return None
    have = corpus_sources_on_disk(loaded.path)
    if have is None or sorted(have) != sorted(str(w) for w in want):
        return (f"the corpus at {loaded.label} is {', '.join(have) if have else 'of unknown origin (no SOURCE file)'}; "
                f"the verdicts were judged on {', '.join(map(str, want))}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetch-optimizer-corpus", action="store_true",
                    help=f"pip download the pinned sdists ({', '.join(CORPORA['optimizer'].sources)}) and unpack their .py files "
                         f"into {_label(OPTIM_CORPUS)}; then run the command, if one is given")
    sub = ap.add_subparsers(dest="cmd")
    for name in ("draw", "score", "show", "judge"):
        p = sub.add_parser(name)
        p.add_argument("--pattern", action="append", required=name != "score", help="pattern id (repeatable; judge: one)")
        p.add_argument("--corpus", default=None, metavar="NAME|DIR",
                       help=f"corpus for every pattern: one of {', '.join(CORPORA)} or a folder (default: the corpus the "
                            f"pattern's yaml names, else {', '.join(f'{k}: {v}' for k, v in PATTERN_CORPUS.items())}, "
                            f"else {DEFAULT_CORPUS} = {_label(CORPUS)})")
        p.add_argument("--audit-dir", type=Path, default=AUDIT_DIR, help="where the <pattern>.yaml files live")
        p.add_argument("--scan", type=Path, default=None, metavar="SCAN_JSON", help="read this scan.json instead of scanning")
        p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="npufuse per-file scan cache and the function index (default: %(default)s)")
        if name == "draw":
            p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the file's, else 0)")
        if name == "show":
            p.add_argument("--section", action="append", choices=SECTIONS, help="only these samples (repeatable)")
            p.add_argument("--unjudged", action="store_true", help="only entries still marked '?'")
            p.add_argument("--context", type=int, default=None, metavar="N", help="suspects: only token lines and N lines around them")
        if name == "judge":
            p.add_argument("--section", required=True, choices=SECTIONS)
            p.add_argument("--index", default="all", help="comma-separated entry numbers (as `show` prints them), or all")
            p.add_argument("--verdict", required=True)
            p.add_argument("--note", default="")
    args = ap.parse_args(argv)
    if args.fetch_optimizer_corpus:
        fetch_optimizer_corpus()
        if args.cmd is None:
            return 0
    if args.cmd is None:
        ap.print_usage(sys.stderr)
        print("a command (draw, score, show, judge) or --fetch-optimizer-corpus is required", file=sys.stderr)
        return 2
    patterns = _patterns(args.pattern, args.audit_dir)
    unknown = [p for p in patterns if p not in SUSPECTS]
    if unknown:
        print(f"unknown pattern {', '.join(unknown)}; known: {', '.join(SUSPECTS)}", file=sys.stderr)
        return 2
    if not patterns:
        print(f"no audit files in {args.audit_dir}; run draw first", file=sys.stderr)
        return 2
    try:
        audits = {p: read_audit(audit_path(args.audit_dir, p)) for p in patterns}
        chosen = {p: corpus_for(p, audits[p], args.corpus) for p in patterns}
    except (ValueError, yaml.YAMLError) as exc:
        print(f"bad audit file: {exc}", file=sys.stderr)
        return 2
    for p, (spec, path) in chosen.items():
        if not path.is_dir():
            hint = spec.fetch_hint if spec is not None else CORPORA[DEFAULT_CORPUS].fetch_hint
            print(f"no corpus at {path} for {p} ({hint} makes it)", file=sys.stderr)
            return 2
    # one scan and one function index per corpus, in the order the patterns first need them
    loaded: dict[Path, _Loaded] = {}
    for p, (spec, path) in chosen.items():
        key = path.resolve()
        if key not in loaded:
            users = [q for q, (_s, qpath) in chosen.items() if qpath.resolve() == key]
            loaded[key] = _load(spec, path, args, users)
    on = {p: loaded[path.resolve()] for p, (_spec, path) in chosen.items()}
    if args.cmd == "draw":
        for p in patterns:
            old, here = audits[p], on[p]
            judged = [e for s in SECTIONS for e in (old or {}).get(s) or [] if str(e.get("verdict", UNJUDGED)) != UNJUDGED]
            if judged and str(old.get("corpus", here.label)) != here.label:
                # its judged entries name sites of the other corpus: they would never resolve here
                print(f"{audit_path(args.audit_dir, p)} was judged on {old.get('corpus')}, not {here.label}; "
                      "draw it on that corpus (or delete the file to start over)", file=sys.stderr)
                return 2
            seed = args.seed if args.seed is not None else int((old or {}).get("seed", 0))
            meta = here.spec if here.spec is not None and here.spec.name != DEFAULT_CORPUS else None
            data = draw(p, here.scan, here.corpus, old, seed, here.label, meta)
            write_audit(audit_path(args.audit_dir, p), data)
            sizes = ", ".join(f"{s} {len(data[s])}/{data['population'][s]}" for s in SECTIONS)
            print(f"{audit_path(args.audit_dir, p)}: {sizes}")
        return 0
    if args.cmd == "judge":
        if len(patterns) != 1 or audits[patterns[0]] is None:
            print("judge takes one --pattern whose audit file exists", file=sys.stderr)
            return 2
        data, here = audits[patterns[0]], on[patterns[0]]
        try:
            idx = None if args.index == "all" else [int(x) for x in args.index.split(",") if x.strip()]
            lines = judge(data, here.scan, here.corpus, args.section, idx, args.verdict, args.note)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        write_audit(audit_path(args.audit_dir, patterns[0]), data)
        print("\n".join(lines))
        return 0
    if args.cmd == "show":
        for p in patterns:
            if audits[p] is None:
                print(f"no audit file {audit_path(args.audit_dir, p)}; run draw first", file=sys.stderr)
                return 2
            print("\n".join(show(audits[p], on[p].scan, on[p].corpus, args.section or SECTIONS, args.unjudged, context=args.context)))
        return 0
    rc = 0
    for p in patterns:
        if audits[p] is None:
            print(f"== {p} ==\nno audit file {audit_path(args.audit_dir, p)}; run draw first")
            rc = max(rc, 2)
            continue
        t = tally(audits[p], on[p].scan, on[p].corpus)
        lines = report(p, t, estimate(t))
        mismatch = _source_mismatch(audits[p], on[p])
        if on[p].spec is not None and on[p].spec.name != DEFAULT_CORPUS:
            lines.insert(1, f"corpus: {on[p].spec.name} ({on[p].label}: {', '.join(on[p].spec.sources)})")
        if mismatch:
            lines.insert(1, f"CORPUS MISMATCH: {mismatch}")
        print("\n".join(lines))
        print()
        if t.unresolved or t.bad_verdicts or mismatch:
            rc = 1
    print(COVERAGE)
    return rc


if __name__ == "__main__":
    sys.exit(main())
