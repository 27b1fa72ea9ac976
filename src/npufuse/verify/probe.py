"""What runs inside a verified process: proof that the fused branch ran, from the outside.

The rewritten user file never imports npufuse (DESIGN rule 1), so the proof is injected:

* In-process (``verify op``): :func:`instrument` wraps every ``npu_*`` function of the
  ``torch_npu`` module (real or emulated) with a counter that records *who called*: a call whose
  caller frame lies inside the candidate's marked ``if``/``else`` in its file counts as a call of
  *this* site, so other applied candidates (still switched on) never pollute the proof.
* In a child process (``verify e2e`` and ``verify op --capture``): :func:`write_bootstrap` writes
  a ``sitecustomize.py`` into a private folder that goes first on the child's ``PYTHONPATH``.
  Python imports it at start-up (unless run with ``-S``/``-I``); it calls :func:`child_main`,
  which reads its settings from the JSON file named by ``NPUFUSE_PROBE`` and

  - installs a meta-path finder: ``import torch_npu`` gets the real module (instrumented) when
    it is installed, else the :mod:`npufuse.emulate` stand-in (instrumented, backend
    "emulated"). Nothing is imported until the program imports torch_npu itself, so unrelated
    Python processes in the launch (shell helpers, tools) pay nothing;
  - in capture mode, wraps the target function when its module is imported and saves the first
    call's arguments (and the module instance of a method) with ``torch.save``, then exits;
  - optionally sets ``torch_npu = None`` in the candidate's module after import (a baseline for
    switches that cannot be flipped from outside: every fused site of that file is then off);
  - writes ``calls_<pid>.json`` (counters, backend, peak RSS, NPU peak memory) at exit, on
    SIGTERM, and on the first call from the site (so a run stopped early still has its proof);
  - runs a watchdog thread that kills its own process group when the npufuse runner dies
    (a SIGKILLed runner must not leave training processes behind).

Module-level imports are stdlib only: this is imported at start-up of every child Python.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

PROBE_ENV = "NPUFUSE_PROBE"


class SiteCounter:
    """Counts torch_npu calls per API, and separately those made from one site's lines."""

    def __init__(self, site_file: str | None = None, lines: tuple[int, int] | None = None) -> None:
        self.site_file = os.path.realpath(site_file) if site_file else None
        self.lines = (int(lines[0]), int(lines[1])) if lines else None
        self.calls: Counter = Counter()  # api -> all calls
        self.site_calls: Counter = Counter()  # api -> calls from the site's lines
        self._is_site_file: dict[str, bool] = {}
        self.on_first_site_call: Callable[[], None] | None = None
        # more sites, counted apart (``verify e2e --all``: one run proves which candidates ran)
        self.sites: list[tuple[str, str, int, int]] = []  # (id, realpath, first, last)
        self.by_site: Counter = Counter()  # id -> calls from that site's lines
        self._real: dict[str, str] = {}

    def add_sites(self, sites: list[dict[str, Any]]) -> None:
        for s in sites:
            self.sites.append((str(s["id"]), os.path.realpath(s["file"]), int(s["lines"][0]), int(s["lines"][1])))

    def hit(self, api: str, filename: str, lineno: int) -> None:
        self.calls[api] += 1
        if self.sites:
            real = self._real.get(filename)
            if real is None:  # realpath once per code file name, not per call
                real = self._real[filename] = os.path.realpath(filename)
            for sid, path, lo, hi in self.sites:
                if lo <= lineno <= hi and path == real:
                    self.by_site[sid] += 1
        if self.site_file is None or self.lines is None:
            return
        known = self._is_site_file.get(filename)
        if known is None:  # realpath once per code file name, not per call
            known = self._is_site_file[filename] = os.path.realpath(filename) == self.site_file
        if known and self.lines[0] <= lineno <= self.lines[1]:
            first = not self.site_calls
            self.site_calls[api] += 1
            if first and self.on_first_site_call is not None:
                self.on_first_site_call()

    @property
    def site_total(self) -> int:
        return sum(self.site_calls.values())


