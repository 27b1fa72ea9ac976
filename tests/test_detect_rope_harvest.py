"""Rope spellings harvested from real repositories (issue 14, session s25): the pair axis merged by
``flatten(-2, -1)`` / ``torch.flatten(t, -2)`` (RoFormer), rotation helpers imported from another file
of the repository (``from .layers import rotate_half``) or from Hugging Face transformers
(streaming-llm's ``from transformers.models.llama.modeling_llama import rotate_half``), and the
xPos look-alike. The single-file forms are examples in patterns/rope.py; what needs a repository
(imports) is here: scanned, rewritten by ``npufuse apply`` and run under the emulator."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.rope import RopePattern
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo
from scratch_repo import import_fresh


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


@pytest.mark.parametrize("text,merged", [
    ("t.flatten(-2)", "t"),
    ("t.flatten(-2, -1)", "t"),
    ("t.flatten(start_dim=-2, end_dim=-1)", "t"),
    ("t.flatten(-2, end_dim=-1)", "t"),
    ("torch.flatten(torch.stack((a, b), -1), -2)", "torch.stack((a, b), -1)"),
    ("torch.flatten(s, -2, -1)", "s"),
    ("t.flatten(-3, -1)", None),  # three axes
    ("t.flatten(-2, -2)", None),  # nothing merged
    ("t.flatten(3)", None),  # depends on the rank: the caller decides
    ("t.flatten()", None),
    ("t.view(-1)", None),
])
def test_merges_last_two(text: str, merged: str | None) -> None:
    got = canonical.merges_last_two(_expr(text))
    assert (ast.unparse(got) if got is not None else None) == merged


def test_library_rotation_reads_the_import_table() -> None:
    m = ModuleInfo.from_source("m.py", "from transformers.models.llama.modeling_llama import rotate_half as rh\n"
                                       "from transformers.models.cohere import modeling_cohere\n"
                                       "from mylib.rope import rotate_half\n")
    assert canonical.library_rotation(m, _expr("rh")) == "half"
    assert canonical.library_rotation(m, _expr("modeling_cohere.rotate_half")) == "interleave"  # Cohere's is interleaved
    assert canonical.library_rotation(m, _expr("rotate_half")) is None  # an unknown library: not assumed


_LAYERS = '''\
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def rotate_swapped(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)
'''

_MODEL = '''\
import torch
from .layers import rotate_half, rotate_every_two, rotate_swapped


def apply_half(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def apply_pairs(x, cos, sin):
    return (x * cos) + (rotate_every_two(x) * sin)


def apply_swapped(x, cos, sin):
    return x * cos + rotate_swapped(x) * sin
'''


def _tables(s: int, d: int, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
    ang = torch.outer(torch.arange(s).float(), inv)
    ang = ang.repeat_interleave(2, -1) if pairs else torch.cat((ang, ang), -1)
    return ang.cos()[None, None], ang.sin()[None, None]


def _run_both(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)
    return [mod.apply_half(x, *_tables(5, 8, False)), mod.apply_pairs(x, *_tables(5, 8, True))]


def test_rotation_helpers_from_another_file_are_verified_there(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": _MODEL}
    ref = _run_both(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[RopePattern()])
    cands = {c["qualname"]: c for c in data["candidates"] if c["pattern"] == "rope"}
    assert set(cands) == {"apply_half", "apply_pairs"}, data["near_misses"]
    assert cands["apply_half"]["params"]["mode"] == "half" and cands["apply_pairs"]["params"]["mode"] == "interleave"
    # the helper that is no rotation is read in its own file and refused with the reason found there
    near = [m for m in data["near_misses"] if m["qualname"] == "apply_swapped"]
    assert near and "pkg/layers.py" in near[0]["reason"] and "halves swapped" in near[0]["reason"], near
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    assert "npu_rotary_mul" in (root / "pkg" / "model.py").read_text(encoding="utf-8")
    with emulate.install() as emu:
        outs = _run_both(import_fresh(root, "pkg.model"))
    assert emu.calls["npu_rotary_mul"] == 2, emu.calls
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, outs))


def test_a_helper_not_found_in_the_repository_stays_unverified(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", {"model.py": "from mylib.rope import rotate_half\n\n\n"
                                                     "def apply(x, cos, sin):\n    return x * cos + rotate_half(x) * sin\n"})
    data = scan(root, patterns=[RopePattern()])
    assert not data["candidates"]
    assert any("cannot be verified" in m["reason"] for m in data["near_misses"]), data["near_misses"]


_STREAMING = '''\
import torch
from transformers.models.llama.modeling_llama import rotate_half


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)
    sin = sin.squeeze(1).squeeze(0)
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    x_embed = (x * cos) + (rotate_half(x) * sin)
    return x_embed
'''


def _stub_transformers() -> dict[str, types.ModuleType | None]:
    """A stand-in for the one transformers module the code imports (transformers is no dependency of
    npufuse): its rotate_half is the library's half rotation."""
    names = ["transformers", "transformers.models", "transformers.models.llama", "transformers.models.llama.modeling_llama"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    sys.modules["transformers.models.llama.modeling_llama"].rotate_half = rotate_half  # type: ignore[attr-defined]
    return saved


def _restore(saved: dict[str, types.ModuleType | None]) -> None:
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


def _run_streaming(code: str) -> torch.Tensor:
    ns: dict = {}
    exec(compile(code, "<streaming>", "exec"), ns)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)
    cos, sin = _tables(9, 8, False)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])
    return ns["apply_rotary_pos_emb_single"](x, cos, sin, position_ids)


def test_transformers_rotate_half_is_the_library_half_rotation(tmp_path: Path) -> None:
    saved = _stub_transformers()
    try:
        ref = _run_streaming(_STREAMING)
        root = make_repo(tmp_path / "repo", {"pos_shift.py": _STREAMING})
        data = scan(root, patterns=[RopePattern()])
        cands = [c for c in data["candidates"] if c["pattern"] == "rope"]
        assert len(cands) == 1 and cands[0]["params"]["mode"] == "half", data["near_misses"]
        assert cands[0]["params"]["cos_layout"].startswith("B1SD")  # per-batch positions: half mode takes them
        assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
        with emulate.install() as emu:
            out = _run_streaming((root / "pos_shift.py").read_text(encoding="utf-8"))
        assert emu.calls["npu_rotary_mul"] == 1
        assert torch.allclose(ref, out, rtol=1e-5, atol=1e-6)
    finally:
        _restore(saved)


def test_cohere_rotate_half_is_interleaved_so_per_batch_tables_are_refused(tmp_path: Path) -> None:
    code = _STREAMING.replace("llama.modeling_llama", "cohere.modeling_cohere")
    root = make_repo(tmp_path / "repo", {"pos_shift.py": code})
    data = scan(root, patterns=[RopePattern()])
    assert not data["candidates"]
    assert any("interleave mode with cos/sin that may depend on the batch" in m["reason"] for m in data["near_misses"]), data["near_misses"]
