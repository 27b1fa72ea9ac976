"""geglu: ``gelu(a) * b`` with a, b from two projections or one split -> ``torch_npu.npu_geglu``.

Uses the gated-activation machinery of :mod:`npufuse.patterns.swiglu` (one scan of a scope serves
both patterns; each gated product belongs to exactly one of them). The replacement maps what the
code computes onto npu_geglu's parameters: ``approximate`` 0 for erf GELU (``F.gelu``'s default,
``nn.GELU()``, ``ACT2FN["gelu"]``), 1 for the tanh form (``approximate="tanh"``,
``gelu_new``/``gelu_pytorch_tanh``, the hand-written ``0.5*x*(1+tanh(...0.044715...))``), and
``activate_left`` True when the gelu is on the first half (the op's default activates the second,
as diffusers' ``hidden * gelu(gate)`` does). ``npu_gelu_mul`` is forward-only and never emitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from npufuse.patterns import swiglu as G
from npufuse.patterns.base import Finding, Fuse, Keep, Pattern, Result
from npufuse.scan.dataflow import ModuleInfo, Scope

if TYPE_CHECKING:  # torch is imported only to run a reference, never to scan
    import torch


class Geglu(Pattern):
    id = "geglu"
    api = "torch_npu.npu_geglu"
    title = "GeGLU (gelu(gate) * up) -> npu_geglu"
    SHARES_SITES_WITH = ("swiglu",)  # one gate reader (swiglu.gate_results) decides which of the two reports a product
    training_ok = True  # npu_geglu has a backward through output 0; npu_gelu_mul (forward-only) is not used
    bound = "memory"
    # gate_results' first text test (a gated activation multiplies), made once by the scan
    SCOPE_WORDS = ("*", ".mul(", ".mul_(", "multiply")

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        for r in G.gate_results(module, scope):
            if r.pattern != self.id:
                continue
            if r.finding is not None:
                yield r.finding
            elif r.miss is not None:
                yield r.miss

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        # a hand-written tanh formula (gelu_new) is ~8 eager kernels; F.gelu / nn.GELU one
        return G.gated_value(finding, config, int(finding.params.get("activation_kernels") or 1))

    @staticmethod
    def reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """fp32 golden: gelu(gate) * up."""
        import torch.nn.functional as F

        return F.gelu(gate.float(), approximate=approximate) * up.float()

    FUSE: list = []
    KEEP: list = []


_DIFFUSERS = '''
import torch
import torch.nn.functional as F
from torch import nn


class GEGLU(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)

    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        if gate.device.type == "mps":
            # fp16 gelu not supported on mps before torch 2.0
            return F.gelu(gate.to(dtype=torch.float32)).to(dtype=gate.dtype)
        return F.gelu(gate)

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = self.proj(hidden_states)
        hidden_states, gate = hidden_states.chunk(2, dim=-1)
        return hidden_states * self.gelu(gate)
'''

_TANH_SECOND = '''
import torch
import torch.nn.functional as F
from torch import nn


class ApproxGEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate, approximate="tanh")
'''

_GELU_FIRST = '''
import torch
import torch.nn.functional as F
from torch import nn


class GEGLUFirst(nn.Module):
    """gelu on the first half of the fused projection."""

    def __init__(self, d, h):
        super().__init__()
        self.wi = nn.Linear(d, 2 * h, bias=False)
        self.wo = nn.Linear(h, d, bias=False)

    def forward(self, x):
        h = self.wi(x)
        gate, value = torch.chunk(h, 2, dim=-1)
        return self.wo(F.gelu(gate) * value)
'''

_T5 = '''
import math
import torch
from torch import nn


class NewGELUActivation(nn.Module):
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class T5DenseGatedActDense(nn.Module):
    def __init__(self, d_model, d_ff, dropout_rate):
        super().__init__()
        self.wi_0 = nn.Linear(d_model, d_ff, bias=False)
        self.wi_1 = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout_rate)
        self.act = NewGELUActivation()

    def forward(self, hidden_states):
        hidden_gelu = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = hidden_gelu * hidden_linear
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states
'''

_T5_CONFIG = '''
import math
import torch
from torch import nn


class NewGELUActivation(nn.Module):
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


ACT2FN = {"gelu_new": NewGELUActivation(), "relu": nn.ReLU()}


class T5DenseGatedActDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = ACT2FN[config.dense_act_fn]

    def forward(self, hidden_states):
        hidden_gelu = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = hidden_gelu * hidden_linear
        return self.wo(hidden_states)
'''

_NN_GELU_MODULE = '''
import torch
from torch import nn


class GeGluMlp(nn.Module):
    """timm-style: the activation module built in __init__, two projections."""

    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1_g = nn.Linear(in_features, hidden_features)
        self.fc1_x = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        x_gate = self.fc1_g(x)
        x = self.fc1_x(x)
        x = self.act(x_gate) * x
        return self.fc2(x)
'''

_DYN_APPROX = '''
import torch
import torch.nn.functional as F
from torch import nn


class GatedGELU(nn.Module):
    def __init__(self, dim_in, dim_out, approximate: str = "none"):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)
        self.approximate = approximate

    def forward(self, hidden_states):
        hidden_states, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return hidden_states * F.gelu(gate, approximate=self.approximate)
'''

Geglu.FUSE = [
    Fuse(
        _DIFFUSERS,
        expect={"approximate": 0, "activate_left": False, "source": "split", "order": "up_first", "split_dim": -1,
                "split_tensor": "hidden_states", "gate": "gate", "up": "hidden_states", "qualname": "GEGLU.forward", "line": 20, "end_line": 21},
        run="m = GEGLU(16, 24)\nx = torch.randn(2, 3, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.proj.weight]\n",
        name="diffusers_geglu_fp32",
    ),
    Fuse(_DIFFUSERS, expect={"approximate": 0},
         run="m = GEGLU(16, 24).to(torch.bfloat16)\nx = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x]\n",
         name="diffusers_geglu_bf16"),
    Fuse(
        _TANH_SECOND,
        expect={"approximate": 1, "activate_left": False, "split_tensor": "self.proj(x)"},
        run="m = ApproxGEGLU(8, 12)\nx = torch.randn(5, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.proj.weight]\n",
        name="tanh_on_second_half",
    ),
    Fuse(
        _GELU_FIRST,
        expect={"approximate": 0, "activate_left": True, "order": "gate_first", "split": "chunk"},
        run="m = GEGLUFirst(8, 6).to(torch.float16)\nx = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)\nout = m(x)\nleaves = [x, m.wi.weight]\n",
        name="gelu_on_first_half_fp16",
    ),
    Fuse(
        _T5,
        expect={"approximate": 1, "activate_left": True, "source": "two_projections", "gate": "self.wi_0(hidden_states)",
                "up": "hidden_linear", "line": 22, "end_line": 24},
        run="m = T5DenseGatedActDense(8, 16, 0.0)\nx = torch.randn(2, 4, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.wi_0.weight, m.wi_1.weight]\n",
        name="t5_v1_1_gated_gelu_new",
    ),
    Fuse(
        _T5_CONFIG,
        expect={"conditional": True, "approximate": "config", "runtime_check": "activation type"},
        run="class C:\n    d_model = 8\n    d_ff = 12\n    dense_act_fn = 'gelu_new'\nm = T5DenseGatedActDense(C())\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.wi_0.weight]\n",
        name="t5_act2fn_config",
    ),
    Fuse(
        _NN_GELU_MODULE,
        expect={"approximate": 1, "gate": "x_gate", "up": "x", "source": "two_projections"},
        run="m = GeGluMlp(8, 10)\nx = torch.randn(6, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.fc1_g.weight]\n",
        name="nn_gelu_tanh_module",
    ),
    Fuse(
        _DYN_APPROX,
        expect={"approximate": "runtime", "activate_left": False},
        run="m = GatedGELU(8, 6, approximate='tanh')\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x]\n",
        name="approximate_from_attribute",
    ),
    Fuse(
        '''
import torch
from torch import nn


class CpmAntDenseGatedACT(nn.Module):
    """The up projection rebinds its own input: ``hidden_states = self.w_1(hidden_states)``."""

    def __init__(self, d, h):
        super().__init__()
        self.w_0 = nn.Linear(d, h, bias=False)
        self.w_1 = nn.Linear(d, h, bias=False)
        self.act = torch.nn.GELU()

    def forward(self, hidden_states):
        gate_score = self.act(self.w_0(hidden_states))
        hidden_states = self.w_1(hidden_states)

        hidden_states = gate_score * hidden_states
        return hidden_states
''',
        expect={"approximate": 0, "activate_left": True, "source": "two_projections", "gate": "self.w_0(hidden_states)",
                "up": "hidden_states", "line": 16, "end_line": 19},
        run="m = CpmAntDenseGatedACT(8, 12)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.w_0.weight, m.w_1.weight]\n",
        name="up_projection_rebinds_its_input",
    ),
]

Geglu.KEEP = [
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


def is_torch_npu_available():
    return False


class GEGLU(nn.Module):
    """diffusers' GEGLU already carries a torch_npu branch."""

    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, hidden_states):
        hidden_states = self.proj(hidden_states)
        if is_torch_npu_available():
            import torch_npu
            return torch_npu.npu_geglu(hidden_states, dim=-1, approximate=1)[0]
        else:
            hidden_states, gate = hidden_states.chunk(2, dim=-1)
            return hidden_states * F.gelu(gate)