class LineTrace:
    """Counts executed lines of one span of one file, as a context manager around a call: the proof
    for a fused branch that calls no torch_npu API (the affinity rewrites are plain torch), where
    :class:`SiteCounter` has nothing to count. In-process only (``sys.settrace``; a tracer already
    installed, e.g. coverage, is suspended for the call and restored after)."""

    def __init__(self, file: str, lines: tuple[int, int]) -> None:
        self.file = os.path.realpath(file)
        self.lines = (int(lines[0]), int(lines[1]))
        self.hits = 0
        self._known: dict[str, bool] = {}
        self._saved: Any = None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and self.lines[0] <= frame.f_lineno <= self.lines[1]:
            self.hits += 1
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        known = self._known.get(name)
        if known is None:
            known = self._known[name] = os.path.realpath(name) == self.file
        return self._local if known else None

    def __enter__(self) -> "LineTrace":
        self._saved = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._saved)


def _counting(api: str, fn: Callable, counter: SiteCounter) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)  # the code that called torch_npu.<api>: the fused branch, we hope
        counter.hit(api, caller.f_code.co_filename, caller.f_lineno)
        return fn(*args, **kwargs)

    wrapper.__npufuse_probe__ = True  # type: ignore[attr-defined]
    return wrapper


def _counting_init(api: str, cls: type, counter: SiteCounter) -> Callable:
    init = cls.__dict__["__init__"] if "__init__" in cls.__dict__ else None
    inner = init or super(cls, cls).__init__  # type: ignore[misc]

    @functools.wraps(inner)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self) is cls:  # count the construction once, not each super().__init__
            caller = sys._getframe(1)
            counter.hit(api, caller.f_code.co_filename, caller.f_lineno)
        inner(self, *args, **kwargs)

    __init__.__npufuse_probe__ = True  # type: ignore[attr-defined]
    return __init__


def instrument(module: Any, counter: SiteCounter) -> Callable[[], None]:
    """Wrap ``module.npu_*`` functions with ``counter``, and count constructions of the
    ``module.optim.Npu*`` classes (by wrapping their ``__init__``: the classes themselves stay,
    so ``isinstance`` in user code keeps working). Returns the undo."""
    saved: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, original, owned by the class)
    for name in list(vars(module)):
        fn = getattr(module, name, None)
        if name.startswith("npu_") and callable(fn) and not isinstance(fn, type) and not getattr(fn, "__npufuse_probe__", False):
            saved.append((module, name, fn, True))
            setattr(module, name, _counting(name, fn, counter))
    optim = getattr(module, "optim", None)
    for name in list(vars(optim)) if optim is not None else []:
        cls = getattr(optim, name, None)
        if isinstance(cls, type) and name.startswith("Npu") and not getattr(cls.__dict__.get("__init__"), "__npufuse_probe__", False):
            saved.append((cls, "__init__", cls.__dict__.get("__init__"), "__init__" in cls.__dict__))
            cls.__init__ = _counting_init(f"optim.{name}", cls, counter)  # type: ignore[misc]

    def undo() -> None:
        for owner, name, original, owned in reversed(saved):
            if owned:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    return undo


# -- the child side ------------------------------------------------------------------------------

BOOTSTRAP = '''\
# npufuse verification probe (written by `npufuse verify`; a private temporary folder, safe to delete).
# It shadows the environment's own sitecustomize, which it then imports in turn.
import os as _os, sys as _sys
try:
    from npufuse.verify import probe as _npufuse_probe
except Exception as _exc:  # npufuse not importable by this interpreter: say so, never break the program
    _sys.stderr.write("npufuse probe: cannot import npufuse (%s: %s)\\n" % (type(_exc).__name__, _exc))
else:
    _npufuse_probe.child_main()
    _npufuse_probe.chain_sitecustomize(_os.path.dirname(_os.path.abspath(__file__)))
'''


