"""s51 (optim51b): fused_optimizer sites reached through another file, and facts scoped to the objects they concern.

Invented reproducers (no repository code), each class with a FUSE example and near-miss (KEEP) twins:
1. a registry of torch.optim classes -- a dict / tuple in another module of the repository, a module-level if/else
   chain -- read where the optimizer is built: a candidate whose guard tests the class the lookup yields at run time;
2. ``from config import *`` where ``config`` (through another star import) does ``from torch.optim import Adam``;
3. an A3C-style worker class writing ``.grad`` of the global network it is handed: not a fact of an optimizer over a
   module another class keeps to itself;
4. params from a repository method returning a list comprehension (a list, not a one-shot generator);
5. a grad-norm helper keeping the PARAMETERS whose grad is not None and reducing only their grads' norms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from npufuse.scan.engine import scan_repo

_NET = """from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)
"""


def _scan(tmp_path: Path, files: dict[str, str]) -> Any:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan_repo(tmp_path, jobs=1, only=["fused_optimizer"])


def _at(res: Any, rel: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return [c for c in res.candidates if c["file"] == rel], [m for m in res.near_misses if m["file"] == rel]


# -- 1. registries ---------------------------------------------------------------------------------------------------

_TABLE = """from torch.optim import SGD, AdamW

OPTIMIZER_TABLE = {
    "sgd": SGD,
    "adamw": AdamW,
}
"""

_SOLVER = """import torch

from registry import OPTIMIZER_TABLE
from nets import Net


class Solver:
    def __init__(self, cfg):
        self.model = Net()
        self.opt = OPTIMIZER_TABLE[cfg.opt_name](self.model.parameters(), lr=cfg.lr)

    def fit(self, batches):
        for x, y in batches:
            self.opt.zero_grad()
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.opt.step()
"""


def _class_test(guard: str, lookup: str, value: Any) -> bool:
    """The guard's class test (the lambda applied to the lookup) evaluated on ``value`` in place of the lookup."""
    start = guard.index("(lambda _cls:")
    end = guard.index(f")({lookup})", start) + 1
    return bool(eval(guard[start:end], {"__builtins__": __builtins__})(value))  # noqa: S307 - the scanner's own guard text


def test_table_imported_from_another_module_is_a_guarded_site(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"registry/__init__.py": _TABLE, "nets.py": _NET, "solver.py": _SOLVER})
    got, _near = _at(res, "solver.py")
    assert len(got) == 1, res.near_misses
    assert "getattr(torch_npu.optim, 'NpuFused' + OPTIMIZER_TABLE[cfg.opt_name].__name__)" in got[0]["fused"]
    guard = got[0]["guard_tensor"]
    # the other classes a table may hold (another library's, the repository's own) keep running torch.optim's code
    assert _class_test(guard, "OPTIMIZER_TABLE[cfg.opt_name]", torch.optim.AdamW)
    assert _class_test(guard, "OPTIMIZER_TABLE[cfg.opt_name]", torch.optim.SGD)
    assert not _class_test(guard, "OPTIMIZER_TABLE[cfg.opt_name]", torch.optim.Adagrad)

    class Own(torch.optim.SGD):
        pass

    assert not _class_test(guard, "OPTIMIZER_TABLE[cfg.opt_name]", Own)


def test_tuple_table_of_one_class_in_a_module_is_a_guarded_site(tmp_path: Path) -> None:
    table = "import torch\n\nOPTIMS = (torch.optim.Adam,)\n"
    solver = _SOLVER.replace("from registry import OPTIMIZER_TABLE", "from lib.tables import OPTIMS").replace(
        "OPTIMIZER_TABLE[cfg.opt_name]", "OPTIMS[cfg.index]")
    res = _scan(tmp_path, {"lib/__init__.py": "", "lib/tables.py": table, "nets.py": _NET, "solver.py": solver})
    got, _near = _at(res, "solver.py")
    assert len(got) == 1 and "OPTIMS[cfg.index]" in got[0]["guard_tensor"], res.near_misses


def test_table_of_the_repositorys_own_classes_is_no_site(tmp_path: Path) -> None:
    table = "from mylib import Lion, Sophia\n\nOPTIMIZER_TABLE = {'lion': Lion, 'sophia': Sophia}\n"
    res = _scan(tmp_path, {"registry/__init__.py": table, "nets.py": _NET, "solver.py": _SOLVER})
    got, near = _at(res, "solver.py")
    assert not got and not near


