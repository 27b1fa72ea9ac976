"""Run-time facts: the per-process records of a traced run merged into ``trace.json``, and
joined onto scan.json candidates (``npufuse scan PATH --trace FILE``).

Pure functions over plain data. ``trace.json``::

    {"tool": "npufuse", "kind": "trace", "version": ..., "command": "...", "exit": "exit code 0",
     "backend": "emulated", "steps": 3, "processes": 1, "wall_s": 4.2, "events_dropped": 0,
     "trace_views": ["trace/trace_view_123.json"],
     "lines": [{"file": "model.py", "line": 40, "func": "forward", "calls": 6, "ops": {"mul": 12},
                "signatures": [{"op": "mul", "shapes": [[2, 8, 16]], "dtypes": ["float32"],
                                "autocast": null}],
                "values": {"add": [["float:grad", "additive_0_neginf"]]}, "batch_uniform": {"1": true},
                "modules": {"model.Expert": 8}, "autocast": {"off": 12}}],
     "runtime_candidates": [...]}

``file`` is relative to the traced root for the repo's own files; files of installed packages
keep their absolute path (a candidate of a package is matched by path suffix).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from npufuse.profile.join import _same_file  # the profile join's rule: a candidate's path is a suffix of the recorded one

MAX_RECORD_BYTES = 512 << 20   # a record file larger than this is not read (a tampered or runaway file)


class TraceInputError(ValueError):
    """trace.json (or a record) is not what npufuse writes: one line saying why."""


def merge_records(record_dir: Path, root: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-line facts of every process of the run (summed), and run totals."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    totals: dict[str, Any] = {"processes": 0, "steps": 0, "events": 0, "events_dropped": 0, "trace_views": [],
                              "stopped": [], "optimizers": [], "functions": []}
    root_real = os.path.realpath(root)
    for path in sorted(record_dir.glob("record_*.json")):
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                continue
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("lines"), list):
            continue
        totals["processes"] += 1
        totals["steps"] = max(totals["steps"], _int(rec.get("steps")))
        totals["events"] += _int(rec.get("events"))
        totals["events_dropped"] += _int(rec.get("events_dropped"))
        totals["stopped"].append(str(rec.get("stopped", "")))
        for opt in rec.get("optimizers") or []:
            try:
                made, stepped = [_rel(str(opt["made_at"][0]), root_real), int(opt["made_at"][1])], \
                    [_rel(str(opt["stepped_at"][0]), root_real), int(opt["stepped_at"][1])]
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            entry = {"class": str(opt.get("class", "")), "made_at": made, "stepped_at": stepped}
            if entry not in totals["optimizers"]:
                totals["optimizers"].append(entry)
        seen_fn = {(f["file"], f["qualname"]) for f in totals["functions"]}
        for fn in rec.get("functions") or []:
            if not (isinstance(fn, dict) and isinstance(fn.get("path"), str) and isinstance(fn.get("qualname"), str)):
                continue
            key_fn = (_rel(fn["path"], root_real), fn["qualname"])
            if key_fn not in seen_fn and isinstance(fn.get("args"), dict):
                seen_fn.add(key_fn)
                totals["functions"].append({"file": key_fn[0], "qualname": key_fn[1], "line": _int(fn.get("line")),
                                            "args": fn["args"], "autocast": fn.get("autocast") if isinstance(fn.get("autocast"), str) else None})
        tv = rec.get("trace_view")
        if isinstance(tv, str) and (record_dir / tv).is_file():
            totals["trace_views"].append(str(record_dir / tv))
        for ln in rec["lines"]:
            if not isinstance(ln, dict) or not isinstance(ln.get("path"), str):
                continue
            real = ln["path"]
            inside = real == root_real or real.startswith(root_real + os.sep)
            file = _rel(real, root_real)
            key = (file, _int(ln.get("line")))
            m = merged.get(key)
            if m is None:
                m = merged[key] = {"file": file, "line": key[1], "func": str(ln.get("func", "")), "in_root": inside,
                                   "calls": 0, "ops": Counter(), "signatures": [], "values": {},
                                   "batch_uniform": {}, "modules": Counter(), "autocast": Counter()}
            m["calls"] += _int(ln.get("calls"))
            m["ops"].update({str(k): _int(v) for k, v in _dict(ln.get("ops")).items()})
            m["modules"].update({str(k): _int(v) for k, v in _dict(ln.get("modules")).items()})
            m["autocast"].update({str(k): _int(v) for k, v in _dict(ln.get("autocast")).items()})
            for sig in ln.get("signatures") or []:
                if isinstance(sig, dict) and sig not in m["signatures"] and len(m["signatures"]) < 6:
                    m["signatures"].append(sig)
            for op, classes in _dict(ln.get("values")).items():
                have = m["values"].setdefault(str(op), [])
                for cls in classes if isinstance(classes, list) else []:
                    if cls not in have:
                        have.append(cls)
            for k, v in _dict(ln.get("batch_uniform")).items():
                if isinstance(v, bool):
                    prev = m["batch_uniform"].get(str(k))
                    m["batch_uniform"][str(k)] = v if prev is None else (prev and v)
    lines = []
    for m in sorted(merged.values(), key=lambda m: (m["file"], m["line"])):
        m["ops"], m["modules"], m["autocast"] = dict(m["ops"]), dict(m["modules"]), dict(m["autocast"])
        lines.append(m)
    return lines, totals


def _rel(real: str, root_real: str) -> str:
    """A recorded absolute path as trace.json shows it: relative inside the root, else as it is."""
    if real == root_real or real.startswith(root_real + os.sep):
        return os.path.relpath(real, root_real).replace(os.sep, "/")
    return real


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 else 0


def _dict(v: Any) -> dict[Any, Any]:
    return v if isinstance(v, dict) else {}


def load_trace(path: Path) -> dict[str, Any]:
    """trace.json as written by ``npufuse trace``; :class:`TraceInputError` for anything else."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise TraceInputError(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB, not a trace npufuse wrote")
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceInputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise TraceInputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != "trace" or not isinstance(data.get("lines"), list):
        raise TraceInputError(f"{path}: not a trace.json written by `npufuse trace`")
    return sanitize_trace(data)


