"""Generic risks of a candidate, added to what its detector reports.

Two halves, because the process pool only ships plain results back:

* :func:`local_risks` needs the AST (runs where the file was parsed): dynamic shapes,
  non-contiguous inputs, autocast regions, host syncs in the generated fused code;
* :func:`repo_risks` needs repo-wide facts (runs after all files are in): the API's dtype
  support against what the repo uses, and an inference-only API in a repo that trains.

A generic risk is dropped when the detector already reported one of the same kind (the
detector knows the site better). Every risk carries a level (low / medium / high) for the
summary table and the suggested order.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Iterator

from npufuse.patterns.base import Finding, Pattern, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, child_nodes, fast_walk

LEVELS = ("none", "low", "medium", "high")
# Level of a detector-reported risk, by kind (detectors report kind and detail only).
KIND_LEVEL = {
    "inference_only": "high",
    "host_sync": "medium",
    "dynamic_shape": "medium",
    "autocast": "medium",
    "layout": "medium",
    "numerics": "medium",
    "non_contiguous": "low",
    "dtype": "low",
    "other": "medium",
}

# Documented dtype support of each pattern's fused API (shared/specs/torch_npu_api.md).
API_DTYPES: dict[str, tuple[str, str]] = {
    "rms_norm": ("fp16, bf16 and fp32", "bf16 is unsupported on Atlas 310P, which also needs x and weight in one dtype"),
    "add_rms_norm": ("fp16, bf16 and fp32 (weight in the dtype of x)", "bf16 is unsupported on Atlas 310P"),
    "swiglu": ("fp16, bf16 and fp32", "documented for Atlas A2/A3"),
    "geglu": ("fp16, bf16 and fp32", "bf16 needs Atlas A2 or newer"),
    "rope": ("fp16, bf16 and fp32 (cos/sin are cast to the input dtype)", "bf16 is unsupported on Atlas 310P"),
    "attention": ("fp16, bf16 and fp32 (q, k, v in one dtype)", "Atlas A2/A3 only: not available on 310P"),
    "sdpa": ("fp16, bf16 and fp32 (q, k, v in one dtype)", "Atlas A2/A3 only: not available on 310P"),
    "moe_experts": ("fp16, bf16 and fp32", "npu_grouped_matmul gives fp32 output only with single tensors; bf16 is unsupported on Atlas 310P"),
    "fused_optimizer": ("fp32 and fp16 parameters", "bf16 parameters raise TypeError in torch_npu.optim.NpuFused*"),
}

SHAPE_SENSITIVE = {"attention", "sdpa", "rope", "moe_experts"}
VARLEN_ARG = re.compile(r"cu_seq|max_seqlen|seq_lens|seqlens|seq_lengths|input_lengths|actual_seq|^lengths$")
DATA_DEPENDENT = {"nonzero", "unique", "unique_consecutive", "masked_select", "bincount", "argwhere"}
HOST_SYNC = {"item", "tolist", "cpu", "numpy"}
VIEW_METHODS = {"transpose", "permute", "t", "swapaxes", "swapdims", "movedim", "moveaxis", "expand", "expand_as", "narrow", "unfold", "as_strided", "diagonal"}
VIEW_ATTRS = {"T", "mT", "H", "mH"}
STRIDE_KEEPING = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}  # preserve_format


def risk(kind: str, detail: str, level: str | None = None, source: str = "scan") -> dict[str, Any]:
    return {"kind": kind, "detail": detail, "level": level or KIND_LEVEL.get(kind, "medium"), "source": source}


def detector_risks(finding: Finding) -> list[dict[str, Any]]:
    out = []
    for r in finding.risks:
        if isinstance(r, Risk):
            out.append(risk(str(r.kind), str(r.detail), source="detector"))
    return out


def merge(detector: list[dict[str, Any]], generic: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kinds = {r["kind"] for r in detector}
    return detector + [r for r in generic if r["kind"] not in kinds]


def overall_level(risks: list[dict[str, Any]]) -> str:
    best = "none"
    for r in risks:
        if LEVELS.index(r.get("level", "medium")) > LEVELS.index(best):
            best = r.get("level", "medium")
    return best


def _seg(module: ModuleInfo, node: ast.AST, limit: int = 80) -> str:
    """Source text of ``node`` on one line (ast.get_source_segment re-splits the whole file on
    every call: too slow inside a scan)."""
    text = None
    lines = _lines(module)
    try:
        a, b = node.lineno, node.end_lineno or node.lineno
        ca, cb = node.col_offset, node.end_col_offset
        if cb is not None and 1 <= a <= b <= len(lines):
            chunk = [ln.encode("utf-8") for ln in lines[a - 1 : b]]  # ast columns are UTF-8 byte offsets
            if a == b:
                text = chunk[0][ca:cb].decode("utf-8", "replace")
            else:
                text = b"".join([chunk[0][ca:], *chunk[1:-1], chunk[-1][:cb]]).decode("utf-8", "replace")
    except AttributeError:
        text = None
    if text is None:
        text = ast.unparse(node)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lines(module: ModuleInfo) -> list[str]:
    """The module's lines (split once per module, shared with the detectors)."""
    return module.lines


