"""s43 review (helper review43): correctness defects found in this session's merged changes, each with the run that
showed it (the rewritten code against the original under the emulator) and its near miss.

1. A norm reached through an object whose class npufuse takes from this file's callers (s43: ``def step(model, x):
   for layer in model.layers: ... layer.ffn_norm(x)``, a method's ``layer`` parameter; s42: a norm handed as a
   parameter) is only known by its run-time class test: a caller elsewhere may hand an object of another class
   whose norm is the same class built with another eps. The construction's literal eps (``nn.RMSNorm(d,
   eps=1e-5)``) was baked into the fused code; the instance's own ``eps`` is read there now.
2. ``returns_bool``'s s43 self-reference (``m = m & c`` read as bool where every plain assignment of ``m`` is)
   assumed the earlier value is one of those assignments; a name also bound otherwise (tuple unpacking, ``for``,
   ``with``, augmented assignment) holds a value nobody read: not proved bool.
"""

from __future__ import annotations

import ast

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns._attention_s35 import returns_bool
from npufuse.patterns.add_rms_norm import AddRmsNorm


def _runs_like_original(code: str, run: str) -> dict:
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings, misses
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999, facts["cos_out"]
    return {"findings": findings, **facts}


# -- 1. a norm of an object whose class comes from this file's callers ---------------------------------------------

_LAYERS = '''
import torch
import torch.nn as nn


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.ffn_norm = NORM


class Model(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d) for _ in range(n)])
'''

_STEP = _LAYERS + '''

def step(model, x):
    for layer in model.layers:
        x = x + layer.attention(x)
        y = layer.ffn_norm(x)
    return y


def train():
    model = Model(16, 2)
    model = torch.compile(model) if False else model
    return step(model, torch.randn(2, 5, 16))
'''

# another file's model: its layers' norm is the same class, built with another eps
_OTHER = '''
class OtherLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.ffn_norm = OTHER_NORM


class OtherModel(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList([OtherLayer(d) for _ in range(n)])


torch.manual_seed(1)
with torch.no_grad():
    out = (CALL_OWN, CALL_OTHER)
'''


@pytest.mark.parametrize("own, other", [
    ("nn.RMSNorm(d, eps=1e-5)", "nn.RMSNorm(d, eps=0.5)"),
    ("nn.RMSNorm(d, eps=1e-5, elementwise_affine=False)", "nn.RMSNorm(d, eps=0.5, elementwise_affine=False)"),
], ids=["weighted", "weightless"])
def test_norm_of_an_object_whose_class_comes_from_callers_reads_the_instances_eps(own: str, other: str) -> None:
    code = _STEP.replace("NORM", own)
    run = _OTHER.replace("OTHER_NORM", other).replace("CALL_OWN", "step(Model(16, 2), torch.randn(2, 5, 16) * 0.3)") \
        .replace("CALL_OTHER", "step(OtherModel(16, 2), torch.randn(2, 5, 16) * 0.3)")
    facts = _runs_like_original(code, run)
    fused = facts["findings"][0].fused
    assert "layer.ffn_norm.eps" in fused and "1e-5" not in fused, fused


def test_norm_of_a_method_parameters_object_reads_the_instances_eps() -> None:
    code = _LAYERS.replace("NORM", "nn.RMSNorm(d, eps=1e-5)") + '''
    def run_layer(self, layer, x):
        x = x + layer.attention(x)
        return layer.ffn_norm(x)

    def forward(self, x):
        for i in range(len(self.layers)):
            x = self.run_layer(self.layers[i], x)
        return x
'''
    run = _OTHER.replace("OTHER_NORM", "nn.RMSNorm(d, eps=0.5)").replace("CALL_OWN", "Model(16, 2)(torch.randn(2, 5, 16))") \
        .replace("CALL_OTHER", "Model(16, 2).run_layer(OtherLayer(16), torch.randn(2, 5, 16) * 0.3)")
    facts = _runs_like_original(code, run)
    assert "layer.ffn_norm.eps" in facts["findings"][0].fused


