"""s46 (helper optim46): fused_optimizer precision classes.

1. An optimizer built by a task method (``MyTask.build_optimizer``) that the trainer of another file reaches only through
   a base class's method of a third file (``BaseTask.configure_optimizers`` calling ``self.build_optimizer(self.model)``):
   the trainer's ``task.zero_grad()`` (nn.Module default set_to_none=True on torch >= 2.0) frees the grads the fused
   optimizer keeps in its flat buffer (NATSpeech, audit46 W1): a near miss naming that call. Twin: a trainer that zeroes
   with set_to_none=False keeps the candidate.
2. A supernet whose forward runs one entry of a submodule list per layer, chosen by an architecture argument zipped
   with the list (Cream, audit46 W2) or by a draw: the unchosen entries have no grad at the first step and the fused
   optimizer excludes them for good: a near miss. Twin: every entry run through a range / enumerate index.
3. An optimizer rebound in the same block before anything reads it (dead construction): a near miss. Twin: rebound on
   one branch only.
"""

from __future__ import annotations

import textwrap

from npufuse.scan.engine import scan_repo

BASE_TASK = textwrap.dedent('''
    import torch.nn as nn


    class BaseTask(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = None

        def build_model(self):
            raise NotImplementedError

        def build_optimizer(self, model):
            raise NotImplementedError

        def configure_optimizers(self):
            optm = self.build_optimizer(self.model)
            if isinstance(optm, (list, tuple)):
                return optm
            return [optm]
''')

MY_TASK = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from commons.base_task import BaseTask


    class MyTask(BaseTask):
        def build_model(self):
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

        def build_optimizer(self, model):
            self.optimizer = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            return optimizer
''')

TRAINER = textwrap.dedent('''
    import torch


    class Trainer:
        def __init__(self, task_cls):
            self.task = task_cls()
            self.optimizers = []

        def fit(self, loader):
            task = self.task
            task.model = task.build_model()
            self.optimizers = task.configure_optimizers()
            for batch in loader:
                loss = task.model(batch).sum()
                loss.backward()
                for optimizer in self.optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
                self.evaluate(self.task)

        def evaluate(self, task):
            task.{zero}
            task.eval()
            with torch.no_grad():
                pass
            task.train()
''')


def _scan(tmp_path, zero: str) -> dict:
    root = tmp_path / "repo"
    for pkg in ("commons", "tasks"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "commons" / "base_task.py").write_text(BASE_TASK)
    (root / "commons" / "trainer.py").write_text(TRAINER.replace("{zero}", zero))
    (root / "tasks" / "my_task.py").write_text(MY_TASK)
    return scan_repo(root, jobs=1, only=["fused_optimizer"]).to_json()


def test_task_zero_grad_of_another_file_through_a_base_class_method_is_a_near_miss(tmp_path):
    data = _scan(tmp_path, "zero_grad()")
    assert not [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "tasks/my_task.py"]
    assert reasons and all("`task.zero_grad()` at commons/trainer.py:" in r and "configure_optimizers" in r for r in reasons)


def test_task_zeroed_in_place_by_the_other_file_stays_a_candidate(tmp_path):
    data = _scan(tmp_path, "zero_grad(set_to_none=False)")
    found = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert [c["file"] for c in found] == ["tasks/my_task.py"]


# --- 2. one entry of a submodule list chosen per call (one-shot NAS supernet, audit46 W2) ---------------------------

SUPERNET = textwrap.dedent('''
    import torch.nn as nn


    class SuperNet(nn.Module):
        def __init__(self, width=8, layers=3, choices=3):
            super().__init__()
            self.stem = nn.Linear(width, width)
            # stages of positions, each position a list of candidate blocks
            self.blocks = nn.ModuleList(nn.ModuleList(
                nn.ModuleList(nn.Linear(width, width) for _ in range(choices)) for _ in range(2)) for _ in range(layers))
            self.head = nn.Linear(width, 2)

        def forward_features(self, x, architecture):
            x = self.stem(x)
            for layer, layer_arch in zip(self.blocks, architecture):
                for blocks, arch in zip(layer, layer_arch):
                    if arch == -1:
                        continue
                    x = blocks[arch](x)
            return x

        def forward(self, x, architecture):
            return self.head(self.forward_features(x, architecture))
