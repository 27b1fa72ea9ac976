"""What the repository already has: torch_npu calls and wrappers, NPU guards, and switches.

One ``ast.walk`` per file (:func:`file_facts`) collects

* ``existing``: ``torch_npu`` imports and calls, functions wrapping them, ``is_torch_npu_available``
  style guards, and sites npufuse already rewrote (its marker);
* ``switches``: arguments, config fields and environment variables named for fusion / NPU /
  flash (``--use-fused-rmsnorm``, ``config.use_flash_attn``, ``os.getenv("USE_NPU_FUSION")``);
* shape sources for :mod:`npufuse.scan.config_shapes`, training markers, bf16 use;
* spans that already have a ``torch_npu`` branch, so their eager fallback is not proposed again.

:func:`choose_switch` then applies DESIGN.md rule 1 for a candidate: the repo's existing switch
relevant to the pattern > a new config field where the module has a config > the environment
variable ``NPUFUSE_<ID>`` > none.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from npufuse.rewrite.codegen import Switch, env_switch
from npufuse.scan import config_shapes, forward_ad
from npufuse.scan.dataflow import _CHILD_FIELDS, ModuleInfo, Scope, child_fields, dotted, folds_to_ascii, lines_of_offsets

# Cheap prefilter: a switch name mentions one of these (is_switch decides).
SWITCH_NAME = re.compile(r"fus(e|ed|ion)|npu|ascend|flash|liger", re.IGNORECASE)
_TOPIC = ("fuse", "fusion", "flash", "liger", "npu", "ascend")
_FUSION_TOPIC = ("fuse", "fusion", "flash", "liger")
_FLAG_VERBS = {"use", "enable", "enabled", "disable", "disabled", "with", "without", "apply", "allow", "no", "do", "turn", "force", "skip"}
# Tokens of names that are sizes, modes or facts about a kernel, not on/off switches for one.
_NOT_A_SWITCH = {
    "size", "dim", "dims", "num", "channels", "channel", "heads", "layers", "layer", "ratio", "dropout", "eps", "impl",
    "implementation", "version", "mode", "type", "path", "dir", "home", "devices", "device", "visible", "rank", "deterministic",
    "input", "inputs", "embed", "hidden", "intermediate", "factor", "scale", "id", "ids", "index", "count", "uses",
    "supports", "supported", "available", "top", "left", "mask", "window", "length", "len",
    # diagnostics: a flag that turns on logging or tracing of a kernel does not choose the kernel
    # (Liger's `LIGER_RMS_DEBUG` prints from its RMSNorm kernel; audit42)
    "debug", "verbose", "log", "logging", "trace", "tracing", "profile", "profiling", "dump",
}


# values an environment variable set as an on/off flag takes (``os.environ["USE_FLASH"] = "1"``)
_FLAG_TEXTS = frozenset(("", "0", "1", "true", "false", "yes", "no", "on", "off", "y", "n", "t", "f"))


def _flag_value(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (bool, int)) or isinstance(node.value, str) and node.value.strip().lower() in _FLAG_TEXTS
    if isinstance(node, ast.IfExp):
        return _flag_value(node.body) and _flag_value(node.orelse)
    # str(flag), str(int(flag)): a bool or number spelled as text
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "int") and len(node.args) == 1


def _carries_value(lines: list[str], target: ast.Subscript) -> bool:
    """``os.environ["X"] = <value>`` where the value is no on/off flag (a path, a mode name, a variable): the
    repository uses the variable to pass a setting, so it is no switch for fused kernels (audit41: Eagle's
    ``os.environ["LA_FLASH_MODEL"] = model_path`` was reused as every attention site's switch, tested against
    "1"/"true": the fused branch never ran). Read from the target's line; a value that does not parse alone
    (continued on the next line) counts as a flag."""
    if target.end_lineno != target.lineno or target.lineno > len(lines):
        return False
    rest = lines[target.lineno - 1][target.end_col_offset or 0:].lstrip()
    if not rest.startswith("=") or rest.startswith("=="):
        return False
    try:
        value = ast.parse(rest[1:].strip(), mode="eval").body
    except SyntaxError:
        return False
    return not _flag_value(value)


def _tokens(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [t for t in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if t]


def is_switch(name: str, kind: str, value: Any = None) -> bool:
    """Is ``name`` an on/off switch for fused/NPU code? It must name the topic (fused, fusion,
    flash, liger, npu, ascend), not be a size or mode (``fusion_hidden_size``,
    ``deterministic_flash_attn``), and look boolean: a flag verb first (``use_``, ``enable_``,
    ``disable_``...), a bool value/default, or (environment variables) a fusion word."""
    tokens = _tokens(name)
    if not tokens or any(t in _NOT_A_SWITCH for t in tokens) or not any(t.startswith(_TOPIC) for t in tokens):
        return False
    if tokens[0] in _FLAG_VERBS or isinstance(value, bool) or value in ("store_true", "store_false"):
        return True
    # an environment variable named for fusion: ``NPU_FUSED_ROPE``, and ``NPUFUSE_RMS_NORM``
    # (npufuse's own spelling, one token); with no flag verb first, every other word must name the
    # topic, an op or a kernel: ``LIGER_RMS_COMPILE_BUCKET`` or ``LIGER_RMS_FORCE_NO_FAST`` tune the
    # repository's own kernel and do not choose one (audit42)
    if kind != "env" or not any(t.startswith(_FUSION_TOPIC) or (t.startswith(("npu", "ascend")) and "fus" in t) for t in tokens):
        return False
    # the first word may be the project's own prefix (``VLLM_USE_TRITON_FLASH_ATTN``, ``LA_FLASH_ATTN``)
    named = tokens[1:] if len(tokens) > 1 else tokens
    return all(t.startswith(_TOPIC) or t in _FLAG_VERBS or t in _FILLER or t in _KERNEL_WORDS or t in _OP_WORDS or any(w in t for w in _ALL_WORDS) or t.isdigit()
               for t in named)
# Words (separators removed, lower case) that tie a switch to a pattern.
PATTERN_WORDS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rmsnorm", "rms"),
    "add_rms_norm": ("addrmsnorm", "rmsnorm", "rms"),
    "swiglu": ("swiglu", "silu", "mlp"),
    "geglu": ("geglu", "gelu", "mlp"),
    "rope": ("rope", "rotary", "rotate", "posemb"),
    "attention": ("flash", "attn", "attention", "sdpa"),
    "sdpa": ("flash", "attn", "attention", "sdpa"),
    "moe_experts": ("moe", "expert", "gmm", "groupedmatmul"),
    "fused_optimizer": ("optim", "adam", "sgd", "lamb"),
    "affinity_index_put": ("affinity", "indexput"),
    "affinity_where": ("affinity", "where"),
}
_ALL_WORDS = {w for words in PATTERN_WORDS.values() for w in words}
# Single words of switch names that name an op a fused kernel replaces (is_switch: an environment
# variable named for one, ``NPU_FUSED_ADD_RMS_NORM``, ``FLASH_ATTN_V2``).
_OP_WORDS = _ALL_WORDS | {"norm", "add", "attn", "rotary", "emb", "embedding", "pos", "mlp", "glu", "experts", "optimizer",
                          "layernorm", "ln", "v1", "v2", "v3", "fa", "fa2", "fa3", "all", "model", "kv", "put", "index"}
_NEGATIVE = re.compile(r"^(disable|no|without|skip)[_-]", re.IGNORECASE)

GUARD_CALLS = {"is_torch_npu_available", "is_npu_available", "is_torch_npu_avaliable", "npu_is_available"}
ENV_READS = {"os.environ.get", "os.getenv", "os.environ.setdefault", "environ.get", "getenv"}


@dataclass
class FileFacts:
    existing: list[dict[str, Any]] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    config_sources: list[config_shapes.ConfigSource] = field(default_factory=list)
    training: list[str] = field(default_factory=list)  # "file:line: what" (first few)
    bf16: bool = False
    # where the file runs code under AMP ("file:line: `torch.autocast(...)`", first few)
    amp: list[str] = field(default_factory=list)
    # spans (start, end, where) whose code already has a torch_npu branch beside it
    fused_spans: list[tuple[int, int, str]] = field(default_factory=list)
    # spans inside an npufuse-rewritten ``if``: (start, end, pattern)
    npufuse_spans: list[tuple[int, int, str]] = field(default_factory=list)
    # class-like names the module imports (``from .configuration_x import XConfig``): a config
    # field of a class the module imports is in scope for its sites (:func:`choose_switch`)
    imports: tuple[str, ...] = ()
    # s41: (kind, line, api) where the file runs code under a functorch transform, forward-mode AD or a
    # double-backward functional API (npufuse.scan.forward_ad)
    transforms: list[tuple[str, int, str]] = field(default_factory=list)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@lru_cache(maxsize=4096)
def switch_relevance(pattern: str, name: str) -> int:
    """2: the switch names this pattern; 1: a generic fusion switch; 0: unrelated."""
    n = _norm(name)
    if any(w in n for w in PATTERN_WORDS.get(pattern, ())):
        return 2
    if "fus" in n and not any(w in n for w in _ALL_WORDS):
        return 1
    return 0


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


# "npu" as a word or in torch_npu / is_npu / npu_* names (not inside "input").
_NPU_TEXT = re.compile(r"(?<![A-Za-z])npu")


def _mentions_bf16(src: str) -> bool:
    """bf16 named on a code line (not after a ``#``): ``torch.bfloat16``, ``"bf16"``,
    ``"bfloat16"``, ``bf16=True``. Plain ``str.find`` (a regex over every file is slower)."""
    for token in ("bfloat16", "bf16"):
        i = src.find(token)
        while i >= 0:
            before = src[i - 6 : i] if i >= 6 else src[:i]
            after = src[i + len(token) : i + len(token) + 8]
            quoted = before[-1:] in ("'", '"') and after[:1] in ("'", '"')
            if before.endswith("torch.") or quoted or (token == "bf16" and after.replace(" ", "").startswith("=True")):
                start = src.rfind("\n", 0, i) + 1
                if "#" not in src[start:i]:
                    return True
            i = src.find(token, i + 1)
    return False
_CFG_ATTR = re.compile(r"(?:config|cfg)\s*\.\s*\w*(?:fus|npu|ascend|flash|liger)", re.IGNORECASE)
# The same search, case-sensitive, over the lower-cased text: about half the cost (an
# IGNORECASE pattern gets no literal-prefix scan). Exact when lower() maps the text character
# by character and no character outside ASCII matches an ASCII letter of the pattern under
# IGNORECASE: of all code points only U+0130 lower-cases to two characters (and U+0130 and
# U+212A to ASCII), and sre also folds U+0131 with "i" and U+017F with "s". A text holding any
# of them takes the regex above.
_CFG_ATTR_LOWER = re.compile(r"(?:config|cfg)\s*\.\s*\w*(?:fus|npu|ascend|flash|liger)")
_CFG_ODD = ("\u0130", "\u0131", "\u017f", "\u212a")


# Text outside ASCII: str.lower() of a two- or four-byte string costs more than the search.
# The same search over the UTF-8 bytes (bytes.lower() lowers ASCII only), every byte outside
# ASCII allowed where the pattern has \s or \w (str's \s also holds \x1c-\x1f), finds every
# match of _CFG_ATTR_LOWER (config, cfg, "." and the words are ASCII in the lowered text, so
# ASCII in the text: no character outside _CFG_ODD lower-cases to ASCII) and maybe more: only
# a text it matches is lowered and searched as before.
_CFG_ATTR_BYTES = re.compile(rb"(?:config|cfg)[\s\x1c-\x1f\x80-\xff]*\.[\s\x1c-\x1f\x80-\xff]*[\w\x80-\xff]*(?:fus|npu|ascend|flash|liger)")


def _mentions_cfg_switch(src: str) -> bool:
    """``_CFG_ATTR.search(src) is not None``."""
    if src.isascii():
        return _CFG_ATTR_LOWER.search(src.lower()) is not None
    if not any(c in src for c in _CFG_ODD):
        if _CFG_ATTR_BYTES.search(src.encode("utf-8", "surrogatepass").lower()) is None:
            return False
        return _CFG_ATTR_LOWER.search(src.lower()) is not None
    return _CFG_ATTR.search(src) is not None


_ASCII_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _mentions_npu(src: str) -> bool:
    """``_NPU_TEXT.search(src) is not None`` without the regex: a lookbehind first defeats the
    regex engine's literal search (it tried every position: a tenth of a file's parse time)."""
    i = src.find("npu")
    while i >= 0:
        if i == 0 or src[i - 1] not in _ASCII_LETTERS:
            return True
        i = src.find("npu", i + 1)
    return False


# The node types file_facts reads (every other node only leads to these).
_FACT_TYPES = frozenset({ast.Call, ast.Attribute, ast.Subscript, ast.Compare, ast.Import, ast.ImportFrom, ast.If, ast.FunctionDef, ast.AsyncFunctionDef})
# Leaf nodes with no children that no reader of _nodes looks at (Load/Store, +, and, ==, not, ...).
_LEAVES = (ast.expr_context, ast.operator, ast.boolop, ast.cmpop, ast.unaryop)


def _nodes(tree: ast.AST, only: frozenset[type] | None = None, lines: list[int] | None = None):
    """Every node but the context/operator leaves, depth first — the same set as ``ast.walk``
    otherwise, at a fraction of its cost (fields that never hold a node are not read).
    ``only``: yield just the nodes of these types (the same ones, in the same order).
    ``lines``: sorted line numbers; a statement spanning none of them is skipped with all it
    holds (the nodes left keep their order: whole subtrees drop out of the same walk)."""
    from bisect import bisect_left

    stack = [tree]
    pop, push = stack.pop, stack.append
    AST, leaves, stmt = ast.AST, _LEAVES, ast.stmt
    fields = _CHILD_FIELDS  # child_fields' table, read inline (a call per node cost a fifth of the walk)
    n_lines = len(lines) if lines is not None else 0
    while stack:
        node = pop()
        if lines is not None and isinstance(node, stmt):
            k = bisect_left(lines, node.lineno)
            if k == n_lines or lines[k] > (node.end_lineno or node.lineno):
                continue
        if only is None or type(node) in only:
            yield node
        names = fields.get(type(node))
        if names is None:
            names = child_fields(type(node))
        for name in names:
            v = getattr(node, name, None)
            if type(v) is list:
                for x in v:  # pushed in the list's order, one by one (no comprehension per list)
                    if isinstance(x, AST) and not isinstance(x, leaves):
                        push(x)
            elif isinstance(v, AST) and not isinstance(v, leaves):
                push(v)


_PRUNE = True  # tests switch it off to compare
_SWITCH_WORDS_LOWER = re.compile(r"fus|npu|ascend|flash|liger")  # SWITCH_NAME's words, lower case
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _switch_word_lines(src: str, folds: bool = True) -> list[int] | None:
    """The lines (numbered as ast does) where an attribute whose name SWITCH_NAME matches can
    have its name, sorted; None when that cannot be told from the text. A name is written on
    one line; SWITCH_NAME (IGNORECASE) matches it only where the lower-cased line holds one of
    its words (the characters ``_mentions_cfg_switch`` guards against aside), unless the line
    holds a character outside ASCII: identifiers are NFKC-normalised (a ligature "\ufb02" reads
    as "fl"), so such lines are all kept, unless ``folds`` is False (``dataflow.folds_to_ascii``:
    no character of the file decomposes to ASCII). Line ends must be "\n" only (ast counts "\r" too)."""
    if "\r" in src or not (src.isascii() or not any(c in src for c in _CFG_ODD)):
        return None
    low = src.lower()  # the same length: no U+0130
    starts = [m.start() for m in _SWITCH_WORDS_LOWER.finditer(low)]
    if not src.isascii() and folds:
        starts += [m.start() for m in _NON_ASCII.finditer(src)]
        starts.sort()
    return lines_of_offsets(src, starts)


# s50: each word with its left boundary after it (as _compiled._SCRIPT_WORD): the same matches, searched by their
# first characters instead of the whole matcher at every position
_AMP_CALL = re.compile(r"(?:autocast(?<!\wautocast)|GradScaler(?<!\wGradScaler))\s*\(")


def _amp_lines(path: str, src: str, limit: int = 8) -> list[str]:
    """Code lines (not comments) entering autocast or building a GradScaler: the repo trains
    under AMP, so a fused site may see autocast's mixed dtypes (a risk, and an op-check pass)."""
    out: list[str] = []
    for n, line in enumerate(src.splitlines(), start=1):
        code = line.split("#", 1)[0]
        # `autocast(..., enabled=False)` turns AMP off for a region: no sign of AMP training
        if _AMP_CALL.search(code) and not re.search(r"enabled\s*=\s*False", code):
            out.append(f"{path}:{n}: `{code.strip()[:70]}`")
            if len(out) >= limit:
                break
    return out


