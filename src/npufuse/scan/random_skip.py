"""Modules whose forward skips a trainable submodule on steps drawn at random (s37, fix37).

torch_npu's fused optimizers build their flat buffers at the first ``step()`` from the parameters
that have a grad at that moment; a parameter without one then is excluded for good (spec §10), and
on later steps without a grad the fused class's in-place ``zero_grad`` gives it a zero grad, so
weight decay and momentum still move it where torch.optim skips it. A model whose forward skips a
submodule call (or replaces its output by a constant) on steps drawn at random leaves that
submodule without a grad on such steps: classifier-free-guidance condition dropout
(``style = torch.zeros_like(self.style_in(s)) if drop else ...`` with ``drop`` from
``torch.rand(1) < p``), an unconditional forward chosen by the trainer
(``uncond = random.random() < ratio; net(x, uncond)`` where ``forward`` runs
``self.reference_unet(...)`` only ``if not uncond``), layer drop / stochastic depth that does not
call the layer (``if self.training and torch.rand([]) < p: continue``).

Not this class: a flag fixed per run (``if self.use_x:``: the params never get a grad, both
optimizers leave them alone), dropout layers and masks multiplied in (``x * 0``, ``mask * branch``:
the branch still runs and its grads exist, possibly zero), per-sample replacement of a row
(``emb[i] = null``: the other rows still flow).

:func:`skip_in_class` analyses one class; :func:`model_random_skip` answers, for an optimizer site,
whether its model may include such a class (resolved as far as the file tells; when it cannot be
told, any such class the trainer's imports reach, or a config file names for ``instantiate``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional

# calls that draw a random number (the last part of the called name)
_RANDOM_CALLS = frozenset(("rand", "rand_like", "randn", "random", "uniform", "uniform_", "bernoulli", "bernoulli_",
                           "randint", "random_sample", "binomial", "choice", "getrandbits"))
# expressions that stand for a submodule's output thrown away: its grads are never computed
_CONSTANT_MAKERS = frozenset(("zeros_like", "ones_like", "full_like", "empty_like", "zeros", "ones"))
# torch.nn modules without parameters (a random skip of one leaves no parameter without a grad)
_PARAMETER_FREE = re.compile(r"(?:Dropout\w*|Identity|ReLU6?|GELU|SiLU|Sigmoid|Tanh|Softmax|\w*Pool\w*d|Upsample|Flatten|Mish|ELU|"
                             r"Hardswish|Hardsigmoid|PixelShuffle|PixelUnshuffle|DropPath)$")
# the usual import names of torchvision / kornia / albumentations transforms
_AUGMENTATION_MODULES = frozenset(("T", "K", "A", "transforms", "kornia", "albumentations", "augmentation", "v2"))
_MAX_DEPTH = 4  # imports followed from the trainer / model classes followed through their constructors


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _draws(node: ast.AST, flags: set[str]) -> bool:
    """Does ``node`` draw a random number, or read a name bound from a draw?"""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _name(n.func) in _RANDOM_CALLS:
            return True
        if isinstance(n, ast.Name) and n.id in flags:
            return True
    return False


def _scalar_draw(node: ast.AST) -> bool:
    """``random.random()``, ``torch.rand(1)``, ``torch.rand([])``, ``np.random.uniform(0, 1)`` (maybe ``.item()``):
    one number drawn, not a tensor of noise (``x = x + torch.randn(b, c)`` does not make ``x`` a flag)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item" and not node.args:
        node = node.func.value
    return (isinstance(node, ast.Call) and _name(node.func) in _RANDOM_CALLS
            and all(isinstance(a, ast.Constant) or (isinstance(a, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in a.elts))
                    for a in node.args))


def _flag_value(node: ast.AST, flags: set[str]) -> bool:
    """A value that is a random decision: a scalar draw, or a comparison / boolean / conditional over one."""
    if _scalar_draw(node):
        return True
    if isinstance(node, (ast.Compare, ast.BoolOp, ast.IfExp)) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
        return _draws(node, flags)
    return isinstance(node, ast.Name) and node.id in flags


