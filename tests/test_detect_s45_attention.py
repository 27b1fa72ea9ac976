"""s45 attn45: attention / sdpa defects and misses left by s44, each pinned by class (Fuse forms run rewritten under the
emulator against the original; near misses carry true reasons).

1. SDPA operands of mixed ranks: SDPA broadcasts 3-D keys beside a 4-D query (B = 1 multi-query); the fused branch
   tested ``q.dim() == 4`` only and handed 3-D keys to npu_fusion_attention. A stated rank other than 4 beside an
   unstated one is a near miss (granite-tsfm PatchTST-FM's 5-D values: the candidate could never run).
2. One head indexed out in a loop (``query_states[:, h, :, :]``, MiniMax-M2): 3-D per-head products, read 4-D before
   (a dead candidate), now the one-head (bmm) reading with run-time rank checks.
3. fused_optimizer (audit44's false reason): LAVIS's ``if self.use_fsdp: assert False, .. else: DDP(..)`` named FSDP,
   yet the program refuses to run with the flag on; such a refused flag is no sharding fact.
5. defects44's left item, attention sites whose Skv is not read: only 5-D folded q/k/v leave it unread, and those
   fold only without a mask (or with a causal one / float biases passed as pse, expanded to the scores' shape): a
   [B, 1, 1, Sq, 1] mask beside them stays a near miss (pinned). Mixed BSND / BNSD operands read Sq and N on the bound
   q in its own layout (the copy ``q.transpose(1, 2).contiguous()`` was made once per mask-line read).
6. GQA written as a 5-D grouped query (qwen3_from_scratch ``q.reshape(B, Hkv, G, S, D)`` against ``k.unsqueeze(2)``) and
   5-D operands with a causal triangle under a condition: folded into the op's batch, k / v's group axis of 1 as one
   kv head (the op's GQA), the triangle's [Sq, Skv] plane as the 2-D mask; leading axes checked at run time.
7. Tiled online-softmax (flash) loop nests in PyTorch (elvin-mark's EducationalFlashAttention): the loop computes
   softmax(q kᵀ·scale + mask) v exactly (running max, rescaled sum and accumulator, final division): one call; a
   key-block skip after the query block needs a mask masking those keys (checked at run time). Keeps: no rescale, a
   different normaliser, a windowed skip, a skip with no mask, the running statistics read after the loop.
4. affinity_index_put (audit44's false reason): ``random_indices[batch_mask, :num_mask, :]`` IS gathered with the mask
   (then sliced): the reason is now the true one (``scatter`` not elementwise), or the slice after the gather.
"""

from __future__ import annotations

import pytest

from pathlib import Path

from apply_support import scan
from pattern_harness import check_rewrite_runs, detect_all
from scratch_repo import write_files
from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.sdpa import SdpaPattern


def _fused(pattern, code: str) -> list:
    findings, misses = detect_all(pattern, code)
    assert findings, [m.reason for m in misses]
    return findings


def _near_miss(pattern, code: str) -> str:
    findings, misses = detect_all(pattern, code)
    assert not findings, findings[0].fused
    assert misses
    return " | ".join(m.reason for m in misses)


def _close(facts: dict, calls: bool = True, tol: float = 0.9999) -> None:
    assert (facts["calls"] >= 1) == calls, facts["all_calls"]
    assert all(a == b for a, b in facts["shapes"]), facts["shapes"]
    assert all(c > tol for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > tol for c in facts["cos_grad"]), facts["cos_grad"]


# -- 1. SDPA operands of mixed ranks -----------------------------------------------------------------------------------

_SDPA_HELPER = '''
import torch
import torch.nn.functional as F


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)
'''
_RUN_KEYS = "q = torch.randn(1, 4, 5, 8, requires_grad=True)\nk = torch.randn({k}, requires_grad=True)\nv = torch.randn({k}, requires_grad=True)\nout = attend(q, k, v)\nleaves = [q, k, v]\n"


def test_sdpa_keys_of_a_lower_rank_run_the_original() -> None:
    # one key / value head shared by every query head, 3-D [B, S, D] (B = 1): SDPA broadcasts it, the op takes 4-D only
    findings = _fused(SdpaPattern(), _SDPA_HELPER)
    assert "_npufuse_q4.dim() == _npufuse_k4.dim() == _npufuse_v4.dim() == 4" in findings[0].fused  # (s51b: the 4-D views)
    _close(check_rewrite_runs(SdpaPattern(), _SDPA_HELPER, _RUN_KEYS.format(k="1, 7, 8"), findings), calls=False)


