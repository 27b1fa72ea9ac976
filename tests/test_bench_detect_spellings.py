"""bench/detect_spellings.py: each respelling keeps what the program computes and changes its spelling."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import detect_spellings  # noqa: E402

from pattern_harness import _exec, _run, cosine  # noqa: E402

PROGRAM = '''
import torch
import torch.nn.functional as F


def norm(x, w, eps=1e-6):
    v = x.pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(v + eps)
    z = w * y
    a = F.silu(z) @ w.unsqueeze(-1)
    b = F.softmax(a.view(-1, 1).transpose(-2, -1), dim=-1)
    return torch.cat([a, z ** 2, b.reshape(-1, 1)], -1).softmax(-1)
'''
RUN = "x = torch.randn(3, 4, requires_grad=True)\nw = torch.randn(4)\nleaves = [x]\nout = norm(x, w)\n"

EXPECTED = {
    "torch_as_th": ["import torch as th", "th.rsqrt(", "th.cat("],
    "functional_spelled_out": ["torch.nn.functional.silu("],
    "renamed_locals": ["v0 = ", "v1 = ", "v2 = ", "v3 = ", "v4 = "],
    "square_spellings": ["x * x", "torch.square(z)"],
    "functions_as_methods": ["(v + eps).rsqrt()"],
    "methods_as_functions": ["torch.matmul(", "torch.softmax(torch.cat("],
    "dim_as_keyword": ["mean(dim=-1, keepdim=True)", "dim=-1)"],
    "hoisted_temporaries": ["h0 = "],
    "view_as_reshape": ["a.reshape(-1, 1)"],
    "softmax_spellings": ["torch.softmax(a.view"],
    "transpose_axes_swapped": [".transpose(-1, -2)"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_respelling_changes_the_text_and_keeps_the_values(name):
    text = detect_spellings.respell(PROGRAM, name)
    assert text is not None
    for piece in EXPECTED[name]:
        assert piece in text, f"{name}: {piece!r} not in\n{text}"
    a_out, a_grad = _run(_exec(PROGRAM, "a"), RUN)
    b_out, b_grad = _run(_exec(text, "b"), RUN)
    assert all(cosine(x, y) > 0.99999 for x, y in zip(a_out + a_grad, b_out + b_grad))


def test_every_transform_is_checked_here():
    assert set(detect_spellings.TRANSFORMS) == set(EXPECTED) | {"unparsed"}


def test_nothing_to_respell_is_said_not_invented():
    assert detect_spellings.respell("import torch\n\n\ndef f(x):\n    return x\n", "square_spellings") is None
    assert detect_spellings.respell("def f(x):\n    return x\n", "torch_as_th") is None


def test_judge_counts_a_respelled_fuse_example_found_and_its_replacement_right():
    from npufuse.patterns.registry import all_patterns

    rms = next(p for p in all_patterns() if p.id == "rms_norm")
    example = next(e for e in rms.FUSE if e.run)
    assert detect_spellings.judge(rms, example, "fuse", "renamed_locals")[0] == "found"