def _random_flags(fn: ast.AST) -> set[str]:
    """Names a function binds from a random draw: ``p = torch.rand([])``, ``drop = random.random() < r``,
    ``skip = True if self.training and p < r else False``, or ``drop = True`` inside ``if torch.rand(1) < r:``."""
    flags: set[str] = set()
    for _ in range(3):  # to a fixed point: flags derived from flags
        before = len(flags)
        for n in ast.walk(fn):
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and _flag_value(n.value, flags):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    flags.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.If) and _draws(n.test, flags):
                for s in n.body:
                    if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, bool):
                        flags.update(t.id for t in s.targets if isinstance(t, ast.Name))
        if len(flags) == before:
            break
    return flags


class RandomSkip:
    """A class whose forward skips (or discards the output of) submodule ``attr`` on steps drawn at
    random; ``param``: the forward parameter the skip is conditioned on when the draw is the
    caller's (None: drawn in the class itself)."""

    __slots__ = ("rel", "cls", "line", "attr", "how", "param", "index")

    def __init__(self, rel: str, cls: str, line: int, attr: str, how: str, param: Optional[str] = None, index: int = -1) -> None:
        self.rel, self.cls, self.line, self.attr, self.how, self.param, self.index = rel, cls, line, attr, how, param, index

    def where(self) -> str:
        drawn = f" when its `{self.param}` argument is drawn at random by the caller" if self.param else " on steps drawn at random"
        return f"`{self.cls}` ({self.rel}:{self.line}) {self.how} `self.{self.attr}`{drawn}"


def _submodules(cls: ast.ClassDef) -> set[str]:
    """Attributes ``__init__`` binds to a module built or handed in (``self.x = nn.Linear(..)``, ``self.x = x``)."""
    out: set[str] = set()
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "__init__":
            a = fn.args
            handed = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self"}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Call, ast.Name)):
                    if isinstance(n.value, ast.Name) and n.value.id not in handed:
                        continue  # `self._resize = Resize`: a class kept to build objects from, not a module
                    if isinstance(n.value, ast.Call) and (_PARAMETER_FREE.search(_name(n.value.func)) or _augmentation(n.value.func)):
                        continue  # nothing to train: skipping it changes no optimizer
                    for t in n.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            out.add(t.attr)
    return out


def _augmentation(func: ast.AST) -> bool:
    """A data-augmentation library's transform (``T.ColorJitter(...)``, ``K.RandomAffine(...)``,
    ``transforms.RandomCrop(...)``, ``A.Blur(...)``): applied at random by design, without parameters."""
    head = func
    while isinstance(head, ast.Attribute):
        head = head.value
    return isinstance(head, ast.Name) and head.id in _AUGMENTATION_MODULES and isinstance(func, ast.Attribute)


def _called_submodules(nodes: Iterable[ast.AST], subs: set[str], loops: dict[str, str]) -> dict[str, int]:
    """Submodules called in ``nodes``: ``self.x(...)``, or a loop variable over ``self.x`` (``for layer in self.layers``)."""
    out: dict[str, int] = {}
    for node in nodes:
        for n in ast.walk(node):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in subs:
                out.setdefault(f.attr, n.lineno)
            elif isinstance(f, ast.Name) and f.id in loops:
                out.setdefault(loops[f.id], n.lineno)
    return out


def _loop_vars(fn: ast.AST, subs: set[str]) -> dict[str, str]:
    """Loop variables bound to the elements of a submodule list (``for i, blk in enumerate(self.blocks)``)."""
    out: dict[str, str] = {}
    for n in ast.walk(fn):
        if isinstance(n, (ast.For, ast.AsyncFor)):
            it = n.iter
            while isinstance(it, ast.Call) and _name(it.func) in ("enumerate", "zip", "reversed", "list") and it.args:
                it = it.args[0]
            if isinstance(it, ast.Attribute) and isinstance(it.value, ast.Name) and it.value.id == "self" and it.attr in subs:
                target = n.target.elts[-1] if isinstance(n.target, ast.Tuple) and n.target.elts else n.target
                if isinstance(target, ast.Name):
                    out[target.id] = it.attr
    return out


