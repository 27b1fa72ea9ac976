"""s38 opt38 (fused_optimizer): an optimizer object that travels through the repository (returned by a builder
of one file, bound by a script of another, handed to a training loop of a third, or handed to a method of an object
the site built) to code that calls ``zero_grad(set_to_none=True)`` (or a flag) on it.

Found as a wrong candidate on blind data (HO14a, vats-multimodal-lm): ``setup_training_components`` builds
``AdamW(...)`` and returns it with the scheduler and the scaler; ``scripts/.../train.py`` hands it to
``train(model, loader, optimizer, ...)`` of ``training/.../loops/training_loop.py``, which calls
``optimizer.zero_grad(set_to_none=True)``. torch_npu's fused optimizers raise ValueError on set_to_none=True
(spec §10). A bare ``optimizer.zero_grad()`` is the optimizer's own default (False on the fused classes): a candidate.

The spellings below were written for this test (none is the vats code)."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import _NET, FusedOptimizer
from scratch_repo import write_files

_SETUP = '''\
import torch


def make_components(net, lr=1e-3):
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = None
    return opt, sched, scaler
'''

_LOOPS = '''\
import torch.nn.functional as F


def fit_loop(net, batches, optim, sched, {free}):
    optim.zero_grad({call})
    for x, y in batches:
        F.mse_loss(net(x), y).backward()
        optim.step()
        sched.step()
        optim.zero_grad({call})
'''

_RUN = '''\
import torch
from model import Net
from pkg.setup import make_components
from pkg.loops import fit_loop


def main():
    net = Net()
    optimizer, scheduler, scaler = make_components(net)
    batches = [(torch.randn(6, 8), torch.randn(6, 4))]
    fit_loop(net, batches, optimizer, scheduler, {free})


if __name__ == "__main__":
    main()
'''


def _repo(root: Path, call: str, free: str = "free=True") -> None:
    write_files(root, {"model.py": _NET, "pkg/__init__.py": "", "pkg/setup.py": _SETUP,
                       "pkg/loops.py": _LOOPS.format(call=call, free=free), "run.py": _RUN.format(free=free.split("=")[0] + "=True")})


def _optim(data: dict, file: str) -> tuple[list[dict], list[str]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file]
    return cands, near


def test_returned_optimizer_handed_to_a_loop_of_a_third_file_that_frees_it_is_refused(tmp_path: Path) -> None:
    _repo(tmp_path, "set_to_none=True")
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "pkg/setup.py")
    assert cands == [], [c["replacement"] for c in cands]
    assert len(near) == 1, near
    # every hop named, the optimizer's own name at its tuple position (not the scheduler's or the scaler's)
    assert "`make_components` is used at run.py:9" in near[0], near
    assert "`fit_loop` (run.py:11, defined at pkg/loops.py:4) takes it as `optim`" in near[0], near
    assert "`optim.zero_grad(set_to_none=True)` (pkg/loops.py:5)" in near[0], near
    assert "raise ValueError on zero_grad(set_to_none=True)" in near[0] and "--optimizer-zero-grad-in-place" in near[0]


def test_a_flag_handed_down_is_refused_and_the_option_zeroes_in_place(tmp_path: Path) -> None:
    _repo(tmp_path, "set_to_none=free")
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "pkg/setup.py")
    assert cands == [] and near and "`optim.zero_grad(set_to_none=free)` (pkg/loops.py:5)" in near[0], near
    # with the option, the fused branch binds the optimizer's zero_grad to zero in place (the object is the same
    # wherever it goes), with the risk stated
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()], optimizer_zero_grad_in_place=True), "pkg/setup.py")
    assert len(cands) == 1 and not near, near
    assert "opt.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))(opt.zero_grad)" \
        in cands[0]["replacement"], cands[0]["replacement"]
    assert any("zeroes those grads in place" in r["detail"] for r in cands[0]["risks"])


def test_keep_a_loop_zeroing_with_the_optimizers_own_default_stays_a_candidate(tmp_path: Path) -> None:
    # near miss of the class: the same hand-off, but `optim.zero_grad()` (the fused class's default is
    # set_to_none=False) or an explicit set_to_none=False frees nothing
    for call in ("", "set_to_none=False"):
        root = tmp_path / (call or "bare")
        _repo(root, call)
        cands, near = _optim(scan(root, patterns=[FusedOptimizer()]), "pkg/setup.py")
        assert len(cands) == 1 and not near, (call, near)


_RUNNER = '''\
import torch.nn.functional as F


class Runner:
    def __init__(self, net):
        self.net = net

    def fit(self, batches, o):
        for x, y in batches:
            F.mse_loss(self.net(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=True)


class GentleRunner:
    def __init__(self, net):
        self.net = net

    def fit(self, batches, o):
        for x, y in batches:
            F.mse_loss(self.net(x), y).backward()
            o.step()
            o.zero_grad()
'''

_SITE = '''\
import torch
from model import Net
from pkg.runner import {cls}


def train(batches):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    runner = {cls}(net)
    runner.fit(batches, opt)
'''


def test_site_handing_its_optimizer_to_a_method_of_an_object_it_built(tmp_path: Path) -> None:
    for cls, freed in (("Runner", True), ("GentleRunner", False)):
        root = tmp_path / cls
        write_files(root, {"model.py": _NET, "pkg/__init__.py": "", "pkg/runner.py": _RUNNER, "train.py": _SITE.format(cls=cls)})
        cands, near = _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")
        if freed:
            assert cands == [] and len(near) == 1, (cls, near)
            assert "`runner.fit` (train.py:10, defined at pkg/runner.py:8) takes it as `o`" in near[0], near
            assert "`o.zero_grad(set_to_none=True)` (pkg/runner.py:12)" in near[0], near
        else:
            assert len(cands) == 1 and not near, (cls, near)


_OTHER_SETUP = '''\
import torch


def make_components(net, lr=1e-3):
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    return opt, None, None
'''


def test_keep_a_builder_of_the_same_name_in_a_module_of_the_same_stem_is_not_driven_by_that_script(tmp_path: Path) -> None:
    # two `setup.py` modules define `make_components`; run.py imports pkg.setup's only: the other builder's
    # optimizer is not the one run.py hands to the freeing loop (no reason naming run.py for it)
    _repo(tmp_path, "set_to_none=True")
    write_files(tmp_path, {"other/__init__.py": "", "other/setup.py": _OTHER_SETUP})
    data = scan(tmp_path, patterns=[FusedOptimizer()])
    cands, near = _optim(data, "other/setup.py")
    assert len(cands) == 1 and not near, near
    assert _optim(data, "pkg/setup.py")[0] == []


def test_model_handed_to_a_loop_that_calls_its_bare_zero_grad_is_zeroed_in_place(tmp_path: Path) -> None:
    # consistent with a bare `model.zero_grad()` in the driving file itself (torch >= 2.0 frees by default): the fused
    # branch binds the model's zero_grad to zero in place, with the risk stated
    write_files(tmp_path, {"model.py": _NET, "pkg/__init__.py": "", "pkg/setup.py": _SETUP,
                           "pkg/loops.py": _LOOPS.format(call="", free="free=True").replace("optim.zero_grad()", "net.zero_grad()"),
                           "run.py": _RUN.format(free="free=True")})
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "pkg/setup.py")
    assert len(cands) == 1 and not near, near
    assert "net.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))(net.zero_grad)" \
        in cands[0]["replacement"], cands[0]["replacement"]
    assert any("`fit_loop` (run.py:11) is handed the model" in r["detail"] for r in cands[0]["risks"]), cands[0]["risks"]


_SITE_UNKNOWN_RUNNER = '''\
import torch
from model import Net


def train(runner, batches):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    runner.fit(batches, o=opt)
'''


def _unknown_runner(root: Path, runner: str) -> tuple[list[dict], list[str]]:
    write_files(root, {"model.py": _NET, "pkg/__init__.py": "", "pkg/runner.py": runner, "train.py": _SITE_UNKNOWN_RUNNER})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")


def test_optimizer_handed_to_an_object_of_unknown_class_whose_namesake_method_frees_it(tmp_path: Path) -> None:
    # `runner` is a parameter: the scan cannot tell its class; the repository's only `fit` methods that could be the
    # callee are matched by name and followed (GentleRunner.fit zeroes with the default: only Runner.fit frees)
    cands, near = _unknown_runner(tmp_path, _RUNNER)
    assert cands == [] and len(near) == 1, near
    assert "`runner.fit` (train.py:8, a call the scan cannot resolve; the repository's `Runner.fit` at pkg/runner.py:8" in near[0], near
    assert "`o.zero_grad(set_to_none=True)` (pkg/runner.py:12)" in near[0], near


def test_keep_an_unknown_callee_whose_namesakes_free_nothing_stays_a_candidate(tmp_path: Path) -> None:
    cands, near = _unknown_runner(tmp_path, _RUNNER.replace("o.zero_grad(set_to_none=True)", "o.zero_grad()"))
    assert len(cands) == 1 and not near, near
