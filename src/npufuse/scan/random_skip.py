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
import os
import re
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional

from npufuse.scan import grad_none

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

    __slots__ = ("rel", "cls", "line", "attr", "how", "param", "index", "rates", "node", "test")

    def __init__(self, rel: str, cls: str, line: int, attr: str, how: str, param: Optional[str] = None, index: int = -1,
                 rates: tuple[str, ...] = (), node: Optional[ast.ClassDef] = None, test: str = "") -> None:
        self.rel, self.cls, self.line, self.attr, self.how, self.param, self.index = rel, cls, line, attr, how, param, index
        # s38: the `self.` attributes the draw is compared with (`torch.rand(1) < self.p`), when every random read of
        # the test is such a comparison: with each of them 0 the decision is fixed for the run (not a random skip)
        self.rates, self.node = rates, node
        # s39: the text of a test on the step's data that decides the call (an MoE expert that receives no token);
        # empty for a random skip
        self.test = test

    @property
    def data_dependent(self) -> bool:
        return bool(self.test)

    def where(self) -> str:
        if self.test:
            return f"`{self.cls}` ({self.rel}:{self.line}) {self.how} `self.{self.attr}` depending on the step's data (`{self.test}`)"
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
                    if isinstance(n.value, ast.Call) and (_PARAMETER_FREE.search(_name(n.value.func)) or _augmentation(n.value.func)
                                                          or _torch_loss(n.value.func)):
                        continue  # nothing to train: skipping it changes no optimizer
                    for t in n.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            out.add(t.attr)
    return out


def _torch_loss(func: ast.AST) -> bool:
    """``nn.CrossEntropyLoss(...)`` / ``torch.nn.MSELoss(...)``: torch.nn's losses hold no parameters (s39: a loss
    computed only when a batch has targets is no skipped submodule); AdaptiveLogSoftmaxWithLoss has weights."""
    if not (isinstance(func, ast.Attribute) and func.attr.endswith("Loss") and func.attr != "AdaptiveLogSoftmaxWithLoss"):
        return False
    head = func.value
    return (isinstance(head, ast.Name) and head.id == "nn") or (
        isinstance(head, ast.Attribute) and head.attr == "nn" and isinstance(head.value, ast.Name) and head.value.id == "torch")


def _augmentation(func: ast.AST) -> bool:
    """A data-augmentation library's transform (``T.ColorJitter(...)``, ``K.RandomAffine(...)``,
    ``transforms.RandomCrop(...)``, ``A.Blur(...)``): applied at random by design, without parameters."""
    head = func
    while isinstance(head, ast.Attribute):
        head = head.value
    return isinstance(head, ast.Name) and head.id in _AUGMENTATION_MODULES and isinstance(func, ast.Attribute)


def _submodule_called(call: ast.Call, subs: set[str], loops: dict[str, str]) -> Optional[str]:
    """The submodule a call runs: ``self.x(...)``, an entry of a submodule list ``self.experts[i](...)`` (s39), or a
    name bound to one (a loop variable over ``self.layers``, ``expert = self.experts[i]``)."""
    f = call.func
    if isinstance(f, ast.Subscript):
        f = f.value
    attr = _self_attr(f)
    if attr is not None:
        return attr if attr in subs else None
    return loops.get(f.id) if isinstance(f, ast.Name) else None


def _called_submodules(nodes: Iterable[ast.AST], subs: set[str], loops: dict[str, str]) -> dict[str, int]:
    """Submodules called in ``nodes``: ``self.x(...)``, ``self.x[i](...)``, or a loop variable over ``self.x``
    (``for layer in self.layers``)."""
    out: dict[str, int] = {}
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                attr = _submodule_called(n, subs, loops)
                if attr is not None:
                    out.setdefault(attr, n.lineno)
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
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Subscript):
            attr = _self_attr(n.value.value)  # `expert = self.experts[i]` (s39)
            if attr in subs:
                out.update((t.id, attr) for t in n.targets if isinstance(t, ast.Name))  # type: ignore[misc]
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


def _self_attr(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _parents(fn: ast.AST) -> dict[int, ast.AST]:
    return {id(c): p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}


def _draw_names(fn: ast.AST) -> set[str]:
    """Names every binding of which in ``fn`` is a scalar draw (``p = torch.rand([])``, ``p = random.random()``)."""
    bound: dict[str, list[ast.AST]] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            bound.setdefault(n.targets[0].id, []).append(n.value)
    return {k for k, vs in bound.items() if all(_scalar_draw(v) for v in vs)}


def _rate_attrs(expr: ast.AST, fn: ast.AST, depth: int = 0) -> Optional[set[str]]:
    """The ``self.`` attributes a random test compares its draws with, when every random read in ``expr`` is such a
    comparison (``torch.rand(1).item() < self.drop_rate``, ``p < self.layerdrop`` with ``p = torch.rand([])``) or a
    flag whose random bindings are (``drop = True`` under such a test); else None. With those attributes 0 a
    scalar draw in [0, 1) gives the same answer every step."""
    draws = _draw_names(fn)
    covered: set[int] = set()
    rates: set[str] = set()
    for n in ast.walk(expr):
        if isinstance(n, ast.Compare) and len(n.comparators) == 1:
            for draw, rate in ((n.left, n.comparators[0]), (n.comparators[0], n.left)):
                attr = _self_attr(rate)
                if attr and (_scalar_draw(draw) or (isinstance(draw, ast.Name) and draw.id in draws)):
                    rates.add(attr)
                    covered |= {id(x) for x in ast.walk(n)}
    flags = _random_flags(fn)
    for n in ast.walk(expr):
        if id(n) in covered:
            continue
        if isinstance(n, ast.Call) and _name(n.func) in _RANDOM_CALLS:
            return None
        if isinstance(n, ast.Name) and (n.id in draws or n.id in flags):
            sub = _flag_rates(fn, n.id, depth + 1) if depth < 2 and n.id not in draws else None
            if sub is None:
                return None
            rates |= sub
    return rates or None


def _flag_rates(fn: ast.AST, name: str, depth: int) -> Optional[set[str]]:
    """:func:`_rate_attrs` of every random binding of the flag ``name`` in ``fn`` (a value computed from draws, or a
    constant set inside an ``if`` whose test draws); None when one of them is not decided by rates."""
    parents = _parents(fn)
    rates: set[str] = set()
    for n in ast.walk(fn):
        if not (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)):
            continue
        if isinstance(n.value, ast.Constant):
            up = parents.get(id(n))
            while up is not None and not isinstance(up, ast.If):
                up = parents.get(id(up))
            if up is None or not _draws(up.test, _random_flags(fn)):
                continue  # a constant bound outside a random test: fixed for the step
            sub = _rate_attrs(up.test, fn, depth)
        else:
            sub = _rate_attrs(n.value, fn, depth) if _draws(n.value, _random_flags(fn)) else set()
        if sub is None:
            return None
        rates |= sub
    return rates


# --- s39 (opt39): a submodule called only when a test on the step's data holds ---------------------------------------
# diff-MoE's `if mask.any(): out = self.general_experts[e](x[mask])`, moe-emergence's `if not mask.any(): continue`
# before `expert(x[mask])`: an expert no token reaches on a step is not called and gets no grad. torch.optim (the
# default `zero_grad(set_to_none=True)`) skips such a param; a fused class zeroes grads in place and still applies
# momentum / weight decay / Adam moments to it, and excludes for good one without a grad at the first step. Calling
# the expert on an empty selection (no test) gives it a zero grad in both: not this class.

# reads of a tensor's contents (whether any element is selected, how many)
_COUNT_READS = frozenset(("any", "all", "numel", "nelement", "nonzero", "count_nonzero", "sum", "item", "argwhere"))
# reads of a length (the data decides them when compared with 0 / 1, or tested for truth)
_LENGTH_READS = frozenset(("len", "size", "shape"))
# calls whose result lists the entries the data selects (`for e in ids.unique().tolist(): self.experts[e](...)`)
_SELECTING_CALLS = frozenset(("unique", "nonzero", "argwhere", "where", "tolist", "bincount", "masked_select"))
_NOT_DATA = frozenset(("self", "torch", "np", "numpy", "math", "F", "nn"))


def _reads_locals(node: ast.AST) -> bool:
    """Does ``node`` read a name other than ``self`` and a module (a forward's tensor or a value derived from one)?"""
    return any(isinstance(n, ast.Name) and n.id not in _NOT_DATA for n in ast.walk(node))


def _length_read(node: ast.AST, data: set[str]) -> bool:
    """``len(x)``, ``x.size(0)``, ``x.shape[0]`` of a value the data selects (``x`` in ``data``: ``token_idx, _ =
    torch.where(...)``, a list appended under a data test); a length of a list the model's configuration fixes
    (``len(sparse_embedding_list)``) is the same every step."""
    if isinstance(node, ast.Call) and _name(node.func) == "len" and node.args:
        operand: Optional[ast.AST] = node.args[0]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size":
        operand = node.func.value
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        operand = node.value.value
    else:
        return False
    while isinstance(operand, (ast.Subscript, ast.Attribute)):
        operand = operand.value
    return isinstance(operand, ast.Name) and operand.id in data