def _discarded(arm: list[ast.stmt] | ast.AST, held: dict[str, str]) -> Optional[tuple[str, int]]:
    """A submodule output replaced by a constant in ``arm``: ``h = torch.zeros_like(h)`` where ``h`` held
    ``self.x(...)``, or ``torch.zeros_like(self.x(...))``."""
    for node in (arm if isinstance(arm, list) else [arm]):
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and _name(n.func) in _CONSTANT_MAKERS:
                for a in n.args[:1]:
                    if isinstance(a, ast.Name) and a.id in held:
                        return held[a.id], n.lineno
                    if (isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and isinstance(a.func.value, ast.Name)
                            and a.func.value.id == "self"):
                        return a.func.attr, n.lineno
    return None


def _skips(fn: ast.FunctionDef | ast.AsyncFunctionDef, subs: set[str], conditioned: set[str]) -> list[tuple[int, str, str]]:
    """(line, submodule, how) of each submodule call that a test reading ``conditioned`` names skips
    or discards in ``fn``."""
    loops = _loop_vars(fn, subs)
    held: dict[str, str] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            f = n.value.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in subs:
                held.update((t.id, f.attr) for t in n.targets if isinstance(t, ast.Name))
    out: list[tuple[int, str, str]] = []
    everywhere = _called_submodules([fn], subs, loops)
    for n in ast.walk(fn):
        if isinstance(n, (ast.If, ast.IfExp)) and _draws(n.test, conditioned):
            body = n.body if isinstance(n.body, list) else [n.body]
            orelse = n.orelse if isinstance(n.orelse, list) else [n.orelse]
            a, b = _called_submodules(body, subs, loops), _called_submodules(orelse, subs, loops)
            outside = _calls_outside(fn, n, subs, loops)
            for attr in (set(a) ^ set(b)) - outside:
                out.append((n.lineno, attr, "skips the call of"))
            for arm in (body, orelse):
                gone = _discarded(arm, held)
                if gone is not None and gone[0] in subs:
                    out.append((n.lineno, gone[0], "replaces by a constant the output of"))
            # `for blk in self.blocks: if torch.rand([]) < p: continue`: the rest of the loop body is skipped
            if isinstance(n, ast.If) and any(isinstance(s, ast.Continue) for s in n.body):
                for attr in set(loops.values()) & set(everywhere):
                    out.append((n.lineno, attr, "skips the call of"))
    return out


def _calls_outside(fn: ast.AST, branch: ast.AST, subs: set[str], loops: dict[str, str]) -> set[str]:
    inside = {id(x) for x in ast.walk(branch)}
    rest = [x for x in ast.walk(fn) if id(x) not in inside and isinstance(x, ast.Call)]
    out: set[str] = set()
    for c in rest:
        f = c.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in subs:
            out.add(f.attr)
        elif isinstance(f, ast.Name) and f.id in loops:
            out.add(loops[f.id])
    return out


def skip_in_class(rel: str, cls: ast.ClassDef) -> list[RandomSkip]:
    """The random skips of ``cls``'s ``forward`` and of the ``self.`` methods it calls (one level)."""
    methods = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    forward = methods.get("forward")
    if forward is None:
        return []
    subs = _submodules(cls) - set(methods)
    if not subs:
        return []
    found: list[RandomSkip] = []
    called = {c.func.attr for c in ast.walk(forward) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
              and isinstance(c.func.value, ast.Name) and c.func.value.id == "self" and c.func.attr in methods}
    for fn in [forward, *(methods[m] for m in sorted(called) if m != "forward")]:
        for line, attr, how in _skips(fn, subs, _random_flags(fn)):
            found.append(RandomSkip(rel, cls.name, line, attr, how))
    if found:
        return found
    # the draw is the caller's: a forward parameter decides the skip (`if not uncond_fwd: self.ref(...)`)
    a = forward.args
    params = [x.arg for x in (*a.posonlyargs, *a.args)][1:]
    for i, p in enumerate(params):
        for line, attr, how in _skips(forward, subs, {p}):
            found.append(RandomSkip(rel, cls.name, line, attr, how, p, i))
    for p in (x.arg for x in a.kwonlyargs):
        for line, attr, how in _skips(forward, subs, {p}):
            found.append(RandomSkip(rel, cls.name, line, attr, how, p, -1))
    return found


def _classes_in(rel: str, tree: ast.Module) -> list[RandomSkip]:
    out: list[RandomSkip] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out += skip_in_class(rel, node)
    return out


