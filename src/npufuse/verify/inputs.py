"""The inputs of an op check: the target function, its arguments, and (for a method) the instance.

Three sources, in the order ``verify op`` prefers them:

``capture`` (``--capture "python train.py ..."``)
    The launch command runs with the probe (:mod:`npufuse.verify.probe`), which wraps the target
    when its module is imported and saves the first call with ``torch.save``: tensors by value
    (shape/dtype/mean/std beyond ``--capture-max-mb``), other arguments as they pickle, and a
    method's ``self`` whole (else its ``state_dict`` and simple attributes). These are the shapes,
    dtypes and values the model really uses.
``shape`` (``--shape NAME=2x16x64[:dtype]`` or positional ``--shape 2x16x64``, ``--dtype``)
    Random normal tensors of the given shapes for the named (or first required) parameters.
``config`` (the model config scan read: hidden_size, heads, head_dim, batch_size, seq_len, torch_dtype)
    Heuristics, stated here because they can be wrong (use ``--capture`` when they are):

    * each required parameter of the target without ``--shape`` gets, by name: ``q``/``query``/
      ``query_states`` → (B, heads, S, head_dim); ``k``/``v``/``key``/``value``(``_states``) →
      (B, kv_heads, S, head_dim); ``cos``/``sin`` → (B, S, head_dim); ``position_embeddings`` →
      (cos, sin); ``attention_mask``/``attn_mask``/``mask`` → additive causal (1, 1, S, S);
      ``position_ids`` → arange; ``input_ids`` → random token ids; anything else → (B, S, hidden);
    * B = min(batch_size, 2), S = min(seq_len, 256) (``--batch``/``--seq-len`` override): hidden
      sizes decide kernel behaviour, the token count mostly decides run time;
    * a method's class is constructed from its ``__init__`` signature: ``--init NAME=VALUE`` first,
      then a ``config``/``cfg``/``args`` parameter gets the module's ``*Config`` class built from the
      scanned values (or a namespace of them), parameters named like a config key (hidden_size,
      dim, eps → rms_norm_eps, ...) get that value, ``layer_idx``/``layer_id`` get 0, defaults stay;
      anything else is an error naming the parameter.

Whatever the source, floating parameters that are constant at construction (RMSNorm's ``ones``)
are perturbed by ±10% noise: with an all-ones weight a fused branch that forgets the weight
would be exact.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import os
import re
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from npufuse.cli import UsageError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}  # fmt: skip

CONFIG_B_MAX = 2
CONFIG_S_MAX = 256

_LOCAL_ALIASES = {
    "eps": "rms_norm_eps", "epsilon": "rms_norm_eps", "variance_epsilon": "rms_norm_eps", "norm_eps": "rms_norm_eps",
    "dim": "hidden_size", "hidden": "hidden_size", "d_model": "hidden_size", "n_embd": "hidden_size",
    "ffn_dim": "intermediate_size", "n_heads": "num_attention_heads", "num_heads": "num_attention_heads",
}  # fmt: skip


# Inputs that are data, not activations: real models never backpropagate into them, and their
# gradients (sums over heads of rounded partials) would only add noise to the check.
NO_GRAD_NAMES = {"cos", "sin", "cos_cached", "sin_cached", "freqs_cos", "freqs_sin", "position_embeddings",
                 "attention_mask", "attn_mask", "mask", "causal_mask", "position_ids", "input_ids"}  # fmt: skip


def flatten(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in nested tuples/lists/dicts (``out[0]``, ``x['k']``)."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, (tuple, list)):
        return [t for i, o in enumerate(obj) for t in flatten(o, f"{prefix}[{i}]")]
    if isinstance(obj, dict):
        return [t for k, o in obj.items() for t in flatten(o, f"{prefix}[{k!r}]")]
    return []


def parse_dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.strip().lower().replace("torch.", "")]
    except KeyError:
        raise UsageError(f"unknown dtype {text!r}; use one of float32, bfloat16, float16, float64") from None


# -- importing the user's rewritten module -------------------------------------------------------


def module_name_for(root: Path, file: str) -> tuple[str, Path]:
    """(dotted module name, sys.path entry) for ``root/file``: packages (``__init__.py``) are
    climbed so relative imports work."""
    path = (root / file).resolve()
    parts = [path.stem] if path.name != "__init__.py" else []
    folder = path.parent
    while (folder / "__init__.py").exists() and folder != folder.parent:
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or path.parent.name, folder


@contextmanager
def user_module(root: Path, file: str) -> Iterator[types.ModuleType]:
    """Import the user's file fresh (under whatever torch_npu is installed now), with its repo on
    ``sys.path``; afterwards drop every module imported from under ``root`` and restore the path,
    so the next check (or test) imports its own copy."""
    name, entry = module_name_for(root, file)
    saved_path = list(sys.path)
    root_s = str(root.resolve())
    prefixes = tuple({os.path.abspath(root) + os.sep, root_s + os.sep})
    before = set(sys.modules)

    def ours(mod: Any) -> bool:
        # string checks only: resolving ~2000 module paths per check would cost half a second
        f = getattr(mod, "__file__", None)
        return isinstance(f, str) and os.path.abspath(f).startswith(prefixes)

    stale = {k: v for k, v in sys.modules.items() if k == name or k.startswith(name + ".") or ours(v)}
    for k in stale:
        sys.modules.pop(k, None)
    for p in (str(entry), str((root / file).resolve().parent), root_s):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        try:
            mod = importlib.import_module(name)
        except UsageError:
            raise
        except BaseException as exc:
            raise UsageError(f"{root / file}: importing it as `{name}` failed: {type(exc).__name__}: {exc}") from None
        yield mod
    finally:
        sys.path[:] = saved_path
        for k in set(sys.modules) - before:
            if ours(sys.modules.get(k)) or k == name:
                sys.modules.pop(k, None)
        sys.modules.update({k: v for k, v in stale.items() if k not in sys.modules})


@dataclass
class Target:
    fn: Any  # the plain function to call (methods: called with the instance first)
    owner: type | None  # the class of a method
    qualname: str
    params: list[inspect.Parameter]  # call parameters, self excluded


def resolve_target(module: types.ModuleType, qualname: str) -> Target:
    if not qualname or qualname == "<module>":
        raise UsageError("the candidate is module-level code: there is no function to call for an op check")
    obj: Any = module
    owner: type | None = None
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if i < len(parts) - 1:
            nxt = getattr(obj, part, None)
            if not isinstance(nxt, type):
                raise UsageError(f"{qualname}: `{part}` is not a module-level class in {module.__name__}; nested functions cannot be called from outside")
            obj = nxt
        else:
            if isinstance(obj, type):
                owner = obj
                raw = inspect.getattr_static(obj, part, None)
                if raw is None:
                    raise UsageError(f"{qualname}: class {obj.__name__} has no `{part}`")
                if isinstance(raw, (staticmethod, classmethod)):
                    fn = raw.__func__
                    owner = None if isinstance(raw, staticmethod) else obj
                else:
                    fn = raw
            else:
                fn = getattr(obj, part, None)
                if fn is None:
                    raise UsageError(f"{qualname}: no `{part}` in {module.__name__}")
            obj = fn
    fn = obj
    if not callable(fn):
        raise UsageError(f"{qualname} is not callable")
    params = list(inspect.signature(fn).parameters.values())
    if owner is not None and params:
        params = params[1:]  # self / cls
    return Target(fn, owner, qualname, params)


# -- building the inputs -------------------------------------------------------------------------


@dataclass
class CallInputs:
    args: list[Any]
    kwargs: dict[str, Any]
    instance: Any  # None for plain functions
    source: str  # capture | shape | config
    dtype: torch.dtype  # the low precision the model runs in (of the first floating input)
    notes: list[str] = field(default_factory=list)
    shapes: dict[str, Any] = field(default_factory=dict)  # name -> [shape, dtype], for the report
    arg_names: list[str] = field(default_factory=list)  # parameter name of each positional argument
    grad_flags: dict[str, bool] = field(default_factory=dict)  # leaf path -> backpropagate into it
    # the autocast region the captured call ran in ("bfloat16" / "float16"), replayed by the op check
    autocast: str | None = None

    def named_leaves(self, args: list[Any], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Floating tensors of (a copy of) the arguments that get gradients, by parameter path."""
        names = self.arg_names + [f"arg{i}" for i in range(len(self.arg_names), len(args))]
        found = [t for n, a in zip(names, args) for t in flatten(a, n)] + [t for k, v in kwargs.items() for t in flatten(v, k)]
        return [(n, t) for n, t in found if t.is_floating_point() and self.grad_flags.get(n, True)]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "dtype": str(self.dtype).replace("torch.", ""), "arguments": self.shapes, "notes": self.notes}