def file_facts(module: ModuleInfo) -> FileFacts:
    """Everything :mod:`repo_search` needs from one parsed file.

    Cheap text checks decide what to look for; the tree is walked (once) only when one of them
    hits, because most model files have no torch_npu code, environment reads or argparse."""
    facts = FileFacts()
    path = module.path
    src = module.source
    want_npu = _mentions_npu(src)
    want_env = "environ" in src or "getenv" in src
    want_args = "add_argument" in src
    want_train = ".backward(" in src or ".step(" in src or "Trainer(" in src
    want_cfg = _mentions_cfg_switch(src)
    # bf16 use is a hint for the dtype risk wording: code lines naming it are enough
    facts.bf16 = _mentions_bf16(src)
    if "autocast" in src or "GradScaler" in src:
        facts.amp = _amp_lines(path, src)
    npu_call_lines: list[tuple[int, str]] = []
    ifs: list[ast.If] = []
    functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    seen: set[tuple[int, str, str]] = set()

    def existing(line: int, what: str, kind: str, **extra: Any) -> None:
        if (line, what, kind) not in seen:
            seen.add((line, what, kind))
            facts.existing.append({"file": path, "line": line, "what": what, "kind": kind, **extra})

    # a build script's environment variables choose how extensions are built, not which code runs
    # (flash-attn's FLASH_ATTENTION_FORCE_BUILD in a vendored setup.py: audit34)
    build_script = path.rsplit("/", 1)[-1] == "setup.py" or "setuptools" in src or "cpp_extension" in src

    def switch(line: int, name: str, kind: str, value: Any = None, **extra: Any) -> None:
        if kind == "env" and build_script:
            return
        if SWITCH_NAME.search(name) and is_switch(name, kind, value):
            facts.switches.append({"file": path, "line": line, "name": name, "kind": kind, **extra})

    # Config-like classes (shapes, switch fields): module-level and nested in module-level classes.
    classes = list(module.classes.values())
    classes += [n for c in module.classes.values() for n in c.body if isinstance(n, ast.ClassDef)]
    for cls in classes:
        src_cfg = config_shapes.class_source(path, cls)
        if src_cfg is not None:
            facts.config_sources.append(src_cfg)
        if config_shapes.CONFIG_CLASS.search(cls.name) or config_shapes._is_dataclass(cls):
            for name, line, value in _class_fields(cls):
                switch(line, name, "config_field", value, owner=cls.name, default=value if isinstance(value, bool) else None)

    facts.imports = _imported_classes(module.tree)
    facts.transforms = forward_ad.uses(module)
    if not (want_npu or want_env or want_args or want_train or want_cfg):
        return facts
    Call, Attribute, Subscript, Compare = ast.Call, ast.Attribute, ast.Subscript, ast.Compare
    # Only a config-switch read asked for (most files that get here): just the statements on
    # lines that can hold one need walking.
    lines = _switch_word_lines(src, folds_to_ascii(module)) if _PRUNE and want_cfg and not (want_npu or want_env or want_args or want_train) else None
    for node in _nodes(module.tree, _FACT_TYPES, lines):
        t = type(node)
        if t is Call:
            func = node.func
            if want_npu or want_env:
                name = module.canonical(func) or ""
                last = name.rsplit(".", 1)[-1]
                if want_npu:
                    if name.startswith("torch_npu."):
                        npu_call_lines.append((node.lineno, name))
                        existing(node.lineno, f"{name} call", "call", api=name)
                    elif last in GUARD_CALLS or name in ("torch.npu.is_available", "torch_npu.npu.is_available"):
                        existing(node.lineno, f"guard: {last}()", "guard")
                    elif last == "find_spec" and node.args and _const_str(node.args[0]) == "torch_npu":
                        existing(node.lineno, 'guard: find_spec("torch_npu")', "guard")
                    elif last == "hasattr" and len(node.args) == 2 and _const_str(node.args[1]) == "npu":
                        existing(node.lineno, 'guard: hasattr(torch, "npu")', "guard")
                if want_env and name in ENV_READS and node.args:
                    var = _const_str(node.args[0])
                    if var:
                        default = config_shapes._literal(node.args[1]) if len(node.args) > 1 else None
                        switch(node.lineno, var, "env", None, default=default if isinstance(default, (str, int, bool)) else None)
            if type(func) is Attribute:
                attr = func.attr
                if want_args and attr == "add_argument":
                    dest = config_shapes.argparse_dest(node)
                    if dest:
                        switch(node.lineno, dest, "argument", _argparse_flag(node))
                    shaped = config_shapes.argparse_value(node)
                    if shaped:
                        facts.config_sources.append(config_shapes.ConfigSource(path, node.lineno, "argparse", f"--{dest.replace('_', '-')}" if dest else "argparse", {shaped[0]: shaped[1]}))
                elif want_train and attr == "backward" and len(facts.training) < 64:
                    facts.training.append(f"{path}:{node.lineno}: {dotted(func) or '.backward'}()")
                elif want_train and attr == "step" and "optim" in (dotted(func.value) or "").lower() and len(facts.training) < 64:
                    facts.training.append(f"{path}:{node.lineno}: {dotted(func)}()")
            if want_train:
                last_name = func.attr if type(func) is Attribute else getattr(func, "id", "")
                if last_name.endswith("Trainer") and last_name[:1].isupper() and len(facts.training) < 64:
                    facts.training.append(f"{path}:{node.lineno}: {last_name}(...)")
        elif t is Attribute:
            attr = node.attr
            if want_npu and attr == "is_npu" and type(node.ctx) is ast.Load:
                existing(node.lineno, "guard: .is_npu", "guard")
            elif want_cfg and type(node.ctx) is ast.Load and SWITCH_NAME.search(attr):
                base = dotted(node.value) or ""
                if base.split(".")[-1] in ("config", "cfg", "model_config"):
                    switch(node.lineno, attr, "config_field", read=f"{base}.{attr}")
        elif t is Subscript:
            if want_env and (module.canonical(node.value) or "") in ("os.environ", "environ"):
                var = _const_str(node.slice)
                if var:
                    if type(node.ctx) is ast.Store:
                        # set here, read elsewhere (or by a library): see choose_switch
                        switch(node.lineno, var, "env", default=None, sets=True, **({"carries": True} if _carries_value(module.lines, node) else {}))
                    else:
                        switch(node.lineno, var, "env", default=None)
        elif t is Compare:
            if want_env and len(node.ops) == 1 and type(node.ops[0]) is ast.In and (module.canonical(node.comparators[0]) or "") in ("os.environ", "environ"):
                var = _const_str(node.left)
                if var:
                    switch(node.lineno, var, "env", default=None)
            elif want_npu and any(_const_str(c) == "npu" for c in [node.left, *node.comparators]):
                existing(node.lineno, 'guard: device type == "npu"', "guard")
        elif t is ast.Import:
            if want_npu:
                for a in node.names:
                    if a.name.split(".")[0] == "torch_npu":
                        existing(node.lineno, f"import {a.name}", "import")
        elif t is ast.ImportFrom:
            if want_npu:
                if (node.module or "").split(".")[0] == "torch_npu":
                    existing(node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}", "import")
                for a in node.names:
                    if a.name in GUARD_CALLS:
                        existing(node.lineno, f"guard import: {a.name}", "guard")
        elif t is ast.If:
            if want_npu:
                ifs.append(node)
        elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            if want_npu:
                functions.append(node)

    if npu_call_lines:
        for fn in functions:
            inside = sorted({api for line, api in npu_call_lines if fn.lineno <= line <= (fn.end_lineno or fn.lineno)})
            if inside:
                existing(fn.lineno, f"wrapper {fn.name}() around {', '.join(inside)}", "wrapper", api=inside[0], name=fn.name)
        _branches(module, ifs, npu_call_lines, facts)
    elif "_npufuse_on_npu" in src:
        _branches(module, ifs, npu_call_lines, facts)
    facts.existing.sort(key=lambda e: (e["line"], e["kind"], e["what"]))
    facts.switches.sort(key=lambda s: (s["line"], s["name"], s["kind"]))
    facts.training = sorted(facts.training, key=lambda t: int(t.split(":")[-2]))[:3]
    return facts