def _counts(v: Any) -> dict[str, int]:
    return {str(k)[:300]: _int(n) for k, n in _dict(v).items()}


def _shape(v: Any) -> list[int] | None:
    if isinstance(v, list) and len(v) <= 16 and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in v):
        return v
    return None


def _signature(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, dict) or not isinstance(v.get("op"), str):
        return None
    shapes = [_shape(x) for x in v.get("shapes") or [] if isinstance(v.get("shapes"), list)]
    dtypes = [d for d in v.get("dtypes") or [] if isinstance(d, str)] if isinstance(v.get("dtypes"), list) else []
    return {"op": v["op"][:100], "shapes": [x for x in shapes if x is not None][:8], "dtypes": dtypes[:8],
            "autocast": v["autocast"] if isinstance(v.get("autocast"), str) else None}


def _value_classes(v: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for op, calls in _dict(v).items():
        keep = []
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, list):
                keep.append([[c[0], c[1]] for c in call if isinstance(c, list) and len(c) == 2
                             and isinstance(c[0], str) and isinstance(c[1], int) and not isinstance(c[1], bool)][:8])
        out[str(op)[:100]] = keep[:8]
    return out


def sanitize_trace(data: dict[str, Any]) -> dict[str, Any]:
    """trace.json is input like any other (it may be shipped or edited): every field the join and
    the report read is brought to its type here, or dropped."""
    lines = []
    for ln in data.get("lines") or []:
        if not (isinstance(ln, dict) and isinstance(ln.get("file"), str) and isinstance(ln.get("line"), int)
                and not isinstance(ln.get("line"), bool)):
            continue
        lines.append({"file": ln["file"], "line": ln["line"], "func": str(ln.get("func", ""))[:200],
                      "in_root": ln.get("in_root") is True, "calls": _int(ln.get("calls")), "ops": _counts(ln.get("ops")),
                      "modules": _counts(ln.get("modules")), "autocast": _counts(ln.get("autocast")),
                      "signatures": [s for s in map(_signature, ln.get("signatures") or [] if isinstance(ln.get("signatures"), list) else []) if s],
                      "values": _value_classes(ln.get("values")),
                      "batch_uniform": {str(k): b for k, b in _dict(ln.get("batch_uniform")).items() if isinstance(b, bool)}})
    functions = []
    for fn in data.get("functions") or [] if isinstance(data.get("functions"), list) else []:
        if isinstance(fn, dict) and isinstance(fn.get("file"), str) and isinstance(fn.get("qualname"), str) \
                and isinstance(fn.get("args"), dict):
            functions.append({"file": fn["file"], "qualname": fn["qualname"], "line": _int(fn.get("line")),
                              "args": fn["args"], "autocast": fn["autocast"] if isinstance(fn.get("autocast"), str) else None})
    found = []
    for f in data.get("runtime_candidates") or [] if isinstance(data.get("runtime_candidates"), list) else []:
        if isinstance(f, dict) and isinstance(f.get("file"), str):
            found.append({"file": f["file"], "line": _int(f.get("line")), "api": str(f.get("api") or ""),
                          "pattern": str(f.get("pattern") or ""), "count": _int(f.get("count")),
                          "ops": [str(o) for o in f.get("ops") or [] if isinstance(f.get("ops"), list)][:32],
                          **({"static_near_miss": str(f["static_near_miss"])} if f.get("static_near_miss") else {})})
    out = {k: data[k] for k in ("tool", "kind", "version") if k in data}
    out.update({"command": str(data.get("command", ""))[:2000], "exit": str(data.get("exit", ""))[:200],
                "backend": str(data.get("backend", "unknown"))[:40], "steps": _int(data.get("steps")),
                "processes": _int(data.get("processes")), "lines": lines, "functions": functions,
                "runtime_candidates": found})
    return out


