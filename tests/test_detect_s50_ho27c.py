"""s50 (ho27c): the judged HO27c attention / sdpa classes, as invented spellings (no repository code).

1. probabilities returned by ``_attend`` whose only caller is a BASE class's ``forward`` (same file, or another file of
   the repository) reading them under ``if self.<flag>:``: fused under ``not self.<flag>`` (the original runs where the
   maps are asked for); a caller reading them unconditionally, or a subclass calling ``_attend``: near miss.
2a. a pair mask built as an einsum outer product of token masks (nothing summed): not "a matrix product other than the
   scores"; an einsum that sums an index still is.
2b. a banded causal mask from a helper with a conditional store: the diagonal is proved kept for every window (no more
   "can leave a query row without any key"); a guard admitting window 0 keeps the near miss (true there).
3. ``torch.where(mask.any(-1, keepdim=True), p, zeros_like(p))`` after the softmax: the zeroing moves onto the fused
   output; a row mask over keys (no keepdim) stays a near miss.
4. SDPA with a float position bias (ALiBi-like) as attn_mask, with / without is_causal: pse, q pre-scaled, scale 1.0
   (fp32 and bf16 under the emulator); a bias holding -inf: near miss saying so.
5. (found on the way) an operand rebound by a statement the fused branch runs before the call: near miss (the start code
   emitted a call reading the rebound, transposed q as BSND).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pattern_harness import check_rewrite_runs, detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.sdpa import SdpaPattern
from npufuse.scan.engine import scan_repo

# -- 1. maps read by a base-class caller under a flag --------------------------------------------------------------

_BASE = 'import torch\nfrom torch import nn\n\n\nclass AttnBase(nn.Module):\n    def __init__(self, width: int, heads: int, keep_maps: bool = False):\n        super().__init__()\n        self.width, self.heads = width, heads\n        self.keep_maps = keep_maps\n\n    def _attend(self, h, pad):\n        raise NotImplementedError\n\n    def forward(self, h, pad):\n        res, maps = self._attend(h, pad)\n        if self.keep_maps:\n            return res, maps.detach()\n        return (res,)\n'

_EAGER = 'import math\nimport torch\nfrom torch import nn\n\n\nclass EagerAttn(AttnBase):\n    def __init__(self, *a, **kw):\n        super().__init__(*a, **kw)\n        self.qkv = nn.Linear(self.width, 3 * self.width)\n        self.out = nn.Linear(self.width, self.width)\n\n    def _attend(self, h, pad):\n        B, T, C = h.shape\n        q, k, v = self.qkv(h).chunk(3, dim=-1)\n        q = q.view(B, T, self.heads, -1).transpose(1, 2)\n        k = k.view(B, T, self.heads, -1).transpose(1, 2)\n        v = v.view(B, T, self.heads, -1).transpose(1, 2)\n        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))\n        s = s.masked_fill(~pad[:, None, None, :], -1e9)\n        p = torch.softmax(s, dim=-1)\n        o = (p @ v).transpose(1, 2).reshape(B, T, C)\n        return self.out(o), p\n'

_FLAG_RUN = """
torch.manual_seed(0)
m = EagerAttn(32, 4)
shown = EagerAttn(32, 4, keep_maps=True)
shown.load_state_dict(m.state_dict())
h = torch.randn(2, 6, 32, requires_grad=True)
pad = torch.ones(2, 6, dtype=torch.bool)
pad[1, 4:] = False
out = [m(h, pad)[0], *shown(h, pad)]
leaves = [h, m.qkv.weight]
"""


def test_maps_read_by_base_class_under_flag_fuse_guarded() -> None:
    code = "import math\n" + _BASE + _EAGER.replace("import math\n", "")
    facts = _fused_and_runs(AttentionPattern(), code, _FLAG_RUN, "EagerAttn._attend")
    assert "(not self.keep_maps)" in facts["rewritten"]
    assert facts["all_calls"] == {"npu_fusion_attention": 1}  # the module asked for maps ran the original


def test_maps_read_by_base_class_in_another_file(tmp_path: Path) -> None:
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "__init__.py").write_text("")
    (tmp_path / "nets" / "core.py").write_text(_BASE)
    (tmp_path / "nets" / "eager.py").write_text(_EAGER.replace("from torch import nn\n", "from torch import nn\nfrom .core import AttnBase\n"))
    res = scan_repo(tmp_path, jobs=1, only=["attention"])
    assert [(c["file"], c["qualname"]) for c in res.candidates] == [("nets/eager.py", "EagerAttn._attend")], res.near_misses
    assert "not self.keep_maps" in res.candidates[0]["replacement"]


def test_maps_read_unconditionally_by_base_class_stay_near_miss() -> None:
    code = "import math\n" + _BASE.replace("        if self.keep_maps:\n            return res, maps.detach()\n", "        self.last = maps\n") + _EAGER
    _near_miss(AttentionPattern(), code, "the attention probabilities (`p`) are returned to the callers")


def test_maps_read_by_a_subclass_stay_near_miss() -> None:
    code = "import math\n" + _BASE + _EAGER + """

