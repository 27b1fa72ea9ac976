"""s42 review (helper review42): defects found in this session's merged changes, each with the test that failed
before its fix and a near miss / twin that must keep working.

1. Module-level aliases of torch APIs (``ModuleInfo.assigned_aliases``, sweep42): ``canonical()`` has no scope, so a
   name bound once at module level (``act = F.silu``) was read as that API everywhere in the file, also where a
   function binds the same name to something else (``act = self.act``, a parameter ``act=F.gelu``): swiglu replaced
   a gelu (or any) activation by ``npu_swiglu``. A name bound anywhere else in the file is now no alias.
2. The same aliases and the ``SCOPE_WORDS`` gates: ``Optim = torch.optim.AdamW`` then ``Optim(params)`` in a
   function was a candidate only with the gates off (the scope holds no class name); the gates now take the alias
   names too. The module-level near miss "the class chosen at run time" is not reported for such an alias, whose
   constructions report themselves.
3. attention, inlined split pipelines with an ``if <flag>: return ..`` left out (ports42): the fused branch runs where
   the caller's flag is false. A method that rebinds the flag before that return (``ret_attn = ret_attn or
   self.keep``), or a caller that rebinds it inside the replaced span, made the test read another value than the
   method's: the fused branch returned one tensor where the original returned two. Such flags are not inlined.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.registry import all_patterns
from npufuse.patterns.swiglu import Swiglu
from npufuse.scan import engine
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all
from test_detect_s42_ports import _FLAGGED, _SPLIT_RUN


# -- 1: a module-level alias shadowed by a local binding

_SHADOWED_ACT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

act = F.silu


class LocalAct(nn.Module):
    def __init__(self, d, h, act_fn):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)
        self.act_fn = act_fn

    def forward(self, x):
        act = self.act_fn
        return self.w2(act(self.w1(x)) * self.w3(x))


class ParamAct(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x, act=F.gelu):
        return self.w2(act(self.w1(x)) * self.w3(x))
'''

_UNSHADOWED_ACT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

act = F.silu


class ModuleAct(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(act(self.w1(x)) * self.w3(x))
'''


def _aliases(code: str) -> dict[str, str]:
    return ModuleInfo.from_source("m.py", code, ast.parse(code)).assigned_aliases


def test_an_alias_name_bound_again_in_a_function_is_no_alias() -> None:
    assert _aliases(_SHADOWED_ACT) == {}
    findings, _ = detect_all(Swiglu(), _SHADOWED_ACT)
    assert not [f for f in findings if "npu_swiglu" in f.fused], findings


@pytest.mark.parametrize("binding", [
    "def configure(name):\n    global act\n    act = getattr(F, name)\n",
    "for act in (F.silu,):\n    pass\n",
    "try:\n    from .kernels import act\nexcept ImportError:\n    pass\n",
    "def act(x):\n    return x\n",
])
def test_other_bindings_of_the_name_in_the_file_cancel_the_alias(binding: str) -> None:
    assert _aliases(_UNSHADOWED_ACT + "\n\n" + binding) == {}


def test_an_alias_bound_once_still_resolves() -> None:
    # twin: the alias used where nothing else binds the name is the torch API (sweep42's class)
    assert _aliases(_UNSHADOWED_ACT) == {"act": "torch.nn.functional.silu"}
    findings, _ = detect_all(Swiglu(), _UNSHADOWED_ACT)
    assert len(findings) == 1 and "npu_swiglu" in findings[0].fused


# -- 2: the scope gates see the alias names

_ALIASED_OPTIMIZER = '''
import torch
from torch import nn
import torch.nn.functional as F

Optim = torch.optim.AdamW


def train(model, loader):
    opt = Optim(model.parameters(), lr=1e-3)
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def _scan(tmp_path: Path, code: str, monkeypatch: pytest.MonkeyPatch, gates: bool) -> engine.FileOutcome:
    (tmp_path / "site.py").write_text(code, encoding="utf-8")
    with monkeypatch.context() as m:
        m.setattr(engine, "SCOPE_GATES", gates)
        return engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())


def _optimizer_results(out: engine.FileOutcome) -> tuple[list, list]:
    hits = [(h.finding.qualname, h.finding.line, h.finding.fused) for h in out.hits if h.finding.pattern == "fused_optimizer"]
    near = [(m["qualname"], m["line"], m["reason"]) for m in out.near_misses if m["pattern"] == "fused_optimizer"]
    return hits, near


def test_a_module_level_optimizer_alias_scans_the_same_with_gates_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on = _optimizer_results(_scan(tmp_path, _ALIASED_OPTIMIZER, monkeypatch, True))
    off = _optimizer_results(_scan(tmp_path, _ALIASED_OPTIMIZER, monkeypatch, False))
    assert on == off
    hits, near = on
    assert [(q, line) for q, line, _ in hits] == [("train", 10)] and "NpuFusedAdamW(model.parameters()" in hits[0][2]
    # no near miss saying the class is chosen at run time beside the candidate its construction is
    assert not [r for _, _, r in near if "chosen at run time" in r], near


def test_an_optimizer_alias_rebound_in_a_function_stays_a_near_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # near miss: the class bound to the name is chosen at run time (`global Optim` rebinds it)
    code = _ALIASED_OPTIMIZER + "\n\ndef use_sgd():\n    global Optim\n    Optim = torch.optim.SGD\n"
    hits, near = _optimizer_results(_scan(tmp_path, code, monkeypatch, True))
    assert not hits and any("is bound to `Optim`" in r and "chosen at run time" in r for _, _, r in near), near


# -- 3: a flag rebound where the inlined pipeline reads it

def _keep_probs(code: str) -> str:
    return code.replace("super().__init__()", "super().__init__()\n        self.keep_probs = True", 1)


def test_a_flag_the_method_rebinds_before_its_return_is_not_left_out() -> None:
    code = _keep_probs(_FLAGGED.replace("        n_batch = value.size(0)\n",
                                        "        n_batch = value.size(0)\n        ret_attn = ret_attn or self.keep_probs\n"))
    assert "ret_attn = ret_attn or self.keep_probs" in code
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings, findings[0].fused


def test_a_flag_the_caller_rebinds_in_the_span_is_not_left_out() -> None:
    scores = "        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)\n"
    code = _keep_probs(_FLAGGED.replace(scores, scores + "        ret_attn = ret_attn or self.keep_probs\n"))
    assert "ret_attn = ret_attn or self.keep_probs" in code
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings, findings[0].fused


def test_a_flag_read_as_given_still_runs_as_written_where_true() -> None:
    # twin: the caller's own flag, rebound nowhere (ports42's FunASR class)
    findings, _ = detect_all(AttentionPattern(), _FLAGGED)
    # s46 (attn46b): the inlined helper also runs as written where a subclass overrides it
    assert len(findings) == 1 and findings[0].fused.startswith("if ret_attn or type(self).forward_attention is not ")
    run = _SPLIT_RUN.replace("out = (m(x, mem, None), m(x, mem, keep))",
                             "out = (m(x, mem, None), *m(x, mem, None, ret_attn=True), m(x, mem, keep))")
    facts = check_rewrite_runs(AttentionPattern(), _FLAGGED, run, findings)
    assert facts["n_out"] == (4, 4) and min(facts["cos_out"]) > 0.9999, facts


# -- 4: the inf/NaN search of affinity_where's branches, once per assignment value

def test_the_branch_search_reads_each_earlier_assignment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from npufuse.patterns import affinity_where

    n = 30
    lines = ["import torch", "def f(x, m):", "    loss = x"]
    lines += [f"    loss = loss * {i} + x" for i in range(n)]
    lines += [f"    y{i} = torch.where(m, torch.zeros_like(loss), loss)" for i in range(n)]
    code = "\n".join([*lines, "    return loss"]) + "\n"
    searched: list[int] = []
    real = affinity_where._unsafe_in
    monkeypatch.setattr(affinity_where, "_unsafe_in", lambda module, scope, root: searched.append(id(root)) or real(module, scope, root))
    pattern = next(p for p in all_patterns() if p.id == "affinity_where")
    findings, _ = detect_all(pattern, code)
    assert len(findings) == n  # no branch computes inf/NaN: every site is still a candidate
    assert len(searched) == len(set(searched)) <= 3 * n + 1, len(searched)  # was n * (n + 1) + n searches