# ---------------------------------------------------------------------------- the join

def site_lines(trace: dict[str, Any], c: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's records of the lines a candidate spans."""
    try:
        lo, hi = int(c["line"]), int(c.get("end_line", c["line"]))
    except (KeyError, TypeError, ValueError):
        return []
    file = str(c.get("file", ""))
    return [ln for ln in trace["lines"] if lo <= ln["line"] <= hi and _same_file(ln["file"], file)]


def function_call(trace: dict[str, Any], c: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded first call of the function holding a candidate (its arguments), if any."""
    for fn in trace.get("functions") or []:
        if isinstance(fn, dict) and fn.get("qualname") == c.get("qualname") and isinstance(fn.get("file"), str) \
                and _same_file(fn["file"], str(c.get("file", ""))) and isinstance(fn.get("args"), dict):
            return fn
    return None


def site_facts(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run established about one site, from its lines' records."""
    ops: Counter = Counter()
    modules: Counter = Counter()
    autocast: Counter = Counter()
    values: dict[str, list[Any]] = {}
    uniform: list[bool] = []
    sigs: list[dict[str, Any]] = []
    for ln in lines:
        ops.update(_dict(ln.get("ops")))
        modules.update(_dict(ln.get("modules")))
        autocast.update(_dict(ln.get("autocast")))
        for op, classes in _dict(ln.get("values")).items():
            for cls in classes if isinstance(classes, list) else []:
                if cls not in values.setdefault(op, []):
                    values[op].append(cls)
        uniform += [v for v in _dict(ln.get("batch_uniform")).values() if isinstance(v, bool)]
        for s in ln.get("signatures") or []:
            if s not in sigs and len(sigs) < 8:
                sigs.append(s)
    facts: dict[str, Any] = {"ops": dict(ops.most_common(12)), "signatures": sigs}
    ac = {k: v for k, v in autocast.items() if k != "off"}
    facts["autocast"] = max(ac, key=ac.get) if ac else None
    dtypes = Counter(d for s in sigs for d in s.get("dtypes") or [] if isinstance(d, str))
    facts["dtypes"] = sorted(dtypes)
    facts["mask_kind"] = _mask_kind(values)
    if uniform:
        facts["batch_uniform"] = all(uniform)
    if modules:
        facts["modules"] = dict(modules.most_common(8))
    return facts


def _mask_operand(classes: list[Any]) -> str | None:
    """The value class of the mask/bias operand of one recorded call, given [class, numel] per
    tensor operand: the smaller operand of a two-tensor call (a mask broadcasts over the scores),
    else the only one without a gradient; None when the call does not say."""
    ops = [c for c in classes if isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], int)]
    if len(ops) < 2:
        return None
    a, b = ops[0], ops[1]
    if a[1] != b[1]:
        return (a if a[1] < b[1] else b)[0]
    grad = [c for c in (a, b) if c[0].endswith(":grad")]
    if len(grad) == 1:
        return (b if grad[0] is a else a)[0]
    return None


