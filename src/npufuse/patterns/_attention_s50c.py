"""Attention constructs of the s50 late pass on HO27c (helper ho27c), from the judge's classes.

* Probabilities returned by a method whose only callers are methods of a BASE class (often in another file of the
  repository) that unpack the result and read the map only under ``if self.<flag>:`` (an ``output_attention``-style
  switch): the fused call runs where the flag is off (the map is None there, which no caller reads), the original
  where it is on (:func:`inherited_caller_flag`). The implementation classes are picked at run time
  (``import_module(f'..attention.{kind}')``) and a sibling may already return ``y, None``; the flag is what decides.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from typing import Any, Optional

from npufuse.scan.dataflow import fast_walk


def _returned_position(fn: ast.AST, name: str) -> Optional[int]:
    """The index of ``name`` in the tuple every ``return`` of ``fn`` (its own, not nested defs') returns, or None."""
    position: Optional[int] = None
    stack = list(getattr(fn, "body", []))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return):
            if not isinstance(node.value, ast.Tuple):
                return None
            names = [e.id if isinstance(e, ast.Name) else None for e in node.value.elts]
            if name not in names or (position is not None and names.index(name) != position):
                return None
            position = names.index(name)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return position


def _classes(trees: list[tuple[str, ast.Module]]) -> dict[str, list[tuple[str, ast.ClassDef]]]:
    out: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for rel, tree in trees:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((rel, node))
    return out


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for b in cls.bases:
        n = b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else None
        if n is not None:
            names.append(n)
    return names


def _gated(load: ast.AST, parents: dict[int, ast.AST], stop: ast.AST) -> Optional[tuple[str, bool]]:
    """(attribute, negated) of the innermost enclosing ``if self.<attr>:`` / ``if not self.<attr>:`` (or conditional
    expression) whose taken branch holds ``load``; negated: the load is in the else branch."""
    up, child = parents.get(id(load)), load
    while up is not None and up is not stop:
        if isinstance(up, (ast.If, ast.IfExp)) and child is not up.test:
            test, neg = up.test, False
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                test, neg = test.operand, True
            if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self":
                in_body = child in up.body if isinstance(up, ast.If) else child is up.body
                return test.attr, (not in_body) != neg
            return None
        up, child = parents.get(id(up)), up
    return None


def _parents(node: ast.AST) -> dict[int, ast.AST]:
    out: dict[int, ast.AST] = {}
    for n in fast_walk(node):
        for c in ast.iter_child_nodes(n):
            out[id(c)] = n
    return out


def _assigns_attr(node: ast.AST, attr: str) -> bool:
    return any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.ctx, ast.Store)
               and isinstance(t.value, ast.Name) and t.value.id == "self" for t in fast_walk(node))


# (root, method name) -> the repository files that read an attribute of that name (None: one could not be read). s50 perf
# fix: the word search ran over every file of the repository for each site (a method named `forward` matched nearly
# every file of the transformers corpus, each then parsed past the parse cache's size): quadratic in the files
# (keyed by the scan's file listing as _REGISTERED_BUFFERS is: repo_facts.reset() makes a new one per scan, and the
# listing is held with the answer so its id is not reused). s51 (perf51): with the files, the names their text may
# define a class of (:data:`_CLASS_WORD`)
_READERS: dict[tuple[str, str, int], tuple[Any, Optional[list[str]], Optional[frozenset[str]]]] = {}

# s51 (perf51): a class statement's name as the text spells it. ``class`` and the name are two tokens with only blanks or
# line continuations (``\\`` + line end) between them (no comment can stand there), so every top-level ``class B`` is
# a match with group 1 == B (other uses of the word, in names, strings or comments, only add names; the name is read by
# a lookahead, so a ``class`` just before cannot swallow the statement's own ``class`` word). A text outside ASCII is
# read in its NFKD form (:func:`_folded`).
_CLASS_WORD = re.compile(r"class\W+(?=(\w+))")