def test_norm_of_a_layer_built_here_keeps_the_constructions_eps() -> None:
    # the class is exact (``self.layers`` built in __init__): the construction's eps is the instance's
    code = _LAYERS.replace("NORM", "nn.RMSNorm(d, eps=1e-5)") + '''
    def forward(self, x):
        for layer in self.layers:
            x = x + layer.attention(x)
            x = layer.ffn_norm(x)
        return x
'''
    findings, _misses = detect_all(AddRmsNorm(), code)
    assert findings and "epsilon=1e-5" in findings[0].fused


def test_a_layernorm_handed_by_another_caller_takes_the_original_statements() -> None:
    # near miss at run time: the class test sends another caller's LayerNorm to the code as written
    code = _STEP.replace("NORM", "nn.RMSNorm(d, eps=1e-5)")
    run = _OTHER.replace("OTHER_NORM", "nn.LayerNorm(d)").replace("CALL_OWN", "step(Model(16, 2), torch.randn(2, 5, 16))") \
        .replace("CALL_OTHER", "step(OtherModel(16, 2), torch.randn(2, 5, 16))")
    _runs_like_original(code, run)


def test_a_norm_parameter_handed_by_another_caller_reads_the_instances_eps() -> None:
    # s42's parameter norm: ``block(x, attn, norm)`` called here with ``nn.RMSNorm(d, eps=1e-5)``
    code = '''
import torch
import torch.nn as nn


def block(x, attn, norm):
    x = x + attn(x)
    return norm(x)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.ffn_norm = nn.RMSNorm(d, eps=1e-5)

    def forward(self, x):
        return block(x, self.attention, self.ffn_norm)
'''
    run = '''
torch.manual_seed(1)
with torch.no_grad():
    out = (Layer(16)(torch.randn(2, 5, 16)), block(torch.randn(2, 5, 16) * 0.3, nn.Linear(16, 16), nn.RMSNorm(16, eps=0.5)))
'''
    facts = _runs_like_original(code, run)
    assert "norm.eps" in facts["findings"][0].fused


# -- 2. returns_bool: a local rebound from itself that is also bound otherwise -----------------------------------


@pytest.mark.parametrize("first, is_bool", [
    ("keep = q <= k", True),  # every binding a comparison: bool
    ("keep, other = attention_mask[:, None, :], q", False),  # an int 0/1 mask unpacked: ``keep & c`` stays int
    ("for keep in (attention_mask,):\n        pass", False),
    ("keep = q <= k\n    keep |= attention_mask", False),
    ("keep = other = attention_mask", False),
    ("keep = q <= k\n    keep[..., 0] = True", True),  # a write into the bool tensor rebinds nothing
])
def test_returns_bool_self_reference_needs_every_binding_read(first: str, is_bool: bool) -> None:
    src = f'''
def mask(attention_mask, q, k):
    {first}
    keep = keep & (q >= k - 2)
    return keep
'''
    fn = ast.parse(src).body[0]
    assert returns_bool(fn) is is_bool


# -- 3. a norm forward that writes state ------------------------------------------------------------------------
# The add + norm replaces the whole call of the norm module: a write its forward makes (a call counter, a cached
# statistic) would be dropped. Found on s43's weight-branch forward (``_s43_branch_return``), true of every
# straight-line forward read through ``S.helper_return``.

_STATEFUL = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.calls = 0

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        norm = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        WRITE
        RETURN


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)

    def forward(self, x):
        x = x + self.attn(x)
        return self.norm2(x)
'''

_BRANCH_RETURN = '''if self.weight is not None:
            return (x * norm * self.weight).to(dt)
        else:
            return (x * norm).to(dt)'''


@pytest.mark.parametrize("write", ["self.calls = self.calls + 1", "self.calls += 1", "self.last_rstd = norm.detach()"])
@pytest.mark.parametrize("ret", [_BRANCH_RETURN, "return (x * norm * self.weight).to(dt)"], ids=["weight_branch", "plain"])
def test_a_norm_forward_that_writes_state_is_a_near_miss(write: str, ret: str) -> None:
    findings, misses = detect_all(AddRmsNorm(), _STATEFUL.replace("WRITE", write).replace("RETURN", ret))
    assert not findings
    assert any("its forward writes `self." in m.reason for m in misses), misses


@pytest.mark.parametrize("ret", [_BRANCH_RETURN, "return (x * norm * self.weight).to(dt)"], ids=["weight_branch", "plain"])
def test_a_norm_forward_writing_locals_only_still_fuses(ret: str) -> None:
    code = _STATEFUL.replace("WRITE", "scale = norm").replace("RETURN", ret.replace("x * norm", "x * scale"))
    run = '''
