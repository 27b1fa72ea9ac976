"""s41 (wrong41): the two precision classes of the s40 blind judge still fused on s40's final code, with invented
reproducers.

1. Attention whose mask a helper builds (a method ``self._band(n, ...)``, a module-level function, a nested builder
   closure, a mask cached on ``self``): the helper is followed, the call's arguments bound to its parameters, and the
   construction evaluated as :mod:`npufuse.patterns._mask_rows` does for a mask built in view.
2. fused_optimizer over a model nothing in the repository tells completely: a model class holding a module handed to
   its constructor (``self.bert = bert``), a trainer never instantiated in the repository, a training function no
   file calls. The holder's slot is resolved from the construction or the annotation; where nothing tells the model,
   any module of the repository that calls an expert only when the step's data reaches it refuses the fused
   optimizer."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from scratch_repo import write_files
from test_detect_s39_optim_data_skip import _GUARDED, _MOE, _UNGUARDED, _optim
from test_detect_s40_wrong_classes import _TRAINER

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import detect_all


def _without_value_rows(text: str) -> str:
    """``text`` without s49's row half of the value checks (``(m == 0).any(-1).all()`` of an additive mask, ``(m == 1)``
    of a 0 / 1 one, in the same host sync as the values): what is left is _mask_rows' own row check, if any."""
    return text.replace(" == 0).any(-1).all()", " == 0)").replace(" == 1).any(-1).all()", " == 1)")


# -- 1. masks a helper builds ---------------------------------------------------------------------------------------------

# a blockwise local attention: the helper method builds an additive window mask in a nested builder, cached per size
_BLOCK_LOCAL = '''
import torch
import torch.nn.functional as F
from torch import nn


class BlockLocal(nn.Module):
    def __init__(self, dim=32, heads=4, window=3, block=4):
        super().__init__()
        self.heads, self.hd, self.window, self.block = heads, dim // heads, window, block
        self.qkv = nn.Linear(dim, 3 * dim)
        self._cache = {}

    def _window_mask(self, q_len, k_len, offset, device):
        def build():
            qi = offset + torch.arange(q_len, device=device)
            ki = torch.arange(k_len, device=device)
            gap = qi[:, None] - ki[None, :]
            ok = (gap > 0) & (gap <= self.window)
            return torch.full((q_len, k_len), float("-inf"), device=device).masked_fill(ok, 0.0)

        key = (q_len, k_len, offset)
        mask = self._cache.get(key)
        if mask is None:
            mask = build()
            self._cache[key] = mask
        return mask

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        out = torch.empty_like(q)
        for s in range(0, n, self.block):
            e = min(s + self.block, n)
            ks = max(0, s - self.window)
            mask = self._window_mask(e - s, e - ks, s - ks, x.device)
            out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, c)
'''

_HELPER_FN = '''
import torch
import torch.nn.functional as F
from torch import nn


def make_mask(n, device=None):
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


class Causal(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        keep = make_mask(n, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, c)
'''


def _sdpa(code: str) -> tuple[list, list]:
    return detect_all(SdpaPattern(), code)


def _guard(fused: str) -> str:
    """The run-time condition the fused branch runs under."""
    return next((ln for ln in fused.splitlines() if ln.startswith("if ")), "")


def test_a_helper_methods_cached_window_mask_runs_fused_only_where_every_row_keeps_a_key() -> None:
    # the first block's first query has no key before it (`gap > 0`): that block runs the original
    (f,), misses = _sdpa(_BLOCK_LOCAL)
    assert ".any(-1).all()" in _guard(f.fused), f.fused
    assert any("a query row can keep no key" in r.detail for r in f.risks)
    assert not misses