def test_table_key_that_calls_code_is_a_near_miss(tmp_path: Path) -> None:
    solver = _SOLVER.replace("OPTIMIZER_TABLE[cfg.opt_name](self.model.parameters(), lr=cfg.lr)",
                             "OPTIMIZER_TABLE[cfg.pop('type')](self.model.parameters(), **cfg)")
    res = _scan(tmp_path, {"registry/__init__.py": _TABLE, "nets.py": _NET, "solver.py": solver})
    got, near = _at(res, "solver.py")
    assert not got
    assert len(near) == 1 and "by a key that calls code (`cfg.pop('type')`)" in near[0]["reason"], near
    assert "OPTIMIZER_TABLE holds torch.optim.AdamW, torch.optim.SGD" in near[0]["reason"]


def test_table_lookup_with_params_only_in_a_mapping_is_a_near_miss(tmp_path: Path) -> None:
    solver = _SOLVER.replace("self.opt = OPTIMIZER_TABLE[cfg.opt_name](self.model.parameters(), lr=cfg.lr)",
                             "kw = {k: v for k, v in cfg.items() if k in ('lr', 'momentum')}\n"
                             "        kw['params'] = self.model.parameters()\n"
                             "        self.opt = OPTIMIZER_TABLE[cfg.opt_name](**kw)")
    res = _scan(tmp_path, {"registry/__init__.py": _TABLE, "nets.py": _NET, "solver.py": solver})
    got, near = _at(res, "solver.py")
    assert not got
    assert len(near) == 1 and "the parameters come only through `**kw`" in near[0]["reason"], near


_CHAIN = """import sys

import torch

if "--sgd" in sys.argv:
    OptimCls = torch.optim.SGD
else:
    OptimCls = torch.optim.AdamW


def build(model, lr=1e-3):
    return OptimCls(model.parameters(), lr=lr)
"""


def test_module_level_if_chain_of_classes_is_a_guarded_site(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"train.py": _CHAIN})
    got, near = _at(res, "train.py")
    assert len(got) == 1 and got[0]["line"] == 12, (got, near)
    assert "getattr(torch_npu.optim, 'NpuFused' + OptimCls.__name__)" in got[0]["fused"]
    assert _class_test(got[0]["guard_tensor"], "OptimCls", torch.optim.SGD)
    # the bindings are no near misses of their own: the construction reports itself
    assert not near, near


def test_module_level_if_chain_with_an_argument_no_fused_class_takes_is_a_near_miss(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"train.py": _CHAIN.replace("lr=lr)", "lr=lr, maximize=True)")})
    got, near = _at(res, "train.py")
    assert not got
    assert any(m["line"] == 12 and "takes the arguments written" in m["reason"] for m in near), near


# -- 2. star imports -------------------------------------------------------------------------------------------------

_SETTINGS = "import torch\nfrom torch.optim import Adam, SGD\n\nLR = 1e-3\n"
_CONFIG = "from settings import *\n\nEPOCHS = 2\n"
_BUILD = """from config import *


def make_optimizer(model, kind):
    if kind == "adam":
        return Adam(model.parameters(), lr=LR)
    return SGD(model.parameters(), lr=LR, momentum=0.9)
"""


def test_torch_optim_names_through_a_chain_of_star_imports(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"settings.py": _SETTINGS, "config.py": _CONFIG, "build.py": _BUILD})
    got, _near = _at(res, "build.py")
    assert sorted(c["line"] for c in got) == [6, 7], res.near_misses
    assert any("torch_npu.optim.NpuFusedAdam(model.parameters(), lr=LR)" in c["fused"] for c in got)


def test_star_imported_name_rebound_to_another_class_is_no_site(tmp_path: Path) -> None:
    config = _CONFIG + "\n\nclass Adam:\n    def __init__(self, params, lr=1e-3):\n        self.params = list(params)\n"
    res = _scan(tmp_path, {"settings.py": _SETTINGS, "config.py": config, "build.py": _BUILD})
    got, _near = _at(res, "build.py")
    assert [c["line"] for c in got] == [7], got  # SGD still torch.optim's; Adam is config's own class