class Probe(EagerAttn):
    def peek(self, h, pad):
        out, maps = self._attend(h, pad)
        return maps
"""
    _near_miss(AttentionPattern(), code, "the attention probabilities (`p`) are returned to the callers")


# -- 2a. einsum outer-product masks ----------------------------------------------------------------------------------

_CROSS = "import math\nimport torch\nfrom torch import nn\n\n\nclass Cross(nn.Module):\n    def __init__(self, width: int, heads: int):\n        super().__init__()\n        self.heads = heads\n        self.q = nn.Linear(width, width)\n        self.kv = nn.Linear(width, 2 * width)\n\n    def forward(self, a, b, a_keep, b_keep):\n        B, S, C = a.shape\n        T = b.shape[1]\n        q = self.q(a).view(B, S, self.heads, -1).transpose(1, 2)\n        k, v = self.kv(b).chunk(2, dim=-1)\n        k = k.view(B, T, self.heads, -1).transpose(1, 2)\n        v = v.view(B, T, self.heads, -1).transpose(1, 2)\n        w = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))\n        pair = torch.einsum('bi,bj->bij', a_keep, b_keep)\n        w = w.masked_fill(pair.unsqueeze(1) == 0, -1e9)\n        w = torch.softmax(w, dim=-1)\n        return (w @ v).transpose(1, 2).reshape(B, S, C)\n"

_CROSS_RUN = """
torch.manual_seed(0)
m = Cross(32, 4)
a = torch.randn(2, 5, 32, requires_grad=True)
b = torch.randn(2, 7, 32, requires_grad=True)
ak = torch.ones(2, 5, dtype=torch.bool)
ak[1, 3:] = False
bk = torch.ones(2, 7, dtype=torch.bool)
bk[0, 4:] = False
out = m(a, b, ak, bk) * ak[..., None]  # padded query rows (no key) do not reach the loss, as in a padded batch
leaves = [a, b, m.q.weight]
"""


def test_einsum_outer_product_mask_fuses() -> None:
    _fused_and_runs(AttentionPattern(), _CROSS, _CROSS_RUN, "Cross.forward")


def test_einsum_that_sums_stays_a_matrix_product() -> None:
    code = _CROSS.replace("torch.einsum('bi,bj->bij', a_keep, b_keep)", "torch.einsum('bid,bjd->bij', a_keep, b_keep)")
    _near_miss(AttentionPattern(), code, "computed from a matrix product other than the scores")


# -- 2b. banded causal mask, diagonal proved -------------------------------------------------------------------------

_BANDED = 'import math\nfrom typing import Optional\n\nimport torch\nfrom torch import nn\n\n\ndef banded(n: int, device, span: Optional[int]) -> torch.Tensor:\n    row = torch.arange(n, device=device)[:, None]\n    col = torch.arange(n, device=device)[None, :]\n    blocked = col > row\n    if span is not None and span > 0:\n        blocked = blocked | ((row - col) >= span)\n    return blocked\n\n\nclass Local(nn.Module):\n    def __init__(self, width: int, heads: int, span: Optional[int] = None):\n        super().__init__()\n        self.heads, self.span = heads, span\n        self.qkv = nn.Linear(width, 3 * width)\n\n    def forward(self, h):\n        B, L, C = h.shape\n        q, k, v = self.qkv(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)\n        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])\n        s = s.masked_fill(banded(L, h.device, self.span), float("-inf"))\n        p = torch.softmax(s, dim=-1)\n        return torch.matmul(p, v).transpose(1, 2).reshape(B, L, C)\n'

_BANDED_RUN = """
torch.manual_seed(0)
mods = [Local(32, 4, span) for span in (None, 0, 1, 3)]
h = torch.randn(2, 7, 32, requires_grad=True)
out = [m(h) for m in mods]
leaves = [h, mods[2].qkv.weight]
"""


def test_banded_helper_with_conditional_store_fuses() -> None:
    _fused_and_runs(AttentionPattern(), _BANDED, _BANDED_RUN, "Local.forward")


def test_banded_helper_admitting_window_zero_keeps_reason() -> None:
    _near_miss(AttentionPattern(), _BANDED.replace("span > 0", "span >= 0"), "can leave a query row without any key")


def test_banded_helper_masking_the_diagonal_keeps_reason() -> None:
    _near_miss(AttentionPattern(), _BANDED.replace("blocked = col > row", "blocked = col >= row"), "without any key")


# -- 3. rows with no key zeroed through torch.where -------------------------------------------------------------------

_WHERE = 'import math\nimport torch\n\n\ndef guarded_attend(q, k, v, visible):\n    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])\n    visible = visible.bool()\n    has_key = visible.any(dim=-1, keepdim=True)\n    s = s.masked_fill(~visible, torch.finfo(s.dtype).min)\n    w = torch.softmax(s, dim=-1)\n    w = torch.where(has_key, w, torch.zeros_like(w))\n    return torch.matmul(w, v)\n'

_WHERE_RUN = """
torch.manual_seed(0)
q = torch.randn(2, 3, 5, 8, requires_grad=True)
k = torch.randn(2, 3, 6, 8, requires_grad=True)
v = torch.randn(2, 3, 6, 8, requires_grad=True)
vis = torch.ones(2, 1, 5, 6, dtype=torch.long)
vis[0, :, 2, :] = 0  # a query row without any visible key
vis[1, :, :, 4:] = 0
out = guarded_attend(q, k, v, vis)
leaves = [q, k, v]
"""


def test_where_zeroed_keyless_rows_fuse_exact() -> None:
    facts = _fused_and_runs(AttentionPattern(), _WHERE, _WHERE_RUN, "guarded_attend")
    assert ".masked_fill(~visible.bool().any(dim=-1, keepdim=True), 0)" in facts["rewritten"]


def test_where_over_keys_stays_near_miss() -> None:
    code = _WHERE.replace("visible.any(dim=-1, keepdim=True)", "visible.any(dim=-2, keepdim=True)")
    _near_miss(AttentionPattern(), code, "modified after softmax")


# -- 4. SDPA float position bias as pse -------------------------------------------------------------------------------

_ALIBI = 'import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n\nclass Slopes(nn.Module):\n    def __init__(self, heads: int):\n        super().__init__()\n        self.s = torch.tensor([2.0 ** (-(h + 1)) for h in range(heads)])[:, None, None]\n\n    def forward(self, n):\n        pos = torch.arange(n)\n        return self.s * (pos[None, :] - pos[:, None])\n\n\nclass LinearBiasAttention(nn.Module):\n    def __init__(self, width: int, heads: int, causal: bool = True):\n        super().__init__()\n        self.heads, self.causal = heads, causal\n        self.qkv = nn.Linear(width, 3 * width)\n        self.bias = Slopes(heads)\n        self.scale = (width // heads) ** -0.5\n\n    def forward(self, h):\n        B, L, C = h.shape\n        q, k, v = self.qkv(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)\n        bias = self.bias(L).unsqueeze(0).to(h.device)\n        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal, scale=self.scale)\n        return y.transpose(1, 2).reshape(B, L, C)\n'


def _alibi_run(dtype: str) -> str:
    return f"""