_RANDOM_WORDS = re.compile(r"\b(?:rand|rand_like|randn|random|uniform_?|bernoulli_?|randint|random_sample|binomial|choice)\s*\(")


class RepoIndex:
    """One scan's files: texts, trees and module paths, read on demand (the pass runs once per scan)."""

    def __init__(self, root: Optional[Path], files: Iterable[str], max_bytes: int) -> None:
        self.root, self.max_bytes = (Path(root) if root is not None else None), max_bytes
        self.files = [f for f in files if f.endswith(".py")]
        self._texts: dict[str, Optional[str]] = {}
        self._trees: dict[str, Optional[ast.Module]] = {}
        self._skips: dict[str, list[RandomSkip]] = {}
        self.modules: dict[str, list[str]] = {}  # dotted module path (and its suffixes) -> files
        for rel in self.files:
            parts = list(PurePosixPath(rel).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            for i in range(len(parts)):
                self.modules.setdefault(".".join(parts[i:]), []).append(rel)

    def text(self, rel: str) -> Optional[str]:
        if rel not in self._texts:
            if self.root is None:
                return None
            from npufuse.scan.repo_facts import _repo_text

            # the repo passes' reader: a link leading out of the (untrusted) repository is never read
            text = _repo_text(self.root, rel)
            try:
                fits = text is not None and (self.root / rel).stat().st_size <= self.max_bytes
            except OSError:
                fits = False
            self._texts[rel] = text if fits else None
        return self._texts[rel]

    def seed(self, rel: str, text: str, tree: ast.Module) -> None:
        """A file already parsed by the scan (the detector's own file)."""
        self._texts[rel], self._trees[rel] = text, tree

    def tree(self, rel: str) -> Optional[ast.Module]:
        if rel not in self._trees:
            from npufuse.scan.repo_facts import _parse_repo_file

            # parsed once per scan with the other repo passes (their cache), not again here
            self._trees[rel] = _parse_repo_file(self.root, rel) if self.text(rel) is not None else None
        return self._trees[rel]

    def skips(self, rel: str) -> list[RandomSkip]:
        """The random-skip classes of one file (text-gated: a random draw and a ``forward``, or a
        ``forward`` whose skip a caller's draw decides)."""
        if rel not in self._skips:
            text = self.text(rel) or ""
            tree = self.tree(rel) if "def forward" in text and "self." in text else None
            self._skips[rel] = _classes_in(rel, tree) if tree is not None else []
        return self._skips[rel]

    def imported_files(self, rel: str) -> list[str]:
        """Files of the repo that ``rel`` imports (absolute and relative imports)."""
        tree = self.tree(rel)
        if tree is None:
            return []
        out: list[str] = []
        package = list(PurePosixPath(rel).parent.parts)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (package[: len(package) - (node.level - 1)] if node.level else [])
                if node.level and node.level - 1 > len(package):
                    continue
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
                names = [mod] + [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            for name in names:
                out += self.modules.get(name, []) if name else []
        return list(dict.fromkeys(f for f in out if f != rel))


def reachable_skips(index: RepoIndex, starts: Iterable[str]) -> list[RandomSkip]:
    """Random-skip classes in the files the ``starts`` import, transitively (bounded), whose skip is
    drawn in the class or by a caller in those files."""
    seen = list(dict.fromkeys(starts))
    frontier = list(seen)
    for _ in range(_MAX_DEPTH):
        nxt: list[str] = []
        for rel in frontier:
            for f in index.imported_files(rel):
                if f not in seen:
                    seen.append(f)
                    nxt.append(f)
        frontier = nxt
    found: list[RandomSkip] = []
    for rel in seen:
        for s in index.skips(rel):
            if s.param is None or _drawn_by_a_caller(index, s, seen):
                found.append(s)
    return found


def configured_skips(index: RepoIndex, config_texts: Iterable[str]) -> list[RandomSkip]:
    """Random-skip classes a config file names by dotted path (``_target_: pkg.mod.Class``) for
    ``instantiate`` (hydra / omegaconf / ldm's ``instantiate_from_config``)."""
    texts = list(config_texts)
    if not texts:
        return []
    found: list[RandomSkip] = []
    for rel in index.files:
        text = index.text(rel) or ""
        if "def forward" not in text:
            continue
        mod = ".".join(PurePosixPath(rel).with_suffix("").parts)
        if not any(mod.split(".")[-1] in t for t in texts):
            continue
        for s in index.skips(rel):
            if s.param is None and any(f"{mod}.{s.cls}" in t or f".{mod}.{s.cls}" in t for t in texts):
                found.append(s)
    return found


def _drawn_by_a_caller(index: RepoIndex, s: RandomSkip, files: Iterable[str]) -> bool:
    """Does a function of ``files`` call an object it built from ``s.cls`` with a random-drawn value
    for the parameter the skip reads (by position or keyword)?"""
    for rel in files:
        text = index.text(rel) or ""
        if s.cls not in text or not _RANDOM_WORDS.search(text):
            continue
        tree = index.tree(rel)
        if tree is None:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            flags = _random_flags(fn)
            if not flags:
                continue
            objects = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                       and _name(n.value.func) == s.cls for t in n.targets if isinstance(t, ast.Name)}
            for c in ast.walk(fn):
                if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in objects):
                    continue
                arg = c.args[s.index] if 0 <= s.index < len(c.args) else next(
                    (k.value for k in c.keywords if k.arg == s.param), None)
                if arg is not None and _draws(arg, flags):
                    return True
    return False


