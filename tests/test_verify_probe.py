"""The probe: per-site call attribution, the capture hook, and the child bootstrap."""

from __future__ import annotations

import json
import subprocess
import textwrap
import types
from pathlib import Path

from test_verify_helpers import PY

from npufuse.verify import probe, runner


def test_site_counter_attributes_calls_by_caller_line(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def site(api):\n    return api(1)\n\n\ndef elsewhere(api):\n    return api(2)\n")
    ns: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)

    class NpuFusedAdamW:
        def __init__(self, lr: float) -> None:
            self.lr = lr

    optim = types.SimpleNamespace(NpuFusedAdamW=NpuFusedAdamW)
    fake = types.SimpleNamespace(npu_op=lambda x: x * 10, optim=optim)
    counter = probe.SiteCounter(str(src), (1, 2))
    undo = probe.instrument(fake, counter)
    assert ns["site"](fake.npu_op) == 10 and ns["elsewhere"](fake.npu_op) == 20
    assert counter.calls == {"npu_op": 2} and counter.site_calls == {"npu_op": 1}
    # optimizer classes: constructions counted from the caller's line, the class itself kept
    opt = ns["site"](optim.NpuFusedAdamW)
    assert isinstance(opt, NpuFusedAdamW) and opt.lr == 1 and counter.site_calls["optim.NpuFusedAdamW"] == 1
    undo()
    assert not hasattr(fake.npu_op, "__npufuse_probe__") and not hasattr(NpuFusedAdamW.__init__, "__npufuse_probe__")


def test_install_capture_function_method_staticmethod() -> None:
    mod = types.ModuleType("m")
    exec(textwrap.dedent("""
        def f(a, b=2):
            return a + b
        class C:
            def m(self, x):
                return x * 2
            @staticmethod
            def s(x):
                return x - 1
    """), mod.__dict__)  # fmt: skip
    seen = []
    for q in ("f", "C.m", "C.s"):
        probe.install_capture(mod, q, lambda is_method, args, kwargs: seen.append((is_method, len(args), kwargs)))
    assert mod.f(1, b=3) == 4 and mod.C().m(5) == 10 and mod.C.s(5) == 4
    assert seen == [(False, 1, {"b": 3}), (True, 2, {}), (False, 1, {})]


def test_bootstrap_loads_probe_and_chains_existing_sitecustomize(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_LOADED'] = '1'\n")
    out = tmp_path / "counters"
    cfg = tmp_path / "probe.json"
    cfg.write_text(json.dumps({"mode": "e2e", "out_dir": str(out), "emulate": "never"}))
    env = runner.child_env({"PYTHONPATH": str(theirs)}, cfg, tmp_path / "site")
    code = "import os, sys; print(os.environ.get('THEIRS_LOADED'), any(type(f).__name__ == '_ProbeFinder' for f in sys.meta_path))"
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["1", "True"], res.stderr
    counters = probe.read_counters(out)  # written at exit
    assert counters["processes"] == 1 and counters["backend"] == "none" and counters["maxrss_bytes"] > 0
    # the bootstrap links only the npufuse package, not our whole site-packages
    assert (tmp_path / "site" / "npufuse").is_symlink() and str(Path(probe.__file__).resolve().parents[1]) not in env["PYTHONPATH"]


def test_sigterm_during_the_exit_write_still_leaves_the_counters(tmp_path: Path) -> None:
    """The runner stops a run (SIGTERM) as soon as it has its steps, which is often while the
    child's probe is writing its counters at exit. The handler must let that write finish and
    then end the process: writing again from the handler waited for the lock its own thread
    held, until the runner's SIGKILL, and left no counters ("the probe did not load"). Here the
    signal is raised from inside the write, so the race is certain."""
    out = tmp_path / "counters"
    cfg = tmp_path / "probe.json"
    cfg.write_text(json.dumps({"mode": "e2e", "out_dir": str(out), "emulate": "never"}))
    env = runner.child_env({}, cfg, tmp_path / "site")
    code = textwrap.dedent("""
        import os, signal
        from npufuse.verify import probe
        real = probe.ChildProbe.snapshot
        def snapshot(self):
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, inside write()
            return real(self)
        probe.ChildProbe.snapshot = snapshot
        print("done", flush=True)
    """)
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=30)  # the old handler hung here
    assert res.stdout.strip() == "done", res.stderr
    assert res.returncode == -15, res.stderr  # ended by the SIGTERM, as without the probe
    counters = probe.read_counters(out)
    assert counters["processes"] == 1 and counters["maxrss_bytes"] > 0


def test_sigterm_outside_a_write_writes_then_ends_the_process(tmp_path: Path) -> None:
    out = tmp_path / "counters"
    cfg = tmp_path / "probe.json"
    cfg.write_text(json.dumps({"mode": "e2e", "out_dir": str(out), "emulate": "never"}))
    env = runner.child_env({}, cfg, tmp_path / "site")
    code = "import os, signal, time\nprint('up', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\nprint('not reached')"
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["up"] and res.returncode == -15, res.stderr
    assert probe.read_counters(out)["processes"] == 1