''')

DRAWN_OP = textwrap.dedent('''
    import random
    import torch.nn as nn


    class SuperNet(nn.Module):
        def __init__(self, width=8, choices=3):
            super().__init__()
            self.ops = nn.ModuleList(nn.Linear(width, width) for _ in range(choices))
            self.head = nn.Linear(width, 2)

        def forward(self, x, architecture=None):
            idx = random.randrange(len(self.ops))
            return self.head(self.ops[idx](x))
''')

EVERY_BLOCK = textwrap.dedent('''
    import torch.nn as nn


    class SuperNet(nn.Module):
        def __init__(self, width=8, layers=3):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
            self.head = nn.Linear(width, 2)

        def forward(self, x, architecture):
            for i in range(len(self.blocks)):
                x = self.norms[i](self.blocks[i](x))
            for i, blk in enumerate(self.blocks):
                x = blk(x) + x
            return self.head(x)
''')

TRAIN = textwrap.dedent('''
    import random
    import torch
    from models.supernet import SuperNet


    def main(loader, steps=10):
        model = SuperNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in loader:
            cand = [[random.randrange(3) for _ in range(2)] for _ in range(3)]
            loss = torch.nn.functional.cross_entropy(model(x, cand), y)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()
''')


def _scan_supernet(tmp_path, model: str) -> dict:
    root = tmp_path / "repo"
    (root / "models").mkdir(parents=True)
    (root / "models" / "__init__.py").write_text("")
    (root / "models" / "supernet.py").write_text(model)
    (root / "train.py").write_text(TRAIN)
    return scan_repo(root, jobs=1, only=["fused_optimizer"]).to_json()


def test_supernet_running_one_sampled_choice_per_layer_is_a_near_miss(tmp_path):
    data = _scan_supernet(tmp_path, SUPERNET)
    assert not [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    assert reasons and all("runs only one entry of `self.blocks`" in r and "arch taken from the argument architecture" in r
                           for r in reasons)


def test_op_drawn_at_random_in_forward_is_a_near_miss(tmp_path):
    data = _scan_supernet(tmp_path, DRAWN_OP)
    assert not [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    assert reasons and all("runs only one entry of `self.ops`" in r and "an index drawn at random" in r for r in reasons)


def test_every_block_run_by_a_range_or_enumerate_index_stays_a_candidate(tmp_path):
    data = _scan_supernet(tmp_path, EVERY_BLOCK)
    found = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert [c["file"] for c in found] == ["train.py"]


# --- 3. dead construction: replaced in the same block before any read -----------------------------------------------

DEAD = textwrap.dedent('''
    import torch


    def build(model, kind="adamw"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        print(n_params)
        return optimizer
''')

CHOSEN = textwrap.dedent('''
    import torch


    def build(model, kind="adamw"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        n_params = sum(p.numel() for p in model.parameters())
        if kind == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        print(n_params)
        return optimizer
''')


def _scan_one(tmp_path, text: str) -> dict:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "optim.py").write_text(text)
    return scan_repo(root, jobs=1, only=["fused_optimizer"]).to_json()


def test_optimizer_replaced_before_any_read_is_a_near_miss(tmp_path):
    data = _scan_one(tmp_path, DEAD)
    assert [c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer"] == [8]
    misses = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    assert [m["line"] for m in misses] == [6] and "`optimizer` is rebound at line 8" in misses[0]["reason"]


def test_optimizer_replaced_only_on_one_branch_stays_a_candidate(tmp_path):
    data = _scan_one(tmp_path, CHOSEN)
    assert sorted(c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer") == [6, 9]


SELF_DEAD = textwrap.dedent('''
    import torch


    class Trainer:
        def __init__(self, model):
            self.model = model
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            n_params = sum(p.numel() for p in model.parameters())
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            self.n_params = n_params
''')


def test_self_attribute_replaced_before_any_read_is_a_near_miss(tmp_path):
    # the `self.<x>` case is this module's reader's alone (a plain name is _optim_s46h's)
    data = _scan_one(tmp_path, SELF_DEAD)
    assert [c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer"] == [10]
    misses = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    assert [m["line"] for m in misses] == [8] and "`self.optimizer` is rebound at line 10" in misses[0]["reason"]


def test_self_attribute_read_through_a_self_call_between_stays_a_candidate(tmp_path):
    code = SELF_DEAD.replace("        n_params = sum(", "        self.log()\n        n_params = sum(")
    assert "self.log()" in code
    data = _scan_one(tmp_path, code)
    assert sorted(c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer") == [8, 11]