def test_a_helper_methods_cached_causal_mask_is_unchanged() -> None:
    # Fuse twin: `gap >= 0` without an offset keeps key 0 in every row at every size, on every path the helper returns
    # (the cache holds what the builder returned). With the offset and the window bound (`(gap >= 0) & (gap <= w)`) the
    # sizes npufuse samples independently can empty a row (offset 8, window 1, one key): the run-time check decides
    code = _BLOCK_LOCAL.replace("qi = offset + torch.arange", "qi = torch.arange").replace(
        "ok = (gap > 0) & (gap <= self.window)", "ok = gap >= 0")
    (f,), misses = _sdpa(code)
    assert ".any(-1).all()" not in _without_value_rows(f.fused), f.fused
    assert not any("a query row can keep no key" in r.detail for r in f.risks)


def test_a_helper_method_that_cannot_be_evaluated_is_guarded() -> None:
    # a size the evaluation does not read (`int(...)`): the helper builds its mask from index arithmetic, so the
    # run-time row check decides
    code = _BLOCK_LOCAL.replace("ok = (gap >= 0)", "ok = (gap > 0)").replace("gap <= self.window", "gap <= int(self.window)")
    (f,), _misses = _sdpa(code)
    assert ".any(-1).all()" in _guard(f.fused), f.fused


def test_a_module_function_mask_with_the_diagonal_is_unchanged() -> None:
    (f,), misses = _sdpa(_HELPER_FN)
    assert ".any(-1).all()" not in _without_value_rows(f.fused) and not misses, f.fused


def test_keep_a_module_function_strict_causal_mask() -> None:
    code = _HELPER_FN.replace(".tril()", ".tril(diagonal=-1)")
    found, misses = _sdpa(code)
    assert not found
    assert any("leaves query row 0 without any key at every size" in m.reason for m in misses), [m.reason for m in misses]


def test_keep_a_helper_whose_constant_argument_excludes_the_query() -> None:
    # the call binds `include_self=False`: the helper's band then drops the diagonal (row 0 empty at every size)
    code = _HELPER_FN.replace(
        "def make_mask(n, device=None):\n    return torch.ones(n, n, dtype=torch.bool, device=device).tril()",
        "def make_mask(n, device=None, include_self=True):\n    i = torch.arange(n, device=device)\n"
        "    if include_self:\n        return i[None, :] <= i[:, None]\n    return i[None, :] < i[:, None]").replace(
        "make_mask(n, x.device)", "make_mask(n, x.device, include_self=False)")
    found, misses = _sdpa(code)
    assert not found and any("leaves query row 0" in m.reason for m in misses), [m.reason for m in misses]
    # Fuse twin: the default (`include_self=True`) takes the path that keeps the diagonal: unchanged
    (f,), _ = _sdpa(code.replace("make_mask(n, x.device, include_self=False)", "make_mask(n, x.device)"))
    assert ".any(-1).all()" not in _without_value_rows(f.fused), f.fused


def test_keep_an_imported_helpers_strict_causal_mask(tmp_path: Path) -> None:
    model = _HELPER_FN.replace("\n\ndef make_mask(n, device=None):\n    return torch.ones(n, n, dtype=torch.bool, device=device).tril()\n",
                               "\nfrom masks import make_mask\n")
    write_files(tmp_path, {"model.py": model, "masks.py": "import torch\n\n\ndef make_mask(n, device=None):\n"
                                                          "    return torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)\n"})
    data = scan(tmp_path, patterns=[SdpaPattern()])
    assert not [c for c in data["candidates"] if c["pattern"] == "sdpa"]
    assert any("leaves query row 0" in m["reason"] for m in data["near_misses"] if m["pattern"] == "sdpa"), data["near_misses"]


_EAGER = '''
import torch
from torch import nn


class Eager(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def _past_only(self, n, device):
        i = torch.arange(n, device=device)
        return i[None, :] < i[:, None]

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / self.hd ** 0.5
        scores = scores.masked_fill(~self._past_only(n, x.device), float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, c)
'''


def test_keep_an_eager_attention_whose_helper_leaves_the_first_row_empty() -> None:
    found, misses = detect_all(AttentionPattern(), _EAGER)
    assert not found and any("leaves query row 0" in m.reason for m in misses), [m.reason for m in misses]