''',
        reason="already has a torch_npu branch",
        name="diffusers_existing_npu_branch",
    ),
    Keep(
        '''
import torch
from torch import nn


class QuickGeGLU(nn.Module):
    """CLIP's quick_gelu used as a gate: x * sigmoid(1.702 x) is not gelu."""

    def __init__(self, d, h):
        super().__init__()
        self.fc = nn.Linear(d, 2 * h)

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=-1)
        return a * torch.sigmoid(1.702 * a) * b
''',
        reason="quick_gelu",
        name="quick_gelu_gate",
    ),
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    """GPT-2 / ViT MLP: gelu without a gate."""

    def __init__(self, d, h):
        super().__init__()
        self.c_fc = nn.Linear(d, h)
        self.c_proj = nn.Linear(h, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
''',
        name="plain_gelu_mlp",
    ),
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class GEGLUWithGate(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj = nn.Linear(d, 2 * h)

    def forward(self, x):
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        g = F.gelu(gate)
        out = hidden * g
        return out, g
''',
        reason="reused after the fused region",
        name="gelu_reused",
    ),
    Keep(
        '''
import torch
from torch import nn

ACT2FN = {"gelu_10": nn.Hardtanh()}


class ClippedGatedMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wi_0 = nn.Linear(d, h)
        self.wi_1 = nn.Linear(d, h)
        self.act = ACT2FN["gelu_10"]

    def forward(self, x):
        return self.act(self.wi_0(x)) * self.wi_1(x)
''',
        reason="cannot be mapped",
        name="clipped_gelu_unmappable",
    ),
]


# -- issue 14, class 6: the activation a constructor parameter's default names ------------------

_CTOR_DEFAULT = '''
import torch
from torch import nn

ACT2FN = {"gelu": nn.GELU(), "gelu_new": nn.GELU(approximate="tanh"), "silu": nn.SiLU()}


class ObjectDefault(nn.Module):
    def __init__(self, d, h, activation=nn.GELU(approximate="tanh")):
        super().__init__()
        self.gate = nn.Linear(d, h)
        self.up = nn.Linear(d, h)
        self.act = activation

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)