def _scope_nodes(scope: Scope) -> Iterator[ast.AST]:
    """Expression nodes of the scope's own statements (not of nested functions or classes)."""
    for _block, _i, stmt in scope.statements():
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for child in child_nodes(stmt):
            if isinstance(child, ast.stmt) or isinstance(child, (ast.excepthandler, ast.match_case)):
                continue
            yield from fast_walk(child)


def _site_statements(scope: Scope, finding: Finding) -> list[ast.stmt]:
    out = []
    for _block, _i, stmt in scope.statements():
        if stmt.lineno >= finding.line and (stmt.end_lineno or stmt.lineno) <= finding.end_line:
            out.append(stmt)
    return out


def _ancestors(scope: Scope, line: int) -> list[ast.stmt]:
    """Compound statements of the scope enclosing ``line`` (outermost first)."""
    chain: list[ast.stmt] = []
    block = scope.body
    while True:
        for stmt in block:
            if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno) and stmt.lineno != line:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    return chain
                inner = [b for b in _child_blocks(stmt) if b and b[0].lineno <= line <= (b[-1].end_lineno or b[-1].lineno)]
                if not inner:
                    return chain
                chain.append(stmt)
                block = inner[0]
                break
        else:
            return chain


def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(stmt, n) for n in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, n, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", []) or []]
    blocks += [c.body for c in getattr(stmt, "cases", []) or []]
    return blocks


def _scope_text(module: ModuleInfo, scope: Scope) -> str:
    node = scope.node
    if not hasattr(node, "lineno"):
        return module.source
    return "".join(_lines(module)[node.lineno - 1 : node.end_lineno])


def _scope_facts(module: ModuleInfo, scope: Scope) -> dict[str, ast.AST | None]:
    """First shape read, data-dependent op and fp64 use of a scope: one walk, memoised per scope
    (several sites often share a function), skipped when the text rules them out."""
    memo = module.__dict__.setdefault("_npufuse_scope_facts", {})
    key = id(scope.node)
    if key in memo:
        return memo[key]
    text = _scope_text(module, scope)
    want_shape = ".shape" in text or ".size(" in text
    want_dep = any(f".{m}(" in text for m in DATA_DEPENDENT) or "where(" in text
    want_fp64 = "float64" in text or "double" in text
    found: dict[str, ast.AST | None] = {"shape": None, "dep": None, "fp64": None}
    if want_shape or want_dep or want_fp64:
        for node in _scope_nodes(scope):
            t = type(node)
            if t is ast.Call:
                f = node.func
                if want_dep and found["dep"] is None and (
                    (type(f) is ast.Attribute and f.attr in DATA_DEPENDENT) or (len(node.args) == 1 and module.canonical(f) == "torch.where")
                ):
                    found["dep"] = node
                if want_shape and found["shape"] is None and type(f) is ast.Attribute and f.attr == "size":
                    found["shape"] = node
                if want_fp64 and found["fp64"] is None and type(f) is ast.Attribute and f.attr == "double":
                    found["fp64"] = node
            elif t is ast.Attribute:
                if want_shape and found["shape"] is None and node.attr == "shape" and type(node.ctx) is ast.Load:
                    found["shape"] = node
                if want_fp64 and found["fp64"] is None and node.attr in ("float64", "double") and (module.canonical(node) or "").startswith("torch."):
                    found["fp64"] = node
    memo[key] = found
    return found


def local_risks(module: ModuleInfo, scope: Scope, finding: Finding, pattern: Pattern) -> list[dict[str, Any]]:
    """Risks read off the code around the site (needs the parsed module)."""
    out: list[dict[str, Any]] = []
    out += _dynamic_shape(module, scope, finding, pattern)
    out += _non_contiguous(module, scope, finding)
    out += _autocast(module, scope, finding)
    out += _host_sync(finding)
    out += _fp64(module, scope)
    return out