def model_classes(index: RepoIndex, rel: str, tree: ast.Module, cls_name: str, depth: int = 0,
                  seen: Optional[set[tuple[str, str]]] = None) -> Optional[list[tuple[str, ast.ClassDef]]]:
    """The repo classes a model of class ``cls_name`` (as named in ``rel``) is built from: itself and
    the classes its methods construct, transitively (bounded); None when ``cls_name`` is not a class
    of the repo (a library model, a factory: the caller must be conservative)."""
    from npufuse.scan.repo_facts import definition_in

    seen = set() if seen is None else seen
    d = definition_in(index.root, rel, tree, cls_name)
    if d is None or not isinstance(d.node, ast.ClassDef):
        return None
    key = (d.rel, d.node.name)
    if key in seen:
        return []
    seen.add(key)
    out = [(d.rel, d.node)]
    if depth >= _MAX_DEPTH:
        return out
    names = {n.func.id if isinstance(n.func, ast.Name) else "" for n in ast.walk(d.node) if isinstance(n, ast.Call)}
    names |= {b.id for b in d.node.bases if isinstance(b, ast.Name)}
    for name in sorted(n for n in names if n and n[:1].isupper()):
        sub = model_classes(index, d.rel, d.tree, name, depth + 1, seen)
        if sub:
            out += sub
    return out


_GUARD_MODEL = re.compile(r"next\(([A-Za-z_][\w.]*)\.parameters\(\)")
_PARAMS_MODEL = re.compile(r"([A-Za-z_][\w.]*)\.(?:named_)?parameters\(")


def _function_of(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    node: ast.AST = tree
    for part in qualname.split("."):
        nxt = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and n.name == part), None)
        if nxt is None:
            return node if node is not tree else None
        node = nxt
    return node


def _enclosing_class(tree: ast.Module, qualname: str) -> Optional[ast.ClassDef]:
    head = qualname.split(".")[0]
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == head), None)


def _classes_of_model(tree: ast.Module, qualname: str, model: str) -> list[str]:
    """The class names a model variable is built from in the site's function (``net = Net(...)``,
    ``m = Model.from_pretrained(...)``, also a wrapper ``m = DDP(m)``) or, for ``self.x``, in its class."""
    region = _enclosing_class(tree, qualname) if model.startswith("self.") else _function_of(tree, qualname)
    out: list[str] = []
    if region is None:
        return out
    for n in ast.walk(region):
        if not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)):
            continue
        if not any((ast.unparse(t) if isinstance(t, (ast.Name, ast.Attribute)) else "") == model for t in n.targets):
            continue
        f = n.value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr.startswith("from_"):
            f = f.value
        name = f.id if isinstance(f, ast.Name) else ""
        if name[:1].isupper() and name not in out:
            out.append(name)
    return out