def _class_fields(cls: ast.ClassDef) -> list[tuple[str, int, Any]]:
    """(name, line, default literal or None) of a config-like class's fields."""
    out: list[tuple[str, int, Any]] = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((stmt.target.id, stmt.lineno, config_shapes._literal(config_shapes._field_default(stmt.value))))
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            a = stmt.args
            positional = [*a.posonlyargs, *a.args]
            defaults = dict(zip([x.arg for x in positional[len(positional) - len(a.defaults):]], a.defaults))
            defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
            out += [(x.arg, stmt.lineno, config_shapes._literal(defaults.get(x.arg))) for x in (*positional, *a.kwonlyargs) if x.arg != "self"]
    return out


def _imported_classes(tree: ast.Module) -> tuple[str, ...]:
    """Capitalised names of ``from ... import`` statements (any level) at module level, also
    under module-level ``if TYPE_CHECKING:`` / ``try: ... except ImportError:`` blocks; the
    module's statements only (not function bodies), so it costs a few hundred nodes a file."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    while stack:
        node = stack.pop()
        if type(node) is ast.ImportFrom:
            names.update(a.name for a in node.names if a.name[:1].isupper())
        elif not isinstance(node, defs):
            for name in ("body", "orelse", "finalbody"):
                block = getattr(node, name, None)
                if type(block) is list:
                    stack.extend(block)
            for part in getattr(node, "handlers", None) or ():
                stack.extend(part.body)
    return tuple(sorted(names))


def _argparse_flag(call: ast.Call) -> Any:
    """"store_true"/"store_false", a bool default, or None: whether an argument is a flag."""
    for kw in call.keywords:
        if kw.arg == "action" and isinstance(kw.value, ast.Constant) and kw.value.value in ("store_true", "store_false"):
            return kw.value.value
        if kw.arg == "default" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool):
            return kw.value.value
        if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id == "bool":
            return True
    return None


def _span(block: list[ast.stmt]) -> tuple[int, int]:
    return block[0].lineno, block[-1].end_lineno or block[-1].lineno


def _branches(module: ModuleInfo, ifs: list[ast.If], npu_calls: list[tuple[int, str]], facts: FileFacts) -> None:
    """Spans whose eager code sits beside a torch_npu branch (already fused by hand or by us)."""
    lines = module.lines  # numbered as ast numbers them
    rewritten = "_npufuse_on_npu" in module.source  # only files npufuse rewrote need the check

    def has_npu(block: list[ast.stmt]) -> bool:
        if not block:
            return False
        a, b = _span(block)
        return any(a <= line <= b for line, _ in npu_calls)

    for node in ifs:
        if rewritten and any(isinstance(n, ast.Name) and n.id == "_npufuse_on_npu" for n in ast.walk(node.test)):
            # the marker ends the `if` header, which may span lines (a guard written over two)
            header = "".join(lines[node.lineno - 1 : max(node.lineno, node.body[0].lineno - 1)])
            m = re.search(r"#\s*npufuse:\s*([a-z_]+)", header)
            pid = m.group(1) if m else "?"
            a, b = node.lineno, node.end_lineno or node.lineno
            facts.npufuse_spans.append((a, b, pid))
            facts.existing.append({"file": module.path, "line": a, "what": f"npufuse-rewritten site ({pid})", "kind": "npufuse_site"})
            continue
        body_npu, else_npu = has_npu(node.body), has_npu(node.orelse)
        where = f"line {node.lineno}"
        if body_npu and node.orelse and not else_npu:
            facts.fused_spans.append((*_span(node.orelse), where))
        elif else_npu and not body_npu:
            facts.fused_spans.append((*_span(node.body), where))
    # ``if on_npu: return torch_npu.op(...)`` followed by the eager code in the same block.
    for block in _blocks(module.tree):
        for i, stmt in enumerate(block):
            if isinstance(stmt, ast.If) and not stmt.orelse and has_npu(stmt.body) and isinstance(stmt.body[-1], (ast.Return, ast.Raise)) and i + 1 < len(block):
                facts.fused_spans.append((*_span(block[i + 1:]), f"line {stmt.lineno}"))


def _blocks(tree: ast.AST):
    for node in _nodes(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


# -- switch choice ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteContext:
    """What a guard expression can reach at a site (computed where the AST is at hand)."""

    config_expr: str | None = None  # "self.config" | "config" | None
    args_expr: str | None = None  # "args" when argparse results are in scope
    self_attrs: tuple[str, ...] = ()  # attributes the class stores on self
    # s40 (audit40): flags that are false wherever the site runs (it sits in ``if not X:`` or in the ``else`` of
    # ``if X:``): HLLM's eager attention under ``if not self.use_ft_flash_attn:`` took that flag as its switch,
    # so the fused branch could never run
    off: tuple[str, ...] = ()
    # review40: flags that are true wherever the site runs (``if X:`` bodies, the ``else`` of ``if not X:``): a
    # negative switch (``disable_fused``, reused as ``not X``) is off there
    on: tuple[str, ...] = ()


def _flags_off_at(scope: Scope, line: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Texts of the plain flags (a name or a dotted attribute) whose falseness every path to ``line`` needs (the
    tests of the ``if not X:`` bodies and of the ``if X: ... else:`` orelse blocks around it), and of those whose
    truth it needs (``if X:`` bodies, the ``else`` of ``if not X:``)."""
    off: set[str] = set()
    on: set[str] = set()
    stack: list[ast.stmt] = list(getattr(scope.node, "body", []))
    while stack:
        st = stack.pop()
        if not (st.lineno <= line <= (st.end_lineno or st.lineno)):
            continue
        if isinstance(st, ast.If):
            test = st.test
            in_body = bool(st.body) and st.body[0].lineno <= line <= (st.body[-1].end_lineno or st.body[-1].lineno)
            in_else = bool(st.orelse) and st.orelse[0].lineno <= line <= (st.orelse[-1].end_lineno or st.orelse[-1].lineno)
            negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            name = dotted(test.operand if negated else test)  # type: ignore[attr-defined]
            if name and (in_body or in_else):  # review40: not a site starting at the ``if`` line (the whole if)
                (off if negated == in_body else on).add(name)
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for block in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(x for x in getattr(st, block, None) or [] if isinstance(x, ast.stmt))
        for h in getattr(st, "handlers", None) or []:
            stack.extend(h.body)
    return tuple(sorted(off)), tuple(sorted(on))


