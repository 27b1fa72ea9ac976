"""s40 review (helper ``review40``): defects found reading the session's merged change, one test each (each fails
on the merged main 59b6975 and passes with the fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import make_repo, scan
from test_detect_s40_config_resolver import _NET
from npufuse.scan import engine


def _scanned(tmp_path: Path, code: str, pattern: object, gates: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    monkeypatch.setattr(engine, "SCOPE_GATES", gates)
    root = make_repo(tmp_path / ("gated" if gates else "open"), {"m.py": code})
    res = scan(root, patterns=[pattern])
    return [(f["line"], f["qualname"]) for f in res["candidates"]]


def test_library_rope_construction_in_a_scope_without_a_product_passes_the_star_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rope's SCOPE_WORDS was ("*",): torchtune's RotaryPositionalEmbeddings built in an __init__ that never multiplies
    # (attn40's construction site) was skipped by the scan's gate, found only with the gates off
    from npufuse.patterns.rope import RopePattern, _S40_TORCHTUNE_ROPE

    code = _S40_TORCHTUNE_ROPE.replace("self.qk = nn.Linear(d, 2 * d)", "self.qk = nn.Linear(d, d + d)")
    assert "*" not in code.split("def forward")[0]
    gated = _scanned(tmp_path, code, RopePattern(), True, monkeypatch)
    assert gated == _scanned(tmp_path, code, RopePattern(), False, monkeypatch) == [(12, "Attention.__init__")]


_PARTIAL_ATTRIBUTE = "from functools import partial\n" + _NET + '''

class Trainer:
    def __init__(self, model, lr=1e-2):
        self.model = model
        self.opt_fn = partial(torch.optim.Adam, betas=(0.9, 0.99))
        self.lr = lr

    def build(self):
        self.opt = self.opt_fn(self.model.parameters(), lr=self.lr)
        return self.opt
'''


def test_optimizer_partial_held_by_an_attribute_and_called_in_another_method_passes_the_scope_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # config40's partial through ``self.`` attribute: the calling method names no optimizer class, so
    # fused_optimizer's SCOPE_WORDS skipped it (found only with the gates off)
    import torch

    from npufuse import emulate
    from npufuse.patterns.fused_optimizer import FusedOptimizer
    from npufuse.rewrite.codegen import splice
    from pattern_harness import detect_all

    gated = _scanned(tmp_path, _PARTIAL_ATTRIBUTE, FusedOptimizer(), True, monkeypatch)
    assert gated == _scanned(tmp_path, _PARTIAL_ATTRIBUTE, FusedOptimizer(), False, monkeypatch) == [(23, "Trainer.build")]
    findings, _ = detect_all(FusedOptimizer(), _PARTIAL_ATTRIBUTE)
    trained = []
    for code in (_PARTIAL_ATTRIBUTE, splice(_PARTIAL_ATTRIBUTE, findings)):
        ns: dict = {}
        with emulate.install():
            exec(compile(code, "<train>", "exec"), ns)
            torch.manual_seed(0)
            model = ns["Net"]()
            opt = ns["Trainer"](model).build()
            gen = torch.Generator().manual_seed(3)
            x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
            for _ in range(3):
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            trained.append(([p.detach().clone() for p in model.parameters()], type(opt).__name__))
    assert trained[1][1] == "NpuFusedAdam", trained[1][1]
    for a, b in zip(trained[0][0], trained[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


_SPLAT = '''import torch
import torch.nn.functional as F


def attention(q, k, v, mask):
    attn_kwargs = {}
    %s
    return F.scaled_dot_product_attention(q, k, v, **attn_kwargs)
'''


@pytest.mark.parametrize("fill", ["add_mask(attn_kwargs, mask)", "extra = attn_kwargs\n    extra['attn_mask'] = mask"])
def test_sdpa_splat_dict_handed_to_a_helper_or_aliased_is_a_near_miss(fill: str) -> None:
    # audit40b reads a ``**`` splat's keys from its literal and ``d[k] = ..`` / ``d.update(k=..)``: a dict handed to a
    # helper (which may add attn_mask / is_causal) or written through an alias was fused, the mask dropped
    from npufuse.patterns.sdpa import SdpaPattern
    from pattern_harness import detect_all

    findings, misses = detect_all(SdpaPattern(), _SPLAT % fill)
    assert findings == [] and ["`**attn_kwargs` are not visible here" in m.reason for m in misses] == [True], (findings, misses)


def test_sdpa_splat_read_by_a_builtin_stays_a_candidate() -> None:
    from npufuse.patterns.sdpa import SdpaPattern
    from pattern_harness import detect_all

    findings, _ = detect_all(SdpaPattern(), _SPLAT % "print(len(attn_kwargs))")
    assert len(findings) == 1


# -- audit40's D1 (a repo switch off on the site's path): the negative-name switches and a site that is the whole ``if``

_NEGATIVE_SWITCH = '''
class Attention:
    def __init__(self, config):
        self.disable_fused_attn = config.disable_fused_attn
        self.use_ft_flash_attn = config.use_ft_flash_attn

    def forward(self, x):
        if self.disable_fused_attn:
            y = eager(x)
        if not self.disable_fused_attn:
            z = eager(x)
        if self.use_ft_flash_attn:
            w = flash(x)
        else:
            w = eager(x)
        return y, z, w
'''


@pytest.mark.parametrize("name, line, dead", [
    ("disable_fused_attn", 9, True),  # reused as ``not self.disable_fused_attn``: false in ``if self.disable_fused_attn:``
    ("disable_fused_attn", 11, False),  # ... true in ``if not self.disable_fused_attn:`` (was declined)
    ("use_ft_flash_attn", 12, False),  # a site spanning the whole ``if`` (starts at its line) runs either arm (was declined)
    ("use_ft_flash_attn", 15, True),
])
def test_switch_off_on_the_sites_path_reads_negative_names_and_whole_ifs(name: str, line: int, dead: bool) -> None:
    from npufuse.scan import repo_search
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("m.py", _NEGATIVE_SWITCH)
    scope = next(s for s in module.scopes if s.qualname.endswith("forward"))
    sw = {"name": name, "kind": "config_field", "file": "m.py", "line": 1}
    _switch, reused, notes = repo_search.choose_switch("attention", repo_search.site_context(module, scope, line), [sw], "auto", None)
    assert (reused is None and any("could never run" in n for n in notes)) if dead else reused is sw, (line, notes)
