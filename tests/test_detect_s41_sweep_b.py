"""s41 sweep41b: classes found by the recall sweep on code npufuse had never seen (bench/detect_labels_sweep41b.json).

1. fused_optimizer: vocos / WavTokenizer's ``gradient_norm`` collects ``[p.grad for p in model.parameters() if p.grad
   is not None]`` and reads the list only through ``torch.norm(torch.stack([torch.norm(g, t) for g in grads]), t)``. A
   fused optimizer leaves a zero grad where torch.optim leaves None: that adds a 0 to the norms a p-norm reduces, so
   the logged value is the same and the test is no reader (npufuse.scan.grad_none). Near misses: the same list whose
   length is also returned, and its norms averaged (a zero changes both).
"""

from __future__ import annotations

from pathlib import Path

from test_detect_s40_optimizer import _main_with

# vocos' decoder/helpers.py gradient_norm (here the method s40's trainer imports as `choice.MinSurprise`)
_HELPERS = '''\
import torch


class MinSurprise:
    def apply(self, model, norm_type: float = 2.0):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total_norm = torch.norm(torch.stack([torch.norm(g.detach(), norm_type) for g in grads]), norm_type)
        return total_norm
'''


def test_fuse_when_the_grads_list_only_feeds_a_total_norm(tmp_path: Path) -> None:
    for name, helpers in (("vocos", _HELPERS),
                          ("method_norm", _HELPERS.replace("torch.norm(g.detach(), norm_type)", "g.norm(norm_type)")),
                          ("linalg", _HELPERS.replace("torch.norm(g.detach(), norm_type)", "torch.linalg.vector_norm(g, norm_type)"))):
        cands, near = _main_with(tmp_path / name, helpers)
        assert len(cands) == 1 and not near, (name, near)


def test_keep_when_the_grads_list_is_read_otherwise(tmp_path: Path) -> None:
    near_misses = {
        # how many parameters have a grad: a zero grad is counted, None is not
        "length": _HELPERS.replace("        return total_norm\n", "        return total_norm, len(grads)\n"),
        # a mean of the norms: a zero lowers it
        "mean": _HELPERS.replace("total_norm = torch.norm(torch.stack(", "total_norm = torch.mean(torch.stack("),
        # the smallest norm (order -inf): a zero grad is the smallest
        "min_order": _HELPERS.replace("for g in grads]), norm_type)", "for g in grads]), -float('inf'))"),
    }
    for name, helpers in near_misses.items():
        cands, near = _main_with(tmp_path / name, helpers)
        assert not cands and len(near) == 1, (name, near)
        assert "tests whether a parameter's grad is None (`p.grad is not None` at choice.py:6)" in near[0], (name, near)