class KeyDefault(nn.Module):
    def __init__(self, d, h, hidden_act="gelu"):
        super().__init__()
        self.gate = nn.Linear(d, h)
        self.up = nn.Linear(d, h)
        self.act = ACT2FN[hidden_act]

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)
'''

Geglu.FUSE += [
    Fuse(_CTOR_DEFAULT, expect={"conditional": True},
         run="m = ObjectDefault(8, 12)\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate.weight]\n",
         name="ctor_default_activation_object"),
    Fuse(_CTOR_DEFAULT, expect={"conditional": True},
         run="m = KeyDefault(8, 12)\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate.weight]\n",
         name="ctor_default_activation_key"),
    # a caller passing another activation: the same code dispatches (here to the tanh gelu)
    Fuse(_CTOR_DEFAULT, expect={"conditional": True},
         run="m = KeyDefault(8, 12, hidden_act='gelu_new')\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate.weight]\n",
         name="ctor_key_overridden_by_caller"),
]


# -- issue 14, class 6: activation defaults reached through inheritance, partials and callers ----

# llm-foundry MPTGLU-style: self.act assigned by an in-module base class's __init__, its default a
# module-level constant built by a resolver from a literal naming gelu; moved with .to(device=...)
_INHERITED_ACT = '''
from copy import deepcopy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