def test_sdpa_four_d_operands_of_unstated_rank_still_fuse() -> None:
    findings = _fused(SdpaPattern(), _SDPA_HELPER)
    _close(check_rewrite_runs(SdpaPattern(), _SDPA_HELPER, _RUN_KEYS.format(k="1, 4, 7, 8"), findings))


_GRANITE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qk_norm=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x, attn_mask=None):
        B, M, N, C = x.shape
        qkv = self.qkv(x).reshape(B, M, N, 3, self.num_heads, self.head_dim).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1) if attn_mask is not None else None)
        return x.permute(0, 2, 3, 1, 4).reshape(B, M, N, C)
'''


def test_sdpa_five_d_values_beside_unstated_queries_are_a_near_miss() -> None:
    # granite-tsfm PatchTST-FM: v is 5-D (a 6-D permute's unbind); the candidate's `q.dim() == 4` never held
    reason = _near_miss(SdpaPattern(), _GRANITE)
    assert "v (`v`) is 5-D while the rank of q, k is not stated" in reason


def test_sdpa_four_d_values_beside_unstated_queries_fuse() -> None:
    # the twin: a 5-D reshape's unbind gives 4-D values; q / k through the norm modules are checked at run time
    code = _GRANITE.replace("B, M, N, C = x.shape", "B, N, C = x.shape").replace(
        "reshape(B, M, N, 3, self.num_heads, self.head_dim).permute(3, 0, 4, 1, 2, 5)",
        "reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)").replace(
        "x.permute(0, 2, 3, 1, 4).reshape(B, M, N, C)", "x.transpose(1, 2).reshape(B, N, C)")
    findings = _fused(SdpaPattern(), code)
    assert "q.dim() == k.dim() == 4" in findings[0].fused
    run = "m = Attention(32, 4)\nx = torch.randn(2, 6, 32, requires_grad=True)\nout = m(x)\nleaves = [x, m.qkv.weight]\n"
    _close(check_rewrite_runs(SdpaPattern(), code, run, findings))


# -- 2. one head indexed out by a loop variable ------------------------------------------------------------------------

_PER_HEAD = '''
import torch
import torch.nn as nn


class ChunkedAttention(nn.Module):
    def __init__(self, dim, heads, chunk=4):
        super().__init__()
        self.heads, self.hd, self.chunk = heads, dim // heads, chunk
        self.scaling = self.hd ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask=None):
        b, s, _ = x.shape
        query_states, key_states, value_states = self.qkv(x).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        parts = []
        for h in range(self.heads):
            q = query_states[:, h, :, :]
            k = key_states[:, h, :, :]
            v = value_states[:, h, :, :]
            out_parts = []
            for i in range(0, q.size(1), self.chunk):
                q_chunk = q[:, i:i + self.chunk, :]
                attn_chunk = torch.matmul(q_chunk, k.transpose(-2, -1))
                attn_chunk.mul_(self.scaling)
                if attention_mask is not None:
                    attn_chunk.add_(attention_mask.squeeze(1)[:, i:i + self.chunk, :])
                attn_chunk = torch.softmax(attn_chunk, dim=-1, dtype=torch.float32).to(q.dtype)
                out_chunk = torch.matmul(attn_chunk, v)
                out_parts.append(out_chunk)
            parts.append(torch.cat(out_parts, dim=1))
        return torch.stack(parts, dim=1).transpose(1, 2).reshape(b, s, -1)
