"""s49 mask49: the norm of a transformers decoder layer taken from a loop over a model's ``layers`` in a function.

HO25b mamba-vla ``extract_attention_from_bridge`` (a module-level function, under ``@torch.inference_mode``) unrolls
a transformers Qwen3-VL text model by hand: ``lm = bridge.causal_model.language_model``, ``for idx, decoder_layer in
enumerate(lm.layers):``, ``hidden_states = residual + attn_out; residual = hidden_states; hidden_states =
decoder_layer.post_attention_layernorm(hidden_states)``. The add + norm reading of a plain function resolves a
member norm (``layer.ffn_norm(x)``) only where the object's class is known; here it is known only through the
annotation of the function's parameter ``bridge: Qwen3VLBridge``, a class of the repository whose ``__init__``
stores ``self.causal_model: "Qwen3VLForConditionalGeneration" = ...``, a name its file imports from
``transformers.models.qwen3_vl`` (a family whose decoder norm is the Llama-style RMSNorm, s37 / s40).

:func:`hf_layer_norm` follows exactly that chain -- loop variable over ``<name>.layers`` (through ``enumerate`` and
a slice), ``<name>`` a parameter or a local assigned once from ``<param>.<attr>...``, the parameter annotated with a
repository class (``repo_facts.definition``) whose ``__init__`` annotates ``self.<attr>`` with a name its file imports
from a Llama-style transformers family -- and then reads the norm as s37 does: fused only under the run-time check
that the module is one of transformers' Llama-style RMSNorm classes, the original call otherwise. Any other link
(an unannotated parameter, an attribute stored without an annotation, a family with another norm) leaves the call
unresolved, as before.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns._rope_s48r import stored_once


def _loop_iter(fn: ast.AST, name: str) -> Optional[ast.expr]:
    """The iterable of the one ``for`` of ``fn`` binding ``name`` (``for name in it`` / ``for i, name in
    enumerate(it)``), enumerate peeled; None where another statement binds it too or no loop does."""
    found: list[ast.expr] = []
    for node in ast.walk(fn):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            it, target = node.iter, node.target
            if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(it, ast.Call) \
                    and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and len(it.args) == 1:
                target, it = target.elts[1], it.args[0]
            if isinstance(target, ast.Name) and target.id == name:
                found.append(it)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return None
    return found[0] if len(found) == 1 else None


def _single_store(scope: Any, name: str) -> Optional[ast.expr]:
    """The value of ``name``'s one ``name = value`` in the scope, where that is its only store of any form."""
    if not stored_once(scope, name):
        return None
    values = [n.value for n in scope.nodes().get(ast.Assign, ()) if len(n.targets) == 1  # type: ignore[attr-defined]
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name]  # type: ignore[attr-defined]
    return values[0] if len(values) == 1 else None


def _stored(scope: Any, name: str) -> bool:
    """``name`` is bound in the scope by any form (a parameter rebound once or more)."""
    return any(n.id == name and type(n.ctx) is not ast.Load for n in scope.nodes().get(ast.Name, ()))  # type: ignore[attr-defined]


def _annotation_name(node: Optional[ast.expr]) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    return None


def _imported_from(tree: ast.Module, name: str) -> Optional[str]:
    """The dotted path ``name`` is imported as anywhere in ``tree`` (``TYPE_CHECKING`` blocks included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if (a.asname or a.name) == name:
                    return f"{node.module}.{a.name}"
    return None


def hf_layer_norm(module: Any, scope: Any, call: ast.Call, family: Any, runtime_norm: Callable[..., Any],
                  source_of: Callable[[Any, ast.AST], str]) -> Any:
    """The s37 run-time-checked reading of ``<layer>.<attr>(s)`` where ``<layer>`` is a decoder layer of a transformers
    Llama-style model by the chain above; None otherwise."""
    from npufuse.scan import repo_facts

    f = call.func
    fn = scope.node
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)) or scope.class_name \
            or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    it = _loop_iter(fn, f.value.id)
    if isinstance(it, ast.Subscript):
        it = it.value  # ``model.layers[:n]``
    if not (isinstance(it, ast.Attribute) and it.attr == "layers"):
        return None
    base: ast.expr = it.value
    if isinstance(base, ast.Name) and base.id not in [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]:
        stored = _single_store(scope, base.id)
        if stored is None:
            return None
        base = stored
    attrs: list[str] = []
    while isinstance(base, ast.Attribute):
        attrs.append(base.attr)
        base = base.value
    if not isinstance(base, ast.Name) or not attrs:
        return None
    param = next((a for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs) if a.arg == base.id), None)
    cls_name = _annotation_name(param.annotation) if param is not None else None
    if cls_name is None or _stored(scope, base.id):
        return None
    found = repo_facts.definition(module, cls_name)
    if found is None or not isinstance(found.node, ast.ClassDef):
        return None
    first = attrs[-1]  # the attribute of the parameter's object: ``bridge.causal_model``
    init = next((n for n in found.node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return None
    anns = [n for n in ast.walk(init) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute)
            and isinstance(n.target.value, ast.Name) and n.target.value.id == "self" and n.target.attr == first]
    if len(anns) != 1:
        return None
    ann = _annotation_name(anns[0].annotation)
    dotted = _imported_from(found.tree, ann) if ann else None
    if dotted is None or not family.match(dotted):
        return None
    origin = (f"`{source_of(module, f.value)}`, a layer of `{source_of(module, it)}`: `{base.id}: {cls_name}` stores "
              f"`self.{first}: {ann}` ({dotted.rsplit('.', 1)[0]}, {found.rel})")
    return runtime_norm(module, call, source_of(module, f), f.attr, origin)