def site_context(module: ModuleInfo, scope: Scope, line: int | None = None) -> SiteContext:
    config_expr = None
    self_attrs: set[str] = set()
    if scope.class_name and scope.class_name in module.classes and "self" in scope.args[:1]:
        memo = module.__dict__.setdefault("_npufuse_self_attrs", {})  # per module: classes repeat across sites
        if scope.class_name not in memo:
            memo[scope.class_name] = _self_attributes(module, module.classes[scope.class_name])
        self_attrs = memo[scope.class_name]
        if "config" in self_attrs:
            config_expr = "self.config"
    if config_expr is None and "config" in scope.args:
        config_expr = "config"
    args_expr = None
    if "args" in scope.args:
        args_expr = "args"
    else:
        for _stmt, value in scope.assignments.get("args", []):
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("parse_args", "parse_known_args"):
                args_expr = "args"
    off, on = _flags_off_at(scope, line) if line else ((), ())
    return SiteContext(config_expr, args_expr, tuple(sorted(self_attrs)), off, on)


_READS_SELF_CONFIG = re.compile(r"self(?<!\wself)\s*\.\s*config(?![\w])")  # s50: boundary after the literal


def _self_attributes(module: ModuleInfo, cls: ast.ClassDef, depth: int = 3) -> set[str]:
    """``self.x`` assigned in the class (or a base class defined in the same module), or
    ``self.config`` read anywhere in it (HF models set it in a library base class). Walks the
    class's statements only (assignment targets), and its text for ``self.config``."""
    out: set[str] = set()
    lines = module.lines
    text = "".join(lines[cls.lineno - 1 : cls.end_lineno]) if cls.end_lineno else ""
    if _READS_SELF_CONFIG.search(text):  # the attribute itself, not ``self.configure_optimizers``
        out.add("config")
    stack: list[ast.AST] = list(cls.body)
    while stack:
        node = stack.pop()
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, name, None)
            if type(block) is list:
                stack.extend(block)
    if depth:
        for base in cls.bases:
            name = dotted(base)
            if name in module.classes and module.classes[name] is not cls:
                out |= _self_attributes(module, module.classes[name], depth - 1)
    return out