@dataclass
class Dims:
    B: int
    S: int
    H: int | None
    nH: int | None
    nKV: int | None
    D: int | None
    vocab: int | None

    @classmethod
    def from_config(cls, cfg: dict[str, Any], batch: int | None, seq_len: int | None) -> "Dims":
        def num(key: str) -> int | None:
            v = cfg.get(key)
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

        B = batch or min(num("batch_size") or 2, CONFIG_B_MAX)
        S = seq_len or min(num("seq_len") or 16, CONFIG_S_MAX)
        H, nH = num("hidden_size"), num("num_attention_heads")
        D = num("head_dim") or (H // nH if H and nH else None)
        return cls(B, S, H, nH, num("num_key_value_heads") or nH, D, num("vocab_size"))


def _need(value: int | None, what: str, name: str) -> int:
    if value is None:
        raise UsageError(f"cannot make argument `{name}`: the config gives no {what}; use --shape {name}=AxBxC or --capture")
    return value


def synth_argument(name: str, dims: Dims, dtype: torch.dtype, gen: torch.Generator) -> Any:
    """A tensor for parameter ``name`` by the naming heuristics of the module docstring."""
    n = name.lower()
    B, S = dims.B, dims.S

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    if n in ("q", "query", "xq", "query_states", "q_states", "query_layer"):
        return randn(B, _need(dims.nH, "num_attention_heads", name), S, _need(dims.D, "head_dim", name))
    if n in ("k", "key", "xk", "key_states", "k_states", "key_layer", "v", "value", "xv", "value_states", "v_states", "value_layer"):
        return randn(B, _need(dims.nKV, "num_key_value_heads", name), S, _need(dims.D, "head_dim", name))
    if n in ("cos", "sin", "cos_cached", "sin_cached", "freqs_cos", "freqs_sin"):
        return _rope_table(dims, dtype, name)[0 if "cos" in n else 1]
    if n == "position_embeddings":
        return _rope_table(dims, dtype, name)
    if n in ("attention_mask", "attn_mask", "mask", "causal_mask"):
        return torch.full((S, S), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    if n == "position_ids":
        return torch.arange(S)[None].expand(B, S).contiguous()
    if n == "input_ids":
        return torch.randint(0, _need(dims.vocab, "vocab_size", name), (B, S), generator=gen)
    return randn(B, S, _need(dims.H, "hidden_size", name))


def _rope_table(dims: Dims, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    D = _need(dims.D, "head_dim", name)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(dims.S, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(dims.B, dims.S, D)
    return emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


_SHAPE = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<shape>\d+(?:[x,]\d+)*)(?::(?P<dtype>\w+))?$")


def parse_shapes(items: list[str]) -> tuple[list[tuple[list[int], str | None]], dict[str, tuple[list[int], str | None]]]:
    positional: list[tuple[list[int], str | None]] = []
    named: dict[str, tuple[list[int], str | None]] = {}
    for item in items:
        m = _SHAPE.match(item.strip())
        if not m:
            raise UsageError(f"--shape {item!r}: expected [NAME=]AxBxC[:dtype], e.g. hidden_states=2x16x64:bf16")
        dims = [int(x) for x in re.split(r"[x,]", m.group("shape"))]
        entry = (dims, m.group("dtype"))
        if m.group("name"):
            named[m.group("name")] = entry
        else:
            positional.append(entry)
    return positional, named


def parse_literal(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def config_object(module: types.ModuleType, values: dict[str, Any]) -> Any:
    """An instance of the module's ``*Config`` class built from ``values``, else a namespace."""
    from npufuse.scan.config_shapes import ALIASES

    spellings = {s: key for key, names in ALIASES.items() for s in names}
    spellings.update(_LOCAL_ALIASES)
    for obj in vars(module).values():
        if isinstance(obj, type) and re.search(r"(Config|Configuration|Args|Arguments)$", obj.__name__):
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            kwargs = {p: values[spellings[p]] for p in sig.parameters if p in spellings and spellings[p] in values}
            if p_missing := [p for p, v in sig.parameters.items() if v.default is inspect.Parameter.empty and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY) and p not in kwargs]:
                continue  # this class needs what we don't know; try another
            try:
                return obj(**kwargs)
            except Exception:
                continue
    ns = types.SimpleNamespace()
    for spelling, key in spellings.items():
        if key in values:
            setattr(ns, spelling, values[key])
    for key, v in values.items():
        setattr(ns, key, v)
    return ns


def traced_argument(rec: Any, module: Any, values: dict[str, Any], lp: torch.dtype, gen: torch.Generator, seed: int) -> Any:
    """One argument as ``npufuse trace`` recorded it (:func:`npufuse.trace.inputs.recorded_arguments`)."""
    if not isinstance(rec, dict):
        return rec   # a plain value: a flag, an unsqueeze dim, a scaling
    if "tensors" in rec:   # a tuple of tensors (position_embeddings)
        return tuple(torch.randn(*shape, generator=gen).to(DTYPES.get(str(dt), lp)) for shape, dt in rec["tensors"])
    if "ints" in rec:   # ids in the recorded range; distinct along the last dim where they fit (top-k expert ids)
        shape, (lo, hi) = rec["ints"], rec["range"]
        dt = getattr(torch, str(rec.get("dtype")), torch.int64)
        dt = dt if isinstance(dt, torch.dtype) else torch.int64
        span, k = hi - lo + 1, shape[-1]
        rows = 1
        for d in shape[:-1]:
            rows *= d
        if k <= span and rows * span <= 1 << 24:
            return (torch.rand(rows, span, generator=gen).argsort(-1)[:, :k] + lo).reshape(shape).to(dt)
        return torch.randint(lo, hi + 1, tuple(shape), generator=gen).to(dt)
    if "causal_mask" in rec:   # the run's 0/-inf additive mask: causal, broadcast to its shape
        shape = rec["causal_mask"]
        dt = DTYPES.get(str(rec.get("dtype")), lp)
        q, kv = (shape[-2], shape[-1]) if len(shape) >= 2 else (shape[-1], shape[-1])
        mask = torch.full((q, kv), torch.finfo(dt).min, dtype=dt).triu(kv - q + 1)
        return mask.expand(*shape).contiguous() if len(shape) >= 2 else mask
    if "object" in rec:   # an object of a class the run built (eager attention's `module`)
        mod_name, _, cls_name = str(rec["object"]).rpartition(".")
        cls = getattr(module, cls_name, None) if cls_name.isidentifier() else None
        if not (isinstance(cls, type) and getattr(cls, "__module__", None) == mod_name):
            raise UsageError(f"cannot build the traced argument of class {rec['object']}: not in the module's namespace; use --capture")
        init = dict(rec.get("init") or {})
        for k, spec in (rec.get("configs") or {}).items():
            init.setdefault(k, traced_config(module, spec))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            obj = construct(cls, module, values, init)
        return obj.eval() if isinstance(obj, torch.nn.Module) else obj
    raise UsageError("a traced argument npufuse does not know how to rebuild; use --shape/--capture")


def traced_config(module: Any, spec: dict[str, Any]) -> Any:
    """The config object a traced run built a class with (``npufuse trace`` recorded its plain
    fields): the module's own class of the recorded name when it takes them, else a namespace.
    Only a class already in the module's namespace is used (nothing is imported by name)."""
    fields = dict(spec.get("config") or {})
    mod_name, _, cls_name = str(spec.get("type", "")).rpartition(".")
    cls = getattr(module, cls_name, None) if cls_name.isidentifier() else None
    if isinstance(cls, type) and getattr(cls, "__module__", None) == mod_name:
        try:
            return cls(**fields)
        except Exception:
            pass  # a class that will not take its own fields back: the namespace below
    return types.SimpleNamespace(**fields)


EMPTY_INIT_STD = 0.02   # transformers' default initializer_range


@contextmanager
def _initialised_empty() -> Iterator[None]:
    """``torch.empty`` gives initialised floats while a class is built for the check.

    transformers' modules (``Qwen2MoeExperts``' expert weights) allocate parameters with
    ``torch.empty`` and leave filling them to the whole model's ``_init_weights``, which a module
    built alone never runs: its weights are whatever the memory held (NaN, 1e38). Here they are
    normal(0, 0.02) from the check's seeded generator; torch.nn layers overwrite theirs in
    ``reset_parameters`` as always."""
    original = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = original(*args, **kwargs)
        if t.is_floating_point() and t.numel():
            with torch.no_grad():
                t.normal_(0.0, EMPTY_INIT_STD)
        return t

    torch.empty = empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = original  # type: ignore[assignment]


def construct(cls: type, module: types.ModuleType, values: dict[str, Any], init: dict[str, Any]) -> Any:
    """An instance of ``cls`` from its ``__init__`` signature (see the module docstring)."""
    from npufuse.scan.config_shapes import ALIASES

    spellings = {s: key for key, names in ALIASES.items() for s in names}
    spellings.update(_LOCAL_ALIASES)
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        raise UsageError(f"cannot read the signature of {cls.__name__}.__init__; use --capture") from None
    kwargs: dict[str, Any] = {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in init:
            kwargs[name] = init[name]
        elif name in ("config", "cfg", "args", "model_args", "model_config") or name.endswith("_config"):
            kwargs[name] = config_object(module, values)
        elif name in spellings and spellings[name] in values:
            kwargs[name] = values[spellings[name]]
        elif name in ("layer_idx", "layer_id", "layer_number", "idx"):
            kwargs[name] = 0 if name != "layer_number" else 1
        elif p.default is inspect.Parameter.empty:
            raise UsageError(f"cannot construct {cls.__name__}: no value for __init__ parameter `{name}`; pass --init {name}=VALUE or use --capture")
    try:
        with _initialised_empty():
            return cls(**kwargs)
    except Exception as exc:
        shown = ", ".join(f"{k}={type(v).__name__ if not isinstance(v, (int, float, str)) else v}" for k, v in kwargs.items())
        raise UsageError(f"{cls.__name__}({shown}) raised {type(exc).__name__}: {exc}; pass --init NAME=VALUE or use --capture") from None


def perturb_constant_parameters(instance: Any, gen: torch.Generator, notes: list[str]) -> None:
    if not isinstance(instance, torch.nn.Module):
        return
    with torch.no_grad():
        for name, p in instance.named_parameters():
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
                scale = float(p.reshape(-1)[0].abs()) or 1.0
                noise = torch.randn(p.shape, generator=gen) * 0.1 * scale
                p.add_(noise.to(p.dtype))
                notes.append(f"parameter `{name}` was constant: perturbed by 10% noise so a dropped or misapplied weight shows")


def _first_float_dtype(objs: list[Any]) -> torch.dtype | None:
    for o in objs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            return o.dtype
        if isinstance(o, (list, tuple)):
            d = _first_float_dtype(list(o))
            if d is not None:
                return d
        if isinstance(o, dict):
            d = _first_float_dtype(list(o.values()))
            if d is not None:
                return d
    return None


def _describe(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return [list(obj.shape), str(obj.dtype).replace("torch.", "")]
    if isinstance(obj, (list, tuple)):
        return [_describe(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _describe(v) for k, v in obj.items()}
    return repr(obj)[:60]


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def from_config_or_shapes(
    module: types.ModuleType,
    target: Target,
    values: dict[str, Any],
    shapes: list[str],
    dtype: torch.dtype | None,
    init: dict[str, Any],
    batch: int | None,
    seq_len: int | None,
    seed: int,
    traced: dict[str, Any] | None = None,
) -> CallInputs:
    gen = torch.Generator().manual_seed(seed)
    positional, named = parse_shapes(shapes)
    # the precision the model runs in: --dtype, else the first dtype given with a --shape, else the config's
    given = next((dt for _, dt in [*positional, *named.values()] if dt), None)
    lp = dtype or (parse_dtype(given) if given else DTYPES.get(str(values.get("torch_dtype", "bfloat16")).lower(), torch.bfloat16))
    source = "shape" if shapes else "config"
    dims = Dims.from_config(values, batch, seq_len)
    notes: list[str] = []
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    described: dict[str, Any] = {}
    flags: dict[str, bool] = {}
    arg_names: list[str] = []
    pos = list(positional)
    gap = False
    for p in target.params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in named or (pos and p.default is inspect.Parameter.empty):
            shape, dt = named.pop(p.name) if p.name in named else pos.pop(0)
            value: Any = torch.randn(*shape, generator=gen).to(parse_dtype(dt) if dt else lp)
        elif traced and p.name in traced and p.name not in init:
            # as the traced run called it (npufuse.trace.inputs.recorded_arguments): a tuple of
            # tensors (position_embeddings) or a plain value (a flag, an unsqueeze dim)
            value = traced_argument(traced[p.name], module, values, lp, gen, seed)
        elif p.default is not inspect.Parameter.empty:
            gap = True   # left at its default: every later argument goes by name
            continue
        elif p.name in init:
            value = init[p.name]
        else:
            value = synth_argument(p.name, dims, lp, gen)
        described[p.name] = _describe(value)
        for path, _t in flatten(value, p.name):
            flags[path] = p.name.lower() not in NO_GRAD_NAMES
        if p.kind == p.KEYWORD_ONLY or (gap and p.kind == p.POSITIONAL_OR_KEYWORD):
            kwargs[p.name] = value
        else:
            args.append(value)
            arg_names.append(p.name)
    if named:
        raise UsageError(f"--shape names {', '.join(sorted(named))}: not parameters of {target.qualname} ({', '.join(p.name for p in target.params)})")
    if pos:
        raise UsageError(f"{len(pos)} more positional --shape than required parameters of {target.qualname}")
    instance = None
    if target.owner is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            instance = construct(target.owner, module, values, init)
        if isinstance(instance, torch.nn.Module):
            instance = instance.to(lp)
        perturb_constant_parameters(instance, gen, notes)
    if source == "config":
        notes.append(f"shapes from the model config (batch {dims.B}, seq_len {dims.S}; heuristics of npufuse.verify.inputs) — `--capture` gives the real ones")
    if any(not f for f in flags.values()):
        notes.append("no gradient checked into " + ", ".join(sorted(k for k, f in flags.items() if not f)) + " (data inputs: cos/sin, masks, ids)")
    return CallInputs(args, kwargs, instance, source, lp, notes, described, arg_names, flags)


def _unpack(obj: Any, gen: torch.Generator, notes: list[str], where: str, flags: dict[str, bool] | None = None) -> Any:
    if isinstance(obj, dict) and obj.get("__npufuse_tensor__"):
        if flags is not None:
            flags[where] = bool(obj.get("requires_grad"))  # backpropagate where the model did
        dtype = parse_dtype(obj["dtype"]) if obj["dtype"] in DTYPES else getattr(torch, obj["dtype"])
        if "value" in obj:
            t = obj["value"]
        elif dtype.is_floating_point:
            t = (torch.randn(*obj["shape"], generator=gen) * obj.get("std", 1.0) + obj.get("mean", 0.0)).to(dtype)
            notes.append(f"{where}: too large to capture by value; random with the captured mean/std")
        else:
            t = torch.zeros(obj["shape"], dtype=dtype)
            notes.append(f"{where}: too large to capture by value; zeros of the captured shape")
        return t
    if isinstance(obj, dict) and "__npufuse_seq__" in obj:
        items = [_unpack(o, gen, notes, f"{where}[{i}]", flags) for i, o in enumerate(obj["items"])]
        return tuple(items) if obj["__npufuse_seq__"] == "tuple" else items
    if isinstance(obj, dict) and obj.get("__npufuse_dict__"):
        return {k: _unpack(v, gen, notes, f"{where}[{k!r}]", flags) for k, v in obj["items"].items()}
    if isinstance(obj, dict) and "__npufuse_unpicklable__" in obj:
        raise UsageError(f"captured argument {where} is a {obj['__npufuse_unpicklable__']} that cannot be saved; use --shape")
    return obj


def from_capture(path: Path, module: types.ModuleType, target: Target, values: dict[str, Any], dtype: torch.dtype | None, init: dict[str, Any], seed: int) -> CallInputs:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UsageError(f"{path}: unreadable capture ({type(exc).__name__}: {exc})") from None
    gen = torch.Generator().manual_seed(seed)
    notes: list[str] = [f"inputs captured from the first call of {target.qualname} in the launch command"]
    names = [p.name for p in target.params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names += [f"arg{i}" for i in range(len(names), len(payload["args"]))]
    flags: dict[str, bool] = {}
    args = [_unpack(a, gen, notes, names[i], flags) for i, a in enumerate(payload["args"])]
    kwargs = {k: _unpack(v, gen, notes, k, flags) for k, v in payload["kwargs"].items()}
    instance = None
    if payload.get("is_method"):
        if "self_pickle" in payload:
            try:
                instance = torch.load(io.BytesIO(payload["self_pickle"]), map_location="cpu", weights_only=False)
            except Exception as exc:
                notes.append(f"captured instance did not unpickle here ({type(exc).__name__}: {exc}); rebuilt from its state_dict")
        if instance is None:
            if target.owner is None:
                raise UsageError(f"{target.qualname}: captured as a method but the target is not a method here")
            instance = construct(target.owner, module, values, init)
            for k, v in (payload.get("self_attrs") or {}).items():
                try:
                    setattr(instance, k, v)
                except Exception:
                    pass
            if payload.get("self_state") and isinstance(instance, torch.nn.Module):
                missing, unexpected = instance.load_state_dict(payload["self_state"], strict=False)
                if missing or unexpected:
                    notes.append(f"state_dict mismatch: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}")
    lp = dtype or _first_float_dtype(args + list(kwargs.values())) or torch.float32
    if dtype is not None:
        args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        if isinstance(instance, torch.nn.Module):
            instance = instance.to(dtype)
        notes.append(f"captured floating tensors cast to {str(dtype).replace('torch.', '')} (--dtype)")
    perturb_constant_parameters(instance, gen, notes)
    described = {names[i]: _describe(a) for i, a in enumerate(args)}
    described.update({k: _describe(v) for k, v in kwargs.items()})
    if not any(flags.values()) and flags:
        notes.append("no captured input required grad: only parameter gradients are checked")
    amp = payload.get("autocast")
    amp_dtype = amp.get("dtype") if isinstance(amp, dict) and amp.get("enabled") and amp.get("dtype") in DTYPES else None
    if amp_dtype:
        notes.append(f"the captured call ran under autocast ({amp_dtype}): the original and fused runs replay it")
    return CallInputs(args, kwargs, instance, "capture", lp, notes, described, names[: len(args)], flags, autocast=amp_dtype)


def clone_inputs(inputs: CallInputs, dtype: torch.dtype | None) -> tuple[list[Any], dict[str, Any], Any]:
    """Fresh copies for one run (``dtype``: cast floating tensors and the instance, for the golden)."""
    args = copy.deepcopy(inputs.args)
    kwargs = copy.deepcopy(inputs.kwargs)
    instance = copy.deepcopy(inputs.instance)
    if dtype is not None:
        args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        if isinstance(instance, torch.nn.Module):
            instance = instance.to(dtype)
    return args, kwargs, instance