def _data_test(test: ast.AST, data: set[str]) -> bool:
    """Does the test read the step's data: a content read of a local tensor (``mask.any()``, ``idx.numel() == 0``,
    ``torch.any(m)``), a length of a value the data selects against 0 / 1 or as a truth value (``len(token_idx) ==
    0``, ``if rows.shape[0]:``), or a name bound from such reads?"""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _data_test(test.operand, data)
    if isinstance(test, ast.BoolOp):
        return any(_data_test(v, data) for v in test.values)
    if _length_read(test, data) or (isinstance(test, ast.Name) and test.id in data):
        return True
    if isinstance(test, ast.Compare) and len(test.comparators) == 1:
        left, right = test.left, test.comparators[0]
        for a, b in ((left, right), (right, left)):
            if (_length_read(a, data) or (isinstance(a, ast.Name) and a.id in data)) and isinstance(b, ast.Constant) and b.value in (0, 1):
                return True
    for n in ast.walk(test):
        # a tensor method (`mask.any()`) or torch's function (`torch.any(mask)`); the builtin `sum(list)` is no read
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _COUNT_READS:
            operand = n.func.value if not (isinstance(n.func.value, ast.Name) and n.func.value.id in _NOT_DATA) \
                else (n.args[0] if n.args else None)
            if operand is not None and _reads_locals(operand) and _self_attr(operand) is None:
                return True
    return False


class _AnyName(set):  # type: ignore[type-arg]
    """Holds every name: a test :func:`_data_test` would call data if every name were."""

    def __contains__(self, _name: object) -> bool:
        return True


_ANY_NAME = _AnyName()


def _data_names(fn: ast.AST) -> set[str]:
    """Names ``fn`` binds from a data test (``has = mask.any()``), from the entries the data selects (``token_idx, _
    = torch.where(ids == e)``, the targets of ``for i, n in enumerate(counts.tolist())``), and containers it fills
    under a data test (``if mask.any(): tokens[e].append(x[mask])``)."""
    out: set[str] = set()
    for _ in range(2):  # containers filled under a test on names bound before
        before = len(out)
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and (_data_test(n.value, out) or _selected(n.value)):
                out.update(t.id for tg in n.targets for t in ast.walk(tg) if isinstance(t, ast.Name))
            elif isinstance(n, (ast.For, ast.AsyncFor)) and _selected(n.iter):
                out.update(t.id for t in ast.walk(n.target) if isinstance(t, ast.Name))
            elif isinstance(n, ast.If) and _data_test(n.test, out):
                for c in ast.walk(n):
                    if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("append", "extend"):
                        head = c.func.value
                        while isinstance(head, ast.Subscript):
                            head = head.value
                        if isinstance(head, ast.Name):
                            out.add(head.id)
        if len(out) == before:
            break
    return out


def _selected(it: ast.AST) -> bool:
    """An iterable of the entries the data selects: ``ids.unique()``, ``torch.nonzero(counts)``, ``x.tolist()``."""
    return any(isinstance(n, ast.Call) and _name(n.func) in _SELECTING_CALLS and _reads_locals(n) and not (
        _self_attr(n.func.value) if isinstance(n.func, ast.Attribute) else None) for n in ast.walk(it))