def _switch_expr(sw: dict[str, Any], ctx: SiteContext) -> str | None:
    name = sw["name"]
    kind = sw["kind"]
    if kind == "env":
        default = sw.get("default")
        default = "1" if default is True else "0" if default in (None, False) else str(default)
        expr = f'_npufuse_os.environ.get("{name}", "{default}").strip().lower() in ("1", "true", "on", "yes")'
    elif kind == "config_field":
        if name in ctx.self_attrs:
            expr = f"self.{name}"
        elif ctx.config_expr:
            expr = f'getattr({ctx.config_expr}, "{name}", False)'
        else:
            return None
    elif kind == "argument":
        if not ctx.args_expr:
            return None
        expr = f'getattr({ctx.args_expr}, "{name}", False)'
    else:
        return None
    return f"not {expr}" if _NEGATIVE.match(name) else expr


def _off_here(sw: dict[str, Any], ctx: SiteContext) -> bool:
    """The switch is off wherever the site runs: a flag its own branch requires to be false (``SiteContext.off``),
    or, for a negative name reused as ``not X`` (``disable_fused``), one it requires to be true (``SiteContext.on``)."""
    flags = ctx.on if _NEGATIVE.match(sw["name"]) else ctx.off
    if not flags or sw["kind"] not in ("config_field", "argument"):
        return False
    bases = {"self", ctx.config_expr or "", ctx.args_expr or "", "self.config", "config", "args"} - {""}
    return any(f.rpartition(".")[2] == sw["name"] and f.rpartition(".")[0] in bases for f in flags)


