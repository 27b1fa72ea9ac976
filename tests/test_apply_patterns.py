"""Issue 4's per-pattern acceptance, through ``npufuse apply`` itself: every pattern's own
real-world-shaped examples are scanned by the real engine, rewritten by the CLI into a copy, and
the rewritten module is executed under the emulator on CPU against the untouched original.

- switch on (emulated torch_npu): the fused API runs; outputs and gradients match (cosine
  >= 0.9999 in fp32), dtypes and shapes match exactly;
- switch off (``--switch`` env variable set to 0, emulator still installed): no fused call, and
  the outputs are bit-identical to the original;
- without torch_npu at all the rewritten module imports and runs the original code;
- the fallback branch is the original statements byte for byte (revert gives the file back).

Parametrized over the registry, like test_patterns.py: a new pattern file is covered by adding it.
"""

from __future__ import annotations

import os

import pytest
import torch

from apply_support import block_of, fallback_of, npufuse, same_statements, scan, state_of
from npufuse import emulate
from npufuse.patterns.registry import all_patterns
from npufuse.rewrite.codegen import source_lines
from pattern_harness import _exec, _run, cosine

PATTERNS = all_patterns()
CASES = [pytest.param(p, ex, id=f"{p.id}-{ex.name or i}") for p in PATTERNS for i, ex in enumerate(p.FUSE) if ex.run]
OFF = "NPUFUSE_ACCEPTANCE_SWITCH"
FIRST_OF_PATTERN = {next((p.id, ex.name) for ex in p.FUSE if ex.run) for p in PATTERNS if any(ex.run for ex in p.FUSE)}


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


def _applied(tmp_path, name, pattern, code, *extra):
    root = tmp_path / name
    root.mkdir()
    (root / "example.py").write_text(code, encoding="utf-8")
    data = scan(root, patterns=[pattern])
    assert data["candidates"], f"{pattern.id}: the scan found nothing in its own example"
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse"), *extra) == 0
    return root, data


def _first_line(code: str, line: int) -> int:
    """Where the statement starting at ``line`` begins in the text: a span starting at a decorated
    def (a @torch.jit.script function rewritten as a whole) takes its decorators along."""
    import ast

    for node in ast.walk(ast.parse(code)):
        if getattr(node, "lineno", None) == line and getattr(node, "decorator_list", None):
            return min(d.lineno for d in node.decorator_list)
    return line


@pytest.mark.skipif(not CASES, reason="no pattern detectors with runnable examples are installed yet")
@pytest.mark.parametrize("pattern,example", CASES)
def test_applied_rewrite_matches_the_original(pattern, example, tmp_path, monkeypatch):
    code = example.code
    ref_outs, ref_grads = _run(_exec(code, "original"), example.run)

    # default switch, emulated NPU: the fused branch runs and matches
    root, data = _applied(tmp_path, "on", pattern, code)
    rewritten = (root / "example.py").read_text(encoding="utf-8")
    assert "import npufuse" not in rewritten and "from npufuse" not in rewritten
    with emulate.install() as emu:
        outs, grads = _run(_exec(rewritten, "rewritten"), example.run)
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run"
    assert len(outs) == len(ref_outs)
    for a, b in zip(ref_outs, outs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert cosine(a.float(), b.float()) >= 0.9999
    for a, b in zip(ref_grads, grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert cosine(a.float(), b.float()) >= 0.9999

    # no torch_npu at all: imports and runs the original branch, bit for bit
    plain, _ = _run(_exec(rewritten, "no_npu"), example.run)
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, plain))

    # the report's code is what was written, and the fallback is the original verbatim
    st = {c["id"]: c for c in state_of(root / ".npufuse")["candidates"]}
    for c in data["candidates"]:
        span = st[c["id"]]["applied"]["span"]
        block = block_of(rewritten, span)
        assert block == c["replacement"]
        original = "".join(source_lines(code)[_first_line(code, c["line"]) - 1 : c["end_line"]])
        assert same_statements(fallback_of(block), original), c["key"]
    assert npufuse("revert", "--state-dir", str(root / ".npufuse")) == 0
    assert (root / "example.py").read_text(encoding="utf-8") == code

    # the switch turns the original back on even where torch_npu is present. Where every site got an
    # environment-variable switch (nearly all examples), the text written above is switched off by its own
    # variables; `--switch NAME` (a second apply) is taken by each pattern's first example and by any example
    # whose sites got another kind of switch (a config field): one apply per example fewer, every switch kind
    # still run.
    names = {c["switch"]["name"] for c in data["candidates"] if c["switch"].get("kind") == "env"}
    if (pattern.id, example.name) in FIRST_OF_PATTERN or any(c["switch"].get("kind") != "env" for c in data["candidates"]):
        root, _ = _applied(tmp_path, "off", pattern, code, "--switch", OFF)
        rewritten = (root / "example.py").read_text(encoding="utf-8")
        names = {OFF}
    for name in names:
        monkeypatch.setenv(name, "0")
    with emulate.install() as emu:
        outs, _ = _run(_exec(rewritten, "switched_off"), example.run)
    assert sum(emu.calls.values()) == 0, dict(emu.calls)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ref_outs, outs))
    for name in names:
        monkeypatch.delenv(name)
        assert os.environ.get(name) is None