def _enclosing_loop(parents: dict[int, ast.AST], node: ast.AST) -> Optional[ast.AST]:
    up = parents.get(id(node))
    while up is not None and not isinstance(up, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        up = parents.get(id(up))
    return up if isinstance(up, (ast.For, ast.AsyncFor, ast.While)) else None


def _skips(fn: ast.FunctionDef | ast.AsyncFunctionDef, subs: set[str], conditioned: set[str], data: bool = False
           ) -> list[tuple[int, str, str, tuple[str, ...], str]]:
    """(line, submodule, how, rates, test) of each submodule call that a test reading ``conditioned`` names (with
    ``data``: a test on the step's data, :func:`_data_test`) skips or discards in ``fn`` (``rates``:
    :func:`_rate_attrs` of a random test, () when it is not decided by rates; ``test``: the data test's text)."""
    loops = _loop_vars(fn, subs)
    held: dict[str, str] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            f = n.value.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in subs:
                held.update((t.id, f.attr) for t in n.targets if isinstance(t, ast.Name))
    out: list[tuple[int, str, str, tuple[str, ...], str]] = []
    everywhere = _called_submodules([fn], subs, loops)
    if not everywhere:
        return out
    names: Optional[set[str]] = None  # the data names: read only for a test that a name or a length could decide

    def data_test(test: ast.AST) -> bool:
        nonlocal names
        if _data_test(test, set()):
            return True
        if not _data_test(test, _ANY_NAME):  # no name or length the data could decide: `x is None`, `self.training`
            return False
        if names is None:
            names = _data_names(fn)
        return bool(names) and _data_test(test, names)

    parents: dict[int, ast.AST] = {}  # built on the first `continue` under a data test
    for n in ast.walk(fn):
        if isinstance(n, (ast.If, ast.IfExp)) and (data_test(n.test) if data else _draws(n.test, conditioned)):
            body = n.body if isinstance(n.body, list) else [n.body]
            orelse = n.orelse if isinstance(n.orelse, list) else [n.orelse]
            a, b = _called_submodules(body, subs, loops), _called_submodules(orelse, subs, loops)
            outside = _calls_outside(fn, n, subs, loops)
            found: list[tuple[str, str]] = [(attr, "skips the call of") for attr in sorted((set(a) ^ set(b)) - outside)]
            for arm in (body, orelse):
                gone = _discarded(arm, held)
                if gone is not None and gone[0] in subs:
                    found.append((gone[0], "replaces by a constant the output of"))
            # `for blk in self.blocks: if torch.rand([]) < p: continue`: the rest of the loop body is skipped
            if isinstance(n, ast.If) and any(isinstance(s, ast.Continue) for s in n.body):
                found += [(attr, "skips the call of") for attr in sorted(set(loops.values()) & set(everywhere))]
                if data and not parents:
                    parents = _parents(fn)
                loop = _enclosing_loop(parents, n) if data else None
                if loop is not None:
                    # `for e in range(E): if not mask.any(): continue; self.experts[e](x[mask])`: the calls after the test
                    later = [s for s in ast.walk(loop) if isinstance(s, ast.stmt) and s.lineno > (n.end_lineno or n.lineno)]
                    after = set(_called_submodules(later, subs, loops)) - _calls_outside(fn, loop, subs, loops)
                    found += [(attr, "skips the call of") for attr in sorted(after) if (attr, "skips the call of") not in found]
            if found:
                rates = tuple(sorted(_rate_attrs(n.test, fn) or ())) if not data and not (conditioned - _random_flags(fn)) else ()
                test = " ".join(ast.unparse(n.test).split())[:80] if data else ""
                out += [(n.lineno, attr, how, rates, test) for attr, how in found]
    if data:
        # `for e in ids.unique().tolist(): out += self.experts[e](x[ids == e])`: only the experts the data selects run
        for n in ast.walk(fn):
            if isinstance(n, (ast.For, ast.AsyncFor)) and _selected(n.iter):
                targets = {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
                for c in ast.walk(n):
                    if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript) and _self_attr(c.func.value) in subs \
                            and any(isinstance(x, ast.Name) and x.id in targets for x in ast.walk(c.func.slice)):
                        test = f"for {ast.unparse(n.target)} in {' '.join(ast.unparse(n.iter).split())[:60]}"
                        out.append((n.lineno, _self_attr(c.func.value), "calls only the entries the data selects of", (), test))  # type: ignore[arg-type]
                        break
    return out


def _calls_outside(fn: ast.AST, branch: ast.AST, subs: set[str], loops: dict[str, str]) -> set[str]:
    inside = {id(x) for x in ast.walk(branch)}
    rest = [x for x in ast.walk(fn) if id(x) not in inside and isinstance(x, ast.Call)]
    return {a for a in (_submodule_called(c, subs, loops) for c in rest) if a is not None}  # type: ignore[misc]


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
        for line, attr, how, rates, _test in _skips(fn, subs, _random_flags(fn)):
            found.append(RandomSkip(rel, cls.name, line, attr, how, rates=rates, node=cls))
    for fn in [forward, *(methods[m] for m in sorted(called) if m != "forward")]:
        for line, attr, how, _rates, test in _skips(fn, subs, set(), data=True):
            found.append(RandomSkip(rel, cls.name, line, attr, how, node=cls, test=test))
    # s46 (optim46): one entry of a submodule list chosen per call by an argument or a draw (NAS supernets)
    from npufuse.patterns._optim_s46 import chosen_entries

    for fn in [forward, *(methods[m] for m in sorted(called) if m != "forward")]:
        for line, attr, test in chosen_entries(fn, subs):
            found.append(RandomSkip(rel, cls.name, line, attr, "runs only one entry of", node=cls, test=test))
    if found:
        return found
    # the draw is the caller's: a forward parameter decides the skip (`if not uncond_fwd: self.ref(...)`)
    a = forward.args
    params = [x.arg for x in (*a.posonlyargs, *a.args)][1:]
    for i, p in enumerate(params):
        for line, attr, how, _rates, _test in _skips(forward, subs, {p}):
            found.append(RandomSkip(rel, cls.name, line, attr, how, p, i, node=cls))
    for p in (x.arg for x in a.kwonlyargs):
        for line, attr, how, _rates, _test in _skips(forward, subs, {p}):
            found.append(RandomSkip(rel, cls.name, line, attr, how, p, -1, node=cls))
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
        self._rates: dict[str, list[tuple[str, float]]] = {}
        self._configs: Optional[list[tuple[str, str]]] = None
        self._imports: dict[str, list[str]] = {}
        # s39 (perf39): per-file answers the per-site questions repeat over the same unchanged trees (icefall: 36
        # optimizer sites asked the same few hundred files again, 189 s); each is what the old per-call walk computed
        self._draws_random: dict[str, bool] = {}
        self._flagged_functions: dict[str, list[tuple[ast.AST, set[str], dict[str, set[str]], list[ast.Call]]]] = {}
        self._caller_draws: dict[tuple[str, str, int, Optional[str]], bool] = {}
        self._registrations: dict[str, tuple[dict[str, set[str]], set[int]]] = {}
        self.reached: dict[tuple[str, ...], list[str]] = {}  # starts -> reachable_files (a copy is handed out)
        self._parents: dict[int, tuple[ast.AST, dict[int, ast.AST]]] = {}
        self._string_constants: dict[str, dict[str, list[int]]] = {}
        self._top_references: dict[str, list[tuple[ast.stmt, dict[str, list[ast.AST]]]]] = {}
        self._grad_none: dict[str, list[tuple[int, str]]] = {}
        self.drivers: dict[tuple[str, str], list[str]] = {}  # (site file, builder) -> _drivers
        self.handed: dict[tuple[str, str, str], Optional["HandedIn"]] = {}  # (site file, class, attribute) -> handed_in_models
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

    def rate_evidence(self, key: str) -> list[tuple[str, float]]:
        """What the repository's Python files and configuration files set ``key`` to (:func:`_rate_evidence`,
        :func:`_config_evidence`), read once per key."""
        got = self._rates.get(key)
        if got is None:
            got = []
            for rel in self.files:
                text = self.text(rel) or ""
                if key in text or key.replace("_", "-") in text:  # `add_argument("--drop-rate", ...)`
                    tree = self.tree(rel)
                    got += _rate_evidence(tree, key) if tree is not None else [("unknown", 0.0)]
            for text in self.config_texts():
                if key in text or key.replace("_", "-") in text:
                    got += _config_evidence(text, key)
            self._rates[key] = got
        return got

    def config_texts(self) -> list[str]:
        """The texts of :meth:`config_files`."""
        return [text for _, text in self.config_files()]

    def config_files(self) -> list[tuple[str, str]]:
        """(suffix, text) of the repository's configuration files and run scripts (yaml / json / toml / sh / cfg /
        ini; 1 MiB each at most, 2000 files), read once."""
        if self._configs is None:
            self._configs = []
            if self.root is not None:
                for top, dirs, names in os.walk(self.root):  # links are not followed (an untrusted repository)
                    # hidden folders, environments and caches hold no configuration of the repository's runs
                    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _NOT_CONFIG_DIRS
                                     and not os.path.isfile(os.path.join(top, d, "pyvenv.cfg")))
                    for name in sorted(names):
                        path = Path(top) / name
                        try:
                            if path.suffix in _CONFIG_SUFFIXES and not path.is_symlink() and path.stat().st_size <= 1 << 20:
                                self._configs.append((path.suffix, path.read_text(encoding="utf-8", errors="replace")))
                        except OSError:
                            continue
                    if len(self._configs) >= 2000:
                        break
        return self._configs

    def draws_random(self, rel: str) -> bool:
        """Does the file's text call a random draw (:data:`_RANDOM_WORDS`)? Searched once per file."""
        got = self._draws_random.get(rel)
        if got is None:
            got = self._draws_random[rel] = bool(_RANDOM_WORDS.search(self.text(rel) or ""))
        return got

    def flagged_functions(self, rel: str) -> list[tuple[ast.AST, set[str], dict[str, set[str]], list[ast.Call]]]:
        """The file's functions (nested ones too, in :func:`ast.walk` order) that bind a random flag: (function, its
        :func:`_random_flags`, called name -> the plain names it assigns that call to, the calls of a plain name in
        walk order), read once per file for :func:`_drawn_by_a_caller`."""
        got = self._flagged_functions.get(rel)
        if got is None:
            got = []
            tree = self.tree(rel)
            for fn in ast.walk(tree) if tree is not None else ():
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                flags = _random_flags(fn)
                if not flags:
                    continue
                built: dict[str, set[str]] = {}
                named_calls: list[ast.Call] = []
                for n in ast.walk(fn):
                    if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
                        built.setdefault(_name(n.value.func), set()).update(t.id for t in n.targets if isinstance(t, ast.Name))
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                        named_calls.append(n)
                got.append((fn, flags, built, named_calls))
            self._flagged_functions[rel] = got
        return got

    def caller_draws(self, rel: str, cls: str, index: int, param: Optional[str]) -> bool:
        """Does a function of ``rel`` call an object it built from ``cls`` with a random-drawn value for the forward
        parameter ``param`` (position ``index``)? Answered once per (file, class, parameter)."""
        key = (rel, cls, index, param)
        got = self._caller_draws.get(key)
        if got is None:
            got = self._caller_draws[key] = self._read_caller_draws(rel, cls, index, param)
        return got

    def _read_caller_draws(self, rel: str, cls: str, index: int, param: Optional[str]) -> bool:
        if cls not in (self.text(rel) or "") or not self.draws_random(rel):
            return False
        for _fn, flags, built, named_calls in self.flagged_functions(rel):
            objects = built.get(cls)
            if not objects:
                continue
            for c in named_calls:
                if c.func.id not in objects:  # type: ignore[attr-defined]
                    continue
                arg = c.args[index] if 0 <= index < len(c.args) else next((k.value for k in c.keywords if k.arg == param), None)
                if arg is not None and _draws(arg, flags):
                    return True
        return False

    def registrations(self, rel: str) -> tuple[dict[str, set[str]], set[int]]:
        """(class / function name -> its registry names, ids of the registration nodes) the file holds
        (:meth:`Registry._read` over its tree), read once per file; every :class:`Registry` merges copies."""
        got = self._registrations.get(rel)
        if got is None:
            reader = Registry(self, [])
            text = self.text(rel) or ""
            tree = self.tree(rel) if "register" in text or "{" in text else None
            for n in ast.walk(tree) if tree is not None else ():
                reader._read(n)
            got = self._registrations[rel] = (reader.keys, reader.positions)
        return got

    def top_references(self, rel: str) -> list[tuple[ast.stmt, dict[str, list[ast.AST]]]]:
        """The file's top-level statements other than imports, each with name -> the ``Name`` / ``Attribute``
        nodes under it that read that name (in :func:`ast.walk` order), read once per file for
        :meth:`Registry._referrers`."""
        got = self._top_references.get(rel)
        if got is None:
            got = []
            tree = self.tree(rel)
            for top in tree.body if tree is not None else ():
                if isinstance(top, (ast.Import, ast.ImportFrom)):
                    continue
                refs: dict[str, list[ast.AST]] = {}
                for n in ast.walk(top):
                    if isinstance(n, ast.Name):
                        refs.setdefault(n.id, []).append(n)
                    elif isinstance(n, ast.Attribute):
                        refs.setdefault(n.attr, []).append(n)
                got.append((top, refs))
            self._top_references[rel] = got
        return got

    def parents(self, fn: ast.AST) -> dict[int, ast.AST]:
        """:func:`_parents` of a node of the index's trees, built once per node (the node is held: its id stays its)."""
        got = self._parents.get(id(fn))
        if got is None:
            got = self._parents[id(fn)] = (fn, _parents(fn))
        return got[1]

    def string_constants(self, rel: str) -> dict[str, list[int]]:
        """String constant -> ids of the file's ``Constant`` nodes holding it, read once per file for
        :meth:`Registry._read_used` (which asked each key of each site's registry over the whole tree)."""
        got = self._string_constants.get(rel)
        if got is None:
            got = {}
            tree = self.tree(rel)
            for n in ast.walk(tree) if tree is not None else ():
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    got.setdefault(n.value, []).append(id(n))
            self._string_constants[rel] = got
        return got

    def grad_none_reads(self, rel: str) -> list[tuple[int, str]]:
        """The grad-None tests of one file whose outcome a zero grad changes (:func:`grad_none.reads`), read once per
        scan (s40)."""
        got = self._grad_none.get(rel)
        if got is None:
            text = self.text(rel) or ""
            got = self._grad_none[rel] = grad_none.reads(text, self.tree(rel) if grad_none.WORD in text else None)
        return got

    def imported_files(self, rel: str) -> list[str]:
        """Files of the repo that ``rel`` imports (absolute and relative imports), read once per file (s39: each
        optimizer site follows the trainer's imports again)."""
        got = self._imports.get(rel)
        if got is None:
            got = self._imports[rel] = self._read_imports(rel)
        return got

    def _read_imports(self, rel: str) -> list[str]:
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