def _dynamic_shape(module: ModuleInfo, scope: Scope, finding: Finding, pattern: Pattern) -> list[dict[str, Any]]:
    varlen = [a for a in scope.args if VARLEN_ARG.search(a)]
    if varlen:
        return [risk("dynamic_shape", f"the function takes variable-length batches (`{varlen[0]}` argument): every new shape can compile a new kernel or graph (torch.compile, aclgraph); pad to a few fixed lengths or check the API's varlen (TND) form")]
    if pattern.id == "moe_experts":
        return [risk("dynamic_shape", "tokens per expert depend on the router output (data-dependent shapes): group lists change every step, so graph mode recompiles and a Python group list needs a host sync")]
    if pattern.id not in SHAPE_SENSITIVE:
        return []
    facts = _scope_facts(module, scope)
    shape_read, data_dep = facts["shape"], facts["dep"]
    if data_dep is not None:
        return [risk("dynamic_shape", f"data-dependent shapes (`{_seg(module, data_dep)}`, line {data_dep.lineno}): shapes change with the data, so graph mode recompiles")]
    if shape_read is not None:
        return [risk("dynamic_shape", f"the sequence length is read from the input at runtime (`{_seg(module, shape_read)}`, line {shape_read.lineno}): if batches vary in length, each new shape can compile a new kernel or graph (torch.compile, aclgraph); pad to a few fixed lengths", level="low")]
    return []


def _view_origin(module: ModuleInfo, expr: ast.AST | None) -> str | None:
    """Source of the view op if ``expr`` evaluates to a (likely) non-contiguous view."""
    node = expr
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRIDE_KEEPING:
        node = node.func.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in VIEW_METHODS:
        return f".{node.func.attr}({', '.join(_seg(module, a, 20) for a in node.args)})"
    if isinstance(node, ast.Attribute) and node.attr in VIEW_ATTRS:
        return f".{node.attr}"
    if isinstance(node, ast.Subscript):
        sl = node.slice
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        # a slice or `...` anywhere but a lone leading position gives strided memory
        if len(elts) > 1 and any(isinstance(e, ast.Slice) for e in elts[1:]):
            return f"[{_seg(module, sl, 30)}]"
        if len(elts) == 1 and isinstance(sl, ast.Slice) and sl.step is not None:
            return f"[{_seg(module, sl, 30)}]"
    return None


def _fused_code(finding: Finding) -> str:
    """The replacement's lines without their comments: generated code, so a regex over it is enough (no
    second parse)."""
    return "\n".join(ln.split("#", 1)[0] for ln in finding.fused.splitlines())


def _non_contiguous(module: ModuleInfo, scope: Scope, finding: Finding) -> list[dict[str, Any]]:
    if scope.qualname == "<module>":
        return []
    found: list[str] = []
    seen: set[str] = set()
    for stmt in _site_statements(scope, finding):
        for node in fast_walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in seen and node.id != "self":
                seen.add(node.id)
                value = scope.definition(node.id, finding.line)
                if value is None:
                    continue
                origin = _view_origin(module, value) or _view_origin(module, scope.resolve(value, getattr(value, "lineno", None)))
                if origin:
                    found.append((node.id, f"`{node.id}` (`{origin}`, line {value.lineno})"))
    if not found:
        return []
    # what the replacement does with each of them: ``.contiguous()`` on another tensor (the output's
    # ``.transpose(1, 2).contiguous()``) does not copy these (a false "makes it contiguous" note; audit33)
    code = _fused_code(finding)
    # (``q.contiguous()``, or after further views of it: ``q.transpose(1, 2).unsqueeze(1).contiguous()``)
    made = [n for n, _ in found[:3]
            if re.search(r"(?<![\w.])" + re.escape(n) + r"(?:\s*\.\s*\w+\s*\([^()]*\))*\s*\.\s*contiguous\s*\(\s*\)", code)]
    if made and len(made) == len(found[:3]):
        tail = "the replacement makes it contiguous (one extra copy)"
    elif made:
        tail = f"the replacement makes {', '.join(f'`{n}`' for n in made)} contiguous (one extra copy each); check the fused API accepts the others"
    else:
        tail = "the replacement passes it as it is: check the fused API accepts it, or the layout it names matches"
    return [risk("non_contiguous", f"non-contiguous view feeding the site: {', '.join(t for _, t in found[:3])}; {tail}")]