_ACT_DEFAULT = {"name": "gelu", "approximate": "none"}


def resolve_act(config=None):
    config = deepcopy(config if config is not None else _ACT_DEFAULT)
    name = config.pop("name")
    return partial(getattr(F, name), **config)


_DEFAULT_ACT = resolve_act(_ACT_DEFAULT)


class PlainMLP(nn.Module):
    def __init__(self, d, h, act_fn=_DEFAULT_ACT):
        super().__init__()
        self.up_proj = nn.Linear(d, h)
        self.act = act_fn
        self.down_proj = nn.Linear(h, d)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(PlainMLP):
    def __init__(self, d, h, act_fn=_DEFAULT_ACT):
        super().__init__(d, h, act_fn=act_fn)
        self.gate_proj = nn.Linear(d, h)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)).to(device=x.device) * self.up_proj(x))
'''

_RUN_INHERITED = '''
m = GatedMLP(8, 12{arg})
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.gate_proj.weight, m.up_proj.weight]
'''

# megablocks/llm-foundry dMoE-style: the expert GLU's activation is a required parameter; the
# module's own constructions hand it down from a default partial(F.gelu, approximate="tanh");
# x.matmul(w.t()) projections of one input
_CALLER_DEFAULT = '''
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ACTIVATION_FN = partial(F.gelu, approximate="tanh")


class ExpertGLU(nn.Module):
    def __init__(self, d, h, n, activation_fn):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, h, d) / d ** 0.5)
        self.v1 = nn.Parameter(torch.randn(n, h, d) / d ** 0.5)
        self.activation_fn = activation_fn

    def forward(self, x, e):
        x1 = x.matmul(self.w1[e].t())
        x2 = x.matmul(self.v1[e].t())
        x1 = self.activation_fn(x1)
        x1 = x1 * x2
        return x1


class Experts(nn.Module):
    def __init__(self, d, h, n, activation_fn):
        super().__init__()
        self.mlp = ExpertGLU(d, h, n, activation_fn=activation_fn)


class MoE(nn.Module):
    def __init__(self, d=8, h=12, n=2, activation_fn=DEFAULT_ACTIVATION_FN):
        super().__init__()
        self.experts = Experts(d, h, n, activation_fn=activation_fn)
'''

_RUN_CALLER_DEFAULT = '''
m = MoE({arg})
x = torch.randn(5, 8, requires_grad=True)
out = m.experts.mlp(x, 1)
leaves = [x, m.experts.mlp.w1]
'''

Geglu.FUSE += [
    Fuse(_INHERITED_ACT, expect={"conditional": True, "default_activation": "gelu", "default_approximate": 0}, run=_RUN_INHERITED.format(arg=""),
         name="inherited_act_resolver_default_gelu"),
    # a caller passing silu: the same rewritten code dispatches to npu_swiglu
    Fuse(_INHERITED_ACT, expect={"conditional": True}, run=_RUN_INHERITED.format(arg=", act_fn=partial(F.silu)"), name="inherited_act_overridden_silu_partial"),
    Fuse(_CALLER_DEFAULT, expect={"conditional": True, "source": "two_projections", "default_approximate": 1}, run=_RUN_CALLER_DEFAULT.format(arg=""),
         name="caller_chain_default_partial_gelu_tanh"),
]

Geglu.KEEP += [
    # a partial with a positional argument bound is not plain gelu: resolved as nothing the fused
    # op computes, the product is reported by swiglu's near miss, never as geglu
    Keep(_CALLER_DEFAULT.replace("x1 = x1 * x2", "x1 = x1 * x1.sum(-1, keepdim=True)"),
         reason="not projections of one input", name="caller_chain_default_not_a_glu"),
]


# -- issue 14, class 6: the activation as the last layer of an nn.Sequential gate (Wan T5) -------

_SEQUENTIAL_GATE = '''
import math