def write_bootstrap(folder: Path) -> bool:
    """Write ``sitecustomize.py`` into ``folder`` with a link to the npufuse package beside it, so
    the child can import npufuse and nothing else from our environment (putting our whole
    site-packages on its path could hand a different interpreter our torch). Returns False when
    the link cannot be made; the caller then puts npufuse's parent folder on the path instead."""
    import npufuse

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(BOOTSTRAP, encoding="utf-8")
    link = folder / "npufuse"
    try:
        if not link.exists():
            link.symlink_to(Path(npufuse.__file__).resolve().parent, target_is_directory=True)
        return True
    except OSError:
        return False


def chain_sitecustomize(own_dir: str) -> None:
    """Import the sitecustomize ours shadows (a venv's or distro's), as Python would have."""
    saved_path = list(sys.path)
    mine = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != own_dir]
        try:
            importlib.import_module("sitecustomize")
        except ImportError:
            pass
        except Exception as exc:  # theirs failed: report as Python does, keep going
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
    finally:
        sys.path[:] = saved_path
        if mine is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = mine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ChildProbe:
    """The per-process state of the probe in a child (see module docstring)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg["out_dir"])
        site = cfg.get("site") or {}
        self.counter = SiteCounter(site.get("file"), tuple(site["lines"]) if site.get("lines") else None)
        self.counter.on_first_site_call = self.write
        self.counter.add_sites([x for x in cfg.get("sites") or [] if isinstance(x, dict)])
        self.backend = "none"  # set when torch_npu is imported: "emulated" | "real"
        self.emulation = None
        self._emu_cm = None
        self.watch_files = {os.path.realpath(p) for p in (cfg.get("capture", {}).get("file"), cfg.get("disable_module")) if p}
        self.watch_stems = {Path(p).stem if Path(p).name != "__init__.py" else Path(p).parent.name for p in self.watch_files}
        self.captured = False
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._writer: int | None = None  # the thread inside write(), if any
        self._term_pending = False

    # -- output
    def snapshot(self) -> dict[str, Any]:
        import resource

        data: dict[str, Any] = {
            "pid": os.getpid(),
            "backend": self.backend,
            "calls": dict(self.counter.calls),
            "site_calls": dict(self.counter.site_calls),
            "by_site": dict(self.counter.by_site),
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "notes": self.notes,
        }
        if self.emulation is not None:
            data["emulator_calls"] = dict(self.emulation.calls)  # includes optimizer classes
        site_file = self.counter.site_file
        if site_file:
            data["site_module_imported"] = any(
                getattr(m, "__file__", None) and os.path.realpath(m.__file__) == site_file for m in list(sys.modules.values())
            )
        if self.backend == "real" and "torch" in sys.modules:
            try:
                npu = getattr(sys.modules["torch"], "npu", None)
                if npu is not None and npu.is_available():
                    data["npu_max_memory_allocated"] = int(npu.max_memory_allocated())
            except Exception as exc:  # memory query is best effort
                data["npu_memory_error"] = f"{type(exc).__name__}: {exc}"
        return data

    def write(self) -> None:
        with self._lock:
            self._writer = threading.get_ident()
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                path = self.out_dir / f"calls_{os.getpid()}.json"
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.snapshot()), encoding="utf-8")
                os.replace(tmp, path)
            except Exception as exc:  # never break the user's program over the proof
                sys.stderr.write(f"npufuse probe: cannot write counters ({exc})\n")
            finally:
                self._writer = None
        if self._term_pending:
            self._die()  # SIGTERM came while this thread was writing: the counters are out now

    def error(self, message: str) -> None:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / f"error_{os.getpid()}.txt").write_text(message, encoding="utf-8")
        except OSError:
            pass
        sys.stderr.write(f"npufuse probe: {message}\n")

    # -- torch_npu
    def load_emulated(self) -> Any:
        from npufuse import emulate

        # kept installed for the life of the process: torch.device("npu") may parse (accelerate, Trainer)
        self._emu_cm = emulate.install(name_device=True)
        self.emulation = self._emu_cm.__enter__()
        self.backend = "emulated"
        instrument(self.emulation.module, self.counter)
        return self.emulation.module

    def after_real_import(self, module: Any) -> None:
        self.backend = "real"
        instrument(module, self.counter)

    # -- the watched user module
    def after_user_import(self, module: Any) -> None:
        try:
            self._after_user_import(module)
        except Exception as exc:  # the probe must never break the user's program
            self.error(f"probe hook failed on {getattr(module, '__name__', '?')}: {type(exc).__name__}: {exc}")

    def _after_user_import(self, module: Any) -> None:
        origin = os.path.realpath(getattr(module, "__file__", "") or "")
        disable = self.cfg.get("disable_module")
        if disable and origin == os.path.realpath(disable):
            module.torch_npu = None  # `_npufuse_on_npu` is then False for every site of this file
            self.notes.append(f"fused sites of {origin} disabled (torch_npu = None in the module)")
        cap = self.cfg.get("capture") or {}
        if cap and origin == os.path.realpath(cap["file"]):
            try:
                install_capture(module, cap["qualname"], self._capture_call)
            except Exception as exc:
                self.error(f"cannot hook {cap['qualname']} in {origin}: {type(exc).__name__}: {exc}")

    def _capture_call(self, is_method: bool, args: tuple, kwargs: dict) -> None:
        if self.captured:
            return
        self.captured = True
        cap = self.cfg["capture"]
        try:
            save_capture(Path(cap["out"]), is_method, args, kwargs, int(cap.get("max_bytes", 512 << 20)), cap["qualname"])
        except Exception as exc:
            self.error(f"capture of {cap['qualname']} failed: {type(exc).__name__}: {exc}")
        self.write()
        sys.stdout.flush()
        os._exit(0)  # stop the launch: npufuse has what it came for (the runner kills the rest)

    # -- lifetime
    def start(self) -> None:
        sys.meta_path.insert(0, _ProbeFinder(self))
        atexit.register(self.write)
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread (embedded interpreter): skip
            pass
        runner = self.cfg.get("runner_pid")
        if runner:
            threading.Thread(target=self._watchdog, args=(int(runner), self.cfg.get("runner_pgid")), daemon=True, name="npufuse-watchdog").start()

    def _on_term(self, signum: int, frame: Any) -> None:
        if self._writer == threading.get_ident():
            # The signal interrupted this thread's own write() (the runner stops a run as soon as
            # it has its steps, often while the program's atexit write is under way): writing
            # again here would wait forever for the lock this thread holds, until the runner's
            # SIGKILL, and leave no counters at all. Let that write finish; it ends the process.
            self._term_pending = True
            return
        self.write()
        self._die()

    @staticmethod
    def _die() -> None:
        """End the process as the SIGTERM it received would have, had the probe not caught it."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _watchdog(self, runner: int, runner_pgid: int | None) -> None:
        while True:
            time.sleep(0.5)
            if not _alive(runner):
                pgid = os.getpgrp()
                if runner_pgid is None or pgid != int(runner_pgid):  # never the runner's own group
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except OSError:
                        pass
                os._exit(137)


