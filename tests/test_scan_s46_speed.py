"""s46 (issue 14 item 3): exact cuts of the analysis' CPU.

* attention's symbolic copies and walks (``_plain``, ``walk_sym``, ``walk_values``) read only the fields
  that can hold a node (``child_fields``) and copy a parser node without ``copy.copy``'s reduce machinery:
  the same trees, the same nodes in the same order as the ``ast.iter_fields`` / ``copy.copy`` versions.
* ``engine.scope_holds_words`` works out a part's gate words once per module and word tuple: the same
  answer on every scope as ``gate_words`` asked afresh.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Iterator

from npufuse.patterns import attention as A
from npufuse.scan import engine, numeric_probe
from npufuse.scan.dataflow import ModuleInfo

from test_scan_prefilter import _texts


# -- the start code's versions, the reference ------------------------------------------------------------------------

def _plain_reference(node: Any, keyed: bool = False) -> Any:
    if isinstance(node, A.Ref):
        if keyed and node.value is not None and not isinstance(node.value, (A.Undef, A.Opaque)):
            return _plain_reference(node.value, True)
        return ast.Name(f"{node.name}@{node.idx}" if keyed else node.name, ast.Load())
    if isinstance(node, A.Cond):
        return ast.IfExp(test=_plain_reference(node.test, keyed), body=_plain_reference(node.body, keyed),
                         orelse=_plain_reference(node.orelse, keyed))
    if isinstance(node, (A.Undef, A.Opaque)):
        return ast.Name("<undefined>", ast.Load())
    if not isinstance(node, ast.AST):
        return node
    new = copy.copy(node)
    for name, value in ast.iter_fields(node):
        if isinstance(value, list):
            setattr(new, name, [_plain_reference(v, keyed) for v in value])
        elif isinstance(value, ast.AST):
            setattr(new, name, _plain_reference(value, keyed))
    return new


def _walk_sym_reference(node: Any, limit: int = 4000) -> Iterator[ast.AST]:
    stack, visited = [node], set()
    while stack and limit:
        limit -= 1
        n = stack.pop()
        if not isinstance(n, ast.AST) or id(n) in visited:
            continue
        visited.add(id(n))
        yield n
        if isinstance(n, A.Ref):
            if n.value is not None:
                stack.append(n.value)
            continue
        for _name, value in ast.iter_fields(n):
            if isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)


def _symbolic_values() -> list[Any]:
    """The symbolic value of every assignment of every block of the examples and sample files (Refs, Conds,
    in-place markers and plain nodes mixed, as the attention matcher sees them)."""
    out: list[Any] = []
    for text in _texts()[::3]:
        module = ModuleInfo.from_source("f.py", text)
        for scope in module.scopes:
            blocks = {id(b): b for b, _i, _s in scope.statements()}
            for block in blocks.values():
                try:
                    interp = A.BlockInterp(block)
                except (Exception, RecursionError):
                    continue
                out.extend(interp.after.values())
                if len(out) > 3000:
                    return out
    return out


def _dump(node: Any) -> str:
    return ast.dump(node, include_attributes=True) if isinstance(node, ast.AST) else repr(node)


def test_plain_builds_the_trees_the_copy_version_built() -> None:
    values = _symbolic_values()
    assert len(values) > 500
    kinds = set()
    for v in values:
        for keyed in (False, True):
            new, old = A._plain(v, keyed), _plain_reference(v, keyed)
            assert _dump(new) == _dump(old)
            assert type(new) is type(old)
            if isinstance(old, ast.AST):
                # attributes set on a node outside its fields (positions, npufuse's marks) are carried alike
                assert set(vars(new)) == set(vars(old))
        kinds.update(type(n).__name__ for n in A.walk_sym(v))
    assert {"Ref", "Call", "Attribute", "Name"} <= kinds


def test_symbolic_walks_yield_the_same_nodes_in_the_same_order() -> None:
    for v in _symbolic_values():
        assert [id(n) for n in A.walk_sym(v)] == [id(n) for n in _walk_sym_reference(v)]
        assert [id(n) for n in A.walk_sym(v, limit=7)] == [id(n) for n in _walk_sym_reference(v, limit=7)]


def test_walk_values_matches_its_iter_fields_form_where_no_shortcut_applies() -> None:
    # walk_values differs from walk_sym only in the nodes it does not enter; on a tree without metadata reads,
    # shape-only / new-tensor calls or *_like calls both walk every node
    tree = ast.parse("a = (x + y) * f(z, k=w)[0] - g(h).t")
    value = tree.body[0].value  # type: ignore[attr-defined]
    assert [id(n) for n in A.walk_values(value)] == [id(n) for n in _walk_sym_reference(value)]


def test_plain_copies_custom_nodes_through_copy() -> None:
    marker = A.InPlace(ast.Name("s", ast.Load()), "s", 3, "s[m] = 0")
    got = A._plain(marker)
    assert type(got) is A.InPlace and got is not marker and got.reason() == marker.reason()


# -- the numeric probe's word gates ---------------------------------------------------------------------------------

def test_scope_holds_words_answers_as_gate_words_asked_afresh() -> None:
    texts = _texts()[::2] + [
        "from torch import rsqrt as r, mean as m\n\ndef f(x, eps):\n    return x * r(m(x * x, -1, keepdim=True) + eps)\n",
        "import torch\n\ndef ｆ(x):\n    return x * torch.ｒｓｑｒｔ(x.ｐｏｗ(2).ｍｅａｎ(-1) + 1e-6)\n",
    ]
    asked = 0
    for text in texts:
        module = ModuleInfo.from_source("f.py", text)
        for scope in module.scopes:
            for words in (numeric_probe.STAT_WORDS, numeric_probe.ROOT_WORDS):
                fresh = not engine.gated_out(module, scope, engine.gate_words(module, engine._Words(words)))  # type: ignore[arg-type]
                assert engine.scope_holds_words(module, scope, words) == fresh
                asked += 1
        assert set(module.__dict__.get("_npufuse_part_gates", {})) <= {numeric_probe.STAT_WORDS, numeric_probe.ROOT_WORDS}
    assert asked > 1000


def test_scope_holds_words_is_open_with_the_gates_off(monkeypatch: Any) -> None:
    module = ModuleInfo.from_source("f.py", "def f(x):\n    return x\n")
    assert not engine.scope_holds_words(module, module.scopes[1], ("rsqrt",))
    monkeypatch.setattr(engine, "SCOPE_GATES", False)
    assert engine.scope_holds_words(module, module.scopes[1], ("rsqrt",))


# -- the numeric probe's and the mask-row reader's walks ------------------------------------------------------------

def _code_nodes_reference(fn: ast.FunctionDef) -> Iterator[ast.AST]:
    stack: list[ast.AST] = [*fn.body, *fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None)]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.Raise):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(node.body)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.arg) or (isinstance(node, ast.AnnAssign) and child is node.annotation):
                continue
            stack.append(child)


def _own_nodes_reference(fn: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack += list(ast.iter_child_nodes(n))
    return out


def test_probe_and_mask_row_walks_visit_what_the_ast_module_walks_visit() -> None:
    from npufuse.patterns import _mask_rows

    functions = 0
    for text in _texts()[::2]:
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            functions += 1
            assert [id(n) for n in numeric_probe._code_nodes(fn)] == [id(n) for n in _code_nodes_reference(fn)]
            assert [id(n) for n in _mask_rows._own_nodes(fn)] == [id(n) for n in _own_nodes_reference(fn)]
            assert numeric_probe._assigned_names(fn) == {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            assert numeric_probe._free_names(fn) == {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    assert functions > 300