m = Block(16)
with torch.no_grad():
    out = m(torch.randn(2, 5, 16))
'''
    _runs_like_original(code, run)


# -- 4. a "logger" that is a parameter or a local is no logging marker ---------------------------------------------
# s43 moves ``logging.<level>(..)`` / a module-level ``logging.getLogger`` logger's calls past the fused norm; a
# parameter or local of that name may be any object (a metrics sink that reads or changes the sum).

_LOGGED = '''
import logging

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)

    def forward(self, x, SIGNATURE):
        BIND
        x = x + self.attn(x)
        logger.info("sum %s", x.shape)
        return self.norm2(x)
'''


def test_the_module_level_logger_between_add_and_norm_moves() -> None:
    code = _LOGGED.replace(", SIGNATURE", "").replace("BIND", "pass")
    run = '''
m = Block(16)
with torch.no_grad():
    out = m(torch.randn(2, 5, 16))
'''
    _runs_like_original(code, run)


@pytest.mark.parametrize("signature, bind", [("logger=None", "pass"), ("sink=None", "logger = sink")], ids=["parameter", "local"])
def test_a_logger_that_is_a_parameter_or_local_is_no_marker(signature: str, bind: str) -> None:
    findings, _misses = detect_all(AddRmsNorm(), _LOGGED.replace("SIGNATURE", signature).replace("BIND", bind))
    assert not findings


# -- 5. the weight-branch test read on the call's module by name, not by text ---------------------------------------

_KIND_BRANCH = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d, kind, eps=1e-6):
        super().__init__()
        self.eps, self.kind = eps, kind
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        norm = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind != "self.plain":
            return (x * norm * self.weight).to(dt)
        else:
            return (x * norm).to(dt)


class Block(nn.Module):
    def __init__(self, d, kind):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d, kind)

    def forward(self, x):
        x = x + self.attn(x)
        return self.norm2(x)
'''


def test_the_weight_branch_test_keeps_its_string_constants() -> None:
    run = '''
with torch.no_grad():
    out = (Block(16, "weighted")(torch.randn(2, 5, 16)), Block(16, "self.plain")(torch.randn(2, 5, 16)))
'''
    facts = _runs_like_original(_KIND_BRANCH, run)
    assert 'self.norm2.kind != "self.plain"' in facts["findings"][0].fused.replace("'", '"')


# -- 6. a local built by a name that a parameter shadows -------------------------------------------------------------


def test_a_local_built_by_a_parameter_named_like_a_class_takes_no_class() -> None:
    # ``def train(Model=OtherModel)``: ``Model(..)`` builds whatever the caller hands, not the file's class Model
    code = _LAYERS.replace("NORM", "nn.RMSNorm(d, eps=1e-5)") + '''

def train(x, Model=None):
    model = Model(16, 2)
    for layer in model.layers:
        x = x + layer.attention(x)
        y = layer.ffn_norm(x)
    return y
'''
    findings, _misses = detect_all(AddRmsNorm(), code)
    assert not any("epsilon=1e-5" in f.fused for f in findings), findings[0].fused


def test_a_local_built_by_the_files_class_reads_its_construction() -> None:
    code = _LAYERS.replace("NORM", "nn.RMSNorm(d, eps=1e-5)") + '''

def train(x):
    model = Model(16, 2)
    for layer in model.layers:
        x = x + layer.attention(x)
        y = layer.ffn_norm(x)
    return y
'''
    run = '''
with torch.no_grad():
    out = train(torch.randn(2, 5, 16))
'''
    facts = _runs_like_original(code, run)
    assert "epsilon=1e-5" in facts["findings"][0].fused