class _Loader(importlib.abc.Loader):
    def __init__(self, probe: ChildProbe) -> None:
        self.probe = probe

    def create_module(self, spec: Any) -> Any:
        return self.probe.load_emulated()

    def exec_module(self, module: Any) -> None:
        return None


class _ProbeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, probe: ChildProbe) -> None:
        self.probe = probe
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if self.busy:
            return None
        if fullname == "torch_npu":
            return self._torch_npu(path)
        if self.probe.watch_files and fullname.rpartition(".")[2] in self.probe.watch_stems:
            spec = self._find(fullname, path)
            if spec is not None and spec.origin and os.path.realpath(spec.origin) in self.probe.watch_files:
                self._hook(spec, self.probe.after_user_import)
                return spec
        return None

    def _find(self, fullname: str, path: Any) -> Any:
        self.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path)
                if spec is not None:
                    return spec
        finally:
            self.busy = False
        return None

    def _torch_npu(self, path: Any) -> Any:
        mode = self.probe.cfg.get("emulate", "auto")
        real = None if mode == "always" else self._find("torch_npu", path)
        if real is not None:
            self._hook(real, self.probe.after_real_import)
            return real
        if mode == "never":
            return None
        return importlib.machinery.ModuleSpec("torch_npu", _Loader(self.probe))

    @staticmethod
    def _hook(spec: Any, after: Callable[[Any], None]) -> None:
        loader = spec.loader
        inner = loader.exec_module

        def exec_module(module: Any) -> None:
            inner(module)
            after(module)

        loader.exec_module = exec_module  # instance attribute: the loader keeps its type