_KIND_PREF = {"config_field": 0, "argument": 1, "env": 2}

# -- which switch applies where -------------------------------------------------------------------
#
# A switch is reused only if it plausibly selects fused / NPU kernels (switch_topic) and is in
# scope for the site (_declined). Scanning a monorepo as one repo must not let one model's field
# guard another's code: CLAP's ``enable_fusion`` (audio feature fusion) is no switch for Llama.

# Tokens that, beside a fusion word, make a name about kernels (``use_fused_kernels``,
# ``enable_fused_ops``); pattern words (``use_fused_rmsnorm``) count too.
_KERNEL_WORDS = frozenset({"kernel", "kernels", "op", "ops", "operator", "operators", "triton", "cuda", "apex", "xformers"})
_NPU_TOPIC = ("npu", "ascend", "flash", "liger")
_FILLER = frozenset({"is", "flag", "switch", "on"})
# Folders that hold a data-file config for the code beside them (``configs/model.yaml``).
_CONFIG_DIRS = frozenset({"config", "configs", "conf", "cfg", "configuration", "configurations", "settings"})


@lru_cache(maxsize=4096)
def switch_topic(name: str) -> str:
    """"kernel": the name says it selects NPU or fused kernels (``use_npu_fusion``,
    ``NPUFUSE_RMS_NORM``, ``--use-flash-attn``, ``use_fused_rmsnorm``, ``use_liger_kernel``);
    "generic": a bare fusion word (``enable_fusion``, ``use_fused``): kernels or a model
    feature, the name cannot tell; "other": a fusion word naming something else, a part of the
    model or another op (``use_bias_in_fusion_residual``, ``enable_early_fusion``,
    ``use_fused_layernorm``): never reused."""
    tokens = _tokens(name)
    if any(t.startswith(_NPU_TOPIC) for t in tokens):
        return "kernel"
    n = _norm(name)
    if any(t in _KERNEL_WORDS for t in tokens) or any(w in n for w in _ALL_WORDS):
        return "kernel"
    rest = [t for t in tokens if t not in _FLAG_VERBS and t not in _FILLER and not t.startswith(_FUSION_TOPIC)]
    return "other" if rest else "generic"