def test_star_import_outside_all_is_no_site(tmp_path: Path) -> None:
    settings = _SETTINGS + "\n__all__ = ['LR']\n"
    res = _scan(tmp_path, {"settings.py": settings, "config.py": _CONFIG, "build.py": _BUILD})
    got, _near = _at(res, "build.py")
    assert not got


# -- 3. grads written by another class ----------------------------------------------------------------------------------

_AGENTS = """import torch
import torch.optim as optim

from nets import Net


class Agent:
    def __init__(self, lr):
        self.net = Net().to("cpu")
        self.optimizer = optim.Adam(self.net.parameters(), lr)

    def learn(self, x, y):
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.optimizer.step()


class Worker:
    def __init__(self, shared_net, shared_opt):
        self.shared_net = shared_net
        self.shared_opt = shared_opt
        self.local = Net()

    def push(self):
        for mine, shared in zip(self.local.parameters(), self.shared_net.parameters()):
            shared._grad = mine.grad
        self.shared_opt.step()


class Pool:
    def __init__(self, lr):
        self.shared = Net()
        self.opt = optim.Adam(self.shared.parameters(), lr)
        self.workers = [Worker(self.shared, self.opt) for _ in range(2)]
"""


def test_grad_writes_of_a_worker_do_not_refuse_another_classs_own_model(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"nets.py": _NET, "agents.py": _AGENTS})
    got, near = _at(res, "agents.py")
    assert [c["line"] for c in got] == [10], (got, near)
    # the pool's optimizer over the network its workers write grads of keeps the refusal
    assert any(m["line"] == 35 and "grads are re-allocated" in m["reason"] for m in near), near


def test_model_handed_to_the_worker_keeps_the_refusal(tmp_path: Path) -> None:
    agents = _AGENTS.replace("        self.optimizer = optim.Adam(self.net.parameters(), lr)\n",
                             "        self.optimizer = optim.Adam(self.net.parameters(), lr)\n"
                             "        self.helper = Worker(self.net, self.optimizer)\n")
    res = _scan(tmp_path, {"nets.py": _NET, "agents.py": agents})
    got, near = _at(res, "agents.py")
    assert not got
    assert any(m["line"] == 10 and "grads are re-allocated" in m["reason"] for m in near), near


def test_model_read_from_outside_the_class_keeps_the_refusal(tmp_path: Path) -> None:
    agents = _AGENTS + "\n\ndef share(agent):\n    return Worker(agent.net, agent.optimizer)\n"
    res = _scan(tmp_path, {"nets.py": _NET, "agents.py": agents})
    got, near = _at(res, "agents.py")
    assert not got
    assert any(m["line"] == 10 and "grads are re-allocated" in m["reason"] for m in near), near


# -- 4. a repository method returning a list comprehension ----------------------------------------------------------------

_GROUPED = """from torch import nn


class Grouped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    def decay_groups(self):
        return [n for n, p in self.inner.named_parameters()]

    def param_groups_for(self, lr=None):
        return [{"params": [p for n, p in self.inner.named_parameters() if n in names], "lr": lr}
                for names in (self.decay_groups(),)]
"""

_CONFIGURE = """from torch.optim import SGD

from engine.grouped import Grouped


def configure(model: Grouped, lr: float):
    return SGD(model.param_groups_for(lr=lr), lr=lr)
"""


def test_params_from_a_method_returning_a_list_comprehension(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"engine/__init__.py": "", "engine/grouped.py": _GROUPED, "opt.py": _CONFIGURE})
    got, near = _at(res, "opt.py")
    assert len(got) == 1, near
    guard = got[0]["guard_tensor"]
    assert "model.param_groups_for" not in guard  # the method runs once, in the branch taken
    net = nn.Linear(4, 4)
    value = eval(guard, {"__builtins__": __builtins__}, {"model": net})  # noqa: S307 - the scanner's own guard text
    assert isinstance(value, torch.Tensor)

    class Listing:  # not an nn.Module: its parameters() is a list, which `next` could not read
        def parameters(self) -> list[torch.Tensor]:
            return [torch.zeros(2)]

    assert eval(guard, {"__builtins__": __builtins__}, {"model": Listing()}) is None  # noqa: S307