'''
_PER_HEAD_RUN = ("m = ChunkedAttention(32, 4)\nx = torch.randn(2, 10, 32, requires_grad=True)\n"
                 "mask = torch.zeros(2, 1, 10, 10)\nmask[1, :, :, 7:] = float('-inf')\n"
                 "out = m(x, {mask})\nleaves = [x, m.qkv.weight]\n")


@pytest.mark.parametrize("mask", ["mask", "None"])
def test_heads_indexed_out_in_a_loop_fuse_as_one_head_calls(mask: str) -> None:
    # MiniMax-M2: read 4-D before, the fused branch's `q_chunk.dim() == 4` never held
    findings = _fused(AttentionPattern(), _PER_HEAD)
    assert "q_chunk.dim() == 3" in findings[0].fused and "q_chunk.dim() == 4" not in findings[0].fused
    _close(check_rewrite_runs(AttentionPattern(), _PER_HEAD, _PER_HEAD_RUN.format(mask=mask), findings))


def test_heads_indexed_out_with_the_probabilities_kept_stay_a_near_miss() -> None:
    # the per-head loop keeping every chunk's probabilities (no flag): the fused op does not produce them
    code = _PER_HEAD.replace("                out_parts.append(out_chunk)\n",
                             "                out_parts.append(out_chunk)\n                self.kept.append(attn_chunk)\n")
    assert "probabilities" in _near_miss(AttentionPattern(), code)


def test_a_head_index_that_is_a_tensor_is_not_read_three_d() -> None:
    # `query_states[:, idx, :, :]` with a tensor of head ids keeps the head axis: no 3-D reading
    code = _PER_HEAD.replace("for h in range(self.heads):", "for h in [torch.tensor([0, 1])]:")
    findings, _ = detect_all(AttentionPattern(), code)
    # (s51b: the run-time lift of 3-D operands, ``int(q_chunk.dim() == 3 and ...)``, is no static 3-D reading)
    assert all("q_chunk.dim() == 3" not in f.fused.replace("int(q_chunk.dim() == 3", "") for f in findings)


# -- 3. a sharding flag the program refuses to run with ----------------------------------------------------------------

_RUNNER = '''\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


class Runner:
    def __init__(self, cfg, model):
        self.cfg, self._model, self._wrapped = cfg, model, None
        self._optimizer = None

    @property
    def use_fsdp(self):
        return self.cfg.get("fsdp", False)

    @property
    def model(self):
        if self._wrapped is None:
            if self.use_fsdp:
                assert False, "FSDP is not supported yet"
            else:
                self._wrapped = DDP(self._model)
        return self._wrapped

    @property
    def optimizer(self):
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=1e-4)
        return self._optimizer

    def unwrap(self, model):
        if self.use_fsdp:
            return model
        return model.module
'''


def _optimizer_results(root: Path, code: str) -> tuple[list[dict], list[str]]:
    write_files(root, {"runner.py": code})
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    return cands, [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]


def test_a_sharding_flag_whose_arm_asserts_false_is_no_sharding(tmp_path: Path) -> None:
    cands, near = _optimizer_results(tmp_path / "refused", _RUNNER)
    assert len(cands) == 1 and not near, near


def test_a_sharding_flag_whose_arm_wraps_stays_a_near_miss(tmp_path: Path) -> None:
    # the twin: the flag's arm wraps the model in FSDP
    code = _RUNNER.replace('assert False, "FSDP is not supported yet"', "self._wrapped = FSDP(self._model)").replace(
        "from torch.nn.parallel import DistributedDataParallel as DDP",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP")
    cands, near = _optimizer_results(tmp_path / "wraps", code)
    assert not cands and any("FSDP/DeepSpeed/ZeRO" in r for r in near), near


def test_a_failing_flag_test_without_another_arm_is_not_the_decision(tmp_path: Path) -> None:
    # `if self.use_fsdp: assert False` with no else (a helper refusing, not the wrapping decision): still a sharding fact
    code = _RUNNER.replace('assert False, "FSDP is not supported yet"\n            else:\n                self._wrapped = DDP(self._model)',
                           'assert False, "FSDP is not supported yet"\n            self._wrapped = DDP(self._model)')
    cands, near = _optimizer_results(tmp_path / "bare", code)
    assert not cands and any("use_fsdp" in r for r in near), (cands, near)


# -- 4. a value operand gathered with the mask, then sliced -------------------------------------------------------------

_TSPULSE = '''\
import torch


def random_mask(fft_tensor, mask_ratio, odd):
    batch, seq_len, channels = fft_tensor.shape
    num_mask = int(seq_len * mask_ratio)
    batch_mask = torch.arange(batch, device=fft_tensor.device) % 2 == (1 if odd else 0)
    mask = torch.ones((batch, seq_len, channels), device=fft_tensor.device, dtype=torch.bool)
    random_indices = torch.rand(batch, seq_len, channels, device=fft_tensor.device).argsort(dim=1)
    mask[batch_mask] = mask[batch_mask].scatter(1, random_indices[batch_mask, :num_mask, :], False)
    return mask