@dataclass(frozen=True)
class SwitchSite:
    """Where a candidate is, for the scope of the repo's switches: its file (relative to the
    scanned root), the class names its module imports (FileFacts.imports) and the folders
    holding torch_npu code (calls, wrappers, guards, imports; not npufuse's own rewrites)."""

    file: str
    imports: frozenset[str] = frozenset()
    npu_folders: frozenset[str] = frozenset()


def _folder(path: str) -> str:
    return path.rpartition("/")[0]


def _under(folder: str, base: str) -> bool:
    return not base or folder == base or folder.startswith(base + "/")


def _declined(sw: dict[str, Any], site: SwitchSite | None) -> str | None:
    """Why the repo switch ``sw`` does not guard a site at ``site``: None when it may, "" when
    it is out of scope or about something else (said nowhere: it is not this site's business),
    else the reason for the site's notes.

    Scope: a config field applies to code in its file's folder and below (a ``config.x`` read,
    a config class's field; a data file's field from its folder, or from the folder above a
    ``configs/`` folder) and to modules importing the field's config class; an environment
    variable or an argument applies anywhere. A generic name (``enable_fusion``) only guards
    code in its own package (folder and below) or a switch beside torch_npu code."""
    topic = switch_topic(sw["name"])
    if topic == "other":
        return ""
    if site is None:
        return None
    home = _folder(sw["file"])
    where = _folder(site.file)
    if sw["kind"] == "config_field":
        data_file = not sw["file"].endswith(".py") and "owner" not in sw and "read" not in sw
        if data_file and home.rpartition("/")[2].lower() in _CONFIG_DIRS:
            home = _folder(home)
        in_package = _under(where, home)
        if not in_package and sw.get("owner") not in site.imports:
            return ""
    else:
        in_package = _under(where, home)
    if topic == "generic" and not in_package and home not in site.npu_folders:
        return (f"repo switch `{sw['name']}` ({sw['file']}:{sw['line']}) is not reused: the name does not say it selects fused "
                f"kernels, and it is neither in this package nor beside torch_npu code")
    return None


