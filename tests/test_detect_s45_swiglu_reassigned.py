"""s45 (review45's left item): swiglu read an activation attribute from ``__init__`` only. A method that stores
``self.act`` again (``set_activation``) can swap the callable before forward, so the kind ``__init__`` chose proves
nothing at the call: fusing it as ``npu_swiglu`` computed silu where the swapped-in GELU ran (emulator cos 0.99).
Now a near miss that names the other store; the twin without it still fuses."""

from __future__ import annotations

from pattern_harness import detect_all
from npufuse.patterns.swiglu import Swiglu

_MLP = '''\
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)
        self.act = nn.SiLU()
{extra}
    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))
'''

_SETTER = '''
    def set_activation(self, name):
        if name == "gelu":
            self.act = nn.GELU()
'''


def test_activation_stored_again_outside_init_is_a_near_miss() -> None:
    findings, misses = detect_all(Swiglu(), _MLP.format(extra=_SETTER))
    assert not findings
    assert any("stored again in `MLP.set_activation`" in m.reason for m in misses), [m.reason for m in misses]


def test_activation_stored_only_in_init_still_fuses() -> None:
    findings, misses = detect_all(Swiglu(), _MLP.format(extra=""))
    assert len(findings) == 1, [m.reason for m in misses]
    assert "npu_swiglu" in findings[0].fused