'''


def _index_put_near_misses(root: Path, code: str) -> list[str]:
    write_files(root, {"masking.py": code})
    data = scan(root, patterns=[AffinityIndexPut()])
    assert not [c for c in data["candidates"] if c["pattern"] == "affinity_index_put"]
    return [m["reason"] for m in data["near_misses"] if m["pattern"] == "affinity_index_put"]


def test_an_operand_gathered_with_the_mask_and_sliced_is_not_called_ungathered(tmp_path: Path) -> None:
    (reason,) = _index_put_near_misses(tmp_path / "scatter", _TSPULSE)
    assert "not gathered with the mask" not in reason and "`mask[batch_mask].scatter(" in reason, reason


def test_an_elementwise_value_sliced_after_the_gather_names_the_slice(tmp_path: Path) -> None:
    code = _TSPULSE.replace("mask[batch_mask].scatter(1, random_indices[batch_mask, :num_mask, :], False)",
                            "mask[batch_mask] & (random_indices[batch_mask, :, :] >= num_mask)")
    (reason,) = _index_put_near_misses(tmp_path / "sliced", code)
    assert reason.startswith("`random_indices[batch_mask, :, :]` in the value takes the mask's rows"), reason


# -- 5. masks beside operands whose key length npufuse reads, and those it does not -------------------------------------

_FOLDED = '''
import math
import torch
from torch import nn


