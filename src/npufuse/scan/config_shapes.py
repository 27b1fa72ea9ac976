"""Model shapes read off a repository's configuration, for the value estimate.

Sources, each remembered with where it came from: ``config.json`` (and ``*config*.json``/``.yaml``)
files, HF-style ``*Config`` classes' ``__init__`` defaults, dataclass fields, class-level
defaults of ``*Args``/``*Config`` classes, and ``argparse`` defaults. Names are mapped onto the
canonical keys the patterns' ``assess`` reads (``hidden_size``, ``num_attention_heads``, ...).
For a candidate, the source nearest to its file wins (same folder, then enclosing folders), so
a repo with several model configs assesses each model with its own shapes.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npufuse.scan.dataflow import literal_eval_node

# canonical key -> accepted spellings, most specific first (the first one present wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "hidden_dim", "embed_dim", "model_dim"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "ffn_dim", "d_ff", "n_inner", "mlp_dim", "inner_dim"),
    "moe_intermediate_size": ("moe_intermediate_size", "expert_intermediate_size"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "multi_query_group_num", "num_query_groups"),
    "head_dim": ("head_dim", "kv_channels", "d_kv", "head_size"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_top_k", "num_selected_experts"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "max_seq_length", "block_size", "n_ctx"),
    "rms_norm_eps": ("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rms_eps"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "vocab_size": ("vocab_size", "n_vocab"),
    "batch_size": ("batch_size", "per_device_train_batch_size", "micro_batch_size", "train_batch_size"),
    "seq_len": ("seq_len", "seq_length", "sequence_length"),
    "torch_dtype": ("torch_dtype",),
}
_SPELLING: dict[str, str] = {s: key for key, names in ALIASES.items() for s in names}
_EXACT = set(ALIASES)  # generic spellings (``dim``) only count inside classes named like configs

_FLOAT_KEYS = {"rms_norm_eps"}
_STR_KEYS = {"torch_dtype"}

CONFIG_CLASS = re.compile(r"(Config|Configuration|Args|Arguments|Params|Options|Settings|HParams|Hparams)$")

# When the repo says nothing, the value estimate assumes this (printed in the report).
DEFAULT_ASSUMPTIONS: dict[str, Any] = {"batch_size": 4, "seq_len": 2048, "torch_dtype": "bfloat16"}
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}

# Kinds, most trusted first (a checked-in config beats a class default beats a CLI default).
KIND_RANK = {"config_json": 0, "config_yaml": 1, "config_class": 2, "dataclass": 3, "class_defaults": 4, "argparse": 5}


@dataclass
class ConfigSource:
    file: str  # relative to the root
    line: int
    kind: str  # see KIND_RANK
    name: str  # class name, argparse, or the file name
    values: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "kind": self.kind, "name": self.name, "values": self.values}


def _accept(key: str, value: Any) -> Any:
    """The value if it is a plausible setting for ``key`` (sizes: positive ints, eps: small floats)."""
    if isinstance(value, bool) or value is None:
        return None
    if key in _STR_KEYS:
        return value.replace("torch.", "") if isinstance(value, str) else None
    if key in _FLOAT_KEYS:
        return float(value) if isinstance(value, (int, float)) and 0 < value < 1 else None
    return value if isinstance(value, int) and value > 0 else None


def map_values(named: dict[str, Any], *, allow_aliases: bool = True) -> dict[str, Any]:
    """Canonical shapes out of ``{spelling: value}`` (first spelling per key in ALIASES order)."""
    out: dict[str, Any] = {}
    for key, spellings in ALIASES.items():
        for s in spellings:
            if s in named and (allow_aliases or s in _EXACT):
                v = _accept(key, named[s])
                if v is not None:
                    out[key] = v
                    break
    return out


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return node.attr  # torch.bfloat16 -> "bfloat16"
    try:
        return literal_eval_node(node)  # ast.literal_eval without its reference cycle
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("dataclass", "define", "attrs", "frozen"):
            return True
    return False


def class_source(path: str, cls: ast.ClassDef) -> ConfigSource | None:
    """Shapes in a config-like class: ``__init__`` defaults and class-level field defaults."""
    named_like = bool(CONFIG_CLASS.search(cls.name))
    dataclass = _is_dataclass(cls)
    if not (named_like or dataclass):
        return None
    named: dict[str, Any] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            named.setdefault(stmt.target.id, _literal(_field_default(stmt.value)))
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            named.setdefault(stmt.targets[0].id, _literal(stmt.value))
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            a = stmt.args
            positional = [*a.posonlyargs, *a.args]
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                named.setdefault(arg.arg, _literal(default))
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                if default is not None:
                    named.setdefault(arg.arg, _literal(default))
    values = map_values(named, allow_aliases=named_like)
    if not values:
        return None
    kind = "config_class" if named_like and not dataclass else ("dataclass" if dataclass else "class_defaults")
    return ConfigSource(path, cls.lineno, kind, cls.name, values)


def _field_default(node: ast.AST | None) -> ast.AST | None:
    """``x: int = field(default=4)`` -> ``4``."""
    if isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg == "default":
                return kw.value
        return None
    return node


def argparse_value(call: ast.Call) -> tuple[str, Any] | None:
    """(canonical key, default) of ``parser.add_argument("--hidden-size", default=4096)``."""
    dest = argparse_dest(call)
    if dest is None:
        return None
    key = _SPELLING.get(dest)
    if key is None:
        return None
    for kw in call.keywords:
        if kw.arg == "default":
            v = _accept(key, _literal(kw.value))
            return (key, v) if v is not None else None
    return None


def argparse_dest(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "dest" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
            return kw.value.value
    longs = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
    if longs:
        return longs[0][2:].replace("-", "_")
    return None


def load_data_file(root: Path, rel: str, max_bytes: int = 1 << 20) -> tuple[ConfigSource | None, list[dict[str, Any]]]:
    """Shapes from a JSON/YAML config file (nested dicts searched breadth first), and its keys
    that look like fusion switches (``"use_flash_attn": true``) as switch entries."""
    path = root / rel
    try:
        if path.stat().st_size > max_bytes:
            return None, []
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None, []
    try:
        if rel.endswith(".json"):
            data = json.loads(text)
            kind = "config_json"
        else:
            import yaml  # only when the repo has YAML configs

            data = yaml.safe_load(text)
            kind = "config_yaml"
    except Exception:  # a malformed config is not the scan's problem: it just gives no shapes
        return None, []
    named: dict[str, Any] = {}
    queue: list[tuple[Any, int]] = [(data, 0)]
    while queue:
        node, depth = queue.pop(0)
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and not isinstance(v, (dict, list)):
                    named.setdefault(k, v)
                elif depth < 4 and isinstance(v, dict):
                    queue.append((v, depth + 1))
    from npufuse.scan.repo_search import is_switch  # late: repo_search imports this module

    lines = text.splitlines()
    switches = []
    for key, value in named.items():
        if isinstance(value, bool) and is_switch(key, "config_field", value):
            line = next((i + 1 for i, ln in enumerate(lines) if key in ln), 1)
            switches.append({"file": rel, "line": line, "name": key, "kind": "config_field", "default": value})
    values = map_values(named)
    source = ConfigSource(rel, 1, kind, rel.rsplit("/", 1)[-1], values) if values else None
    return source, switches


def _folder(rel: str) -> tuple[str, ...]:
    parts = rel.split("/")[:-1]
    return tuple(parts)


def folder_distance(here: tuple[str, ...], there: tuple[str, ...]) -> int:
    """How far a source in folder ``there`` is from a file in folder ``here``: the levels up
    for an enclosing folder (0: the same folder), else 100 plus the steps up and down through
    the nearest common folder."""
    n = len(here)
    if there and (not here or there[0] != here[0]):
        return 100 + n + len(there)  # no common leading folder (the common case): common = 0 below
    if here[: len(there)] == there:
        return n - len(there)
    common = 0
    for a, b in zip(here, there):
        if a != b:
            break
        common += 1
    return 100 + (n - common) + (len(there) - common)


def shapes_for(file: str, sources: list[ConfigSource], overrides: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{key: {"value": v, "from": "config.json"}}`` for a candidate in ``file``.

    Precedence: explicit overrides (CLI) > the nearest source (same folder, then enclosing
    folders, then anywhere else) > the documented assumptions.
    """
    here = _folder(file)
    folders: dict[str, tuple[str, ...]] = {}

    def distance(src: ConfigSource) -> tuple[int, int, str, int]:
        there = folders.get(src.file)
        if there is None:
            there = folders[src.file] = _folder(src.file)
        return (folder_distance(here, there), KIND_RANK.get(src.kind, 9), src.file, src.line)

    out: dict[str, dict[str, Any]] = {}
    for key, value in (overrides or {}).items():
        if value is not None:
            out[key] = {"value": value, "from": "command line"}
    for src in sorted(sources, key=distance):
        if out.keys() >= src.values.keys():
            continue  # a nearer source set every key already (skipping it dominated warm scans' time)
        where = f"{src.file}:{src.line}" if src.kind not in ("config_json", "config_yaml") else src.file
        label = where if src.kind in ("config_json", "config_yaml") else f"{where} ({src.name})"
        for key, value in src.values.items():
            out.setdefault(key, {"value": value, "from": label})
    for key, value in DEFAULT_ASSUMPTIONS.items():
        out.setdefault(key, {"value": value, "from": "assumed"})
    return {k: out[k] for k in sorted(out)}


def plain_config(shapes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The dict handed to ``Pattern.assess``: canonical keys -> values, plus ``dtype_bytes``."""
    config = {k: v["value"] for k, v in shapes.items()}
    config["dtype_bytes"] = DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")).lower(), 2)
    return config
