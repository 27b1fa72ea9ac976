"""From a traced run to ``verify op``: whether the candidate ran, and the shapes it ran with.

``npufuse trace`` records the arguments of the first call of every user function that ran a
torch op (:mod:`npufuse.trace.recorder`); ``npufuse scan --trace`` / ``npufuse trace`` copy those of
the function holding a candidate into its scan.json entry (``runtime.arguments``). ``verify op``
then builds its inputs at those shapes and dtypes by default (no ``--shape``/``--capture`` given),
scaled down when huge, and says so.
"""

from __future__ import annotations

import math
from typing import Any

MAX_NUMEL = 1 << 22      # one input tensor above this is scaled down (the check runs on CPU)
BATCH_MAX = 2
SEQ_MAX = 256


def not_reached(scan_entry: dict[str, Any]) -> str | None:
    """The reason verify op gives for a site the traced run never executed, else None."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    if isinstance(rt, dict) and rt.get("reached") is False:
        return (f"not reached: the traced run ({rt.get('source', 'trace.json')}) never executed this site, so it is "
                f"dead code under that configuration; no op check was run")
    return None


def _scaled(shape: list[int]) -> tuple[list[int], bool]:
    out = list(shape)
    if math.prod(out) <= MAX_NUMEL:
        return out, False
    if out and out[0] > BATCH_MAX:
        out[0] = BATCH_MAX
    for k in range(1, len(out) - 1):   # then the longest inner (sequence) dimension, never the last (hidden)
        if math.prod(out) <= MAX_NUMEL:
            break
        j = max(range(1, len(out) - 1), key=lambda i: out[i])
        if out[j] > SEQ_MAX:
            out[j] = SEQ_MAX
    return out, out != shape


def recorded_shapes(scan_entry: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``--shape NAME=AxB:dtype`` items for the candidate's tensor arguments as the traced run
    called them, and notes saying where they came from (and what was scaled down)."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    args = rt.get("arguments") if isinstance(rt, dict) else None
    if not isinstance(args, dict):
        return [], []
    items: list[str] = []
    scaled: list[str] = []
    for name, v in args.items():
        if name in ("self", "cls") or not isinstance(name, str) or not name.isidentifier():
            continue
        if not (isinstance(v, dict) and isinstance(v.get("tensor"), list) and isinstance(v.get("dtype"), str)):
            continue
        shape = v["tensor"]
        if not shape or not all(isinstance(d, int) and 0 < d < 1 << 31 for d in shape):
            continue
        if not v["dtype"].startswith(("float", "bfloat")):
            continue   # ids, bool masks: a random float tensor of that shape is no stand-in (recorded_arguments)
        if name.lower() in MASK_NAMES and _additive_mask(scan_entry):
            continue   # a 0/-inf mask: recorded_arguments makes a causal one, not noise
        new, changed = _scaled(shape)
        if changed:
            scaled.append(f"{name} {'x'.join(map(str, shape))} -> {'x'.join(map(str, new))}")
        dtype = v["dtype"] if v["dtype"] in ("float32", "float16", "bfloat16", "float64") else None
        items.append(f"{name}={'x'.join(map(str, new))}" + (f":{dtype}" if dtype else ""))
    if not items:
        return [], []
    notes = [f"input shapes and dtypes as the traced run called {scan_entry.get('qualname', 'the function')} "
             f"({rt.get('source', 'trace.json')}): " + ", ".join(items)]
    if scaled:
        notes.append("scaled down to run on CPU (batch <= 2, sequence <= 256): " + "; ".join(scaled))
    ac = rt.get("arguments_autocast")
    if isinstance(ac, str):
        notes.append(f"the traced run called it under {ac} autocast")
    return items, notes


MASK_NAMES = {"attention_mask", "attn_mask", "mask", "causal_mask"}


def _additive_mask(scan_entry: dict[str, Any]) -> bool:
    """The run saw a 0/-inf additive mask at this site (or no mask class at all), not an
    arbitrary float bias (ALiBi), which stays random."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    facts = rt.get("facts") if isinstance(rt, dict) else None
    kind = facts.get("mask_kind") if isinstance(facts, dict) else None
    return kind in (None, "additive_0_neginf")