def reachable_files(index: RepoIndex, starts: Iterable[str]) -> list[str]:
    """The ``starts`` and the files of the repo they import, transitively (bounded); followed once per scan for the
    same starts (a site asks twice: its registry and its skips)."""
    seen = list(dict.fromkeys(starts))
    key = tuple(seen)
    got = index.reached.get(key)
    if got is not None:
        return list(got)
    members = set(seen)  # membership by set: icefall's closures hold hundreds of files
    frontier = list(seen)
    for _ in range(_MAX_DEPTH):
        nxt: list[str] = []
        for rel in frontier:
            for f in index.imported_files(rel):
                if f not in members:
                    members.add(f)
                    seen.append(f)
                    nxt.append(f)
        frontier = nxt
    index.reached[key] = list(seen)
    return seen


def reachable_skips(index: RepoIndex, starts: Iterable[str]) -> list[RandomSkip]:
    """Random-skip classes in the files the ``starts`` import, transitively (bounded), whose skip is
    drawn in the class or by a caller in those files."""
    seen = reachable_files(index, starts)
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


# --- s38 (opt38): a draw against a rate that is 0 in every configuration of the repository decides nothing ---------
# wenet's Branchformer layer drops its attention branch when `torch.rand(1).item() < self.attn_branch_drop_rate`; the
# rate's default is 0.0 (the layer's and the encoder's `__init__`) and the repository's only config sets 0.0: the
# skip never fires. A rate any config, caller or default sets to another value (seed-vc's `class_dropout_prob: 0.1`),
# or to a value the scan cannot read, keeps the skip.

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".sh", ".cfg", ".ini")  # run scripts pass `--arch x --drop 0.1`
_NOT_CONFIG_DIRS = frozenset(("node_modules", "__pycache__", "site-packages", "build", "dist"))
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def _rate_key(cls: ast.ClassDef, attr: str) -> Optional[tuple[str, Optional[ast.expr]]]:
    """(the name a caller or a configuration sets ``self.<attr>`` by, the ``__init__`` default when it is a parameter
    of the class: an expression or None) from the one assignment ``__init__`` makes: ``self.p = p`` (a parameter),
    ``self.p = cfg.key`` / ``cfg["key"]`` / ``cfg.get("key", d)``; None for anything else."""
    init = next((f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "__init__"), None)
    if init is None:
        return None
    values = [n.value for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
              and any(_self_attr(t) == attr for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    if len(values) != 1:
        return None
    v = values[0]
    if isinstance(v, ast.Name):
        a = init.args
        positional = [*a.posonlyargs, *a.args]
        defaults: dict[str, Optional[ast.expr]] = {x.arg: None for x in (*positional, *a.kwonlyargs)}
        defaults.update({x.arg: d for x, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)})
        defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults)})
        return (v.id, defaults[v.id]) if v.id in defaults else None
    if isinstance(v, ast.Attribute):
        return v.attr, None
    if isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Constant) and isinstance(v.slice.value, str):
        return v.slice.value, None
    if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get" and v.args
            and isinstance(v.args[0], ast.Constant) and isinstance(v.args[0].value, str)):
        return v.args[0].value, (v.args[1] if len(v.args) > 1 else None)
    return None


def _rate_value(v: Optional[ast.expr], key: Optional[str]) -> tuple[str, float]:
    """("number", x) for a literal, ("pass", 0) for a value handed along under the same name ``key`` (``p=p``,
    ``p=cfg.p``, ``p=rates[i]``; None: a default, never handed along), ("unknown", 0) otherwise."""
    if isinstance(v, ast.UnaryOp) and isinstance(v.op, (ast.USub, ast.UAdd)) and isinstance(v.operand, ast.Constant):
        v = ast.Constant(-v.operand.value if isinstance(v.op, ast.USub) and isinstance(v.operand.value, (int, float)) else v.operand.value)
    if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) and not isinstance(v.value, bool):
        return "number", float(v.value)
    if key is not None and v is not None and _handed_along(v, key):
        return "pass", 0.0
    return "unknown", 0.0


def _handed_along(v: ast.AST, key: str) -> bool:
    """Is ``v`` the value of ``key`` itself, unchanged: ``key``, ``x.key``, ``x["key"]``, ``x.get("key", ...)``, one
    element of it (``key[i]``), or a list repeating it (``[key] * n``)? (``x.key or 0.1`` is not.)"""
    while True:
        if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult):
            v = v.left if isinstance(v.left, (ast.List, ast.Tuple)) else v.right
        elif isinstance(v, (ast.List, ast.Tuple)) and len(v.elts) == 1:
            v = v.elts[0]
        elif isinstance(v, ast.Subscript) and not (isinstance(v.slice, ast.Constant) and isinstance(v.slice.value, str)):
            v = v.value
        else:
            break
    if isinstance(v, ast.Name):
        return v.id == key
    if isinstance(v, ast.Attribute):
        return v.attr == key
    if isinstance(v, ast.Subscript):
        return v.slice.value == key  # type: ignore[attr-defined]
    return (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get" and len(v.args) == 1
            and isinstance(v.args[0], ast.Constant) and v.args[0].value == key)  # (a default of its own is a value)


def _rate_evidence(tree: ast.Module, key: str) -> list[tuple[str, float]]:
    """What one file sets ``key`` to: parameter defaults, keyword arguments, assignments to ``key`` / ``x.key``,
    dict literal entries, ``add_argument("--key", default=...)``."""
    out: list[tuple[str, float]] = []
    dashed = {f"--{key}", f"--{key.replace('_', '-')}"}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
            out += [_rate_value(d, None) for x, d in pairs if x.arg == key and d is not None]
        elif isinstance(n, ast.Call):
            out += [_rate_value(k.value, key) for k in n.keywords if k.arg == key]
            if (_name(n.func) == "add_argument" and n.args and isinstance(n.args[0], ast.Constant)
                    and n.args[0].value in dashed):
                out += [_rate_value(k.value, None) for k in n.keywords if k.arg == "default"]
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if (isinstance(t, ast.Name) and t.id == key) or (isinstance(t, ast.Attribute) and t.attr == key):
                    out.append(_rate_value(n.value, key))
        elif isinstance(n, ast.Dict):
            out += [_rate_value(v, key) for k, v in zip(n.keys, n.values) if isinstance(k, ast.Constant) and k.value == key]
    return out


def _config_evidence(text: str, key: str) -> list[tuple[str, float]]:
    """``key: value`` / ``"key": value`` / ``key = value`` entries of a yaml / json / toml text."""
    out: list[tuple[str, float]] = []
    entries = r"(?<![\w.-])[\"']?" + re.escape(key) + r"[\"']?\s*[:=]\s*([^\s,#}\]]*)"
    # a run script's `--drop-rate 0.1` / `--drop_rate=0.1`
    flags = r"--(?:" + re.escape(key) + "|" + re.escape(key.replace("_", "-")) + r")(?:\s+|=)([^\s\\;]*)"
    for m in [*re.finditer(entries, text), *re.finditer(flags, text)]:
        value = m.group(1).strip("\"'")
        out.append(("number", float(value)) if _NUMBER.match(value) else ("unknown", 0.0))
    return out


def _positional_evidence(index: "RepoIndex", cls: ast.ClassDef, key: str) -> list[tuple[str, float]]:
    """What the repository's constructions of ``cls`` pass by position for its ``__init__`` parameter ``key``
    (``Layer(8, 0.3)``), subclasses' ``super().__init__(...)`` included; a ``*args`` before it is unknown."""
    init = next((f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "__init__"), None)
    params = [x.arg for x in (*init.args.posonlyargs, *init.args.args)][1:] if init is not None else []
    if key not in params:
        return []
    at = params.index(key)
    out: list[tuple[str, float]] = []
    for rel in index.files:
        if cls.name not in (index.text(rel) or ""):
            continue
        tree = index.tree(rel)
        subclasses = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                      and any(_name(b) == cls.name for b in c.bases)} if tree is not None else set()
        for n in ast.walk(tree) if tree is not None else ():
            if not isinstance(n, ast.Call):
                continue
            direct = _name(n.func) == cls.name
            parent = (subclasses and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"
                      and isinstance(n.func.value, ast.Call) and _name(n.func.value.func) == "super")
            if not (direct or parent):
                continue
            if any(isinstance(a, ast.Starred) for a in n.args[: at + 1]):
                out.append(("unknown", 0.0))
            elif at < len(n.args):
                out.append(_rate_value(n.args[at], key))
    return out


def never_drawn(index: "RepoIndex", s: RandomSkip) -> bool:
    """Is the skip's draw compared only with rates that are 0 wherever the repository sets them (a default of 0,
    and no caller, config or command-line default giving another value or one the scan cannot read)?"""
    if not s.rates or s.node is None:
        return False
    for attr in s.rates:
        got = _rate_key(s.node, attr)
        if got is None:
            return False
        key, default = got
        values = ([_rate_value(default, None)] if default is not None else []) + index.rate_evidence(key) \
            + _positional_evidence(index, s.node, key)
        values = [v for v in values if v[0] != "pass"]
        if not values or any(kind != "number" or x != 0.0 for kind, x in values):
            return False
    return True