class WindowAttention(nn.Module):
    def __init__(self, d, n, w=2):
        super().__init__()
        self.n, self.hd, self.w = n, d // n, w
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, self.w, s // self.w, 3, self.n, self.hd).permute(3, 0, 4, 1, 2, 5)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        scores = scores.masked_fill(~keep, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)
'''
_MIXED = '''
import math
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n, self.hd = n, d // n
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.n, self.hd).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bqnd,bnkd->bnqk", q, k) / math.sqrt(self.hd)
        scores = scores.masked_fill(~keep[:, None, :, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.transpose(1, 2).reshape(b, s, -1)
'''


def test_a_query_row_mask_beside_five_d_windows_stays_a_near_miss() -> None:
    assert "a mask beside 5-D q/k/v is not folded" in _near_miss(AttentionPattern(), _FOLDED)


def test_mixed_layouts_read_the_query_length_without_copying_q() -> None:
    findings = _fused(AttentionPattern(), _MIXED)
    assert ".contiguous().shape" not in findings[0].fused and "_npufuse_mask.shape[2] != q.shape[1]" in findings[0].fused
    run = ("m = Attn(32, 4)\nx = torch.randn(2, 6, 32, requires_grad=True)\nkeep = torch.ones(2, 6, dtype=torch.bool)\n"
           "out = m(x, keep)\nleaves = [x, m.q.weight, m.kv.weight]\n")
    _close(check_rewrite_runs(AttentionPattern(), _MIXED, run, findings))


# -- 6. GQA as a 5-D grouped query; 5-D operands with a conditional causal triangle ------------------------------------

_GROUPED = '''
import torch
from torch import nn


class GroupedAttention(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.n_head_dim = head_dim

    def forward(self, q, k, v, is_causal: bool = True):
        batch_size, head_q, seq_len_q, head_dim = q.shape
        head_kv = k.shape[1]
        scale = self.n_head_dim ** -0.5
        n_groups = head_q // head_kv
        q_reshaped = q.reshape(batch_size, head_kv, n_groups, seq_len_q, head_dim)
        k_expanded = k.unsqueeze(2)
        v_expanded = v.unsqueeze(2)
        scores = torch.matmul(q_reshaped, k_expanded.transpose(-2, -1)) * scale
        seq_len_k = k.shape[2]
        if seq_len_q > 1 and is_causal:
            causal_mask = torch.tril(torch.ones(seq_len_q, seq_len_k, device=q.device, dtype=torch.bool))
            scores = scores.masked_fill(~causal_mask.unsqueeze(0).unsqueeze(0).unsqueeze(0), float("-inf"))
        attn_weights = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn_weights, v_expanded)
        return out.reshape(batch_size, head_q, seq_len_q, head_dim)
'''
_GROUPED_RUN = ("m = GroupedAttention(8)\nq = torch.randn(2, 6, {sq}, 8, requires_grad=True)\nk = torch.randn(2, 2, {skv}, 8, requires_grad=True)\n"
                "v = torch.randn(2, 2, {skv}, 8, requires_grad=True)\nout = m(q, k, v, {causal})\nleaves = [q, k, v]\n")


@pytest.mark.parametrize("sq,skv,causal", [(5, 5, "True"), (5, 5, "False"), (1, 7, "True"), (3, 7, "True")])
def test_gqa_as_a_five_d_grouped_query_fuses(sq: int, skv: int, causal: str) -> None:
    findings = _fused(AttentionPattern(), _GROUPED)
    assert "unflatten(0, q_reshaped.shape[:2])" in findings[0].fused
    _close(check_rewrite_runs(AttentionPattern(), _GROUPED, _GROUPED_RUN.format(sq=sq, skv=skv, causal=causal), findings))


def test_gqa_as_a_five_d_grouped_query_with_a_padding_mask_stays_a_near_miss() -> None:
    # a key-padding mask (not a triangle: it differs per batch row) would have to be folded like q: not done
    code = _GROUPED.replace("is_causal: bool = True):", "is_causal: bool = True, pad=None):").replace(
        "        attn_weights = torch.softmax(", "        if pad is not None:\n            scores = scores.masked_fill(pad[:, None, None, None, :], float(\"-inf\"))\n"
        "        attn_weights = torch.softmax(")
    assert "a mask beside 5-D q/k/v is not folded" in _near_miss(AttentionPattern(), code)


def test_a_key_group_axis_neither_one_nor_the_querys_runs_the_original() -> None:
    # the eager matmuls broadcast only equal or size-1 axes; the test keeps the fold to those (and shared leading axes)
    findings = _fused(AttentionPattern(), _GROUPED)
    assert "(k_expanded.shape[2] in (1, q_reshaped.shape[2]))" in findings[0].fused
    assert "(k_expanded.shape[:2] == q_reshaped.shape[:2] == v_expanded.shape[:2])" in findings[0].fused


# -- 7. tiled online-softmax loop nests --------------------------------------------------------------------------------

_TILED = '''
import math
import torch
from torch import nn


class FlashLoop(nn.Module):
    def __init__(self, dim, n_heads, block_size=3):
        super().__init__()
        self.n_heads, self.head_dim, self.block_size = n_heads, dim // n_heads, block_size
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x, mask=None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.qkv(x).view(bsz, seqlen, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scale = 1.0 / math.sqrt(self.head_dim)
        output = torch.zeros_like(xq)
        for i_start in range(0, seqlen, self.block_size):
            i_end = min(i_start + self.block_size, seqlen)
            q_block = xq[:, :, i_start:i_end, :]
            q_len = i_end - i_start
            m_i = torch.full((bsz, self.n_heads, q_len, 1), float("-inf"), device=x.device)
            l_i = torch.zeros((bsz, self.n_heads, q_len, 1), device=x.device)
            acc_i = torch.zeros((bsz, self.n_heads, q_len, self.head_dim), device=x.device)
            for j_start in range(0, seqlen, self.block_size):
                j_end = min(j_start + self.block_size, seqlen)
                if mask is not None and j_start >= i_end:
                    continue
                k_block = xk[:, :, j_start:j_end, :]
                v_block = xv[:, :, j_start:j_end, :]
                scores_ij = torch.matmul(q_block, k_block.transpose(2, 3)) * scale
                if mask is not None:
                    mask_ij = mask[:, :, i_start:i_end, j_start:j_end]
                    scores_ij = scores_ij + mask_ij
                m_ij = torch.max(scores_ij, dim=-1, keepdim=True).values
                m_new = torch.maximum(m_i, m_ij)
                alpha = torch.exp(m_i - m_new)
                p_ij = torch.exp(scores_ij - m_new)
                l_new = alpha * l_i + p_ij.sum(dim=-1, keepdim=True)
                acc_i = alpha * acc_i + torch.matmul(p_ij, v_block)
                m_i = m_new
                l_i = l_new
            output[:, :, i_start:i_end, :] = acc_i / l_i
        return output.transpose(1, 2).reshape(bsz, seqlen, -1)
'''
# another spelling: the tile ends unclamped, kᵀ as `.mT`, the row max by `amax`, exp as a method, the products with `@`
_TILED_B = (_TILED.replace("i_end = min(i_start + self.block_size, seqlen)", "i_end = i_start + self.block_size")
            .replace("torch.matmul(q_block, k_block.transpose(2, 3)) * scale", "scale * (q_block @ k_block.mT)")
            .replace("torch.max(scores_ij, dim=-1, keepdim=True).values", "scores_ij.amax(dim=-1, keepdim=True)")
            .replace("torch.exp(scores_ij - m_new)", "(scores_ij - m_new).exp()")
            .replace("alpha * acc_i + torch.matmul(p_ij, v_block)", "p_ij @ v_block + acc_i * alpha"))
_TILED_RUN = ("m = FlashLoop(32, 4)\nx = torch.randn(2, 9, 32, requires_grad=True)\n{mask}\nout = m(x, mask)\n"
              "leaves = [x, m.qkv.weight]\n")
_CAUSAL = "mask = torch.full((9, 9), float('-inf')).triu(1)[None, None]"
_CAUSAL_PADDED = "mask = torch.full((9, 9), float('-inf')).triu(1)[None, None].repeat(2, 1, 1, 1)\nmask[1, :, :, 7:] = float('-inf')"


@pytest.mark.parametrize("code", [_TILED, _TILED_B], ids=["elvin", "respelled"])
@pytest.mark.parametrize("mask", [_CAUSAL, "mask = None", _CAUSAL_PADDED], ids=["causal", "none", "causal_padded"])
def test_tiled_online_softmax_loops_fuse(code: str, mask: str) -> None:
    findings = _fused(AttentionPattern(), code)
    assert len(findings) == 1 and findings[0].variant.startswith("tiled_online_softmax")
    _close(check_rewrite_runs(AttentionPattern(), code, _TILED_RUN.format(mask=mask), findings))


def test_tiled_loop_with_a_mask_that_leaves_later_keys_runs_the_original() -> None:
    # a padding-only mask: the loop still skips the later key blocks (its own result), the fused call would attend them
    findings = _fused(AttentionPattern(), _TILED)
    _close(check_rewrite_runs(AttentionPattern(), _TILED, _TILED_RUN.format(mask="mask = torch.zeros(1, 1, 9, 9)"), findings),
           calls=False)


@pytest.mark.parametrize("old,new", [
    ("alpha * acc_i + torch.matmul(p_ij, v_block)", "acc_i + torch.matmul(p_ij, v_block)"),  # no rescale
    ("output[:, :, i_start:i_end, :] = acc_i / l_i", "output[:, :, i_start:i_end, :] = acc_i / (l_i + 1.0)"),  # another normaliser
    ("            output[:, :, i_start:i_end, :] = acc_i / l_i", "            if i_start == 0:\n                output[:, :, i_start:i_end, :] = acc_i / l_i"),
], ids=["no_rescale", "other_normaliser", "partial_blocks"])
def test_loops_that_are_not_softmax_attention_are_not_fused(old: str, new: str) -> None:
    code = _TILED.replace(old, new)
    assert old in _TILED
    findings, _ = detect_all(AttentionPattern(), code)
    assert not [f for f in findings if f.variant.startswith("tiled")]


@pytest.mark.parametrize("old,new,why", [
    ("if mask is not None and j_start >= i_end:", "if j_end <= i_start - 4:", "windowed / block-sparse"),
    ("if mask is not None and j_start >= i_end:", "if j_start >= i_end:", "block-causal attention"),
    ("        return output.transpose(1, 2).reshape(bsz, seqlen, -1)", "        return output.transpose(1, 2).reshape(bsz, seqlen, -1), m_i + l_i.log()",
     "read after it"),
], ids=["window_skip", "skip_without_mask", "lse_returned"])
def test_tiled_loops_npufuse_does_not_replace_are_near_misses(old: str, new: str, why: str) -> None:
    assert why in _near_miss(AttentionPattern(), _TILED.replace(old, new))