def _folded(text: str) -> str:
    """``text`` NFKD-decomposed. Python reads an identifier as its NFKC form; where that is an ASCII name B (as every
    base name compared here is where a file defines it), the identifier's NFKD form is B (NFKD(NFKC(x)) == NFKD(x), and
    B decomposes to itself), and in a file that parses the identifier is followed by an ASCII character that is not a
    word character (``(``, ``:``, a blank): the folded text holds ``class`` and B as the pattern reads them. ASCII
    characters decompose to themselves and no combining mark is reordered across them, so the whole text's NFKD form
    is that of each run outside ASCII in place (5x faster than decomposing run by run). A file that does not parse
    makes inherited_caller_flag's answer None on its own."""
    return text if text.isascii() else unicodedata.normalize("NFKD", text)


def _readers(root: Any, fn: str) -> tuple[Optional[list[str]], Optional[frozenset[str]]]:
    """(files of the repository whose text has ``.fn`` (an attribute read, as every call of a method is: ``self.fn(``,
    ``obj.fn(``, ``super().fn(``, ``Base.fn(``; a file that only defines ``fn`` holds no call of it), the names
    those files may define a class of). (None, None): a file unread."""
    from npufuse.scan import repo_facts

    files = repo_facts._repo_py_files(root)
    key = (str(root), fn, id(files))
    if key in _READERS:
        return _READERS[key][1:]
    attr = re.compile(r"\.\s*" + re.escape(fn) + r"\b")
    out: Optional[list[str]] = []
    names: set[str] = set()
    for rel in files:
        text = repo_facts._repo_text(root, rel)
        if text is None:
            out = None
            break
        if fn in text and attr.search(text):
            out.append(rel)
            names.update(_CLASS_WORD.findall(_folded(text)))
    if len(_READERS) > 256:
        _READERS.clear()
    defined = frozenset(names) if out is not None else None
    _READERS[key] = (files, out, defined)
    return out, defined


def _files_reading_attr(root: Any, fn: str) -> Optional[list[str]]:
    """The first of :func:`_readers`."""
    return _readers(root, fn)[0]


def _may_have_ancestor(tree: ast.Module, class_name: str, defined: frozenset[str]) -> bool:
    """Can :func:`inherited_caller_flag` find an ancestor of the top-level class ``class_name`` of ``tree``: is it
    one class of that name there, with a base named by a top-level class of ``tree`` or by a name in ``defined``
    (the class names the other files may define)? False only where the answer is None."""
    own = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    if len(own) != 1:
        return False  # inherited_caller_flag's own test: which class is meant is not told
    here = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return any(b in here or b in defined for b in _base_names(own[0]))