def choose_switch(pattern: str, ctx: SiteContext, switches: list[dict[str, Any]], mode: str = "auto", site: SwitchSite | None = None) -> tuple[Switch, dict[str, Any] | None, list[str]]:
    """DESIGN.md rule 1 for one site. Returns the switch, the repo switch it reuses (if any),
    and notes for the report (e.g. a relevant switch that this site cannot reach). ``site``:
    where the candidate is, so only switches in scope for it are reused (:func:`_declined`);
    None: every switch about kernels counts as in scope."""
    notes: list[str] = []
    if mode == "none":
        return Switch("none"), None, notes
    if mode == "env":
        return env_switch(pattern), None, notes
    # an environment variable the repository sets to a value (a path, a mode) somewhere is a setting, and one it only
    # sets and never reads is an input of another program (Eagle's worker exports LA_FLASH_* for the model's release
    # files): neither is a switch of this code (audit41)
    read = {s["name"] for s in switches if s["kind"] == "env" and not s.get("sets")}
    not_switches = {s["name"] for s in switches if s["kind"] == "env" and (s.get("carries") or s["name"] not in read)}
    relevant = [(switch_relevance(pattern, s["name"]), s) for s in switches if not (s["kind"] == "env" and s["name"] in not_switches)]
    relevant = [(r, s) for r, s in relevant if r]
    relevant.sort(key=lambda rs: (-rs[0], _KIND_PREF.get(rs[1]["kind"], 9), rs[1]["file"], rs[1]["line"], rs[1]["name"]))
    unreachable: list[dict[str, Any]] = []
    declined: list[str] = []
    for _r, sw in relevant:
        why = _declined(sw, site)
        if why is not None:
            if why and why not in declined:
                declined.append(why)
            continue
        expr = _switch_expr(sw, ctx)
        if expr is not None and _off_here(sw, ctx):
            why = (f"repo switch `{sw['name']}` ({sw['file']}:{sw['line']}) is not reused: this code runs only where it is "
                   "off (the site is in its " + ("`if ...` branch of this negative flag" if _NEGATIVE.match(sw["name"]) else "`if not ...` branch")
                   + "), so the fused branch could never run")
            if why not in declined:
                declined.append(why)
            continue
        if expr is not None:
            return Switch("existing", expr=expr), sw, notes
        unreachable.append(sw)
    notes += declined[:2]
    if unreachable:
        names = sorted({f"`{s['name']}` ({s['file']}:{s['line']})" for s in unreachable})
        notes.append(f"repo switch {', '.join(names[:3])} is not reachable from this site; wire it by hand to control this site with it")
    if ctx.config_expr == "self.config":
        return Switch("new_field", expr=f'getattr(self.config, "use_npu_{pattern}", True)'), None, notes
    return env_switch(pattern), None, notes


def switch_json(switch: Switch, reused: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": switch.kind, "expr": switch.expr, "name": switch.name, "describe": switch.describe()}
    if reused is not None:
        out["reuses"] = {"file": reused["file"], "line": reused["line"], "name": reused["name"], "kind": reused["kind"]}
    return out


__all__ = ["FileFacts", "file_facts", "SiteContext", "site_context", "SwitchSite", "choose_switch", "switch_json", "switch_relevance", "switch_topic"]