def _drivers(index: RepoIndex, rel: str, qualname: str) -> list[str]:
    """Files that import the site's module and name its builder (where the trainer builds the model)."""
    stem = PurePosixPath(rel).stem if PurePosixPath(rel).stem != "__init__" else PurePosixPath(rel).parent.name
    builder = qualname.split(".")[0]
    out = []
    for f in index.files:
        if f == rel:
            continue
        text = index.text(f) or ""
        if stem in text and builder in text and ("import" in text) and rel in index.imported_files(f):
            out.append(f)
    return out[:8]


def site_random_skip(index: RepoIndex, rel: str, qualname: str, guard: str, params: str) -> Optional[tuple[RandomSkip, bool]]:
    """The random skip an optimizer site's model may include: (skip, resolved?) where ``resolved`` says
    the model's class was told (else the skip is one the trainer's imports or config reach)."""
    tree = index.tree(rel)
    if tree is None:
        return None
    m = _GUARD_MODEL.search(guard or "") or _PARAMS_MODEL.search(params or "")
    model = m.group(1) if m else ""
    told = [c for c in (model_classes(index, rel, tree, name) for name in _classes_of_model(tree, qualname, model)) if c is not None] \
        if model else []
    if told:
        # the model's class is one of the repo's (a wrapper such as DDP(...) is not): its own classes decide
        classes = [c for found in told for c in found]
        if classes:
            files = list(dict.fromkeys([rel, *(r for r, _ in classes)]))
            for r, node in classes:
                for s in skip_in_class(r, node):
                    if s.param is None or _drawn_by_a_caller(index, s, files):
                        return s, True
            return None
    starts = [rel, *_drivers(index, rel, qualname)]
    found = reachable_skips(index, starts)
    if not found and any("instantiate" in (index.text(f) or "") for f in starts):
        found = configured_skips(index, _config_texts(index))
    return (found[0], False) if found else None


def _config_texts(index: RepoIndex) -> list[str]:
    out: list[str] = []
    if index.root is None:
        return out
    try:
        for path in sorted(index.root.rglob("*")):
            if path.suffix in (".yaml", ".yml", ".json", ".toml") and path.is_file() and path.stat().st_size <= 1 << 20:
                text = path.read_text(encoding="utf-8", errors="replace")
                if "_target_" in text or "target:" in text or "class_path" in text:
                    out.append(text)
            if len(out) > 400:
                break
    except OSError:
        pass
    return out


def apply(root: Path, files: Iterable[str], outcomes: list, near: list, max_bytes: int, pattern: str = "fused_optimizer") -> None:
    """Turn fused_optimizer candidates whose model may skip a trainable submodule on random steps into
    near misses naming the skip (called once per scan by :mod:`npufuse.scan.repo_facts`)."""
    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == pattern]
    if not hits:
        return
    index = RepoIndex(root, files, max_bytes)
    for o, h in hits:
        f = h.finding
        found = site_random_skip(index, o.file, f.qualname, f.guard_tensor or "", str((f.params or {}).get("params", "")))
        if found is None:
            continue
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": reason(*found)})


def reason(skip: RandomSkip, resolved: bool) -> str:
    """The near-miss reason of an optimizer whose model may include ``skip``."""
    whose = "the model the optimizer takes" if resolved else "a model class the trainer's code reaches (its model is not told apart)"
    return (f"{whose} may skip a trainable submodule on random steps: {skip.where()}; its parameters then have no grad "
            "on such steps, and torch_npu fused optimizers build their flat buffers at the first step from the params "
            "that have a grad (one without is excluded for good) and zero grads in place (later such steps still apply "
            "momentum and weight decay where torch.optim skips the param)")


def in_file(rel: str, text: str, tree: ast.Module, root: Optional[Path], qualname: str, guard: str, params: str) -> Optional[str]:
    """The near-miss reason for an optimizer site from its own file alone (the scan's repo pass,
    :func:`apply`, looks further): a model class of the file (or one it imports, when ``root`` is
    known) that skips a submodule on random steps."""
    if "def forward" not in text and "import" not in text:
        return None
    index = RepoIndex(root, [rel], 1 << 24)
    index.seed(rel, text, tree)
    found = site_random_skip(index, rel, qualname, guard, params)
    return reason(*found) if found is not None else None
