"""Every finding and near miss of a scan as tables, for the hand spot-check of precision/recall.

    .venv/bin/python bench/corpus_findings.py [CORPUS_DIR] [--pattern rms_norm] [--markdown out.md]
                                              [--sample 20 --seed 0] [--suspects]

Per pattern: candidate and near-miss counts, then one row per finding (id, file:line, qualname,
variant, confidence) and per near miss (reason). ``--sample N`` lists N random rows per pattern
for the precision check (open each and judge it). ``--suspects`` lists, per pattern, functions
whose text has the pattern's tell-tale tokens (``rsqrt``, ``rotate_half``, ``softmax`` with a
matmul, ``silu``, ``scaled_dot_product_attention``, a loop over experts, ``torch.optim.X(``...)
but no finding and no near miss of that pattern: the pool to check recall against (a miss there
is a false negative; a legitimate non-match should have been a near miss). Prints tables only.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
CORPUS = HERE / ".data" / "transformers"

# Tell-tale tokens per pattern (all must match the function's source). Deliberately loose:
# they collect the functions a careful reader would look at, not findings.
# rms_norm also takes L2-norm spellings; swiglu any activation call in a product (ACT2FN's act_fn,
# act, activation...) or silu next to a product; geglu any mention of gelu beside a product (the
# hand-written tanh formula included); rope a cos product with a sin anywhere, besides the
# rotate_half / complex spellings. Widened for bench/corpus_audit.py so the recall pool does not
# only hold the spellings the detectors already know.
_NORM2 = r"torch\.norm\(|\.norm\(\s*(?:p\s*=\s*)?2|vector_norm\("
_ACT = r"(?:silu|swish|sigmoid|act_fn|act|activation|activation_fn|act_layer|nonlinearity|gelu\w*)"
_CALL = r"\([^()\n]*(?:\([^()\n]*(?:\([^()\n]*\))?[^()\n]*\))?[^()\n]*\)"
_MUL = r"[\w)\]]\s*\*\s*[\w(]"  # a product, not ``**kwargs`` or ``x ** 2``
SUSPECTS: dict[str, list[str]] = {
    "rms_norm": [r"rsqrt|torch\.sqrt\(|\.sqrt\(\)|" + _NORM2, r"\.mean\(|\.pow\(2\)|\*\*\s*2|torch\.square|" + _NORM2],
    "add_rms_norm": [r"residual\s*\+|\+\s*residual", r"norm\("],
    "swiglu": [_ACT + _CALL + r"\s*\*|\*\s*(?:[\w.]*\.)?" + _ACT + r"\(|silu\w*\(.*\*|\*.*silu\w*\("],
    "geglu": [r"gelu", _MUL],
    "rope": [r"rotate_half\(|rotate_every_two\(|view_as_complex\(|\*\s*\w*cos\w*\b|\b\w*cos\w*(?:\[[^\]]*\])?\s*\*", r"sin"],
    "attention": [r"softmax", r"matmul|@|bmm|einsum"],
    "sdpa": [r"scaled_dot_product_attention"],
    "moe_experts": [r"expert", r"for\s+\w+.*\bin\b"],
    # any optimizer construction, also after `from torch.optim import AdamW` / `import torch.optim as optim`:
    # every torch.optim class; a class held in a variable (`optimizer_cls(...)`, `opt_class(...)`),
    # looked up by name (`getattr(torch.optim, name)`) or bound with functools.partial
    "fused_optimizer": [r"(?:torch\.optim\.|optim\.|\b)(?:AdamW|Adam|SGD|Adagrad|RMSprop|Adadelta|Adamax|NAdam|RAdam"
                        r"|ASGD|Rprop|LBFGS|SparseAdam)\("
                        r"|\b\w*opt\w*_(?:cls|class|type|fn|factory)\(|getattr\(\s*(?:torch\.)?optim\s*,"
                        r"|partial\(\s*(?:torch\.optim\.|optim\.)\w+"],
    # an assignment (plain or augmented) through an index that looks boolean: a mask name, a comparison,
    # `~`, isnan/isinf/isfinite, .bool() -- or an explicit index_put
    "affinity_index_put": [r"\[[^\]\n]*(?:mask|==|!=|<|>|~|isnan|isinf|isfinite|\.bool\(\))[^\]\n]*\]\s*(?:[-+*/]?=)(?!=)|\.index_put_?\("],
    # a torch.where with at least two arguments; the condition may hold calls nested two deep
    "affinity_where": [r"torch\.where\((?:[^,()]|\((?:[^()]|\([^()]*\))*\))+,"],
}
_SUSPECT_RX: dict[str, list[re.Pattern[str]]] = {}


class Function(NamedTuple):
    """One function of the corpus, named as the scanner names scopes (``Class.method``, ``outer.inner``)."""

    file: str
    qualname: str
    line: int  # the ``def`` line
    end_line: int
    text: str  # its lines, comments stripped


def functions(root: Path, files: list[str]) -> Iterator[Function]:
    """Every function and method in ``files`` (relative to ``root``); unreadable files are skipped."""
    for rel in files:
        try:
            src = (root / rel).read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        stack = [(n, "") for n in tree.body]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, ast.ClassDef):
                stack += [(n, f"{prefix}{node.name}.") for n in node.body]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{node.name}"
                end = node.end_lineno or node.lineno
                # the function's own lines, without nested definitions' docstrings mattering much
                text = "\n".join(ln.split("#", 1)[0] for ln in lines[node.lineno - 1 : end])
                yield Function(rel, qual, node.lineno, end, text)
                stack += [(n, f"{qual}.") for n in node.body]
            else:
                # a def under if/else/try/except/with/for/while/match is a scope of the scanner
                # too (xlstm's kernels sit under `if is_xlstm_available(): ... else:`); the
                # block adds nothing to the qualname
                for name in ("body", "orelse", "finalbody"):
                    stack += [(n, prefix) for n in getattr(node, name, None) or () if isinstance(n, ast.stmt)]
                for part in (getattr(node, "handlers", None) or []) + (getattr(node, "cases", None) or []):
                    stack += [(n, prefix) for n in part.body]


def is_suspect(pattern: str, text: str) -> bool:
    """Whether a function's text has all of ``pattern``'s tell-tale tokens (False: no tokens defined)."""
    rxs = _SUSPECT_RX.get(pattern)
    if rxs is None:
        rxs = _SUSPECT_RX[pattern] = [re.compile(r) for r in SUSPECTS.get(pattern, [])]
    return bool(rxs) and all(r.search(text) for r in rxs)


def unflagged_suspects(funcs: Iterable[Function], pattern: str, scan: dict[str, Any]) -> list[Function]:
    """Suspect functions of ``pattern`` holding no candidate and no near miss of it.

    "Holding" is by line: a finding whose first line lies inside the function's span (so an
    outer function holding a flagged nested one is not a suspect either)."""
    starts: dict[str, list[int]] = {}
    for f in list(scan["candidates"]) + list(scan["near_misses"]):
        if f["pattern"] == pattern:
            starts.setdefault(f["file"], []).append(f["line"])
    return [fn for fn in funcs if is_suspect(pattern, fn.text) and not any(fn.line <= ln <= fn.end_line for ln in starts.get(fn.file, ()))]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="?", help=f"folder to scan (default: {CORPUS.relative_to(HERE.parent)}; bench/scan.py --fetch-transformers makes it)")
    ap.add_argument("--pattern", action="append", help="only these pattern ids (repeatable)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the tables to FILE")
    ap.add_argument("--sample", type=int, default=0, metavar="N", help="N random findings and N random near misses per pattern (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--suspects", action="store_true", help="list unflagged functions with the pattern's tell-tale tokens (recall check)")
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)

    corpus = Path(args.corpus) if args.corpus else CORPUS
    if not corpus.is_dir():
        print(f"no corpus at {corpus}", file=sys.stderr)
        return 2
    from npufuse.scan.engine import scan_repo
    from npufuse.scan.walk import walk

    res = scan_repo(corpus, only=args.pattern, jobs=args.jobs)
    scan = res.to_json()
    ids = scan["patterns"]
    rnd = random.Random(args.seed)
    out: list[str] = [f"# Findings on {corpus}", "", f"{scan['files_scanned']} files scanned, {len(scan['files_failed'])} problems.", ""]
    out += ["| pattern | candidates | near misses |", "|---|---:|---:|"]
    for pid in ids:
        nc = sum(c["pattern"] == pid for c in scan["candidates"])
        nm = sum(m["pattern"] == pid for m in scan["near_misses"])
        out.append(f"| {pid} | {nc} | {nm} |")
    out.append("")
    if scan["files_failed"]:
        out += ["## Problems", "", "| file | kind | error |", "|---|---|---|"]
        out += [_row([f["file"], f["kind"], f["error"]]) for f in scan["files_failed"]]
        out.append("")
    for pid in ids:
        cands = [c for c in scan["candidates"] if c["pattern"] == pid]
        near = [m for m in scan["near_misses"] if m["pattern"] == pid]
        if args.sample:
            cands = sorted(rnd.sample(cands, min(args.sample, len(cands))), key=lambda c: c["id"])
            near = sorted(rnd.sample(near, min(args.sample, len(near))), key=lambda m: (m["file"], m["line"]))
        out += [f"## {pid}", "", f"### findings ({len(cands)} shown)", "", "| id | file:line | qualname | variant | confidence | risk |", "|---:|---|---|---|---|---|"]
        out += [_row([str(c["id"]), f"{c['file']}:{c['line']}-{c['end_line']}", c["qualname"], c.get("variant", ""), c["confidence"], c.get("risk_level", "")]) for c in cands]
        out += ["", f"### near misses ({len(near)} shown)", "", "| file:line | qualname | reason |", "|---|---|---|"]
        out += [_row([f"{m['file']}:{m['line']}", m["qualname"], m["reason"]]) for m in near]
        out.append("")
    if args.suspects:
        walked = walk(corpus)
        out += ["## Unflagged suspects (recall check)", ""]
        funcs = list(functions(walked.root, walked.files))
        for pid in ids:
            if not SUSPECTS.get(pid):
                continue
            hits = [(fn.file, fn.qualname, fn.line) for fn in unflagged_suspects(funcs, pid, scan)]
            out += [f"### {pid}: {len(hits)} functions", "", "| file:line | qualname |", "|---|---|"]
            shown = hits if not args.sample else sorted(rnd.sample(hits, min(args.sample, len(hits))))
            out += [_row([f"{rel}:{ln}", q]) for rel, q, ln in shown]
            out.append("")
    text = "\n".join(out) + "\n"
    print(text, end="")
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
