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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
CORPUS = HERE / ".data" / "transformers"

# Tell-tale tokens per pattern (all must match the function's source). Deliberately loose:
# they collect the functions a careful reader would look at, not findings.
SUSPECTS: dict[str, list[str]] = {
    "rms_norm": [r"rsqrt|/\s*torch\.sqrt|\.sqrt\(\)", r"\.mean\(|\.pow\(2\)|\*\*\s*2|torch\.square"],
    "add_rms_norm": [r"residual\s*\+|\+\s*residual", r"norm\("],
    "swiglu": [r"(?:silu|SiLU\(\)|act_fn|act|sigmoid)\([^()]*(?:\([^()]*\))?[^()]*\)\s*\*|\*\s*(?:F\.|nn\.functional\.)?(?:silu|act_fn)\("],
    "geglu": [r"gelu\([^()]*(?:\([^()]*\))?[^()]*\)\s*\*|\*\s*(?:F\.|nn\.functional\.)?gelu\("],
    "rope": [r"rotate_half\(|rotate_every_two\(|view_as_complex\(", r"\bsin\b|freqs"],
    "attention": [r"softmax", r"matmul|@|bmm|einsum"],
    "sdpa": [r"scaled_dot_product_attention"],
    "moe_experts": [r"expert", r"for\s+\w+.*\bin\b"],
    "fused_optimizer": [r"torch\.optim\.\w+\("],
    "affinity_index_put": [r"\[[^\]\n]*mask[^\]\n]*\]\s*=(?!=)"],
    "affinity_where": [r"torch\.where\([^,()]+,"],
}


def _functions(root: Path, files: list[str]):
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
                # the function's own lines, without nested definitions' docstrings mattering much
                text = "\n".join(ln.split("#", 1)[0] for ln in lines[node.lineno - 1 : node.end_lineno])
                yield rel, qual, node.lineno, text
                stack += [(n, f"{qual}.") for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


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
    flagged: dict[str, set[tuple[str, str]]] = {pid: set() for pid in ids}
    for pid in ids:
        cands = [c for c in scan["candidates"] if c["pattern"] == pid]
        near = [m for m in scan["near_misses"] if m["pattern"] == pid]
        flagged[pid] = {(c["file"], c["qualname"]) for c in cands} | {(m["file"], m["qualname"]) for m in near}
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
        funcs = list(_functions(walked.root, walked.files))
        for pid in ids:
            rxs = [re.compile(r) for r in SUSPECTS.get(pid, [])]
            if not rxs:
                continue
            hits = [(rel, q, ln) for rel, q, ln, text in funcs if all(r.search(text) for r in rxs) and (rel, q) not in flagged[pid]]
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
