"""s39 perf39: the random-skip pass's per-scan indexes answer exactly what the per-call tree walks answered.

icefall's scan spent 189 s in :func:`npufuse.scan.random_skip.apply`: each of 36 optimizer sites walked the same
unchanged trees again (callers drawing a forward argument, registry entries, references to a class). The pass now
reads each file once per scan (:class:`RepoIndex` ``caller_draws`` / ``registrations`` / ``top_references``). These
tests pin the indexed answers to the old walks (kept here as the reference) on a crafted repository, and that a
second site's questions read no tree again. The spellings are written for this test."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

from npufuse.scan import random_skip
from npufuse.scan.random_skip import Registry, RepoIndex, _draws, _name, _random_flags
from scratch_repo import write_files

_FILES = {
    "pkg/__init__.py": "",
    "pkg/nets.py": '''\
import torch
import torch.nn as nn


class Guided(nn.Module):
    def __init__(self):
        super().__init__()
        self.ref = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, x, uncond=False, *, drop_ref=False):
        if not uncond:
            x = x + self.ref(x)
        if not drop_ref:
            x = x + self.extra(x)
        return self.body(x)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


MODELS = {"guided": Guided, "plain": Plain}
''',
    "pkg/build.py": '''\
from pkg.nets import Guided, Plain


def build(cfg):
    if cfg["arch"] == "guided_v0":
        return Guided()
    return Plain()


@register("helper")
def helper():
    return Guided()
''',
    "train.py": '''\
import random
import torch
from pkg.nets import Guided
from pkg.build import build


def main():
    net = Guided()
    other = build({"arch": "plain"})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for step in range(10):
        uncond = random.random() < 0.1
        x = torch.randn(2, 4)
        net(x, uncond)
        net(x, drop_ref=torch.rand(1) < 0.2)
        opt.step()

    def inner():
        keep = random.random() > 0.5
        m = Guided()
        m(torch.zeros(1), keep)


def other():
    model = build({"arch": "plain"})
    return torch.optim.SGD(model.parameters(), lr=0.1)
''',
}


def _old_caller_draws(index: RepoIndex, rel: str, cls: str, position: int, param: Optional[str]) -> bool:
    """The per-call walk :func:`random_skip._drawn_by_a_caller` made for one file before s39 (perf39)."""
    text = index.text(rel) or ""
    if cls not in text or not random_skip._RANDOM_WORDS.search(text):
        return False
    tree = index.tree(rel)
    for fn in ast.walk(tree) if tree is not None else ():
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        flags = _random_flags(fn)
        if not flags:
            continue
        objects = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                   and _name(n.value.func) == cls for t in n.targets if isinstance(t, ast.Name)}
        for c in ast.walk(fn):
            if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in objects):
                continue
            arg = c.args[position] if 0 <= position < len(c.args) else next((k.value for k in c.keywords if k.arg == param), None)
            if arg is not None and _draws(arg, flags):
                return True
    return False


def _old_registry(index: RepoIndex, files: list[str]) -> tuple[dict[str, set[str]], set[int]]:
    """The registry the pre-s39 ``Registry.__init__`` read by walking every file's tree itself."""
    reader = Registry(index, [])
    for rel in files:
        text = index.text(rel) or ""
        if "register" not in text and "{" not in text:
            continue
        tree = index.tree(rel)
        for n in ast.walk(tree) if tree is not None else ():
            reader._read(n)
    return reader.keys, reader.positions


def _old_references(index: RepoIndex, rel: str, name: str, positions: set[int]) -> list[tuple[str, list[int]]]:
    """(top-level statement, ids of its references to ``name``) as the pre-s39 ``_referrers`` listed them."""
    out = []
    tree = index.tree(rel)
    for top in tree.body if tree is not None else ():
        if isinstance(top, (ast.Import, ast.ImportFrom)) or (isinstance(top, (ast.ClassDef, ast.FunctionDef)) and top.name == name):
            continue
        refs = [id(n) for n in ast.walk(top) if id(n) not in positions and (
            (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name))]
        out.append((ast.dump(top)[:40], refs))
    return out


@pytest.fixture()
def index(tmp_path: Path) -> RepoIndex:
    write_files(tmp_path, _FILES)
    return RepoIndex(tmp_path, sorted(_FILES), 1 << 20)


def test_caller_draws_equal_the_per_call_walk(index: RepoIndex) -> None:
    skips = index.skips("pkg/nets.py")
    assert {(s.cls, s.param) for s in skips} >= {("Guided", "uncond"), ("Guided", "drop_ref")}
    asked = [(s.cls, s.index, s.param) for s in skips] + [("Guided", 5, "nothing"), ("Plain", 0, "x"), ("Missing", 0, "p")]
    for rel in index.files:
        for cls, position, param in asked:
            want = _old_caller_draws(index, rel, cls, position, param)
            assert index.caller_draws(rel, cls, position, param) == want, (rel, cls, position, param)
            assert index.caller_draws(rel, cls, position, param) == want  # the memo answers the same again
    assert index.caller_draws("train.py", "Guided", 1, "uncond") and index.caller_draws("train.py", "Guided", -1, "drop_ref")


def test_registry_and_references_equal_the_per_call_walk(index: RepoIndex) -> None:
    files = list(index.files)
    registry = Registry(index, files)
    keys, positions = _old_registry(index, files)
    assert registry.keys == keys and registry.positions == positions
    assert registry.keys["Guided"] == {"guided"} and registry.keys["helper"] == {"helper"}
    # a Registry's own additions (an if-arm's names) stay out of the per-file index the next Registry copies
    registry.selected_out("Guided")
    again = Registry(index, files)
    assert again.keys == keys and again.positions == positions
    for rel in files:
        for name in ("Guided", "Plain", "build", "helper"):
            got = [(ast.dump(top)[:40], [id(n) for n in named.get(name, ()) if id(n) not in positions])
                   for top, named in index.top_references(rel)
                   if not (isinstance(top, (ast.ClassDef, ast.FunctionDef)) and top.name == name)]
            assert got == _old_references(index, rel, name, positions), (rel, name)


def test_second_site_reads_no_tree_again(index: RepoIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    sites = [("main", "net.parameters()"), ("other", "model.parameters()")]
    first = [random_skip.site_random_skip(index, "train.py", q, "", p) for q, p in sites]
    assert first[0] is not None and first[0][1] and first[1] is not None and not first[1][1]  # told / reached
    reads: list[str] = []
    for owner, name in ((RepoIndex, "_read_caller_draws"), (RepoIndex, "_read_imports"), (Registry, "_read")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name: reads.append(_name) or _real(*a))
    again = [random_skip.site_random_skip(index, "train.py", q, "", p) for q, p in sites]
    assert reads == []  # the second round's answers come from the per-scan indexes: no file walked again
    monkeypatch.undo()
    fresh = RepoIndex(index.root, index.files, 1 << 20)
    for a, b, c in zip(first, again, [random_skip.site_random_skip(fresh, "train.py", q, "", p) for q, p in sites]):
        assert a is not None and b is not None and c is not None
        assert a[0].where() == b[0].where() == c[0].where() and a[1] == b[1] == c[1]