def install_capture(module: Any, qualname: str, record: Callable[[bool, tuple, dict], None]) -> None:
    """Wrap ``module.<qualname>`` (a function, or a method of a class) to record its first call."""
    parts = qualname.split(".")
    owner: Any = module
    for part in parts[:-1]:
        owner = getattr(owner, part)
        if not isinstance(owner, type):
            raise TypeError(f"{part} is not a class; nested functions cannot be hooked")
    name = parts[-1]
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    is_static = isinstance(raw, staticmethod)
    is_class = isinstance(raw, classmethod)
    fn = raw.__func__ if (is_static or is_class) else raw
    is_method = isinstance(owner, type) and not is_static and not is_class

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        record(is_method, args, kwargs)
        return fn(*args, **kwargs)

    new: Any = staticmethod(wrapper) if is_static else classmethod(wrapper) if is_class else wrapper
    setattr(owner, name, new)


def _simple(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)) and depth < 2:
        return all(_simple(v, depth + 1) for v in value)
    return False


def _autocast_state(torch: Any, values: list[Any]) -> dict[str, Any]:
    """Whether the call runs inside an autocast region for its tensors' device, and its dtype."""
    kind = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
    try:
        enabled = bool(torch.is_autocast_enabled(kind))
        dtype = str(torch.get_autocast_dtype(kind)).replace("torch.", "") if enabled else None
    except (TypeError, AttributeError, RuntimeError):  # an older torch: no per-device query
        return {"enabled": None, "device": kind}
    return {"enabled": enabled, "dtype": dtype, "device": kind}