def _is_autocast(module: ModuleInfo, node: ast.AST) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    name = module.canonical(target) or ""
    return name.rsplit(".", 1)[-1] in ("autocast", "custom_fwd", "custom_bwd")


def _autocast(module: ModuleInfo, scope: Scope, finding: Finding) -> list[dict[str, Any]]:
    hits: list[str] = []
    for stmt in _ancestors(scope, finding.line):
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if _is_autocast(module, item.context_expr):
                    hits.append(f"`with {_seg(module, item.context_expr)}` (line {stmt.lineno})")
    fn = scope.node
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for d in fn.decorator_list:
            if _is_autocast(module, d):
                hits.append(f"decorator `@{_seg(module, d)}` (line {d.lineno})")
    if not hits:
        return []
    return [risk("autocast", f"the site runs under autocast ({'; '.join(hits)}): the fused op sees the dtypes autocast leaves and its output dtype must match what the original produced there (DESIGN rule 2); check the op against autocast's cast lists")]


_HOST_SYNC_CALL = re.compile(r"\.(" + "|".join(sorted(HOST_SYNC)) + r")\(\s*\)")


def _host_sync(finding: Finding) -> list[dict[str, Any]]:
    code = _fused_code(finding)
    calls = sorted({f".{m.group(1)}()" for m in _HOST_SYNC_CALL.finditer(code)})
    if not calls:
        return []
    return [risk("host_sync", f"the replacement calls {', '.join(calls)}: a device-to-host sync on every call (the API takes Python values here); keep it out of hot loops")]


def _fp64(module: ModuleInfo, scope: Scope) -> list[dict[str, Any]]:
    if scope.qualname == "<module>":
        return []
    node = _scope_facts(module, scope)["fp64"]
    if node is None:
        return []
    return [risk("dtype", f"the function uses float64 (line {node.lineno}): the fused APIs reject fp64; the guard must keep fp64 inputs on the original code", level="medium")]


# Fusions whose inputs can meet in mixed dtypes under autocast (a fused op does not follow it)
AMP_SENSITIVE = frozenset({"attention", "sdpa", "rope", "rms_norm", "add_rms_norm", "swiglu", "geglu", "moe_experts"})


def repo_risks(finding: Finding, pattern: Pattern, *, training: list[str], bf16: bool, amp: list[str] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """Risks that need repo-wide facts: dtype support vs the repo's dtypes, inference-only APIs,
    AMP (``amp``: where the repo enters autocast)."""
    out: list[dict[str, Any]] = []
    if amp and pattern.id in AMP_SENSITIVE:
        unify = ("the replacement casts q/k/v to the autocast dtype as the original's matmuls would" if pattern.id in ("attention", "sdpa")
                 else "torch_npu ops do not follow autocast, so the fused op runs in the dtypes it is given")  # fmt: skip
        more = f" and {len(amp) - 1} more" if len(amp) > 1 else ""
        out.append(risk("autocast", f"the repo trains under autocast ({amp[0]}{more}): the site can see mixed dtypes (e.g. q/k float32 after RoPE, v bf16) "
                                    f"and its output must keep the dtype the original gives under autocast; {unify}; "
                                    "`npufuse verify op` adds an autocast (bfloat16) pass for it"))  # fmt: skip
    dtypes = API_DTYPES.get(pattern.id)
    if dtypes is not None:
        supported, caveat = dtypes
        if pattern.id == "fused_optimizer" and bf16:
            out.append(risk("dtype", f"the repo uses bf16 and {caveat}; keep bf16 parameters on the original optimizer (or use `torch.optim.AdamW(fused=True)` where the stack supports it)", level="high"))
        else:
            used = "; the repo uses bf16" if bf16 else ""
            out.append(risk("dtype", f"`{pattern.api}` takes {supported}; {caveat}{used}", level="low"))
    if not finding.training_ok or not pattern.training_ok:
        if training:
            out.append(risk("inference_only", f"`{pattern.api}` has no backward, and this repo trains (`{training[0]}`): the fused branch must only run without autograd (`not torch.is_grad_enabled()`), or the backward will fail", level="high"))
        else:
            out.append(risk("inference_only", f"`{pattern.api}` has no backward; no training code was found in the scanned tree, but if this model is trained elsewhere the fused branch must be off under autograd", level="medium"))
    return out