# --- s38 (opt38): a skipped submodule that is frozen gets no grad on any step ------------------------------------
# Moore-AnimateAnyone's stage 2 builds `Net(reference_unet, ...)` after `reference_unet.requires_grad_(False)`: the
# uncond steps skip a submodule that never has a grad (both optimizers leave it alone). Stage 1 unfreezes it
# (`for name, param in reference_unet.named_parameters(): ... param.requires_grad_(True)`): still a skip.

_NO_GRAD_CONTEXTS = frozenset(("no_grad", "inference_mode"))


def _freezes(call: ast.AST) -> Optional[bool]:
    """True for ``x.requires_grad_(False)``, False for ``x.requires_grad_()`` / ``x.requires_grad_(True)`` (or a
    flag), None for any other node; an assignment ``x.requires_grad = <c>`` likewise."""
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "requires_grad_":
        flag = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "requires_grad"), None)
        return isinstance(flag, ast.Constant) and flag.value is False
    if isinstance(call, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "requires_grad" for t in call.targets):
        return isinstance(call.value, ast.Constant) and call.value.value is False
    return None


def _receiver(node: ast.AST) -> Optional[ast.AST]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value
    if isinstance(node, ast.Assign):
        return next((t.value for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "requires_grad"), None)
    return None


def _frozen_object(region: ast.AST, names: set[str]) -> bool:
    """Does ``region`` freeze the object a name of ``names`` holds (``x.requires_grad_(False)``, ``for p in
    x.parameters(): p.requires_grad = False``) and never unfreeze it or anything bound from it (``for n, p in
    x.named_parameters(): p.requires_grad_(True)``)?"""
    from npufuse.scan.dataflow import dotted, names_bound_from

    heads = {n.split(".")[0] for n in names}
    derived = names_bound_from(region, heads, 3)
    # loop variables over all of an object's parameters: `for p in x.parameters():` (a part of it is not the whole)
    whole = {n.target.id for n in ast.walk(region) if isinstance(n, (ast.For, ast.AsyncFor)) and isinstance(n.target, ast.Name)
             and isinstance(n.iter, ast.Call) and isinstance(n.iter.func, ast.Attribute) and n.iter.func.attr == "parameters"
             and dotted(n.iter.func.value) in names}
    parents = _parents(region)
    frozen = False
    for n in ast.walk(region):
        verdict = _freezes(n)
        recv = _receiver(n) if verdict is not None else None
        path = dotted(recv) if recv is not None else None
        if path is None:
            continue
        if verdict and (path in names or path in whole) and _unconditional(n, parents, region):
            frozen = True
        elif not verdict and path.split(".")[0] in derived:
            return False
    return frozen


def _unconditional(node: ast.AST, parents: dict[int, ast.AST], region: ast.AST) -> bool:
    """Does ``node`` run whenever ``region`` runs (no ``if`` / ``while`` / ``try`` handler / conditional expression
    between; a ``for`` over parameters is the freezing loop itself)?"""
    up = parents.get(id(node))
    while up is not None and up is not region:
        if isinstance(up, (ast.If, ast.IfExp, ast.While, ast.ExceptHandler, ast.BoolOp)):
            return False
        up = parents.get(id(up))
    return True


def _no_grad_only(cls: ast.ClassDef, attr: str) -> bool:
    """Is every call of ``self.<attr>`` in the class inside ``with torch.no_grad()`` / ``torch.inference_mode()``?"""
    calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call) and _self_attr(n.func) == attr]
    covered: set[int] = set()
    for w in ast.walk(cls):
        if isinstance(w, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call) and _name(i.context_expr.func) in _NO_GRAD_CONTEXTS for i in w.items):
            covered |= {id(x) for x in ast.walk(w)}
    return bool(calls) and all(id(c) in covered for c in calls)


def frozen_in_class(s: RandomSkip) -> bool:
    """Does the class itself freeze the skipped submodule (``self.x.requires_grad_(False)``, ``for p in
    self.x.parameters(): p.requires_grad = False``) or call it only without grad?"""
    if s.node is None:
        return False
    if _no_grad_only(s.node, s.attr):
        return True
    return any(_frozen_object(fn, {f"self.{s.attr}"}) for fn in s.node.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _frozen_at_construction(region: ast.AST, model: str, s: RandomSkip, construction: ast.Call) -> bool:
    """The site's function hands the skipped submodule to the model's constructor (``Net(reference_unet, ...)``
    where ``__init__`` stores ``self.reference_unet = reference_unet``) and freezes that object, or freezes
    ``model.<attr>`` itself."""
    names = {f"{model}.{s.attr}"}
    init = next((f for f in (s.node.body if s.node else []) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and f.name == "__init__"), None)
    if init is not None:
        stored = {n.value.id for n in ast.walk(init) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
                  and any(_self_attr(t) == s.attr for t in n.targets)}
        params = [x.arg for x in (*init.args.posonlyargs, *init.args.args)][1:]
        from npufuse.scan.dataflow import dotted

        for i, a in enumerate(construction.args):
            if isinstance(a, ast.Starred):
                break
            if i < len(params) and params[i] in stored and dotted(a):
                names.add(dotted(a))  # type: ignore[arg-type]
        names |= {dotted(k.value) for k in construction.keywords if k.arg in stored and dotted(k.value)}  # type: ignore[misc]
    return _frozen_object(region, names)


# --- s38 (opt38): DDP told that every parameter gets a grad every step -------------------------------------------
# `DistributedDataParallel(model, find_unused_parameters=False)` (or accelerate's `DistributedDataParallelKwargs`,
# Lightning's `DDPStrategy`) fails the step after one where a trainable parameter got no grad ("Expected to have
# finished reduction in the prior iteration"): training code that states it has no parameter a step leaves
# without a grad.

def every_param_used(index: "RepoIndex", files: Iterable[str]) -> Optional[str]:
    """``file:line`` of a ``find_unused_parameters=False`` the training files state, when every
    ``find_unused_parameters`` keyword there is a literal False; else None."""
    found: Optional[str] = None
    for rel in files:
        if "find_unused_parameters" not in (index.text(rel) or ""):
            continue
        tree = index.tree(rel)
        for n in ast.walk(tree) if tree is not None else ():
            for k in (n.keywords if isinstance(n, ast.Call) else []):
                if k.arg == "find_unused_parameters":
                    if not (isinstance(k.value, ast.Constant) and k.value.value is False):
                        return None
                    found = found or f"{rel}:{n.lineno}"
    return found


def _drawn_by_a_caller(index: RepoIndex, s: RandomSkip, files: Iterable[str]) -> bool:
    """Does a function of ``files`` call an object it built from ``s.cls`` with a random-drawn value
    for the parameter the skip reads (by position or keyword)?"""
    # per file, from the index's per-file functions and memo (s39, perf39: 878 calls walked the same files again)
    return any(index.caller_draws(rel, s.cls, s.index, s.param) for rel in files)


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
    if qualname == "<module>":
        return tree  # a script's optimizer: the model is built at module level too (s39)
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
    return list(dict.fromkeys(name for name, _call in _constructions(tree, qualname, model)))


def _constructions(tree: ast.Module, qualname: str, model: str) -> list[tuple[str, ast.Call]]:
    """(class name, call) of each construction :func:`_classes_of_model` reads."""
    region = _enclosing_class(tree, qualname) if model.startswith("self.") else _function_of(tree, qualname)
    out: list[tuple[str, ast.Call]] = []
    if region is None:
        return out
    for n in ast.walk(region):
        if not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)):
            continue
        if not any((ast.unparse(t) if isinstance(t, (ast.Name, ast.Attribute)) else "") == model for t in n.targets):
            continue
        call = n.value
        # `Model(...).to(device)`, `.cuda()`: the construction is the innermost call (s39)
        while isinstance(call.func, ast.Attribute) and call.func.attr in _MOVES and isinstance(call.func.value, ast.Call):
            call = call.func.value
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr.startswith("from_"):
            f = f.value
        name = f.id if isinstance(f, ast.Name) else ""
        if name[:1].isupper():
            out.append((name, call))
    return out


_MOVES = frozenset(("to", "cuda", "npu", "cpu", "float", "half", "train", "eval", "requires_grad_"))


def _drivers(index: RepoIndex, rel: str, qualname: str) -> list[str]:
    """Files that import the site's module and name its builder (where the trainer builds the model)."""
    stem = PurePosixPath(rel).stem if PurePosixPath(rel).stem != "__init__" else PurePosixPath(rel).parent.name
    builder = qualname.split(".")[0]
    got = index.drivers.get((rel, builder))  # s40: asked again by the grad-None readers' pass of the same site
    if got is not None:
        return list(got)
    out = []
    for f in index.files:
        if f == rel:
            continue
        text = index.text(f) or ""
        if stem in text and builder in text and ("import" in text) and rel in index.imported_files(f):
            out.append(f)
    index.drivers[(rel, builder)] = out[:8]
    return out[:8]


# --- s40 (wrong40): a model handed to a trainer's constructor -------------------------------------------------------
# `class Trainer: def __init__(self, model): self.model = model; self.opt = AdamW(self.model.parameters())` builds the
# optimizer over whatever each `Trainer(...)` passes: the classes those instantiations construct decide, as for a model
# built where the optimizer is (a driver importing the trainer through a package's `__init__` is found here too).