torch.manual_seed(0)
m = LinearBiasAttention(32, 4).to({dtype})
m2 = LinearBiasAttention(32, 4, causal=False).to({dtype})
m2.load_state_dict(m.state_dict())
h = torch.randn(2, 6, 32, dtype={dtype}, requires_grad=True)
out = [m(h), m2(h)]
leaves = [h, m.qkv.weight]
"""


def test_sdpa_position_bias_as_pse_fp32() -> None:
    facts = _fused_and_runs(SdpaPattern(), _ALIBI, _alibi_run("torch.float32"), "LinearBiasAttention.forward")
    assert facts["all_calls"] == {"npu_fusion_attention": 2} and "pse=_npufuse_pse" in facts["rewritten"]
    assert "scale=1.0" in facts["rewritten"]


def test_sdpa_position_bias_as_pse_bf16() -> None:
    _fused_and_runs(SdpaPattern(), _ALIBI, _alibi_run("torch.bfloat16"), "LinearBiasAttention.forward", tol=0.999)


def test_sdpa_bias_holding_minus_inf_says_so() -> None:
    code = _ALIBI.replace("        y = F.scaled_dot_product_attention(",
                          "        bias.masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), float('-inf'))\n"
                          "        y = F.scaled_dot_product_attention(")
    _near_miss(SdpaPattern(), code, "does not split an infinite part out of a bias")


# -- 5. an operand rebound before the call ---------------------------------------------------------------------------

_REBOUND = 'import math\nimport torch\nfrom torch import nn\n\n\nclass WithBias(nn.Module):\n    def __init__(self, width: int, heads: int):\n        super().__init__()\n        self.heads, self.dh = heads, width // heads\n        self.qkv = nn.Linear(width, 3 * width)\n        self.table = nn.Parameter(torch.zeros(9, self.dh))\n\n    def _bias(self, q):\n        L = q.shape[2]\n        off = torch.arange(L)[None, :] - torch.arange(L)[:, None]\n        return torch.matmul(q, self.table[(off.clamp(-4, 4) + 4)].transpose(-1, -2)).diagonal(dim1=-3, dim2=-2).movedim(-1, -2)\n\n    def forward(self, h):\n        B, L, C = h.shape\n        q, k, v = self.qkv(h).view(B, L, 3, self.heads, self.dh).unbind(2)\n        q = q.transpose(1, 2)\n        k = k.transpose(1, 2)\n        v = v.transpose(1, 2)\n        s = torch.matmul(q, k.transpose(-2, -1))\n        b = self._bias(q)\n        s = (s + b) / math.sqrt(self.dh)\n        p = torch.softmax(s, dim=-1)\n        return torch.matmul(p, v).transpose(1, 2).reshape(B, L, C)\n'


def test_operand_rebound_by_a_statement_run_before_the_call_is_near_miss() -> None:
    _near_miss(AttentionPattern(), _REBOUND, "`q` is rebound at line")


# -- 6. fused_optimizer: a grad-None test tied to the optimizer it concerns; DDP bucket views guarded ------------------

_FACTORY = """import torch