def inherited_caller_flag(module: Any, scope: Any, name: str) -> Optional[tuple[ast.expr, bool]]:
    """(``self.<flag>``, False) where the method ``scope`` returns the probabilities ``name`` at one tuple position and
    every call of it in the repository is ``a, w = self.<method>(...)`` in a method of an ANCESTOR class of its class
    that the class (and no class between) overrides, each reading ``w`` only in the branch of ``if self.<flag>:`` (one
    attribute for all, never assigned by those methods or this one): the callers get the map only where the flag is
    on, so the fused call runs where it is off. None otherwise (a call through another object, by a subclass, the
    result kept whole, a read outside the flag's branch)."""
    fn = getattr(scope.node, "name", None)
    if scope.class_name is None or not isinstance(scope.node, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn is None:
        return None
    position = _returned_position(scope.node, name)
    if position is None:
        return None
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    trees: list[tuple[str, ast.Module]] = [(module.path, module.tree)]
    if root is not None:
        repo_facts._depends(root, module.path)  # the answer reads the other files of the repository
        rels, defined = _readers(root, fn)
        if rels is None:
            return None  # a file could not be read: it may call the method
        if defined is not None and not _may_have_ancestor(module.tree, scope.class_name, defined):
            # s51 (perf51): a caller counts only in an ANCESTOR class, and the first ancestor is a top-level class named
            # by a base of the class: defined in no file, none is found, no caller counts and the answer is None
            # whatever the other files hold (parsing them was half the parse time of an attention scan)
            return None
        for rel in rels:
            if rel == module.path:
                continue
            tree = repo_facts._parse_repo_file(root, rel)
            if tree is None:
                return None
            trees.append((rel, tree))
    classes = _classes(trees)
    own = [c for rel, c in classes.get(scope.class_name, []) if rel == module.path]
    if len(own) != 1:
        return None  # two classes of that name in this file: which one is meant is not told
    # (a class of the same name in another file is another class: its own ``self.<method>`` calls are its own)
    # ancestors by name (unique names only), nearest first
    ancestors: list[ast.ClassDef] = []
    frontier = _base_names(own[0])
    while frontier:
        b = frontier.pop(0)
        found = classes.get(b, [])
        if len(found) != 1:
            continue  # nn.Module, abc.ABC, or a class in a file that does not mention the method: no call of it there
        if found[0][1] in ancestors:
            continue
        ancestors.append(found[0][1])
        frontier.extend(_base_names(found[0][1]))
    ancestor_ids = {id(a) for a in ancestors}
    flags: set[tuple[str, bool]] = set()
    callers = 0
    for rel, tree in trees:
        parents: Optional[dict[int, ast.AST]] = None
        for cls in (n for n in fast_walk(tree) if isinstance(n, ast.ClassDef)):
            for method in cls.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                calls = [c for c in fast_walk(method) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                         and c.func.attr == fn]
                if not calls:
                    continue
                if id(cls) not in ancestor_ids:
                    if any(not (isinstance(c.func.value, ast.Name) and c.func.value.id == "self") for c in calls):
                        return None
                    if cls is own[0] or scope.class_name in _base_names(cls):
                        return None  # the class itself or a subclass calls it: not read here
                    continue  # another class's own method of that name
                if cls is not own[0] and any(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == method.name
                                             for c in [own[0], *ancestors[:ancestors.index(cls)]] for m in c.body):
                    continue  # overridden on the way down: this caller does not run for the class
                if parents is None:
                    parents = _parents(tree)
                for call in calls:
                    if not (isinstance(call.func.value, ast.Name) and call.func.value.id == "self"):
                        return None
                    assign = parents.get(id(call))
                    if not (isinstance(assign, ast.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0], ast.Tuple)
                            and position < len(assign.targets[0].elts) and isinstance(assign.targets[0].elts[position], ast.Name)
                            and not any(isinstance(e, ast.Starred) for e in assign.targets[0].elts)):
                        return None  # the result kept whole: what reads the map is not visible
                    weights = assign.targets[0].elts[position].id
                    loads = [n for n in fast_walk(method) if isinstance(n, ast.Name) and n.id == weights and isinstance(n.ctx, ast.Load)]
                    for load in loads:
                        g = _gated(load, parents, method)
                        if g is None:
                            return None
                        flags.add(g)
                    callers += 1
                for attr, _neg in flags:
                    if _assigns_attr(method, attr):
                        return None
    if callers == 0 or len(flags) != 1:
        return None
    attr, negated = next(iter(flags))
    if _assigns_attr(scope.node, attr):
        return None
    # Chain.excluded convention: negated=False means the reads are in the if-branch: the fused call runs where the test
    # is false
    return ast.Attribute(ast.Name("self", ast.Load()), attr, ast.Load()), negated


# --- an einsum that sums over no index is an elementwise / broadcast product, not a matrix product -----------------
# ``torch.einsum('bt,bT->btT', q_keep, k_keep)`` (a pair mask as the outer product of two token masks): every index of
# the inputs is in the output, so each output element is ONE product of input elements (no sum): it is what
# ``q_keep[:, :, None] * k_keep[:, None, :]`` (for bool inputs ``&``) computes. Such a product is not the scores and
# not another matrix product: a mask built from it is computed on the fused branch as written.
_EINSUM_SPEC = re.compile(r"^\s*([A-Za-z]+(?:\s*,\s*[A-Za-z]+)*)\s*->\s*([A-Za-z]*)\s*$")