def _mask_kind(values: dict[str, list[Any]]) -> str | None:
    """bool | additive_0_neginf | float (an arbitrary bias, e.g. ALiBi) | None (no mask seen)."""
    kinds: set[str] = set()
    for op in ("masked_fill", "masked_fill_", "where"):
        for classes in values.get(op, []):
            if isinstance(classes, list) and any(isinstance(c, list) and c and c[0] == "bool" for c in classes):
                kinds.add("bool")
    for op in ("add", "add_", "baddbmm", "scaled_dot_product_attention"):
        for classes in values.get(op, []):
            if not isinstance(classes, list):
                continue
            if op == "scaled_dot_product_attention":   # q, k, v, attn_mask
                m = classes[3] if len(classes) >= 4 and isinstance(classes[3], list) and classes[3] else None
                cls = m[0] if m and isinstance(m[0], str) else None
            else:
                cls = _mask_operand(classes)
            if cls is not None:
                cls = cls.split(":")[0]
                if cls in ("bool", "additive_0_neginf", "float"):
                    kinds.add(cls)
    for kind in ("float", "additive_0_neginf", "bool"):
        if kind in kinds:
            return kind
    return None


def join_trace(scan: dict[str, Any], trace: dict[str, Any], source: str) -> None:
    """Annotate scan.json candidates in place: ``runtime`` (reached, calls, facts), risks the run
    established, and unreached candidates ranked last."""
    has_data = bool(trace["lines"])
    for c in scan.get("candidates", []):
        lines = site_lines(trace, c)
        calls = max((_int(ln.get("calls")) for ln in lines), default=0)
        reached = calls > 0
        rt: dict[str, Any] = {"source": source, "reached": reached if has_data else None, "calls": calls}
        risks = c.setdefault("risks", [])
        if reached:
            facts = site_facts(lines)
            fn = function_call(trace, c)
            if fn is not None:
                rt["arguments"] = fn["args"]
                rt["arguments_autocast"] = fn.get("autocast")
            owner = str(c.get("qualname", "")).rpartition(".")[0]
            init = function_call(trace, {**c, "qualname": owner + ".__init__"}) if owner else None
            if init is not None:
                # the plain values the class was built with (verify op's --init)
                rt["init_arguments"] = {k: v for k, v in init["args"].items() if k != "self"
                                        and (v is None or isinstance(v, (bool, int, float, str)))}
                # a config object's plain fields (verify op builds the config class from them)
                configs = {k: {"type": str(v.get("type", ""))[:300], "config": v["config"]} for k, v in init["args"].items()
                           if isinstance(v, dict) and isinstance(v.get("config"), dict)}
                if configs:
                    rt["init_configs"] = configs
            objects = _argument_objects(trace, fn["args"]) if fn is not None else {}
            if objects:
                rt["argument_objects"] = objects
            rt["facts"] = facts
            for kind, detail in settle(c, facts):
                risks.append({"kind": kind, "detail": detail, "level": "high" if kind == "runtime_mask_values" else "medium",
                              "source": "run"})
        elif has_data:
            risks.append({"kind": "not_reached", "level": "low", "source": "run",
                          "detail": "never executed in the traced run: dead code under the traced configuration "
                                    "(ranked last; verify op says 'not reached')"})
        c["runtime"] = rt
    order = scan.get("suggested_order")
    if isinstance(order, list) and has_data:
        by_id = {c.get("id"): c for c in scan.get("candidates", [])}
        reached_ids = [i for i in order if (by_id.get(i) or {}).get("runtime", {}).get("reached")]
        scan["suggested_order"] = reached_ids + [i for i in order if i not in reached_ids]