def make_opt(params, lr):
    return torch.optim.AdamW(params, lr=lr)
"""

_TRAINER = """import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kit.opt import make_opt


def probe(net):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 4)).sum().backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    opt.step()
    return missing


def main(check=False, ddp=False):
    net = nn.Linear(4, 4)
    if check:
        return probe(net)
    if ddp:
        net = DDP(net, gradient_as_bucket_view=True)
    opt = make_opt(net.parameters(), 1e-3)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
"""


def _opt_repo(tmp_path: Path, trainer: str) -> Any:
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "__init__.py").write_text("")
    (tmp_path / "kit" / "opt.py").write_text(_FACTORY)
    (tmp_path / "train.py").write_text(trainer)
    return scan_repo(tmp_path, jobs=1, only=["fused_optimizer"])


def test_grad_test_of_a_function_with_its_own_optimizer_is_not_this_ones(tmp_path: Path) -> None:
    res = _opt_repo(tmp_path, _TRAINER)
    got = [c for c in res.candidates if c["file"] == "kit/opt.py"]
    assert len(got) == 1, res.near_misses
    # the conditional DDP bucket-view wrap: the fused optimizer only where no process group exists
    assert 'distributed.is_initialized()' in got[0]["replacement"]


def test_grad_test_beside_the_factory_call_still_refuses(tmp_path: Path) -> None:
    trainer = _TRAINER.replace("    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n", "    opt = make_opt(net.parameters(), 1e-3)\n")
    res = _opt_repo(tmp_path, trainer)
    assert not [c for c in res.candidates if c["file"] == "kit/opt.py"]
    assert any("grad is None" in m["reason"] or "grad is not None" in m["reason"] for m in res.near_misses
               if m["file"] == "kit/opt.py"), res.near_misses