def test_an_eager_attention_whose_helper_keeps_the_diagonal_is_unchanged() -> None:
    (f,), _ = detect_all(AttentionPattern(), _EAGER.replace("i[None, :] < i[:, None]", "i[None, :] <= i[:, None]"))
    assert ".any(-1).all()" not in _without_value_rows(f.fused) and ".all(-1).any()" not in f.fused, f.fused

# -- 2. a model nothing in the repository tells completely --------------------------------------------------------------

_HOLDER = '''\
import torch.nn as nn
from pkg.models.moe import Net


class PretrainModel(nn.Module):
    def __init__(self, backbone: Net, dim=8):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.backbone(x))
'''

# s40's trainer, its model a holder built around the backbone it is handed
_HOLDER_TRAINER = _TRAINER.replace("import torch\n", "import torch\nfrom pkg.models.holder import PretrainModel\n", 1).replace(
    "    def __init__(self, model, lr=1e-3):\n        self.model = model\n",
    "    def __init__(self, backbone, lr=1e-3):\n        self.model = PretrainModel(backbone).to(\"cpu\")\n")


def _repo(root: Path, body: str, files: dict[str, str]) -> tuple[list[dict], list[str]]:
    write_files(root, {"pkg/__init__.py": "", "pkg/models/__init__.py": "", "pkg/engine/__init__.py": "",
                       "pkg/models/moe.py": _MOE.format(body=body), **files})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "pkg/engine/trainer.py")


def test_keep_a_holder_annotated_with_an_moe_backbone(tmp_path: Path) -> None:
    # the trainer wraps whatever backbone it is handed; the holder's annotation names the MoE
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": _HOLDER, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert not cands and len(near) == 1, near
    assert near[0].startswith("the model the optimizer takes calls a trainable submodule only when a test on the step's data holds")
    assert "`Router` (pkg/models/moe.py:" in near[0]