def save_capture(out: Path, is_method: bool, args: tuple, kwargs: dict, max_bytes: int, qualname: str) -> None:
    """Save the call with ``torch.save``: tensors by value while under ``max_bytes`` in all (then
    by shape/dtype/mean/std), other arguments as they pickle, a method's ``self`` whole when it
    pickles, else its state_dict and simple attributes."""
    import io
    import pickle

    import torch

    budget = [max_bytes]

    def pack(obj: Any, depth: int = 0) -> Any:
        if isinstance(obj, torch.Tensor):
            size = obj.numel() * obj.element_size()
            entry: dict[str, Any] = {"__npufuse_tensor__": True, "shape": list(obj.shape), "dtype": str(obj.dtype).replace("torch.", ""), "requires_grad": bool(obj.requires_grad), "device": str(obj.device)}
            if size <= budget[0]:
                budget[0] -= size
                entry["value"] = obj.detach().cpu().clone()
            elif obj.is_floating_point() and obj.numel():
                f = obj.detach().float()
                entry["mean"], entry["std"] = float(f.mean()), float(f.std()) if obj.numel() > 1 else 0.0
            return entry
        if isinstance(obj, (list, tuple)) and depth < 4:
            packed = [pack(o, depth + 1) for o in obj]
            return {"__npufuse_seq__": type(obj).__name__, "items": packed}
        if isinstance(obj, dict) and depth < 4:
            return {"__npufuse_dict__": True, "items": {k: pack(v, depth + 1) for k, v in obj.items()}}
        try:
            pickle.dumps(obj)
            return obj
        except Exception:
            return {"__npufuse_unpicklable__": f"{type(obj).__module__}.{type(obj).__qualname__}"}

    call_args = args[1:] if is_method else args
    payload: dict[str, Any] = {
        "version": 1,
        "qualname": qualname,
        "is_method": is_method,
        "args": [pack(a) for a in call_args],
        "kwargs": {k: pack(v) for k, v in kwargs.items()},
        "grad_enabled": torch.is_grad_enabled(),
        "autocast": _autocast_state(torch, list(call_args) + list(kwargs.values())),
    }
    if is_method:
        obj = args[0]
        payload["self_class"] = f"{type(obj).__module__}:{type(obj).__qualname__}"
        payload["training"] = getattr(obj, "training", None)
        try:
            buf = io.BytesIO()
            torch.save(obj, buf)
            payload["self_pickle"] = buf.getvalue()
        except Exception as exc:
            payload["self_pickle_error"] = f"{type(exc).__name__}: {exc}"
            if isinstance(obj, torch.nn.Module):
                payload["self_state"] = {k: v.detach().cpu().clone() for k, v in obj.state_dict().items()}
            payload["self_attrs"] = {k: v for k, v in vars(obj).items() if not k.startswith("_") and _simple(v)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, out)


def child_main() -> None:
    """Entry point of the bootstrap: start the probe if ``NPUFUSE_PROBE`` names a settings file."""
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        sys.stderr.write(f"npufuse probe: cannot read {path} ({exc})\n")
        return
    ChildProbe(cfg).start()
    if isinstance(cfg.get("trace"), dict):  # `npufuse trace`: record the run (see npufuse.trace.recorder)
        from npufuse.trace.recorder import start as start_trace

        start_trace(cfg["trace"])


def read_counters(out_dir: Path) -> dict[str, Any]:
    """Sum the ``calls_<pid>.json`` files of one run: calls, site calls, backend, peak memory."""
    total: dict[str, Any] = {"processes": 0, "backend": "none", "calls": Counter(), "site_calls": Counter(), "by_site": Counter(), "emulator_calls": Counter(), "maxrss_bytes": None, "npu_max_memory_allocated": None, "site_module_imported": False, "errors": [], "notes": []}
    backends = set()
    for f in sorted(Path(out_dir).glob("calls_*.json")):
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        total["processes"] += 1
        if d.get("backend") and d["backend"] != "none":
            backends.add(d["backend"])
        total["calls"].update(d.get("calls", {}))
        total["site_calls"].update(d.get("site_calls", {}))
        total["by_site"].update({str(k): int(v) for k, v in (d.get("by_site") or {}).items() if isinstance(v, int)})
        total["emulator_calls"].update(d.get("emulator_calls", {}))
        total["site_module_imported"] = total["site_module_imported"] or bool(d.get("site_module_imported"))
        total["notes"] += [n for n in d.get("notes", []) if n not in total["notes"]]
        for key in ("maxrss_bytes", "npu_max_memory_allocated"):
            if d.get(key) is not None:
                total[key] = max(total[key] or 0, int(d[key]))
    for f in sorted(Path(out_dir).glob("error_*.txt")):
        try:
            total["errors"].append(f.read_text(encoding="utf-8").strip())
        except OSError:
            pass
    total["backend"] = "+".join(sorted(backends)) if backends else "none"
    for key in ("calls", "site_calls", "by_site", "emulator_calls"):
        total[key] = dict(total[key])
    return total