def elementwise_einsum(node: Any) -> bool:
    """``node`` is ``einsum('<in>,<in>->out', ...)`` with a constant equation (letters only, no ellipsis) in which each
    input index occurs once per operand and every index occurs in the output (nothing is summed)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    m = _EINSUM_SPEC.match(node.args[0].value)
    if m is None:
        return False
    inputs = [s.strip() for s in m.group(1).split(",")]
    out = m.group(2)
    if len(inputs) != len(node.args) - 1 or len(set(out)) != len(out):
        return False
    return all(len(set(s)) == len(s) and set(s) <= set(out) for s in inputs)


# --- a banded / causal mask helper whose diagonal is kept for every size: proved, not sampled ------------------------
# ``i = arange(n)[:, None]; j = arange(n)[None, :]; m = j > i; if w is not None and w > 0: m = m | ((i - j) >= w)``:
# the sampler of _mask_rows gave up on the conditional store and called the mask "can leave a row without a key" (false:
# key j = i is never masked). Here the helper is read on its diagonal: every ``arange`` over ONE length is the same value
# t (the element (t, t) of the broadcast result; a 1-D result's element t), so an index difference there is a number,
# and each comparison is decided from the branch conditions (``w > 0``) and the convention that an unknown scalar (a
# length, a window, an offset) is >= 0. The mask is proved to keep its diagonal on every path of the helper, or nothing
# is said (the sampler's verdict stands). A row with a key is then every query row < n: the mask is [n, n] over the
# same length, which every arange sharing one length expression shows.
_INF = float("inf")
_Affine = dict  # {"": constant, "t": coefficient of the diagonal index, "<scalar>": coefficient}


class _NoProof(Exception):
    pass


def _aff(const: float = 0.0, **terms: float) -> dict:
    out = {"": const}
    out.update(terms)
    return out


def _add(a: dict, b: dict, sign: int = 1) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v != 0 or k == ""}


def _range(a: dict, bounds: dict[str, tuple[float, float]]) -> tuple[float, float]:
    lo = hi = a.get("", 0)
    for k, c in a.items():
        if k == "":
            continue
        if c == 0:
            continue
        b_lo, b_hi = bounds.get(k, (0, _INF))  # an unknown scalar, or t in [0, n - 1]: >= 0
        terms = (c * b_lo, c * b_hi)
        lo, hi = lo + min(terms), hi + max(terms)
    return lo, hi


class _Diag:
    """Reads a helper's statements on the diagonal. Values: an affine dict (an index tensor or an int scalar), a bool
    (a mask element known on the diagonal), None (unknown)."""

    def __init__(self, params: set[str]) -> None:
        self.params = params
        self.length: Optional[str] = None  # the text of the one length every arange runs over

    def value(self, node: ast.AST, env: dict[str, Any], bounds: dict[str, tuple[float, float]]) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                return node.value
            if isinstance(node.value, (int, float)):
                return _aff(node.value)
            raise _NoProof()
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in self.params:
                return _aff(0.0, **{node.id: 1.0})
            raise _NoProof()
        if isinstance(node, ast.UnaryOp):
            x = self.value(node.operand, env, bounds)
            if isinstance(node.op, ast.USub) and isinstance(x, dict):
                return {k: -v for k, v in x.items()}
            if isinstance(node.op, (ast.Invert, ast.Not)) and isinstance(x, bool):
                return not x
            raise _NoProof()
        if isinstance(node, ast.BinOp):
            a, b = self.value(node.left, env, bounds), self.value(node.right, env, bounds)
            if isinstance(a, dict) and isinstance(b, dict) and isinstance(node.op, (ast.Add, ast.Sub)):
                return _add(a, b, 1 if isinstance(node.op, ast.Add) else -1)
            if isinstance(node.op, (ast.BitOr, ast.BitAnd)) and isinstance(a, (bool, type(None))) and isinstance(b, (bool, type(None))):
                if isinstance(node.op, ast.BitOr):
                    return True if True in (a, b) else None if None in (a, b) else False
                return False if False in (a, b) else None if None in (a, b) else True
            raise _NoProof()
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b = self.value(node.left, env, bounds), self.value(node.comparators[0], env, bounds)
            if not (isinstance(a, dict) and isinstance(b, dict)):
                raise _NoProof()
            lo, hi = _range(_add(a, b, -1), bounds)
            op = node.ops[0]
            if isinstance(op, ast.Gt):
                return True if lo > 0 else False if hi <= 0 else None
            if isinstance(op, ast.GtE):
                return True if lo >= 0 else False if hi < 0 else None
            if isinstance(op, ast.Lt):
                return True if hi < 0 else False if lo >= 0 else None
            if isinstance(op, ast.LtE):
                return True if hi <= 0 else False if lo > 0 else None
            if isinstance(op, ast.Eq):
                return True if lo == hi == 0 else False if lo > 0 or hi < 0 else None
            if isinstance(op, ast.NotEq):
                return False if lo == hi == 0 else True if lo > 0 or hi < 0 else None
            raise _NoProof()
        if isinstance(node, ast.Subscript):
            base = self.value(node.value, env, bounds)
            sl = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if all(isinstance(s, ast.Slice) and s.lower is None and s.upper is None and s.step is None
                   or isinstance(s, ast.Constant) and s.value is None for s in sl):
                return base  # a broadcasting view: the same element on the diagonal
            raise _NoProof()
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            module_fn = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("torch", "th")
            if name == "arange" and module_fn and len(node.args) == 1 and not any(k.arg in ("start", "end", "step") for k in node.keywords):
                text = ast.dump(node.args[0])
                if self.length is None:
                    self.length = text
                elif self.length != text:
                    raise _NoProof()  # aranges over two lengths: no common diagonal
                return _aff(0.0, t=1.0)
            if not module_fn and isinstance(f, ast.Attribute) and name in ("unsqueeze", "bool", "long", "int", "to", "contiguous", "view", "expand"):
                if name in ("view", "expand", "to") and not (name == "to" and node.args and isinstance(node.args[0], ast.Attribute)
                                                           and node.args[0].attr == "device"):
                    if name != "to" or any(k.arg == "dtype" for k in node.keywords) or node.args:
                        raise _NoProof()  # a reshape may move the diagonal; a dtype change is a cast
                return self.value(f.value, env, bounds)
            if name in ("logical_or", "logical_and") and module_fn and len(node.args) == 2:
                return self.value(ast.BinOp(node.args[0], ast.BitOr() if name == "logical_or" else ast.BitAnd(), node.args[1]), env, bounds)
            if name == "logical_not" and module_fn and len(node.args) == 1:
                return self.value(ast.UnaryOp(ast.Invert(), node.args[0]), env, bounds)
        raise _NoProof()

    def cond(self, test: ast.AST, env: dict[str, Any], bounds: dict[str, tuple[float, float]], taken: bool
             ) -> Optional[dict[str, tuple[float, float]]]:
        """The bounds under ``test`` being ``taken`` (True / False); None when that path cannot run. Parts not read add
        nothing (every path is still analysed)."""
        out = dict(bounds)
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and taken:
            for v in test.values:
                got = self.cond(v, env, out, True)
                if got is None:
                    return None
                out = got
            return out
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.cond(test.operand, env, bounds, not taken)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) and test.left.id in self.params \
                and isinstance(test.comparators[0], ast.Constant) and isinstance(test.comparators[0].value, int) \
                and not isinstance(test.comparators[0].value, bool):
            c = test.comparators[0].value
            lo, hi = out.get(test.left.id, (0, _INF))
            op = test.ops[0]
            if isinstance(op, (ast.Gt, ast.GtE, ast.Lt, ast.LtE)):
                strict = isinstance(op, (ast.Gt, ast.Lt))
                upper = isinstance(op, (ast.Lt, ast.LtE)) != (not taken)
                if not taken:
                    strict = not strict
                if upper:
                    hi = min(hi, c - 1 if strict else c)
                else:
                    lo = max(lo, c + 1 if strict else c)  # ints: > c is >= c + 1
                if lo > hi:
                    return None
                out[test.left.id] = (lo, hi)
        return out


def _paths(stmts: list[ast.stmt], diag: _Diag, states: list[tuple[dict[str, Any], dict[str, tuple[float, float]]]],
           returned: list[Any], budget: list[int]) -> list[tuple[dict[str, Any], dict[str, tuple[float, float]]]]:
    for st in stmts:
        budget[0] -= 1
        if budget[0] < 0 or len(states) > 16:
            raise _NoProof()
        if isinstance(st, (ast.Expr, ast.Pass)) and not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
            continue  # a docstring
        new: list[tuple[dict[str, Any], dict[str, tuple[float, float]]]] = []
        for env, bounds in states:
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                try:
                    v = diag.value(st.value, env, bounds)
                except _NoProof:
                    v = _UNREAD
                new.append(({**env, st.targets[0].id: v}, bounds))
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                try:
                    v = diag.value(st.value, env, bounds)
                except _NoProof:
                    v = _UNREAD
                new.append(({**env, st.target.id: v}, bounds))
            elif isinstance(st, ast.If):
                for taken, body in ((True, st.body), (False, st.orelse)):
                    b = diag.cond(st.test, env, bounds, taken)
                    if b is not None:
                        new.extend(_paths(body, diag, [(dict(env), b)], returned, budget))
            elif isinstance(st, ast.Return) and st.value is not None:
                try:
                    returned.append(diag.value(st.value, env, bounds))
                except _NoProof:
                    returned.append(_UNREAD)
            elif isinstance(st, (ast.Raise, ast.Assert)):
                new.append((env, bounds))  # a path that raises returns no mask; an assert holding changes nothing
            else:
                raise _NoProof()
        states = [s for s in new]
        if not states:
            break
    return states


_UNREAD = object()


def diagonal_kept(node: Any, polarity: str, resolve: Any) -> bool:
    """The mask ``node`` (a call of a repository helper the mask reader resolves) keeps key j = i for every query row i on
    every path of the helper, for every non-negative length / window it reads: proved on the helper's diagonal. The
    helper must build its mask only from ``arange`` over one length (its values compared, added, subtracted, combined
    with ``| & ~``), under ``if`` tests on its scalar parameters."""
    while type(node).__name__ == "Ref" and getattr(node, "value", None) is not None:
        node = node.value  # ``mask = helper(..)`` then ``masked_fill(mask, ..)``: the call the name holds
    if polarity not in ("masked", "keep") or not isinstance(node, ast.Call):
        return False
    helper = getattr(resolve, "_helper", None)
    got = helper(node) if helper is not None else None
    if got is None:
        return False
    fn = got[0]
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} - {"self", "cls"}
    diag = _Diag(params)
    returned: list[Any] = []
    try:
        ends = _paths(list(fn.body), diag, [({}, {})], returned, [60])
    except _NoProof:
        return False
    if ends or not returned or diag.length is None:
        return False  # a path falling off the end returns None (no mask: every key kept); not read here, said nothing
    want = False if polarity == "masked" else True
    return all(r is want for r in returned)


# --- rows with no visible key zeroed after the softmax through torch.where ------------------------------------------
# ``valid = mask.any(dim=-1, keepdim=True); p = torch.where(valid, softmax(s), torch.zeros_like(p))``: whole query rows
# of the probabilities set to 0 (the rows every key of which is masked). s44 reads ``p.masked_fill(rows, 0)`` with a row
# mask of size 1 on the key axis as the same masked_fill of the fused OUTPUT (row i of P @ V is sum_j P[i, j] v[j]);
# this is that reading for the where spelling, the row mask being a keepdim reduction over the last axis. The fused
# output's row is then 0 whatever the op computes on a fully masked row (forward exact; the backward of a zeroed row
# passes no gradient into the op there, as the where passes none into the softmax).
def _keepdim_last(matcher: Any, node: Any) -> bool:
    """``X.any(dim=-1, keepdim=True)`` / ``.all(..)`` / ``torch.any(X, -1, keepdim=True)``: size 1 on the last axis."""
    from npufuse.patterns.attention import deref
    from npufuse.scan.dataflow import const_value

    node = deref(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        node = deref(node.operand)
    if not isinstance(node, ast.Call):
        return False
    kw = {k.arg: k.value for k in node.keywords}
    if matcher.method(node, "any", "all"):
        dim = node.args[0] if node.args else kw.get("dim")
    elif matcher._fn(node) in ("torch.any", "torch.all") and node.args:
        dim = node.args[1] if len(node.args) > 1 else kw.get("dim")
    else:
        return False
    return dim is not None and const_value(dim) == -1 and "keepdim" in kw and const_value(kw["keepdim"]) is True


def where_zeroed_rows(matcher: Any, node: Any) -> Optional[tuple[Any, Any]]:
    """(P, rows zeroed: a True = zeroed node) of ``torch.where(M, P, Z)`` / ``torch.where(M, Z, P)`` with Z a zero
    (literal, ``torch.tensor(0)``, ``torch.zeros_like(P)``) and M a keepdim reduction over the last axis; else None."""
    from npufuse.patterns.attention import deref
    from npufuse.scan.dataflow import const_value

    if not (isinstance(node, ast.Call) and matcher._fn(node) == "torch.where" and len(node.args) == 3 and not node.keywords):
        return None
    m, a, b = node.args

    def zero(z: Any, other: Any) -> bool:
        z = deref(z)
        if isinstance(z, ast.Call) and matcher._fn(z) == "torch.zeros_like" and len(z.args) == 1 and not z.keywords:
            return deref(z.args[0]) is deref(other)
        if isinstance(z, ast.Call) and matcher._fn(z) in ("torch.scalar_tensor", "torch.tensor") and z.args:
            z = deref(z.args[0])
        v = const_value(z)
        return v in (0, 0.0) and not isinstance(v, bool)

    if not _keepdim_last(matcher, m):
        return None
    if zero(b, a) and not zero(a, b):
        return a, ast.UnaryOp(op=ast.Invert(), operand=m)
    if zero(a, b) and not zero(b, a):
        return b, m
    return None


def mark_row_statements(rows: Any, chain: Any) -> None:
    """The statements computing the row mask are steps of the site (``valid = mask.any(-1, keepdim=True)`` after
    ``mask = mask.to(torch.bool)``, itself a step of the mask): the fused branch renders the mask from them, so they
    are not statements between the steps that read an intermediate."""
    from npufuse.patterns.attention import Ref, walk_sym

    for n in walk_sym(rows, limit=200):
        if isinstance(n, Ref) and n.idx >= 0 and n.value is not None:
            chain.seen.add(n.idx)


# --- an operand name rebound by a statement the fused branch runs before the call ------------------------------------
# Music-Transformer style: ``q = q.transpose(1, 2)`` is read by a bias helper (``rel = self._rel(q)``) that the fused
# branch runs as written, while the call reads q from BEFORE the transpose (BSND): the name then holds the transposed
# tensor. Refused with the fact (found when the HO27c mask fix let such a site reach the renderer).
def stale_operand(module: Any, interp: Any, chain: Any, texts: tuple[str, str, str], executed: set[int], s: int, e: int
                  ) -> Optional[str]:
    from npufuse.patterns.attention import Ref

    for leaf, text in zip((chain.q.leaf, chain.k.leaf, chain.v.leaf), texts):
        stack, refs = [leaf], []
        while stack:
            n = stack.pop()
            if isinstance(n, Ref):
                refs.append(n)
                continue
            if isinstance(n, ast.AST):
                stack.extend(ast.iter_child_nodes(n))
        for ref in refs:
            if not re.search(r"\b" + re.escape(ref.name) + r"\b", text):
                continue
            for j in sorted(executed):
                if max(ref.idx, s - 1) < j < e and ref.name in interp.assigned[j]:
                    st = interp.block[j]
                    return (f"`{ref.name}` is rebound at line {st.lineno} (`{' '.join(ast.unparse(st).split())[:60]}`) by a statement "
                            f"the fused branch runs as written before the call, which reads `{ref.name}` as it was before that line: "
                            "npufuse does not rename the operand")
    return None
