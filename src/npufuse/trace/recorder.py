"""What runs inside a traced process: one record per executed source line of the user's code.

Started from the verification probe's bootstrap (:mod:`npufuse.verify.probe`: the probe's
settings carry a ``"trace"`` section), so a traced run gets the same ``torch_npu`` stand-in, the
same watchdog and the same start-up path as ``verify e2e``. It waits for ``import torch`` (a
meta-path hook): Python processes of the launch that never import torch pay nothing.

Recording is a :class:`torch.overrides.TorchFunctionMode` entered for the whole process, plus
global ``nn.Module`` forward pre-hooks and optimizer step hooks:

* every torch function / Tensor method call (the mode sees top-level calls only: what the call
  runs inside is not seen, exactly like the top-level host ops of a profiler trace) is charged to
  the innermost frame of *user code* (any file that is not torch, npufuse or the standard
  library: the repo and the installed packages it calls, such as transformers);
* per line: op counts, the first distinct (op, shapes, dtypes, autocast) signatures, value
  classes of mask/bias-like operands (bool, int, 0/-inf additive, arbitrary float) and whether an
  operand is the same over the batch (cos/sin), for the first few calls only;
* per line: the classes of the ``nn.Module`` objects called there (experts, activations);
* a chrome-trace file in the layout of torch_npu's ``trace_view.json`` (``cpu_op`` events with a
  ``Call stack``, ``ProfilerStep#N`` and ``Optimizer.step#`` spans), so the profile stage's
  sequence miner reads the run with its own code (:mod:`npufuse.profile`).

The backward pass runs in autograd's C++ engine and is not seen by a function mode: the record
covers the forward pass and the optimizer step. Only the thread that imported torch is recorded
(function modes are per thread).

Module-level imports are stdlib only: this module is imported at start-up of every child Python.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import sys
import sysconfig
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Calls that read metadata or convert, not compute: never ops of a sequence.
SKIP = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "stride", "storage_offset", "element_size", "data_ptr",
    "is_contiguous", "is_floating_point", "is_complex", "__len__", "__iter__", "__bool__", "__format__",
    "__repr__", "__str__", "__hash__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__getstate__",
    "requires_grad_", "register_hook", "retain_grad", "_has_compatible_shallow_copy_type", "__index__",
    "__int__", "__float__", "__array__", "tolist", "get_device", "untyped_storage", "_typed_storage",
    "backward", "_set_grad_enabled", "is_grad_enabled", "get_default_dtype", "is_autocast_enabled",
    "_get_tracing_state", "is_inference_mode_enabled", "_record_function_enter_new", "_record_function_exit",
    "_RecordFunction", "__contains__", "__dir__", "__sizeof__", "__class__", "nelement", "ndimension", "type",
    "is_shared", "is_pinned", "_is_view", "__reversed__", "detach_", "share_memory_", "__torch_function__",
})

# Python spellings -> the aten names the knowledge base's `aten:` sequences use.
RENAME = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub",
    "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
    "__rtruediv__": "div", "__div__": "div", "__rdiv__": "div", "__itruediv__": "div_", "__floordiv__": "floor_divide", "__neg__": "neg",
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
    "__getitem__": "slice", "__setitem__": "index_put_", "__and__": "bitwise_and", "__or__": "bitwise_or",
    "__invert__": "bitwise_not", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
    "__eq__": "eq", "__ne__": "ne", "__mod__": "remainder", "__abs__": "abs",
    "float": "to", "half": "to", "bfloat16": "to", "double": "to", "long": "to", "int": "to", "bool": "to",
    "type_as": "type_as", "scaled_dot_product_attention": "scaled_dot_product_attention",
}

# Ops whose tensor operands get a value class (mask / bias / position tables).
VALUE_OPS = frozenset({"add", "add_", "sub", "masked_fill", "masked_fill_", "where", "softmax", "baddbmm",
                       "mul", "scaled_dot_product_attention"})
VALUE_CALLS = 3          # value classes are read on a line's first few calls of an op only
VALUE_MAX_NUMEL = 1 << 22
MAX_SIGNATURES = 6
MAX_DEPTH = 64
MAX_FUNCTIONS = 5000
TRACE_ENV = "NPUFUSE_TRACE"


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    name = name.rpartition(".")[2]   # `_record_function_exit._RecordFunction`
    return RENAME.get(name, name)


def _value_class(t: Any) -> str:
    """bool | int | zeros | additive_0_neginf | float, with ':grad' for tensors that carry a gradient."""
    import torch

    if t.dtype == torch.bool:
        return "bool"
    if not (t.is_floating_point() or t.is_complex()):
        return "int"
    suffix = ":grad" if t.requires_grad else ""
    if t.numel() > VALUE_MAX_NUMEL or t.is_complex():
        return "float(unchecked)" + suffix
    with torch.no_grad():
        v = t.detach()
        nz = v[v != 0]
        if nz.numel() == 0:
            return "zeros" + suffix
        # an additive mask: every non-zero entry is -inf or a huge negative (finfo.min, -1e9, -1e4)
        if bool(((nz <= -1e4) | torch.isneginf(nz)).all()):
            return "additive_0_neginf" + suffix
    return "float" + suffix


def _out_ids(out: Any, torch: Any) -> list[int]:
    if isinstance(out, torch.Tensor):
        return [id(out)]
    if isinstance(out, (tuple, list)):
        return [id(o) for o in out[:8] if isinstance(o, torch.Tensor)]
    return []


def _autocast_now() -> str | None:
    try:
        import torch

        if torch.is_autocast_enabled("cpu"):
            return str(torch.get_autocast_dtype("cpu")).replace("torch.", "")
    except (AttributeError, TypeError, RuntimeError):
        pass
    return None


def _describe(v: Any, depth: int = 0) -> Any:
    """A value as JSON: tensors by shape/dtype, containers of them, plain scalars; else the type."""
    import torch

    if isinstance(v, torch.Tensor):
        out_t: dict[str, Any] = {"tensor": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "requires_grad": bool(v.requires_grad)}
        if not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool) and 0 < v.numel() <= INT_RANGE_MAX_NUMEL:
            # index tensors (a router's top-k expert ids, position ids): verify op draws ids in this range
            try:
                with torch._C.DisableTorchFunction():   # not an op of the user's run
                    lo, hi = torch.aminmax(v.detach())
                out_t["range"] = [int(lo), int(hi)]
            except Exception:  # an exotic tensor: no range, the record goes on
                pass
        return out_t
    if v is None or isinstance(v, (bool, int, float)):
        return v if not (isinstance(v, float) and v != v) else "nan"
    if isinstance(v, str):
        return v[:200]
    if isinstance(v, (tuple, list)) and depth < 2 and len(v) <= 16:
        return {"sequence": [_describe(x, depth + 1) for x in v]}
    out: dict[str, Any] = {"type": f"{type(v).__module__}.{type(v).__qualname__}"}
    if depth == 0 and _CONFIG_CLASS.search(type(v).__name__):
        # a model config (transformers' Qwen2MoeConfig, a dataclass of args): its plain fields, so
        # verify op can build the class that took it (installed models have no config in the repo)
        attrs = _plain_fields(v)
        if attrs is not None:
            out["config"] = attrs
    return out


_CONFIG_CLASS = re.compile(r"(Config|Configuration|Args|Arguments|Namespace)$")
CONFIG_MAX_FIELDS = 400
INT_RANGE_MAX_NUMEL = 1 << 20


def _plain(v: Any, depth: int = 0) -> tuple[bool, Any]:
    """(True, v) when ``v`` is JSON-plain (scalars, short lists of them, str-keyed dicts of them)."""
    if v is None or isinstance(v, (bool, int, str)):
        return True, v[:200] if isinstance(v, str) else v
    if isinstance(v, float):
        return (v == v and abs(v) != float("inf")), v
    if depth < 2 and isinstance(v, (list, tuple)) and len(v) <= 64:
        items = [_plain(x, depth + 1) for x in v]
        return all(ok for ok, _ in items), [x for _, x in items]
    if depth < 2 and isinstance(v, dict) and len(v) <= 64 and all(isinstance(k, str) for k in v):
        items2 = {k: _plain(x, depth + 1) for k, x in v.items()}
        return all(ok for ok, _ in items2.values()), {k: x for k, (_, x) in items2.items()}
    return False, None


def _plain_fields(obj: Any) -> dict[str, Any] | None:
    """The public, JSON-plain instance attributes of a config-like object (read from its
    ``__dict__``: no method of the user's object is called)."""
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    if not isinstance(fields, dict):
        return None
    out: dict[str, Any] = {}
    for k, v in list(fields.items())[:CONFIG_MAX_FIELDS]:
        if isinstance(k, str) and not k.startswith("_"):
            ok, plain = _plain(v)
            if ok:
                out[k] = plain
    return out


def _batch_uniform(t: Any) -> bool | None:
    """True when every batch row equals the first (cos/sin built once and expanded); None: not a
    tensor with a batch dimension worth reading."""
    import torch

    if t.dim() < 2 or t.shape[0] <= 1 or t.numel() > VALUE_MAX_NUMEL or t.requires_grad:
        return None
    with torch.no_grad():
        return bool(torch.equal(t, t[:1].expand_as(t)))


class Recorder:
    """The per-process record. :meth:`write` is idempotent and safe from atexit and signals."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg["out_dir"])
        self.root = os.path.realpath(cfg.get("root") or ".")
        self.max_steps = int(cfg["steps"]) if cfg.get("steps") else None
        self.max_events = int(cfg.get("max_events", 300_000))
        self.pid = os.getpid()
        self.tid = threading.get_ident()
        self.lines: dict[tuple[str, int], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.events_dropped = 0
        self.steps = 0
        self.optimizers: dict[tuple[str, int, str, int], str] = {}   # (made at file, line, stepped at file, line) -> class
        self.step_start_ns: int | None = None
        self.opt_start_ns: int | None = None
        self.t0 = time.perf_counter_ns()
        self._user: dict[str, bool] = {}
        self._called: set[Any] = set()     # code objects whose first call's arguments are recorded
        self.functions: list[dict[str, Any]] = []
        self._stacks: dict[tuple, str] = {}
        self._lock = threading.RLock()
        self._written = False
        self.mode: Any = None
        self.autocast_error = False
        import npufuse

        skip = [os.path.dirname(os.path.realpath(npufuse.__file__))]
        for key in ("stdlib", "platstdlib"):
            try:
                skip.append(os.path.realpath(sysconfig.get_paths()[key]))
            except (KeyError, OSError):
                pass
        self._skip_dirs = tuple(d + os.sep for d in skip if d)

    # -- where an op comes from
    def _is_user(self, filename: str) -> bool:
        if not filename or filename.startswith("<"):
            return False
        real = os.path.realpath(filename)
        if real.startswith(self._skip_dirs):
            return False
        return True

    def frames(self, depth: int) -> list[tuple[str, int, str]]:
        """User frames of the current stack, innermost first (``depth`` frames of ours skipped)."""
        out: list[tuple[str, int, str]] = []
        f = sys._getframe(depth)
        n = 0
        user = self._user
        while f is not None and n < MAX_DEPTH:
            co = f.f_code
            fn = co.co_filename
            u = user.get(fn)
            if u is None:
                u = user[fn] = self._is_user(fn)
            if u:
                # every user function on the stack, not only the innermost: a class whose
                # __init__ only builds submodules (a decoder layer) runs no op of its own
                if co not in self._called:
                    self._capture_arguments(f)
                out.append((fn, f.f_lineno, co.co_name))
            f = f.f_back
            n += 1
        return out

    def _capture_arguments(self, frame: Any) -> None:
        """The arguments of a user function's first call that runs a torch op, as shapes, dtypes
        and plain values: the inputs ``verify op`` rebuilds for a candidate held in it."""
        co = frame.f_code
        self._called.add(co)
        if len(self.functions) >= MAX_FUNCTIONS:
            return
        names = co.co_varnames[: co.co_argcount + co.co_kwonlyargcount]
        local = frame.f_locals
        args: dict[str, Any] = {}
        for name in names:
            if name in local:
                args[name] = _describe(local[name])
        self.functions.append({"path": os.path.realpath(co.co_filename), "qualname": getattr(co, "co_qualname", co.co_name),
                               "line": co.co_firstlineno, "args": args, "autocast": _autocast_now()})

    def _line(self, frame: tuple[str, int, str]) -> dict[str, Any]:
        key = (frame[0], frame[1])
        rec = self.lines.get(key)
        if rec is None:
            rec = self.lines[key] = {"func": frame[2], "ops": Counter(), "signatures": [], "values": {},
                                     "batch_uniform": {}, "modules": Counter(), "autocast": Counter()}
        return rec

    def _stack_text(self, frames: list[tuple[str, int, str]]) -> str:
        key = tuple(frames)
        s = self._stacks.get(key)
        if s is None:
            # innermost first, as torch_npu writes its Call stack column
            s = self._stacks[key] = ";".join(f"{fn}({ln}): {name}" for fn, ln, name in frames)
        return s

    # -- the function mode's callback
    def on_call(self, func: Any, args: tuple, kwargs: dict, out: Any, t0: int, t1: int) -> None:
        name = _op_name(func)
        if name in SKIP:
            return
        frames = self.frames(3)
        if not frames:
            return
        import torch

        with self._lock:
            rec = self._line(frames[0])
            rec["ops"][name] += 1
            try:
                ac = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
            except (AttributeError, TypeError, RuntimeError):
                ac = None
            ac_name = str(ac).replace("torch.", "") if ac is not None else None
            rec["autocast"][ac_name or "off"] += 1
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            if len(rec["signatures"]) < MAX_SIGNATURES:
                sig = {"op": name, "shapes": [list(t.shape) for t in tensors],
                       "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors], "autocast": ac_name}
                if sig not in rec["signatures"]:
                    rec["signatures"].append(sig)
            if name in VALUE_OPS and rec["ops"][name] <= VALUE_CALLS and tensors:
                classes = rec["values"].setdefault(name, [])
                try:
                    cls = [[_value_class(t), int(t.numel())] for t in tensors]
                except Exception:  # an exotic tensor subclass: no value class, the run goes on
                    cls = []
                if cls and cls not in classes:
                    classes.append(cls)
                if name == "mul":
                    for k, t in enumerate(tensors):
                        try:
                            u = _batch_uniform(t)
                        except Exception:
                            u = None
                        if u is not None:
                            prev = rec["batch_uniform"].get(str(k))
                            rec["batch_uniform"][str(k)] = u if prev is None else (prev and u)
            if len(self.events) < self.max_events:
                self.events.append({"ph": "X", "cat": "cpu_op", "name": "aten::" + name, "pid": self.pid,
                                    "tid": 1, "ts": (t0 - self.t0) / 1000.0, "dur": max(t1 - t0, 1) / 1000.0,
                                    "args": {"Call stack": self._stack_text(frames),
                                             # tensor identities: which op fed which (dataflow evidence)
                                             "in": [id(t) for t in tensors], "out": _out_ids(out, torch)}})
            else:
                self.events_dropped += 1

    # -- module and optimizer hooks
    def on_module(self, module: Any, args: Any) -> None:
        frames = self.frames(2)
        if frames:
            with self._lock:
                cls = type(module)
                self._line(frames[0])["modules"][f"{cls.__module__}.{cls.__qualname__}"] += 1

    def on_optimizer_init(self, optimizer: Any) -> None:
        frames = self.frames(3)
        if frames:
            with self._lock:
                cls = type(optimizer)
                self._line(frames[0])["modules"][f"{cls.__module__}.{cls.__qualname__}"] += 1
                optimizer.__dict__["_npufuse_site"] = frames[0]

    def on_step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.opt_start_ns = time.perf_counter_ns()
        site = optimizer.__dict__.get("_npufuse_site")
        frames = self.frames(3)
        with self._lock:
            if site is not None:
                # the construction line "ran" once per step: a fused-optimizer candidate is reached
                self._line(site)["ops"]["optimizer.step"] += 1
            if site is not None and frames:
                self.optimizers.setdefault((site[0], site[1], frames[0][0], frames[0][1]), type(optimizer).__name__)

    def on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter_ns()
        with self._lock:
            self.steps += 1
            begin = self.step_start_ns if self.step_start_ns is not None else self.t0
            cls = type(optimizer).__name__
            if self.opt_start_ns is not None:
                self.events.append({"ph": "X", "cat": "user_annotation", "name": f"Optimizer.step#{cls}.step",
                                    "pid": self.pid, "tid": 1, "ts": (self.opt_start_ns - self.t0) / 1000.0,
                                    "dur": (now - self.opt_start_ns) / 1000.0})
            self.events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{self.steps}",
                                "pid": self.pid, "tid": 1, "ts": (begin - self.t0) / 1000.0,
                                "dur": (now - begin) / 1000.0})
            self.step_start_ns = now
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.write(reason=f"{self.steps} optimizer steps recorded")
            sys.stdout.flush()
            sys.stderr.flush()
            # End the launch here: the record is complete. os._exit, not SystemExit: a training
            # loop's `except Exception`/finally blocks must not run more steps after this one.
            os._exit(0)

    # -- output
    def lines_json(self) -> list[dict[str, Any]]:
        out = []
        for (fn, ln), rec in self.lines.items():
            real = os.path.realpath(fn)
            out.append({"path": real, "line": ln, "func": rec["func"],
                        "in_root": real == self.root or real.startswith(self.root + os.sep),
                        "ops": dict(rec["ops"]), "calls": max(rec["ops"].values()) if rec["ops"] else 0,
                        "signatures": rec["signatures"], "values": rec["values"],
                        "batch_uniform": rec["batch_uniform"], "modules": dict(rec["modules"]),
                        "autocast": dict(rec["autocast"])})
        return out

    def write(self, reason: str = "exit") -> None:
        with self._lock:
            if self._written:
                return
            self._written = True
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                meta = [{"ph": "M", "name": "process_name", "pid": self.pid, "args": {"name": "Python (npufuse trace)"}}]
                events_path = self.out_dir / f"trace_view_{self.pid}.json"
                _atomic_json(events_path, {"traceEvents": meta + self.events})
                _atomic_json(self.out_dir / f"record_{self.pid}.json", {
                    "pid": self.pid, "argv": list(sys.argv), "root": self.root, "steps": self.steps,
                    "stopped": reason, "events": len(self.events), "events_dropped": self.events_dropped,
                    "wall_s": (time.perf_counter_ns() - self.t0) / 1e9, "trace_view": events_path.name,
                    "optimizers": [{"class": c, "made_at": [os.path.realpath(a), b], "stepped_at": [os.path.realpath(x), y]}
                                   for (a, b, x, y), c in self.optimizers.items()],
                    "functions": self.functions, "lines": self.lines_json()})
            except Exception as exc:  # never break the user's program over its record
                sys.stderr.write(f"npufuse trace: cannot write the record ({type(exc).__name__}: {exc})\n")


def _atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"), default=str)
    os.replace(tmp, path)


def _make_mode(rec: Recorder) -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    perf = time.perf_counter_ns

    class RecordingMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            t0 = perf()
            out = func(*args, **kwargs)
            t1 = perf()
            if threading.get_ident() == rec.tid:
                try:
                    rec.on_call(func, args, kwargs, out, t0, t1)
                except Exception:  # the record is best effort; the program's result is not
                    pass
            return out

    del torch
    return RecordingMode()


def start_recording(rec: Recorder) -> None:
    """Enter the mode and hooks now (torch is imported)."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    rec.tid = threading.get_ident()
    # torch itself (and its sibling packages) is where an op lands, not where it comes from
    site = os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__)))
    rec._skip_dirs += tuple(os.path.join(site, name) + os.sep for name in ("torch", "functorch", "torchgen", "torch_npu"))
    rec._user.clear()
    rec.mode = _make_mode(rec)
    rec.mode.__enter__()  # for the life of the process: never exited
    register_module_forward_pre_hook(lambda m, a: rec.on_module(m, a))
    init = torch.optim.Optimizer.__init__

    def optimizer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            rec.on_optimizer_init(self)
        except Exception:
            pass

    torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
    register_optimizer_step_pre_hook(rec.on_step_pre)
    register_optimizer_step_post_hook(rec.on_step_post)
    del torch


class _AfterTorch:
    """Meta-path hook: start recording right after ``import torch`` has finished."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch" or self.busy:
            return None
        self.busy = True
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return None
        inner = spec.loader.exec_module
        rec = self.rec

        def exec_module(module: Any) -> None:
            inner(module)
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            start_recording(rec)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def start(cfg: dict[str, Any]) -> Recorder:
    """Called by the probe's bootstrap in the child when its settings have a ``trace`` section."""
    rec = Recorder(cfg)
    atexit.register(rec.write)
    try:
        prev = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            rec.write(reason="terminated")
            if callable(prev):
                prev(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass
    if "torch" in sys.modules:
        start_recording(rec)
    else:
        sys.meta_path.insert(0, _AfterTorch(rec))
    return rec