class HandedIn:
    """What the instantiations of a trainer class pass for the constructor argument its model attribute holds:
    ``classes`` (model_classes of each resolved argument), ``sites`` (``file:line`` of every instantiation),
    ``unknown`` (a sentence per instantiation whose argument npufuse does not resolve to a repository class),
    ``files`` (the files holding the instantiations)."""

    __slots__ = ("classes", "sites", "unknown", "files")

    def __init__(self) -> None:
        self.classes: list[list[tuple[str, ast.ClassDef]]] = []
        self.sites: list[str] = []
        self.unknown: list[str] = []
        self.files: list[str] = []


def _holds_argument(value: ast.AST, names: set[str]) -> bool:
    """Is ``value`` one of ``names`` or that object moved / wrapped (``model.to(dev)``, ``DDP(model)``,
    ``torch.compile(model)``): the same parameters either way?"""
    while isinstance(value, ast.Call):
        f = value.func
        if isinstance(f, ast.Attribute) and f.attr in _MOVES and not value.args[1:]:
            value = f.value
        elif value.args:
            value = value.args[0]
        else:
            return False
    return (ast.unparse(value) if isinstance(value, (ast.Name, ast.Attribute)) else "") in names


def _constructor_argument(cls: ast.ClassDef, attr: str) -> Optional[tuple[int, str]]:
    """(position, name) of the ``__init__`` parameter every store of ``attr`` (``self.model``) in the class holds,
    position -1 for a keyword-only one; None when a store holds anything else."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return None
    positional = [a.arg for a in init.args.posonlyargs + init.args.args][1:]
    candidates = set(positional) | {a.arg for a in init.args.kwonlyargs}
    found: Optional[str] = None
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        if not any(isinstance(t, ast.Attribute) and ast.unparse(t) == attr for t in targets):
            continue
        value = getattr(n, "value", None)
        if value is None or isinstance(n, ast.AugAssign):
            return None
        direct = next((c for c in candidates if _holds_argument(value, {c})), None)
        if direct is not None and n in ast.walk(init) and found in (None, direct):
            found = direct
        elif not _holds_argument(value, {attr}):
            return None  # rebound to something else (a model built here, a copy): not the argument alone
    if found is None:
        return None
    return (positional.index(found) if found in positional else -1), found


def _region_of(tree: ast.Module, node: ast.AST) -> ast.AST:
    """The innermost function holding ``node`` (by lines), else the module."""
    best: ast.AST = tree
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno <= node.lineno <= (fn.end_lineno or fn.lineno) \
                and (best is tree or fn.lineno >= best.lineno):  # type: ignore[attr-defined]
            best = fn
    return best


def _unmoved(value: ast.AST) -> ast.AST:
    """The construction under moves of its result (``Net(...).to(device).train()`` -> ``Net(...)``)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _MOVES \
            and isinstance(value.func.value, ast.Call):
        value = value.func.value
    return value


def _call_argument(call: ast.Call, pos: int, name: str) -> Optional[ast.expr]:
    """What ``call`` passes for parameter ``name`` at position ``pos`` (-1: keyword-only): by keyword, else by
    position where no ``*args`` comes before it."""
    given = next((k.value for k in call.keywords if k.arg == name), None)
    if given is None and 0 <= pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:pos + 1]):
        given = call.args[pos]
    return given


def _argument_classes(index: RepoIndex, rel: str, tree: ast.Module, call: ast.Call, arg: ast.AST) -> Optional[list[str]]:
    """The class names the argument of an instantiation is built from in its file: a construction in place
    (``Net(...)``, ``Net.from_pretrained(...)``, moved / wrapped) or a local bound to such constructions; None
    when any binding is something else (a factory, a parameter, a loaded object)."""
    def built(value: ast.AST) -> Optional[str]:
        value = _unmoved(value)
        if not isinstance(value, ast.Call):
            return None
        f = value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr.startswith("from_"):
            f = f.value
        name = f.id if isinstance(f, ast.Name) else ""
        return name if name[:1].isupper() else None

    direct = built(arg)
    if direct is not None:
        return [direct]
    if not isinstance(arg, ast.Name):
        return None
    region = _region_of(tree, call)
    names: list[str] = []
    for n in ast.walk(region):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets):
            if _holds_argument(n.value, {arg.id}):
                continue  # `model = DDP(model)`: the same parameters
            name = built(n.value)
            if name is None:
                return None
            names.append(name)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and n is region and arg.id in \
                {a.arg for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs}:
            return None  # the caller's own parameter: handed in further up
    return names or None


def handed_in_models(index: RepoIndex, rel: str, tree: ast.Module, qualname: str, model: str) -> Optional[HandedIn]:
    """For an optimizer over ``self.<attr>`` whose class stores a constructor argument there, what every
    instantiation of that class in the repository passes; None when the attribute is not such an argument."""
    cls = _enclosing_class(tree, qualname)
    if cls is None:
        return None
    key = (rel, cls.name, model)
    if key in index.handed:
        return index.handed[key]
    index.handed[key] = None
    arg = _constructor_argument(cls, model)
    if arg is None:
        return None
    pos, pname = arg
    out = HandedIn()
    from npufuse.scan.repo_facts import definition_in

    for f in index.files:
        text = index.text(f) or ""
        if cls.name not in text:
            continue
        ftree = index.tree(f)
        for call in (n for n in ast.walk(ftree) if isinstance(n, ast.Call)) if ftree is not None else ():
            fn = call.func
            if not (isinstance(fn, ast.Name) and fn.id == cls.name or isinstance(fn, ast.Attribute) and fn.attr == cls.name):
                continue
            if isinstance(fn, ast.Name):
                d = definition_in(index.root, f, ftree, cls.name)
                if d is not None and (d.rel, d.node.name) != (rel, cls.name):
                    continue  # another class of the same name
            where = f"{f}:{call.lineno}"
            out.sites.append(where)
            out.files.append(f)
            given = _call_argument(call, pos, pname)
            names = _argument_classes(index, f, ftree, call, given) if given is not None else None
            found = [c for c in (model_classes(index, f, ftree, name) for name in names or ()) if c is not None]
            if not names or len(found) != len(names):
                shown = ast.unparse(given) if given is not None else "no model argument npufuse reads"
                out.unknown.append(f"`{cls.name}(...)` at {where} passes `{shown[:80]}`, which npufuse does not resolve to a "
                                   "model class of the repository")
                continue
            out.classes += found
    out.files = list(dict.fromkeys(out.files))
    index.handed[key] = out
    return out


# --- s41 (wrong41): a model class holding a module handed to its constructor -----------------------------------------
# `class BERTLM(nn.Module): def __init__(self, bert: BERT): self.bert = bert` -- the classes BERTLM's own code builds
# are not the whole model: `self.bert` is whatever the caller passes (an MoE skipping idle experts, say). The slot is
# resolved from the construction's argument (`BERTLM(BERT(cfg))`) or the parameter's annotation (`bert: BERT`); where
# neither names a class of the repository, the model is not told and the trainer's reachable code decides.

def _open_slots(cls: ast.ClassDef) -> list[tuple[str, int, str, Optional[ast.expr], int]]:
    """(attribute, parameter position (-1: keyword-only), parameter, annotation, line) of each submodule the class's
    ``__init__`` stores from one of its own parameters (moved / wrapped: ``self.bert = bert``, ``self.enc = enc.to(d)``)
    and the class calls (``self.bert(x)``, ``self.bert.forward(x)``)."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return []
    positional = [a for a in init.args.posonlyargs + init.args.args][1:]
    params = {a.arg: (i, a.annotation) for i, a in enumerate(positional)}
    params.update({a.arg: (-1, a.annotation) for a in init.args.kwonlyargs})
    if not params:
        return []
    called: set[str] = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "forward":
                f = f.value
            attr = _self_attr(f)
            if attr is not None:
                called.add(attr)
    out: list[tuple[str, int, str, Optional[ast.expr], int]] = []
    for n in ast.walk(init):
        if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
            continue
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
            attr = _self_attr(t)
            if attr is None or attr not in called:
                continue
            given = next((p for p in params if _module_argument(n.value) == p), None)
            if given is not None:
                out.append((attr, params[given][0], given, params[given][1], n.lineno))
    return out


def _module_argument(value: ast.AST) -> str:
    """The parameter name ``value`` is, moved or copied (``bert``, ``bert.to(device)``, ``copy.deepcopy(bert)``); a
    module built from it (``nn.Linear(dim, dim)``) is not."""
    while isinstance(value, ast.Call):
        f = value.func
        if isinstance(f, ast.Attribute) and f.attr in _MOVES:
            value = f.value
        elif _name(f) == "deepcopy" and len(value.args) == 1:
            value = value.args[0]
        else:
            return ""
    return value.id if isinstance(value, ast.Name) else ""


def _outside_built(index: RepoIndex, tree: ast.Module, region: ast.AST, arg: ast.AST) -> bool:
    """Is ``arg`` a module of a library class (``nn.Linear(8, 8)``, ``timm.create_model(...)``: the callee's module
    is imported from outside the repository), in place or through every store of the local it names? Such a module
    holds no skip of the repository's."""
    def outside(value: ast.AST) -> bool:
        value = _unmoved(value)
        if not isinstance(value, ast.Call):
            return False
        root = value.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name) or root is value.func:
            return False
        for n in tree.body:
            if isinstance(n, ast.Import):
                for a in n.names:
                    if (a.asname or a.name.split(".")[0]) == root.id:
                        return a.name not in index.modules and a.name.split(".")[0] not in index.modules
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                for a in n.names:
                    if (a.asname or a.name) == root.id:
                        return f"{n.module}.{a.name}" not in index.modules and n.module not in index.modules
        return False

    if isinstance(arg, ast.Name):
        stores = [n.value for n in ast.walk(region) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)]
        return bool(stores) and all(outside(v) or _holds_argument(v, {arg.id}) for v in stores)
    return outside(arg)