import torch
from torch import nn


class TanhGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GatedFeedForward(nn.Module):
    def __init__(self, dim, dim_ffn, dropout=0.0):
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), TanhGELU())
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.fc1(x) * self.gate(x)
        x = self.dropout(x)
        return self.fc2(x)
'''

_RUN_SEQUENTIAL_GATE = '''
m = GatedFeedForward(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.gate[0].weight, m.fc1.weight]
'''

Geglu.FUSE += [
    Fuse(_SEQUENTIAL_GATE, expect={"approximate": 1, "source": "two_projections"}, run=_RUN_SEQUENTIAL_GATE, name="sequential_gate_last_layer_tanh_gelu"),
    Fuse(_SEQUENTIAL_GATE.replace("nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), TanhGELU())",
                                  "nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), nn.Identity(), nn.GELU())"),
         expect={"approximate": 0}, run=_RUN_SEQUENTIAL_GATE, name="sequential_gate_three_layers_gelu"),
]

Geglu.KEEP += [
    # the Sequential ends in a projection (a plain MLP inside): no gate activation at all
    Keep(_SEQUENTIAL_GATE.replace("nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), TanhGELU())",
                                  "nn.Sequential(TanhGELU(), nn.Linear(dim, dim_ffn, bias=False))"),
         reason="", name="sequential_ending_in_a_projection"),
    # the gate's Sequential reads another input than the up projection
    Keep(_SEQUENTIAL_GATE.replace("self.fc1(x) * self.gate(x)", "self.fc1(x) * self.gate(x.flip(-1))"),
         reason="not projections of one input", name="sequential_gate_on_another_input"),
]


# --- glu: an activation read with getattr and a gelu fallback (issue 14, class 6) --------------

Geglu.FUSE += [
    # the fallback (F.gelu) files it under geglu; the fused branch dispatches on the object
    Fuse(G._GETATTR_ACT, expect={"activation": "config", "default_activation": "gelu", "split": "split"},
           run=G._RUN_GETATTR, name="activation_from_getattr_with_gelu_fallback"),
    Fuse(G._GETATTR_ACT, expect={"activation": "config"},
           run=G._RUN_GETATTR.replace("for _ in range(3)]", "for _ in range(3)]\nfor e in experts:\n    e.activation = nn.SiLU()"),
           name="activation_from_getattr_set_to_silu"),
]
Geglu.KEEP += [
    # three parts of one split: gate and up are not the two halves
    Keep(G._GETATTR_ACT.replace("gate, up = gate_up.split(self.ffn, dim=1)", "gate, up, extra = gate_up.split(self.ffn, dim=1)"),
           reason="split into 3 parts (unpacked into (gate, up, extra)), not two halves", name="activation_from_getattr_three_part_split"),
]


# the gated branch of an if/else whose other branch assigns the same names before reading them
_GATED_OR_NOT = G._GETATTR_ACT.replace(
    "    def __init__(self, experts, ffn):\n        super().__init__()\n",
    "    def __init__(self, experts, ffn, gated=True):\n        super().__init__()\n        self.gated = gated\n"
    "        self.w_gate = nn.ParameterList([nn.Parameter(e[0].weight) for e in experts])\n").replace(
    "            gate_up = F.linear(x[pos], self.w_gate_up[e])\n"
    "            gate, up = gate_up.split(self.ffn, dim=1)\n"
    "            gate = self.activation(gate)\n"
    "            hidden = gate * up\n",
    "            if self.gated:\n"
    "                gate_up = F.linear(x[pos], self.w_gate_up[e])\n"
    "                gate, up = gate_up.split(self.ffn, dim=1)\n"
    "                gate = self.activation(gate)\n"
    "                hidden = gate * up\n"
    "            else:\n"
    "                gate = F.linear(x[pos], self.w_gate[e])\n"
    "                hidden = self.activation(gate)\n")

Geglu.FUSE += [
    Fuse(_GATED_OR_NOT, expect={"activation": "config", "line": 23, "end_line": 25},
         run=G._RUN_GETATTR + "m2 = GroupedExperts(experts, 12, gated=False)\nout = (out, m2.forward_tokens(x, torch.arange(10) % 3))\n",
         name="activation_from_getattr_gated_branch_of_an_if_else"),
]
Geglu.KEEP += [
    # the other branch reads the activated gate the span no longer computes
    Keep(_GATED_OR_NOT.replace("                gate = F.linear(x[pos], self.w_gate[e])\n", ""),
         reason="intermediate `gate` reused after the fused region", name="activation_from_getattr_other_branch_reads_the_gate"),
]


# --- glu harvest (s25): the gelu side of the harvest's classes (tests/test_detect_glu_harvest.py) ---

Geglu.FUSE += [
    # T5-style gated gelu with the activation in fp32, rounded back to the gate's dtype
    Fuse(G._HARVEST_CAST_TO.replace("F.silu(g.float()).to(g.dtype)", "F.gelu(g.float(), approximate=\"tanh\").type_as(g)"),
         expect={"activation": "gelu_tanh", "gate": "g"}, run=G._RUN_HARVEST_CAST_TO, name="harvest_gelu_in_fp32_cast_back"),
]

# interleaved gate/up columns (was a near miss): the two strided parts concatenated
Geglu.FUSE += [
    Fuse('''