def _argument_objects(trace: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Arguments that are objects of a class whose ``__init__`` the run recorded (transformers'
    ``eager_attention_forward(module, ...)`` reads ``module.num_key_value_groups``): name ->
    {"type", "init": plain values, "configs": config fields}, so verify op can build one."""
    out: dict[str, Any] = {}
    for name, v in args.items():
        if name in ("self", "cls") or not (isinstance(v, dict) and set(v) == {"type"} and isinstance(v["type"], str)):
            continue
        mod, _, cls = v["type"].rpartition(".")
        if not mod or not cls.isidentifier():
            continue
        init = function_call(trace, {"qualname": cls + ".__init__", "file": mod.replace(".", "/") + ".py"})
        if init is None:
            continue
        plain = {k: x for k, x in init["args"].items() if k != "self" and (x is None or isinstance(x, (bool, int, float, str)))}
        configs = {k: {"type": str(x.get("type", ""))[:300], "config": x["config"]} for k, x in init["args"].items()
                   if isinstance(x, dict) and isinstance(x.get("config"), dict)}
        out[name] = {"type": v["type"][:300], "init": plain, "configs": configs}
    return out


def settle(c: dict[str, Any], facts: dict[str, Any]) -> list[tuple[str, str]]:
    """Risks (kind, detail) that the run's facts establish for one candidate."""
    out: list[tuple[str, str]] = []
    pattern = c.get("pattern")
    if facts.get("autocast"):
        out.append(("autocast", f"runs under {facts['autocast']} autocast at run time: the fused branch must produce the "
                           f"dtypes autocast gives the original (verify op replays it)"))
    if pattern in ("attention", "sdpa"):
        kind = facts.get("mask_kind")
        if kind == "float":
            out.append(("runtime_mask_values", "the mask/bias added to the scores holds arbitrary float values at run "
                                               "time (an ALiBi-like bias, not 0/-inf): it must be passed as an "
                                               "additive pse, never binarised into atten_mask"))
    if pattern == "rope" and facts.get("batch_uniform") is False:
        out.append(("runtime_batch_varying", "cos/sin differ across the batch at run time: a [1, S, 1, D] table "
                                             "cannot be shared; the fused call needs per-batch cos/sin"))
    return out


def runtime_section(scan: dict[str, Any], trace: dict[str, Any]) -> str:
    """Report section: what the run established (reached or not, facts) and run-time-only candidates."""
    out = ["### 1.3 Run-time evidence (`npufuse trace`)", ""]
    out.append(f"Traced command: `{_cell(trace.get('command', ''))}` (torch_npu: {trace.get('backend', 'unknown')}, "
               f"{trace.get('steps', 0)} optimizer steps, {trace.get('processes', 0)} process(es), "
               f"{trace.get('exit', '')}). Facts below come from that run, not from reading the code.")
    out.append("")
    cands = scan.get("candidates", [])
    if cands:
        out.append("| id | pattern | location | reached | facts from the run |")
        out.append("| --- | --- | --- | --- | --- |")
        for c in cands:
            rt = c.get("runtime") or {}
            reached = rt.get("reached")
            r = "unknown" if reached is None else (f"yes ({rt.get('calls', 0)} calls)" if reached else "**no**")
            facts = rt.get("facts") or {}
            bits = []
            if facts.get("dtypes"):
                bits.append("dtypes " + "/".join(facts["dtypes"]))
            if facts.get("autocast"):
                bits.append(f"autocast {facts['autocast']}")
            if facts.get("mask_kind"):
                bits.append(f"mask {facts['mask_kind']}")
            if "batch_uniform" in facts:
                bits.append("cos/sin same over batch" if facts["batch_uniform"] else "cos/sin vary over batch")
            if facts.get("modules"):
                bits.append("modules " + ", ".join(k.rsplit(".", 1)[-1] for k in facts["modules"]))
            out.append(f"| {c.get('id')} | {c.get('pattern')} | {_cell(c.get('file'))}:{c.get('line')} | {r} | "
                       f"{_cell('; '.join(bits)) or '-'} |")
        out.append("")
    found = trace.get("runtime_candidates") or []
    out.append("**Found at run time** (op sequences the profile stage's knowledge base recognises in the recorded run, "
               "at lines no static candidate covers):")
    out.append("")
    if not found:
        out.append("none.")
    else:
        out.append("| location | fused API | pattern | op sequence | count | note |")
        out.append("| --- | --- | --- | --- | --- | --- |")
        for f in found:
            note = f"static scan: near miss ({f['static_near_miss']})" if f.get("static_near_miss") else \
                "no static candidate; no rewrite template is implied"
            out.append(f"| {_cell(f.get('file'))}:{f.get('line')} | `{_cell(f.get('api') or 'none known')}` | "
                       f"{_cell(f.get('pattern') or '-')} | {_cell(' > '.join(f.get('ops') or []))} | {f.get('count', '')} | "
                       f"{_cell(note)} |")
    return "\n".join(out) + "\n"


def _cell(text: Any) -> str:
    s = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in str(text))
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("`", "'")
