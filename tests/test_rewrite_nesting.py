"""libcst's native parser overflows the C stack on deeply nested source (SIGSEGV: the Python
process dies, no exception). Every libcst parse of user text goes through
:func:`npufuse.rewrite.nesting.check` first, so such a file is refused with a per-file reason
and left byte for byte as it was.

The crashing inputs run in a subprocess: a regression segfaults the child and fails the test
instead of killing pytest. In-process tests stay between the limit and the crash depth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apply_support import HEAD, MODEL, make_repo, npufuse, scan, state_of
from npufuse.rewrite import nesting
from npufuse.rewrite.codegen import env_switch
from npufuse.rewrite.transform import SiteEdit, marked_sites, parse_expression, revert_source, rewrite_source

CRASH_BRACKETS = 2000  # libcst 1.9 crashes at ~1,200 nested brackets on an 8 MiB stack
BETWEEN = 600  # over the limit, far below the crash: safe to try in process


def nested(n: int) -> str:
    return "(" * n + "1" + ")" * n


# -- the measure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, depth", [
    ("x = 1\n", 0),
    (f"x = {nested(10)}\n", 10),
    ("x = [[[1], [2]], {'a': (3,)}]\n", 3),
    ("f(a, b)(c)[0]\n", 1),
    ('s = "((((((((" + \'[[[[[\' + """\n((((((\n"""  # ((((((((\n', 0),  # strings and comments are no code
    ('s = f"{((((1))))}"\n', 5),  # an f-string's fields are code libcst parses
    ("if x:\n    if y:\n        z = (1)\nw = 1\n", 3),
    ("x = " + "-" * 600 + "1\n", 100),  # a chain: six unary minus cost libcst about the stack of one bracket
    ("x = " + " + ".join(["a * b ** 2"] * 600) + "\n", 150),  # a sum: the `+` chain (599 x 3/12), each term's own chains afresh
    ("x = a" + ".b" * 120 + "\n", 30),
    ("x = " + "lambda: " * 120 + "1\n", 50),
    ("x = a < b < c < d < e\n", 0),  # a comparison is one flat node
    ("x = [" + "1, " * 5000 + "]\n", 1),  # a long flat list is not deep
])  # fmt: skip
def test_measure(code: str, depth: int) -> None:
    assert nesting.measure(code).depth == depth


def test_deepest_line_is_reported() -> None:
    text = "a = 1\n" + f"b = {nested(5)}\n" + "c = (\n  1,\n)\n"
    assert nesting.measure(text) == nesting.Nesting(5, 2)


def test_real_code_is_far_below_the_limit() -> None:
    root = Path(nesting.__file__).parents[1]
    deepest = max(nesting.measure(p.read_text(encoding="utf-8")).depth for p in root.rglob("*.py"))
    assert deepest < nesting.LIMIT / 10


def test_problem_and_check_name_depth_and_limit() -> None:
    text = f"x = {nested(BETWEEN)}\n"
    want = f"nesting too deep for the rewriter: depth {BETWEEN} > limit {nesting.LIMIT} (line 1); left unchanged"
    assert nesting.problem(text) == want
    assert nesting.problem(f"x = {nested(nesting.LIMIT)}\n") is None
    with pytest.raises(nesting.TooDeep, match=r"depth 600 > limit 400"):
        nesting.check(text)


# Twice as long as the shortest refused chain of each kind still parses in a child: the limit
# keeps a margin on this machine's stack (a smaller stack would need a lower limit; the
# measured crash depths are in npufuse/rewrite/nesting.py).
MARGIN_CASES = {
    "brackets": lambda n: "x = " + nested(n) + "\n",
    "unary minus": lambda n: "x = " + "-" * n + "1\n",
    "and chain": lambda n: "x = " + "a and " * n + "a\n",
    "lambdas": lambda n: "x = " + "lambda: " * n + "1\n",
}


@pytest.mark.parametrize("kind", list(MARGIN_CASES))
def test_twice_the_refused_depth_does_not_crash_libcst(kind: str) -> None:
    make = MARGIN_CASES[kind]
    lo, hi = 1, 2
    while nesting.measure(make(hi)).depth <= nesting.LIMIT:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the shortest refused length
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if nesting.measure(make(mid)).depth > nesting.LIMIT else (mid, hi)
    code = "import sys, libcst; libcst.parse_module(sys.stdin.read())"
    proc = subprocess.run([sys.executable, "-c", code], input=make(2 * hi), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"libcst died (rc {proc.returncode}) on {2 * hi} levels of {kind}, refused from {hi}: {proc.stderr[-500:]}"


# -- every libcst entry point refuses before parsing ------------------------------------------------

DEEP = f"import torch\n\n\ndef f(x):\n    y = x + 1\n    return y\n\n\nz = {nested(BETWEEN)}\n"


def test_rewrite_revert_and_marked_sites_refuse_deep_text() -> None:
    edit = SiteEdit(5, 5, "y = x + 2", "_npufuse_on_npu(x)", "rms_norm", "t")
    for call in (lambda: rewrite_source(DEEP, [edit]), lambda: revert_source(DEEP), lambda: marked_sites(DEEP), lambda: parse_expression(nested(BETWEEN))):
        with pytest.raises(nesting.TooDeep, match="nesting too deep for the rewriter"):
            call()


def test_deep_generated_code_skips_the_site() -> None:
    src = "def f(x):\n    y = x + 1\n    return y\n"
    out = rewrite_source(src, [SiteEdit(2, 2, f"y = {nested(BETWEEN)}", "_npufuse_on_npu(x)", "rms_norm", "t")])
    assert out.text == src and not out.applied
    assert "generated code: nesting too deep for the rewriter" in out.skipped[0][1]


def test_render_site_refuses_deep_files() -> None:
    from npufuse.patterns.base import Finding
    from npufuse.rewrite.codegen import render_site

    f = Finding("rms_norm", "f", 5, 5, {}, "y = x + 2", "x")
    with pytest.raises(nesting.TooDeep):  # the scan's fallback renderer: a near miss with this reason
        render_site(DEEP, f, env_switch("rms_norm"))


# -- apply, revert and verify in a child process: a regression segfaults the child, not pytest ------


def _run(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-m", "npufuse", *argv], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _refused(proc: subprocess.CompletedProcess[str], rc: int) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode >= 0, f"the child died of signal {-proc.returncode}:\n{out[-3000:]}"
    assert proc.returncode == rc, out[-3000:]
    assert f"nesting too deep for the rewriter: depth {CRASH_BRACKETS} > limit {nesting.LIMIT}" in out, out[-3000:]
    return out


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, Path]:
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    scan(root)
    return root, root / ".npufuse"


def test_revert_of_a_file_edited_deep_is_refused_byte_identical(repo: tuple[Path, Path]) -> None:
    root, sd = repo
    assert npufuse("apply", "--state-dir", str(sd), "--accept", "1,2,3,4") == 0
    path = root / "model.py"
    edited = path.read_bytes() + f"\nDEEP = {nested(CRASH_BRACKETS)}\n".encode()
    path.write_bytes(edited)
    _refused(_run(root, "revert", "--state-dir", str(sd)), 1)
    assert path.read_bytes() == edited
    # the other file is reverted as usual
    assert (root / "head.py").read_text() == HEAD
    # verify reads the site with libcst too: a usage error naming the file, no crash
    mid = next(c["id"] for c in state_of(sd)["candidates"] if c["file"] == "model.py")
    proc = _run(root, "verify", "op", str(mid), "--state-dir", str(sd))
    _refused(proc, 2)
    assert path.read_bytes() == edited


def test_apply_to_a_deep_file_is_refused_byte_identical(repo: tuple[Path, Path]) -> None:
    """A scan.json naming a file too deep for libcst (hand-edited, or from a Python whose parser
    accepts more nesting than this one's): apply skips it with the reason, the rest applies."""
    import hashlib
    import json

    root, sd = repo
    path = root / "model.py"
    deep = path.read_bytes() + f"\nDEEP = {nested(CRASH_BRACKETS)}\n".encode()
    path.write_bytes(deep)
    data = json.loads((sd / "scan.json").read_text())
    for c in data["candidates"]:
        if c["file"] == "model.py":
            c["file_sha256"] = hashlib.sha256(deep).hexdigest()
    (sd / "scan.json").write_text(json.dumps(data))
    ids = ",".join(str(c["id"]) for c in data["candidates"])
    _refused(_run(root, "apply", "--state-dir", str(sd), "--accept", ids), 1)
    assert path.read_bytes() == deep
    assert "torch_npu" in (root / "head.py").read_text()  # the file that is fine was rewritten


# -- what is left in files this module does not own ---------------------------------------------------


def test_bug_scan_offers_a_site_in_a_file_too_deep_for_apply(tmp_path: Path) -> None:
    deep = MODEL + "\n\nHANDLERS = " + "lambda: " * 1000 + "1\n"
    assert nesting.problem(deep) is not None
    root = make_repo(tmp_path / "repo", {"model.py": deep})
    data = scan(root)
    assert not [c for c in data["candidates"] if c["file"] == "model.py"], "a candidate apply must refuse"
    assert any("nesting too deep for the rewriter" in n["reason"] for n in data["near_misses"])