def recorded_init(scan_entry: dict[str, Any]) -> dict[str, Any]:
    """The plain ``__init__`` arguments the traced run built the candidate's class with."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    init = rt.get("init_arguments") if isinstance(rt, dict) else None
    if not isinstance(init, dict):
        return {}
    return {k: v for k, v in init.items() if isinstance(k, str) and k.isidentifier()
            and (v is None or isinstance(v, (bool, int, float, str)))}


def recorded_autocast(scan_entry: dict[str, Any]) -> str | None:
    """The autocast dtype the traced run called the candidate's function under (verify op's
    autocast pass replays it), or None when the run did not record one."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    ac = rt.get("arguments_autocast") if isinstance(rt, dict) else None
    return ac if ac in ("bfloat16", "float16") else None


def recorded_configs(scan_entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``__init__`` arguments the traced run passed a config object for (transformers' ``config``):
    name -> {"type": "module.Class", "config": {plain fields}}. verify op builds that class (or a
    namespace) from them: an installed model's sizes are in no file of the repo."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    cfgs = rt.get("init_configs") if isinstance(rt, dict) else None
    if not isinstance(cfgs, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, spec in cfgs.items():
        if isinstance(name, str) and name.isidentifier() and isinstance(spec, dict) and isinstance(spec.get("config"), dict):
            fields = {k: v for k, v in spec["config"].items() if isinstance(k, str) and k.isidentifier() and not k.startswith("_")}
            out[name] = {"type": str(spec.get("type", "")), "config": fields}
    return out


def recorded_arguments(scan_entry: dict[str, Any]) -> dict[str, Any]:
    """The traced call's arguments that ``--shape`` cannot say: a tuple of tensors (transformers'
    ``position_embeddings=(cos, sin)``) as a list of [shape, dtype], and plain values (flags, ints).
    Tensor shapes are scaled down as :func:`recorded_shapes` does."""
    rt = scan_entry.get("runtime") if isinstance(scan_entry, dict) else None
    args = rt.get("arguments") if isinstance(rt, dict) else None
    if not isinstance(args, dict):
        return {}
    out: dict[str, Any] = {}
    objects = rt.get("argument_objects") if isinstance(rt.get("argument_objects"), dict) else {}
    for name, v in args.items():
        if name in ("self", "cls") or not isinstance(name, str) or not name.isidentifier():
            continue
        if isinstance(v, (bool, int, float, str)) and not (isinstance(v, str) and len(v) > 200):
            out[name] = v
        elif isinstance(objects.get(name), dict) and isinstance(objects[name].get("type"), str):
            o = objects[name]
            init = {k: x for k, x in (o.get("init") or {}).items() if isinstance(k, str) and k.isidentifier()
                    and (x is None or isinstance(x, (bool, int, float, str)))} if isinstance(o.get("init"), dict) else {}
            cfgs = recorded_configs({"runtime": {"init_configs": o.get("configs")}})
            out[name] = {"object": o["type"], "init": init, "configs": cfgs}
        elif isinstance(v, dict) and isinstance(v.get("tensor"), list) and isinstance(v.get("dtype"), str) \
                and v["tensor"] and all(isinstance(d, int) and 0 < d < 1 << 31 for d in v["tensor"]):
            shape = _scaled(v["tensor"])[0]
            rng = v.get("range")
            if v["dtype"].startswith("int") and isinstance(rng, list) and len(rng) == 2 \
                    and all(isinstance(x, int) and not isinstance(x, bool) and abs(x) < 1 << 62 for x in rng) and rng[0] <= rng[1]:
                out[name] = {"ints": shape, "dtype": v["dtype"], "range": rng}
            elif v["dtype"].startswith(("float", "bfloat")) and name.lower() in MASK_NAMES and _additive_mask(scan_entry):
                out[name] = {"causal_mask": shape, "dtype": v["dtype"]}
        elif isinstance(v, dict) and isinstance(v.get("sequence"), list) and v["sequence"]:
            leaves = []
            for x in v["sequence"]:
                shape = x.get("tensor") if isinstance(x, dict) else None
                if not (isinstance(shape, list) and shape and all(isinstance(d, int) and 0 < d < 1 << 31 for d in shape)
                        and isinstance(x.get("dtype"), str)):
                    break
                leaves.append([_scaled(shape)[0], x["dtype"]])
            else:
                out[name] = {"tensors": leaves}
    return out