def test_params_from_a_method_that_yields_keep_the_reason(tmp_path: Path) -> None:
    grouped = _GROUPED.replace(
        '        return [{"params": [p for n, p in self.inner.named_parameters() if n in names], "lr": lr}\n'
        "                for names in (self.decay_groups(),)]\n",
        '        for names in (self.decay_groups(),):\n'
        '            yield {"params": [p for n, p in self.inner.named_parameters() if n in names], "lr": lr}\n')
    res = _scan(tmp_path, {"engine/__init__.py": "", "engine/grouped.py": grouped, "opt.py": _CONFIGURE})
    got, near = _at(res, "opt.py")
    assert not got
    assert any("may be a one-shot iterator" in m["reason"] for m in near), near


# -- 5. a grad-norm helper over the parameters ----------------------------------------------------------------------------

_NORMS = """import torch


def grad_total_norm(model, norm_type=2.0):
    kept = [q for q in model.parameters() if q.grad is not None]
    if len(kept) == 0:
        return torch.tensor(0.0)
    device = kept[0].grad.device
    if norm_type == float("inf"):
        return max(q.grad.detach().abs().max() for q in kept).to(device)
    return torch.norm(torch.stack([torch.norm(q.grad.detach(), norm_type) for q in kept]), norm_type).to(device)
"""

_LOOP = """import torch

from norms import grad_total_norm


def train(model, batches, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        print(grad_total_norm(model))
        opt.step()
"""


def test_grad_norm_helper_over_parameters_is_no_grad_none_reader(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"norms.py": _NORMS, "loop.py": _LOOP})
    got, near = _at(res, "loop.py")
    assert len(got) == 1, near


def test_grad_norm_helper_averaging_over_the_kept_count_keeps_the_reason(tmp_path: Path) -> None:
    norms = _NORMS.replace("    device = kept[0].grad.device\n",
                           "    device = kept[0].grad.device\n    scale = 1.0 / len(kept)\n")
    res = _scan(tmp_path, {"norms.py": norms, "loop.py": _LOOP})
    got, near = _at(res, "loop.py")
    assert not got
    assert any("grad is None" in m["reason"] or "q.grad is not None" in m["reason"] for m in near), near


def test_star_imported_name_rebound_under_a_try_is_no_site(tmp_path: Path) -> None:
    settings = _SETTINGS + "\ntry:\n    from fancy_optim import Adam\nexcept ImportError:\n    pass\n"
    res = _scan(tmp_path, {"settings.py": settings, "config.py": _CONFIG, "build.py": _BUILD})
    got, _near = _at(res, "build.py")
    assert [c["line"] for c in got] == [7], got  # Adam may be fancy_optim's: only SGD is torch.optim's for sure


_HANDED = """import torch

from nets import Net


class Module:
    def __init__(self, optimizer_table, name, lr=1e-3):
        self.optimizer_table = optimizer_table
        self.net = Net()
        cls = self.optimizer_table[name]
        self.opt = cls(self.net.parameters(), lr=lr)

    def step(self, x, y):
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.net(x), y).backward()
        self.opt.step()
"""


def test_table_handed_in_through_an_attribute_is_a_guarded_site(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"nets.py": _NET, "module.py": _HANDED})
    got, near = _at(res, "module.py")
    assert len(got) == 1, near
    guard = got[0]["guard_tensor"]
    assert _class_test(guard, "cls", torch.optim.Adam) and not _class_test(guard, "cls", torch.optim.Adamax)


def test_table_whose_name_says_nothing_of_optimizers_is_no_site(tmp_path: Path) -> None:
    res = _scan(tmp_path, {"nets.py": _NET, "module.py": _HANDED.replace("optimizer_table", "table")})
    got, _near = _at(res, "module.py")
    assert not got


def test_model_read_from_another_file_keeps_the_refusal(tmp_path: Path) -> None:
    main = "from agents import Agent, Worker\n\nagent = Agent(1e-3)\nhelper = Worker(agent.net, agent.optimizer)\n"
    res = _scan(tmp_path, {"nets.py": _NET, "agents.py": _AGENTS, "main.py": main})
    got, near = _at(res, "agents.py")
    assert not got
    assert any(m["line"] == 10 and "grads are re-allocated" in m["reason"] for m in near), near
