"""Issue 14 class 5: an optimizer class chosen at run time and built in the same function
(``opts = {"sgd": torch.optim.SGD, ...}; opts[name](...)``, ``optimizer_cls = AdamW`` in one arm of
an ``if``): the construction is the candidate and its guard tests the choice, so every other
choice keeps its own class (checked here under the emulator: no fused call, same type, same
result), and ``npufuse apply`` writes it."""

from __future__ import annotations

from pathlib import Path

from apply_support import npufuse, scan
from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns.fused_optimizer import _CHOSEN_BY_IF, _CHOSEN_FROM_DICT, FusedOptimizer

_STEPS = ("for _ in range(3):\n    model(torch.randn(4, 8)).square().mean().backward()\n    opt.step()\n    opt.zero_grad()\n"
          "out = tuple(p.detach().clone() for p in model.parameters())\n")


def test_other_choice_of_the_dict_runs_its_own_class() -> None:
    findings, _ = detect_all(FusedOptimizer(), _CHOSEN_FROM_DICT)
    assert len(findings) == 1 and "opts[name] is torch.optim.SGD" in (findings[0].guard_tensor or "")
    facts = check_rewrite_runs(FusedOptimizer(), _CHOSEN_FROM_DICT,
                               "model = Net()\nopt = run(model, 'rowwise')\nassert type(opt).__name__ == 'RowWise'\n" + _STEPS, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999
    # the chosen torch class takes the fused branch
    facts = check_rewrite_runs(FusedOptimizer(), _CHOSEN_FROM_DICT, "model = Net()\nopt = run(model)\n" + _STEPS, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.99999


def test_other_arm_of_the_if_runs_its_own_class() -> None:
    # the bitsandbytes arm is not importable here: a stand-in class in its place keeps the structure
    code = _CHOSEN_BY_IF.replace("        import bitsandbytes as bnb\n        optimizer_cls = bnb.optim.AdamW8bit\n",
                                 "        optimizer_cls = torch.optim.Adam\n")
    findings, near = detect_all(FusedOptimizer(), code)
    # two torch.optim classes are now among the choices: refused with that reason
    assert findings == [] and "several torch.optim classes are among the choices (Adam, AdamW)" in near[0].reason
    code = _CHOSEN_BY_IF.replace("        import bitsandbytes as bnb\n        optimizer_cls = bnb.optim.AdamW8bit\n",
                                 "        optimizer_cls = Plain\n") + "\n\nclass Plain(torch.optim.SGD):\n    pass\n"
    findings, _ = detect_all(FusedOptimizer(), code)
    assert len(findings) == 1
    facts = check_rewrite_runs(FusedOptimizer(), code, "model = Net()\nopt = build(model, use_8bit=True)\n"
                               "assert type(opt).__name__ == 'Plain'\n" + _STEPS, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999


def test_apply_writes_the_class_test(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text(_CHOSEN_FROM_DICT, encoding="utf-8")
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert len(cands) == 1 and cands[0]["line"] == 23
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    text = (root / "train.py").read_text(encoding="utf-8")
    assert "opts[name] is torch.optim.SGD" in text and "torch_npu.optim.NpuFusedSGD(model.parameters(), lr=0.1)" in text
    compile(text, "train.py", "exec")
