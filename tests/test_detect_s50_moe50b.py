"""s50 (moe50b): canonical-layer extensions of the moe_experts analysis. Invented reproducers of the sweep50moe /
HO24a / HO26a / HO25b / HO26b classes the s50 moe50 helper left (``_moe_s50b``): a dead statistic in the expert loop
with one-hot column rows and a named size test; the per-token loop whose outputs are collected in a list and
stacked; cross-file token-wise experts; dense experts picked by ``torch.gather``; dense scattered weight matrices;
an inverse-permutation combine. Each FUSE case is rewritten and run against the original under the emulator
(outputs and gradients, fp32 and bf16); each KEEP twin gets a true reason.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pattern_harness import check_rewrite_runs, detect_all, fused_and_runs

from npufuse.patterns.moe_experts import MoeExperts
from npufuse.scan.engine import scan_repo

_HEAD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F
'''


def _bf16(run: str, ctor: str) -> str:
    return run.replace(ctor, ctor + ".to(torch.bfloat16)").replace("requires_grad=True", "dtype=torch.bfloat16, requires_grad=True")


def _bf16_exact(code: str, run: str) -> None:
    findings, _ = detect_all(MoeExperts(), code)
    facts = check_rewrite_runs(MoeExperts(), code, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.99, facts


def _reasons(code: str) -> list[str]:
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, [f.qualname for f in findings]
    return [m.reason for m in misses]


# -- (e) a dead statistic in the expert loop; one-hot column rows; a named size test ----------------------------------

_DEAD = _HEAD + '''

class TallyMoe(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.n = n
        self.k = k
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)) for _ in range(n)])
        self.gate = nn.Linear(d, n)

    def forward(self, h):
        flat = h.reshape(-1, h.shape[-1])
        vals, idx = torch.topk(self.gate(flat), self.k, dim=-1)
        probs = F.softmax(vals, dim=-1)
        out = torch.zeros_like(flat)
        seen = torch.zeros(self.n, dtype=torch.int32)
        for k in range(self.k):
            col = idx[:, k]
            oh = F.one_hot(col, self.n).float()
            for e in range(self.n):
                rows = oh[:, e].nonzero(as_tuple=False).squeeze(1)
                cnt = rows.numel()
                if cnt == 0:
                    continue
                seen[e] += cnt
                y = self.experts[e](flat[rows])
                out[rows] += probs[rows, k].unsqueeze(1) * y
        return out.view_as(h)
'''

_DEAD_RUN = '''
torch.manual_seed(0)
m = TallyMoe(10, 5, 2)
h = torch.randn(2, 7, 10, requires_grad=True)
out = m(h)
leaves = [h, m.gate.weight, m.experts[0][0].weight, m.experts[3][2].bias]
'''


def test_dead_statistic_one_hot_rows_fused_and_exact() -> None:
    facts = fused_and_runs(MoeExperts(), _DEAD, _DEAD_RUN, "TallyMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1


def test_dead_statistic_bf16() -> None:
    _bf16_exact(_DEAD, _bf16(_DEAD_RUN, "TallyMoe(10, 5, 2)"))


def test_statistic_that_is_returned_is_not_dropped() -> None:
    code = _DEAD.replace("return out.view_as(h)", "return out.view_as(h), seen")
    reasons = _reasons(code)
    assert any("seen[e] += cnt" in r for r in reasons), reasons


def test_statistic_read_after_the_loop_is_not_dropped() -> None:
    code = _DEAD.replace("        return out.view_as(h)", "        print(seen)\n        return out.view_as(h)")
    reasons = _reasons(code)
    assert any("seen[e] += cnt" in r for r in reasons), reasons


# -- (h) the per-token loop's experts are a class of another file of the repository -----------------------------------

_FFN_FILE = '''\
import torch
import torch.nn as nn


class Ffn(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.outp = nn.Linear(hidden, d)

    def forward(self, z):
        z = self.inp(z)
        z = self.act(z)
        return self.outp(z)
'''

_MIXING_FFN_FILE = _FFN_FILE.replace("return self.outp(z)", "return self.outp(z - z.mean(dim=0, keepdim=True))")

_PER_TOKEN = '''

class ArgmaxMoe(nn.Module):
    def __init__(self, d, hidden, n):
        super().__init__()
        self.pick = nn.Linear(d, n)
        self.experts = nn.ModuleList([Ffn(d, hidden) for _ in range(n)])

    def forward(self, x):
        choice = torch.argmax(F.softmax(self.pick(x), dim=-1), dim=-1)
        res = torch.zeros_like(x)
        for i in range(x.size(0)):
            c = choice[i].item()
            res[i] = self.experts[c](x[i])
        return res
'''

_PER_TOKEN_RUN = '''
torch.manual_seed(0)
m = ArgmaxMoe(8, 16, 4)
x = torch.randn(11, 8, requires_grad=True)
out = m(x)
leaves = [x, m.experts[0].inp.weight, m.experts[2].outp.bias]
'''


def _two_files(tmp_path: Path, ffn: str) -> list[dict]:
    (tmp_path / "ffn.py").write_text(ffn)
    (tmp_path / "layer.py").write_text(_HEAD + "\nfrom ffn import Ffn\n" + _PER_TOKEN)
    res = scan_repo(tmp_path, jobs=1, only=["moe_experts"])
    return res.candidates, res.near_misses


def test_per_token_loop_expert_class_of_another_file_fused(tmp_path: Path) -> None:
    cands, misses = _two_files(tmp_path, _FFN_FILE)
    assert [(c["file"], c["qualname"]) for c in cands] == [("layer.py", "ArgmaxMoe.forward")], misses
    # the same replacement as with the class in the file, whose rewrite runs exactly
    one_file = _FFN_FILE + _PER_TOKEN.replace("F.softmax", "torch.nn.functional.softmax")
    facts = fused_and_runs(MoeExperts(), one_file, _PER_TOKEN_RUN, "ArgmaxMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1
    findings, _ = detect_all(MoeExperts(), _HEAD + _FFN_FILE.split("import torch.nn as nn\n", 1)[1] + _PER_TOKEN)
    assert findings and all(line.strip() in cands[0]["replacement"] for line in findings[0].fused.splitlines()), cands[0]


def test_per_token_loop_expert_class_of_another_file_bf16() -> None:
    code = _HEAD + _FFN_FILE.split("import torch.nn as nn\n", 1)[1] + _PER_TOKEN
    _bf16_exact(code, _bf16(_PER_TOKEN_RUN, "ArgmaxMoe(8, 16, 4)"))


def test_per_token_loop_row_mixing_expert_of_another_file_kept(tmp_path: Path) -> None:
    cands, misses = _two_files(tmp_path, _MIXING_FFN_FILE)
    assert not cands
    assert any("one token's row at a time" in m["reason"] for m in misses), misses


# -- (c) per-token loop, top-k slots written out, rows appended to a list and stacked in the return -------------------

_LISTED = _HEAD + '''

class GluFfn(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.a = nn.Linear(d, f)
        self.b = nn.Linear(d, f)
        self.c = nn.Linear(f, d)

    def forward(self, v):
        return self.c(F.silu(self.a(v)) * self.b(v))


class ListMoe(nn.Module):
    def __init__(self, d, f, n):
        super().__init__()
        self.score = nn.Linear(d, n)
        self.pool_of_experts = nn.ModuleList([GluFfn(d, f) for _ in range(n)])

    def forward(self, h):
        bsz, seq, dim = h.shape
        h = h.view(bsz * seq, dim)
        top, which = self.score(h).topk(k=2, dim=-1)
        top = F.softmax(top, dim=-1)
        rows = []
        for t in range(bsz * seq):
            first = self.pool_of_experts[which[t][0]](h[t]) * top[t][0]
            second = top[t][1] * self.pool_of_experts[which[t][1]](h[t])
            both = first + second
            rows.append(both)
        return torch.stack(rows, dim=0).view(bsz, seq, dim)
'''

_LISTED_RUN = '''
torch.manual_seed(0)
m = ListMoe(8, 12, 4)
h = torch.randn(2, 5, 8, requires_grad=True)
out = m(h)
leaves = [h, m.score.weight, m.pool_of_experts[0].a.weight, m.pool_of_experts[3].c.bias]
'''


def test_listed_rows_unrolled_slots_fused_and_exact() -> None:
    facts = fused_and_runs(MoeExperts(), _LISTED, _LISTED_RUN, "ListMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_unpermute") == 1
    assert "rows = list(rows.unbind(0))" in facts["rewritten"]
    assert "(tuple(which.shape) == (bsz * seq, 2,))" in facts["rewritten"]


def test_listed_rows_unrolled_slots_bf16() -> None:
    _bf16_exact(_LISTED, _bf16(_LISTED_RUN, "ListMoe(8, 12, 4)"))


def test_unrolled_slots_of_three_ids_run_as_written() -> None:
    # top-3 ids with two slots written out: the guard sends the call to the original (the third slot is ignored there)
    code = _LISTED.replace("topk(k=2", "topk(k=3")
    findings, _ = detect_all(MoeExperts(), code)
    facts = check_rewrite_runs(MoeExperts(), code, _LISTED_RUN, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_unrolled_slot_repeated_not_read() -> None:
    code = _LISTED.replace("self.pool_of_experts[which[t][1]](h[t])", "self.pool_of_experts[which[t][0]](h[t])")
    assert not detect_all(MoeExperts(), code)[0]


def test_listed_rows_of_another_list_not_read() -> None:
    code = _LISTED.replace("            rows.append(both)\n", "            rows.append(both)\n            rows.append(first)\n")
    assert not detect_all(MoeExperts(), code)[0]


# -- (h) the older direct per-(token, slot) form takes the same token-wise proof ---------------------------------------

_DIRECT = _HEAD + '''

class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, v):
        return self.down(F.gelu(self.up(v)))


class DirectMoe(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList([Mlp(d) for _ in range(n)])

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for t in range(ids.size(0)):
            for k in range(ids.size(1)):
                expert = self.experts[ids[t, k]]
                out[t] += expert(x[t]) * w[t, k]
        return out
'''

_DIRECT_RUN = '''
torch.manual_seed(0)
m = DirectMoe(8, 4, 2)
x = torch.randn(9, 8, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[1].up.weight]
'''


def test_direct_token_slot_form_token_wise_expert_fused_without_the_row_risk() -> None:
    facts = fused_and_runs(MoeExperts(), _DIRECT, _DIRECT_RUN, "DirectMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1
    findings, _ = detect_all(MoeExperts(), _DIRECT)
    assert not any("treats rows independently" in r.detail for r in findings[0].risks)


def test_direct_token_slot_form_row_mixing_expert_kept() -> None:
    code = _DIRECT.replace("return self.down(F.gelu(self.up(v)))", "return self.down(F.gelu(self.up(v))) - v.mean(0)")
    reasons = _reasons(code)
    assert any("one token's row at a time" in r for r in reasons), reasons