def _annotated_class(annotation: Optional[ast.expr]) -> str:
    """The class an annotation names (``BERT``, ``"BERT"``, ``models.BERT``), else empty (``Optional[...]``, ``nn.Module``)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str) and annotation.value.isidentifier():
        return annotation.value
    if isinstance(annotation, ast.Name):
        return annotation.id
    return ""


def _fill_open_slots(index: RepoIndex, classes: list[tuple[str, ast.ClassDef]], built: list[tuple[str, ast.Call]],
                     rel: str, tree: ast.Module) -> str:
    """Adds to ``classes`` (in place) the classes of the modules handed to their constructors (:func:`_open_slots`):
    from the site's construction of the holder (``BERTLM(BERT(cfg))``), else the parameter's annotation. Returns a
    sentence naming the first slot neither resolves (empty when all are)."""
    unresolved = ""
    seen = {(r, node.name) for r, node in classes}
    i = 0
    while i < len(classes) and i < 64:
        r, node = classes[i]
        i += 1
        for attr, pos, pname, annotation, line in _open_slots(node):
            found: Optional[list[tuple[str, ast.ClassDef]]] = None
            for name, call in built:
                if name != node.name:
                    continue
                given = _call_argument(call, pos, pname)
                if given is not None and _outside_built(index, tree, _region_of(tree, call), given):
                    found = []  # a library module (`nn.Linear(8, 8)`): no class of the repository
                    continue
                names = _argument_classes(index, rel, tree, call, given) if given is not None else None
                got = [model_classes(index, rel, tree, c) for c in names or ()]
                found = [c for g in got if g is not None for c in g] if names and all(g is not None for g in got) else None
            rtree = index.tree(r)
            if found is None and _annotated_class(annotation)[:1].isupper() and rtree is not None:
                found = model_classes(index, r, rtree, _annotated_class(annotation))
            if found is None:
                unresolved = unresolved or (f"its model's class `{node.name}` holds a module handed to its constructor "
                                            f"(`self.{attr} = {pname}` at {r}:{line}), whose class npufuse does not resolve")
                continue
            for c in found:
                if (c[0], c[1].name) not in seen:
                    seen.add((c[0], c[1].name))
                    classes.append(c)
    return unresolved


def site_random_skip(index: RepoIndex, rel: str, qualname: str, guard: str, params: str,
                     every: Optional[list[RandomSkip]] = None) -> Optional[tuple[RandomSkip, bool, str]]:
    """The random skip an optimizer site's model may include: (skip, resolved?, note) where ``resolved`` says
    the model's class was told (else the skip is one the trainer's imports or config reach); ``note`` says why the
    model is not told: an instantiation of the trainer whose model argument npufuse does not resolve (s40), a module
    handed to the model class's constructor it does not resolve (s41), else empty. ``every`` (s51): where the model is
    not told, every skip that counts there is appended to it (the first is the one returned), for a guard on them all."""
    tree = index.tree(rel)
    if tree is None:
        return None
    m = _GUARD_MODEL.search(guard or "") or _PARAMS_MODEL.search(params or "")
    model = m.group(1) if m else ""
    told = [c for c in (model_classes(index, rel, tree, name) for name in _classes_of_model(tree, qualname, model)) if c is not None] \
        if model else []
    handed = handed_in_models(index, rel, tree, qualname, model) if not told and model.startswith("self.") else None
    if handed is not None and handed.classes:
        # s40 (wrong40): `self.model = model` of a constructor argument: the classes the instantiations pass decide (where
        # one passes a model npufuse does not resolve, the trainer's reachable code below decides after them)
        told = handed.classes
    open_note = ""
    if told:
        # the model's class is one of the repo's (a wrapper such as DDP(...) is not): its own classes decide
        classes = [c for found in told for c in found]
        if classes:
            if every_param_used(index, [rel, *(handed.files if handed is not None else [])]):
                return None
            region = _function_of(tree, qualname)
            built = [(name, call) for name, call in _constructions(tree, qualname, model)] if region is not None else []
            open_note = _fill_open_slots(index, classes, built, rel, tree)  # s41: modules handed to a class's constructor
            files = list(dict.fromkeys([rel, *(r for r, _ in classes)]))
            for r, node in classes:
                for s in skip_in_class(r, node):
                    if not (s.param is None or _drawn_by_a_caller(index, s, files)) or not _matters(index, s):
                        continue
                    if region is not None and any(name == node.name and _frozen_at_construction(region, model, s, call)
                                                  for name, call in built):
                        continue  # the site's code freezes the submodule it hands the model
                    return s, True, ""
            if (handed is None or not handed.unknown) and not open_note:
                return None
    starts = [rel, *_drivers(index, rel, qualname)]
    if handed is not None:
        # the files that instantiate the trainer build (or receive) its model: their imports are the model's (a driver
        # importing the trainer through a package's `__init__` is not one `_drivers` finds)
        starts = list(dict.fromkeys([*starts, *handed.files]))
    if every_param_used(index, starts):
        return None
    registry = Registry(index, reachable_files(index, starts))
    # the first skip that counts (s39: data-dependent skips made the list long; each registry check reads the files)
    first = _first((s for s in reachable_skips(index, starts) if _matters(index, s) and not registry.selected_out(s.cls)), every)
    if first is None and any("instantiate" in (index.text(f) or "") for f in starts):
        first = _first((s for s in configured_skips(index, _config_texts(index)) if _matters(index, s)), every)
    # the reason names an instantiation whose model npufuse does not resolve (the skip objects are shared: not stored there)
    note = f"its model is a constructor argument and {handed.unknown[0]}" if handed is not None and handed.unknown else open_note
    if first is None:
        # s41 (wrong41): nothing in the repository tells the model (handed in, never built where npufuse sees it): any
        # module of the repository that calls an expert / branch only when the step's data reaches it may be the one
        untold = _untold_model(index, rel, tree, qualname, model, handed, open_note, starts[1:])
        if untold:
            first = _first((s for f in index.files for s in index.skips(f) if s.data_dependent and _matters(index, s)), every)
            note = f"{_ANY_CLASS} ({untold})"
    return (first, False, note) if first is not None else None


_ANY_CLASS = "a model class of the repository"


def _called_by_text(index: RepoIndex, name: str, keyword: str) -> bool:
    """Does any file of the repository -- one npufuse could not parse included (a newer Python's f-string) -- call
    ``name(`` other than in its own ``class`` / ``def`` line?"""
    pattern = re.compile(rf"(?<!{keyword} )\b{re.escape(name)}\(")
    return any(name in (text := index.text(f) or "") and pattern.search(text) for f in index.files)


def _first(skips: Iterable[RandomSkip], every: Optional[list[RandomSkip]]) -> Optional[RandomSkip]:
    """The first of ``skips``; with ``every`` (s51) all of them are read and appended to it (at most 64: more
    leaves the list one longer than 64, which the guard builder refuses)."""
    if every is None:
        return next(iter(skips), None)
    for n, s in enumerate(skips):
        every.append(s)
        if n >= 64:
            break
    return every[0] if every else None


def _untold_model(index: RepoIndex, rel: str, tree: ast.Module, qualname: str, model: str, handed: Optional[HandedIn],
                  open_note: str, drivers: list[str]) -> str:
    """Why the optimizer's model is one nothing in the repository tells (a sentence), else empty: the trainer stores
    a constructor argument no code of the repository instantiates it with (or one npufuse does not resolve), a model
    class holds a module handed to its constructor npufuse does not resolve, or the model is a parameter of the
    site's function no file of the repository calls it with."""
    if handed is not None and not handed.sites and not _called_by_text(index, qualname.split(".")[0], "class"):
        return f"the optimizer's model `{model}` is a constructor argument and no code of the repository instantiates the trainer"
    if handed is not None and handed.unknown:
        return f"the optimizer's model `{model}` is a constructor argument and {handed.unknown[0]}"
    if open_note:
        return open_note
    region = _function_of(tree, qualname)
    if isinstance(region, (ast.FunctionDef, ast.AsyncFunctionDef)) and model.isidentifier() and not drivers \
            and model in {a.arg for a in region.args.posonlyargs + region.args.args + region.args.kwonlyargs} \
            and not _called_by_text(index, region.name, "def"):
        return f"the optimizer's model `{model}` is a parameter of `{qualname}`, which no file of the repository calls"
    return ""


# --- s38 (opt38): a class chosen by a name no configuration of the repository names ---------------------------------
# A model built by name (`MODELS[cfg.arch](...)`, `@register_model("opt")`) reaches, through a registry package's
# `__init__`, every model family of the repository; the trainer builds the one its configuration names. A skip class
# that is built only by registry entries whose names appear in no configuration file and no string of the
# repository's code (other than the registration itself) is not the trained model's.

def _registration_names(node: ast.AST) -> list[str]:
    """The names a decorator / registering call gives: string arguments and ``name=`` keywords."""
    if not isinstance(node, ast.Call):
        return []
    out = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    out += [k.value.value for k in node.keywords if k.arg == "name" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
    return out


class Registry:
    """Name -> class registries of a set of files (dict literals with string keys and class values, ``register``
    decorators and calls), and who else refers to each class."""

    def __init__(self, index: RepoIndex, files: list[str]) -> None:
        self.index, self.files = index, files
        self.keys: dict[str, set[str]] = {}  # class / function name -> its registry names
        self.positions: set[int] = set()  # ids of nodes that are registrations (not uses)
        self._used_keys: dict[str, bool] = {}
        for rel in files:  # each file read once per scan by the index (s39, perf39); copies: the checks add to them
            keys, positions = index.registrations(rel)
            for name, names in keys.items():
                self.keys.setdefault(name, set()).update(names)
            self.positions |= positions

    def _read(self, n: ast.AST) -> None:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef)):
            for d in n.decorator_list:
                if "register" in _name(d.func if isinstance(d, ast.Call) else d).lower():
                    names = _registration_names(d) or [n.name]
                    self.keys.setdefault(n.name, set()).update(names)
                    self.positions |= {id(x) for x in ast.walk(d)}
        elif isinstance(n, ast.Dict) and len(n.keys) >= 2 and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in n.keys) \
                and all(isinstance(v, (ast.Name, ast.Attribute)) for v in n.values):
            for k, v in zip(n.keys, n.values):
                self.keys.setdefault(_name(v), set()).add(k.value)  # type: ignore[union-attr]
            self.positions |= {id(x) for x in ast.walk(n)}
        elif isinstance(n, ast.Call) and "register" in _name(n.func).lower():
            names = _registration_names(n)
            for a in [*n.args, *(k.value for k in n.keywords)]:
                if isinstance(a, (ast.Name, ast.Attribute)) and names:
                    self.keys.setdefault(_name(a), set()).update(names)
            if names:
                self.positions |= {id(x) for x in ast.walk(n)}

    def _used(self, key: str) -> bool:
        """Does a configuration file or a string of the repository's code (not a registration) name ``key``? Read
        once per key (s39: if-arm names ask per reference): registrations only grow, so a False stays false and a
        True kept is the conservative answer."""
        got = self._used_keys.get(key)
        if got is None:
            got = self._used_keys[key] = self._read_used(key)
        return got

    def _read_used(self, key: str) -> bool:
        token = re.compile(r"(?<![\w.-])" + re.escape(key) + r"(?![\w-])")
        if any(token.search(t) for t in self.index.config_texts()):
            return True
        for rel in self.index.files:
            text = self.index.text(rel) or ""
            if f'"{key}"' not in text and f"'{key}'" not in text:
                continue
            if self.index.tree(rel) is None or any(i not in self.positions for i in self.index.string_constants(rel).get(key, ())):
                return True
        return False

    def _referrers(self, name: str) -> Optional[set[str]]:
        """The top-level classes / functions of the files that refer to ``name`` (call it, subclass it, hold it)
        outside registrations and its own definition; None when module-level code refers to it."""
        out: set[str] = set()
        for rel in self.files:
            if name not in (self.index.text(rel) or ""):
                continue
            for top, named in self.index.top_references(rel):
                if isinstance(top, (ast.ClassDef, ast.FunctionDef)) and top.name == name:
                    continue
                refs = [n for n in named.get(name, ()) if id(n) not in self.positions]
                if not refs:
                    continue
                if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) and self._chosen_by_unused_names(top, refs, name):
                    continue  # s39: built only in `if cfg["encoder"] == "<name>":` arms no configuration names
                if not isinstance(top, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if isinstance(top, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in top.targets):
                        continue
                    return None
                out.add(top.name)
        return out

    def _chosen_by_unused_names(self, fn: ast.AST, refs: list[ast.AST], name: str) -> bool:
        """Is every reference in ``refs`` in the body of an ``if`` of ``fn`` testing a value against string names
        (``cfg["encoder"] == "branchformer"``, ``name in ("a", "b")``, an ``elif`` chain) that no configuration file
        or other code string names (wenet's ``init_model``)? The test's strings are registrations, not uses."""
        parents = self.index.parents(fn)  # each site's registry asks of the same functions
        keys: list[str] = []
        for ref in refs:
            child, up = ref, parents.get(id(ref))
            while up is not None and not (isinstance(up, ast.If) and any(child is s for s in up.body)):
                child, up = up, parents.get(id(up))
            names = _compared_names(up.test) if isinstance(up, ast.If) else []
            if not names:
                return False
            self.positions |= {id(x) for x in ast.walk(up.test)}
            keys += names
        if any(self._used(k) for k in keys):
            return False
        self.keys.setdefault(name, set()).update(keys)  # registered under those (unused) names
        return True

    def selected_out(self, name: str, depth: int = 0, seen: Optional[set[str]] = None) -> bool:
        """Is every way the reachable code builds ``name`` a registry entry whose names nothing uses?"""
        seen = set() if seen is None else seen
        if name in seen or depth > _MAX_DEPTH:
            return name in seen  # a cycle adds no way in; too deep: cannot tell
        seen.add(name)
        keys = self.keys.get(name)
        if keys and any(self._used(k) for k in keys):
            return False
        ups = self._referrers(name)
        if ups is None:
            return False
        if not ups:
            return bool(self.keys.get(name))  # registered under unused names only, and nothing else builds it
        return all(self.selected_out(u, depth + 1, seen) for u in ups)


def _compared_names(test: ast.AST) -> list[str]:
    """The strings an ``if`` test compares a value with for equality (``x == "a"``, ``"a" == x``, ``x in ("a", "b")``);
    [] for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return []
    left, right, op = test.left, test.comparators[0], test.ops[0]
    if isinstance(op, ast.Eq):
        const = right if isinstance(right, ast.Constant) else left if isinstance(left, ast.Constant) else None
        return [const.value] if const is not None and isinstance(const.value, str) and const.value else []
    if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
        vals = [e.value for e in right.elts if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value]
        return vals if len(vals) == len(right.elts) else []
    return []


def _matters(index: RepoIndex, s: RandomSkip) -> bool:
    """Is the skip one that can leave a trainable parameter without a grad on a drawn step (s38): its draw is
    compared with a rate the repository leaves nonzero (or unread), and its class neither freezes the submodule nor
    calls it only without grad?"""
    return not never_drawn(index, s) and not frozen_in_class(s)


def _config_texts(index: RepoIndex) -> list[str]:
    """The structured configuration files (yaml / json / toml) that name classes to build (Hydra ``_target_``,
    ``target:``, ``class_path``), from the index's one walk of the repository (no links, no hidden folders or
    environments: an untrusted repository's link to a file outside it is never read)."""
    out = [text for suffix, text in index.config_files()
           if suffix in (".yaml", ".yml", ".json", ".toml") and ("_target_" in text or "target:" in text or "class_path" in text)]
    return out[:401]


def apply(root: Path, files: Iterable[str], outcomes: list, near: list, max_bytes: int, pattern: str = "fused_optimizer") -> None:
    """Turn fused_optimizer candidates whose model may skip a trainable submodule on random steps into
    near misses naming the skip (called once per scan by :mod:`npufuse.scan.repo_facts`)."""
    from npufuse.patterns import _fused_optimizer_s51a  # s51 (a pattern helper; imported here to avoid a cycle)

    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == pattern]
    if not hits:
        return
    index = RepoIndex(root, files, max_bytes)
    for o, h in hits:
        f = h.finding
        params = str((f.params or {}).get("params", ""))
        every: list[RandomSkip] = []
        found = site_random_skip(index, o.file, f.qualname, f.guard_tensor or "", params, every)
        if found is not None and not found[1] and (_fused_optimizer_s51a.repo_pass_checked(f.params or {}, every)
                                                   or _fused_optimizer_s51a.guard_in_repo_pass(f, every, index)):
            found = None  # s51: the candidate's guard keeps torch.optim for models holding these classes
        why = reason(*found) if found is not None else grad_none.site_reads(index, o.file, f.qualname, params)
        if why is None:
            continue
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": why})


def reason(skip: RandomSkip, resolved: bool, note: str = "") -> str:
    """The near-miss reason of an optimizer whose model may include ``skip``."""
    whose = "the model the optimizer takes" if resolved else "a model class the trainer's code reaches (its model is not told apart)"
    if note and not resolved:
        whose = note if note.startswith(_ANY_CLASS) else f"a model class the trainer's code reaches ({note})"
    if skip.data_dependent:
        return (f"{whose} calls a trainable submodule only when a test on the step's data holds: {skip.where()}; on a "
                "step where it fails (an expert no token reaches, a branch the batch does not take) those parameters get "
                "no grad, which torch.optim (zero_grad's default set_to_none=True) skips, while torch_npu fused "
                "optimizers zero grads in place and still apply momentum / weight decay / Adam moments to them (and "
                "exclude for good a param without a grad at the first step)")
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