import torch
import torch.nn.functional as F
from torch import nn


class InterleavedGEGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj = nn.Linear(d, 2 * h)

    def forward(self, x):
        h = self.proj(x)
        return h[..., 0::2] * F.gelu(h[..., 1::2])
''', expect={"activation": "gelu", "gate": "h[..., 1::2]", "up": "h[..., 0::2]", "approximate": 0},
         run="m = InterleavedGEGLU(8, 6)\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.proj.weight]\n",
         name="harvest_interleaved_gelu_columns"),
]


# --- s26 (issue 14): a gelu(tanh) gate transformed under a condition before the product (AltUp-style) ---

Geglu.FUSE += [
    Fuse(G._S26_GLU_FFN_CONDITIONAL, expect={"activation": "gelu_tanh", "approximate": 1, "gate": "gate", "up": "seqs"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nout = (TanhGLU(8, 6)(x), TanhGLU(8, 6, sparsity=0.5)(x))\nleaves = [x]\n",
         name="s26_tanh_gate_sparsified_under_condition"),
]


# --- s28: gelu(tanh) over two weight objects' `.mm` of one input (inference engines) ---

Geglu.FUSE += [
    Fuse(G._S28_WEIGHT_MM.replace("out = F.silu(gate) * up", 'out = F.gelu(gate, approximate="tanh") * up'),
         expect={"activation": "gelu_tanh", "approximate": 1, "activate_left": True, "gate": "gate", "up": "up"},
         run=G._RUN_S28_WEIGHT_MM, name="s28_weight_objects_mm_gelu_tanh"),
]


# --- s30: halves split in an enclosing block, the gelu product in a nested option branch ---------

Geglu.FUSE += [
    # swiglu's example: its `if activation == "gelu":` branch is the geglu site
    Fuse(G._S30_OUTER_SPLIT, expect={"approximate": 0, "qualname": "experts_forward"}, run=G._RUN_S30_OUTER_SPLIT,
         name="s30_split_in_an_enclosing_block"),
]


# --- s36 glu36: GELU's `approximate` chosen by a bool inside a function (an expression, not a name) --
# (ppl.pmx's GeGLU autograd op: `gelu(x, approximate="tanh" if approximate else "none")`). The
# rendered expression is pasted into the dispatch `(1 if (<e>) == "tanh" else 0)`: unparenthesised it
# did not parse (or, for a name bound to such an expression, meant `... else ("none" == "tanh")`).

_S36_APPROX_BY_FLAG_OP = '''
import torch


class GatedGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X: torch.Tensor, approximate: bool = False):
        x, g = torch.split(X, [X.shape[-1] // 2, X.shape[-1] // 2], -1)
        Y = g * torch.nn.functional.gelu(x, approximate="tanh" if approximate else "none")
        return Y
'''

# invented: a plain helper, the halves by chunk (gate second), the mode bound to a name first
_S36_APPROX_MODE_NAME = '''
import torch
import torch.nn.functional as F


def gelu_gated(packed, fast=False):
    mode = "tanh" if fast else "none"
    value, gate = packed.chunk(2, dim=-1)
    return F.gelu(gate, approximate=mode) * value
'''

# invented: an nn.Module whose flag is an attribute; up half first in a slice pair
_S36_APPROX_ATTR_FLAG = '''
import torch
import torch.nn.functional as F
from torch import nn


class GegluHead(nn.Module):
    def __init__(self, d, h, use_tanh=True):
        super().__init__()
        self.proj = nn.Linear(d, 2 * h)
        self.h = h
        self.use_tanh = use_tanh

    def forward(self, inp):
        z = self.proj(inp)
        up, gate = z[..., :self.h], z[..., self.h:]
        return up * F.gelu(gate, approximate=("tanh" if self.use_tanh else "none"))
'''

Geglu.FUSE += [
    Fuse(_S36_APPROX_BY_FLAG_OP, expect={"approximate": "runtime", "activate_left": True, "split": "split"},
         run="x = torch.randn(3, 8, requires_grad=True)\nout = (GatedGelu.forward(None, x, True), GatedGelu.forward(None, x, False))\nleaves = [x]\n",
         name="s36_approximate_chosen_by_a_bool_in_an_autograd_op"),
    Fuse(_S36_APPROX_MODE_NAME, expect={"approximate": "runtime", "activate_left": False},
         run="x = torch.randn(2, 5, 12, requires_grad=True)\nout = (gelu_gated(x, True), gelu_gated(x))\nleaves = [x]\n",
         name="s36_approximate_mode_bound_to_a_name"),
    Fuse(_S36_APPROX_ATTR_FLAG, expect={"approximate": "runtime", "activate_left": False},
         run="x = torch.randn(4, 8, requires_grad=True)\nout = (GegluHead(8, 6)(x), GegluHead(8, 6, use_tanh=False)(x))\nleaves = [x]\n",
         name="s36_approximate_chosen_by_an_attribute_flag"),
]

Geglu.KEEP += [
    # the same op whose halves come from two different tensors: no GLU of one input
    Keep(_S36_APPROX_BY_FLAG_OP.replace("x, g = torch.split(X, [X.shape[-1] // 2, X.shape[-1] // 2], -1)",
                                        "x, _ = torch.split(X, [X.shape[-1] // 2, X.shape[-1] // 2], -1)\n"
                                        "        _, g = torch.split(X.flip(0), [X.shape[-1] // 2, X.shape[-1] // 2], -1)"),
         reason="halves of different tensors", name="s36_approximate_by_flag_halves_of_two_tensors"),
]


# --- s38 glumoe38: an activation module built in place under a name that says nothing -------------
# (HO14b OFormer's GeGELU: `self.fn = nn.GELU()`, forward `self.fn(x[..., :int(c // 2)]) * x[..., int(c // 2):]`).
# The forward's text names no activation, so the scope never reached the gated-product reader; the
# constructor stored in __init__ now names it. Invented spellings below (other attribute names, tanh mode).

_S38_BUILT_IN_PLACE = '''
import torch
from torch import nn


class HalfGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.nonlin = nn.GELU(approximate="tanh")

    def forward(self, z):
        width = z.shape[-1]
        return self.nonlin(z[..., :int(width // 2)]) * z[..., int(width // 2):]
'''

Geglu.FUSE += [
    Fuse(_S38_BUILT_IN_PLACE, expect={"activation": "gelu_tanh", "approximate": 1, "activate_left": True},
         run="x = torch.randn(3, 4, 10, requires_grad=True)\nout = HalfGate()(x)\nleaves = [x]\n",
         name="s38_activation_module_under_a_plain_attribute_name"),
]

Geglu.KEEP += [
    # the up slice starts one column past the gate's end: not the two halves of one tensor
    Keep(_S38_BUILT_IN_PLACE.replace("z[..., int(width // 2):]", "z[..., int(width // 2) + 1:]"),
         reason="do not split one tensor in two", name="s38_plain_attribute_activation_slices_not_halves"),
]