def test_a_holder_annotated_with_a_dense_backbone_is_fused(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/models/holder.py": _HOLDER, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert len(cands) == 1 and not near, near


def test_keep_a_holder_whose_unannotated_slot_the_trainer_code_reaches_an_moe_for(tmp_path: Path) -> None:
    # no annotation, the backbone a parameter: the slot is not resolved; the trainer's imports reach the MoE
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert not cands and len(near) == 1, near
    assert "its model's class `PretrainModel` holds a module handed to its constructor (`self.backbone = backbone` at " \
           "pkg/models/holder.py:8), whose class npufuse does not resolve" in near[0], near


def test_a_holder_built_around_a_dense_module_in_place_is_fused(tmp_path: Path) -> None:
    # `PretrainModel(Net())`: the construction tells the slot (the annotation-free holder, a dense Net)
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    trainer = _HOLDER_TRAINER.replace("def __init__(self, backbone, lr=1e-3):", "def __init__(self, lr=1e-3):").replace(
        "PretrainModel(backbone)", "PretrainModel(Net())").replace("from pkg.models.holder", "from pkg.models.moe import Net\nfrom pkg.models.holder")
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": trainer})
    assert len(cands) == 1 and not near, near


def test_a_holder_built_around_an_moe_in_place_is_a_near_miss(tmp_path: Path) -> None:
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    trainer = _HOLDER_TRAINER.replace("def __init__(self, backbone, lr=1e-3):", "def __init__(self, lr=1e-3):").replace(
        "PretrainModel(backbone)", "PretrainModel(Net())").replace("from pkg.models.holder", "from pkg.models.moe import Net\nfrom pkg.models.holder")
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": trainer})
    assert not cands and len(near) == 1 and near[0].startswith("the model the optimizer takes"), near




def test_keep_a_trainer_never_instantiated_in_a_repository_with_an_moe(tmp_path: Path) -> None:
    # the trainer imports no model and nothing instantiates it: the user's script hands it a model of the repository
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/engine/trainer.py": _TRAINER})
    assert not cands and len(near) == 1, near
    assert near[0].startswith("a model class of the repository (the optimizer's model `self.model` is a constructor argument "
                              "and no code of the repository instantiates the trainer) calls a trainable submodule only when"), near


def test_a_trainer_never_instantiated_in_a_dense_repository_is_fused(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/engine/trainer.py": _TRAINER})
    assert len(cands) == 1 and not near, near


_TRAIN_FUNCTION = '''\
import torch


def train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x in batches:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
'''


def test_a_training_function_no_file_calls(tmp_path: Path) -> None:
    function = _TRAIN_FUNCTION
    cands, near = _repo(tmp_path / "moe", _GUARDED, {"pkg/engine/trainer.py": function})
    assert not cands and len(near) == 1 and "is a parameter of `train`, which no file of the repository calls" in near[0], near
    cands, near = _repo(tmp_path / "dense", _UNGUARDED, {"pkg/engine/trainer.py": function})
    assert len(cands) == 1 and not near, near


def test_a_training_function_called_from_a_file_npufuse_cannot_parse_is_not_untold(tmp_path: Path) -> None:
    # the caller is there (a script with a syntax error for the scanning Python): the model is the caller's, not any
    # module of the repository; the old reading (the trainer's reachable code, which reaches no MoE) holds
    function = _TRAIN_FUNCTION
    script = "from pkg.engine.trainer import train\n\ntrain(make_dense_model(), [])\nprint(f'{\n"
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/engine/trainer.py": function, "scripts/run.py": script})
    assert len(cands) == 1 and not near, near


def test_keep_a_builder_nested_in_the_attention_function() -> None:
    # `def past():` inside forward reads forward's `n` (a closure): strict past only, row 0 empty at every size
    code = _HELPER_FN.replace("        keep = make_mask(n, x.device)\n",
                              "        def past():\n            i = torch.arange(n, device=x.device)\n"
                              "            return i[None, :] < i[:, None]\n\n        keep = past()\n")
    found, misses = _sdpa(code)
    assert not found and any("leaves query row 0" in m.reason for m in misses), [m.reason for m in misses]
    (f,), _ = _sdpa(code.replace("i[None, :] < i[:, None]", "i[None, :] <= i[:, None]"))
    assert ".any(-1).all()" not in _without_value_rows(f.fused), f.fused


def test_keep_a_bottom_right_causal_helper_mask_a_check_would_call_twice() -> None:
    # `ones(i, j).triu(j - i + 1)` masks every key of the first rows where the queries outnumber the keys (i > j);
    # the eager form renders the helper call in the check and again in the fused branch: a near miss saying both
    code = next(e.code for e in AttentionPattern.FUSE if e.name == "conditional_masks_module_call_bound_once").replace(
        ".triu(1)", ".triu(j - i + 1)")
    found, misses = detect_all(AttentionPattern(), code)
    assert not found
    assert any("its construction can leave a query row without any key" in m.reason
               and "would call `self.get_mask(q_len, k_len, device)` a second time" in m.reason for m in misses), misses


_CACHE_CAUSAL = '''
import torch
import torch.nn.functional as F
from torch import nn


def cache_causal(*, q_len, k_len, device=None):
    if q_len <= 0 or k_len <= 0:
        raise ValueError("lengths must be positive")
    if k_len < q_len:
        raise ValueError("the cache holds at least the queries")
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


class Cached(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, past_k, past_v):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        keep = cache_causal(q_len=n, k_len=k.shape[2], device=x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, c)
'''


def test_a_helper_raising_on_the_sizes_that_would_empty_rows_is_unchanged() -> None:
    # bottom-right causal empties the first rows only where the queries outnumber the keys, which the helper refuses
    (f,), misses = _sdpa(_CACHE_CAUSAL)
    assert ".any(-1).all()" not in _without_value_rows(f.fused) and not misses, f.fused


def test_the_same_helper_without_its_size_check_runs_fused_only_where_every_row_keeps_a_key() -> None:
    code = _CACHE_CAUSAL.replace('    if k_len < q_len:\n        raise ValueError("the cache holds at least the queries")\n', "")
    (f,), _ = _sdpa(code)
    assert ".any(-1).all()" in _guard(f.fused), f.fused
