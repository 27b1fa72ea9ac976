"""Reader tolerance: column variants, bare CSV, several ranks, readers agree, malformed input."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.profile.analysis import Options, analyze
from npufuse.profile.readers import discover, read_kernel_details

SHARED = Path(__file__).parents[1].parent / "shared"
GEN = SHARED / "tools" / "gen_ascend_profile.py"
LLAMA = SHARED / "fixtures" / "ascend_profile" / "llama_like"

pytestmark = pytest.mark.skipif(not GEN.is_file(), reason="shared generator not present")
HAS_POLARS = __import__("importlib").util.find_spec("polars") is not None


def _gen(out: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, str(GEN), "--out", str(out), "--steps", "1", "--layers", "2", *extra],
                   check=True, stdout=subprocess.DEVNULL)
    return next(out.glob("*_ascend_pt"))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _gen(tmp_path_factory.mktemp("gen"))


def _kd(d: Path) -> Path:
    return d / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"


def _rewrite(src: Path, dst: Path, rename: dict[str, str] | None = None, drop=lambda h: False) -> Path:
    with open(src, newline="", encoding="utf-8") as fp:
        rows = list(csv.reader(fp))
    keep = [k for k, h in enumerate(rows[0]) if not drop(h)]
    with open(dst, "w", newline="", encoding="utf-8") as fp:
        w = csv.writer(fp)
        w.writerow([(rename or {}).get(rows[0][k], rows[0][k]) for k in keep])
        for r in rows[1:]:
            w.writerow([r[k] for k in keep])
    return dst


def _patterns(r: dict) -> set[str]:
    return {f["pattern"] for f in r["fusions"]}


def test_bare_csv_without_stacks_says_module_unconfirmed(small: Path) -> None:
    r = analyze([str(_kd(small))], Options(backend="csv"))
    assert r["usable"] and not r["module_confirmed"]
    assert "could not be confirmed" in r["module_note"]
    assert {"rms_norm", "add_rms_norm", "rope", "attention", "swiglu", "add_layer_norm", "fast_gelu",
            "fused_optimizer"} <= _patterns(r)
    assert all(f["location"] is None and not f["module_confirmed"] for f in r["fusions"])
    opt = next(f for f in r["fusions"] if f["pattern"] == "fused_optimizer")
    assert "foreach" in opt["note"]                       # found by kernel names, no trace span


def test_column_variants(small: Path, tmp_path: Path) -> None:
    base = analyze([str(_kd(small))], Options(backend="csv"))
    variant = _rewrite(_kd(small), tmp_path / "kernel_details.csv",
                       rename={"Type": "OP Type", "Duration(us)": "Task Duration(us)",
                               "Start Time(us)": "Task Start Time(us)", "Stream ID": "Stream Id"},
                       drop=lambda h: h == "Step Id" or h.startswith(("aic_", "aiv_")))
    r = analyze([str(variant)], Options(backend="csv"))
    cols = r["inputs"][0]["files"]["kernel_details.csv"]["columns"]
    assert cols["used"]["type"] == "OP Type" and cols["used"]["duration"] == "Task Duration(us)"
    assert cols["ignored_metric_columns"] == 0 and "step" not in cols["used"]
    assert any("Step Id" in n for n in r["inputs"][0]["files"]["kernel_details.csv"]["notes"])
    assert _patterns(r) == _patterns(base)


def test_type_column_missing_falls_back_to_kernel_name(small: Path, tmp_path: Path) -> None:
    variant = _rewrite(_kd(small), tmp_path / "kernel_details.csv", drop=lambda h: h == "Type")
    r = analyze([str(variant)], Options(backend="csv"))
    assert {"rms_norm", "rope", "attention"} <= _patterns(r)


@pytest.mark.skipif(not HAS_POLARS, reason="polars not installed")
def test_polars_and_csv_readers_agree(small: Path) -> None:
    a, _ = read_kernel_details(_kd(small), backend="csv")
    b, _ = read_kernel_details(_kd(small), backend="polars")
    assert a is not None and b is not None and b.backend == "polars"
    assert a.n == b.n
    assert [a.types[c] for c in a.type_code] == [b.types[c] for c in b.type_code]
    assert (a.dur == b.dur).all() and (a.start == b.start).all() and (a.step == b.step).all()
    assert [a.shape_keys[c] for c in a.shape_code] == [b.shape_keys[c] for c in b.shape_code]
    ra = analyze([str(small)], Options(backend="csv"))
    rb = analyze([str(small)], Options(backend="polars"))
    strip = lambda r: [(f["pattern"], f["count"], f["time_us"]) for f in r["fusions"]]  # noqa: E731
    assert strip(ra) == strip(rb)


def test_several_ranks(small: Path, tmp_path: Path) -> None:
    for rank in (0, 1):
        d = tmp_path / "run" / f"host_{rank}_ascend_pt"
        shutil.copytree(small, d)
        info = json.loads((d / "profiler_info_0.json").read_text())
        info["rank_id"] = rank
        (d / "profiler_info_0.json").unlink()
        (d / f"profiler_info_{rank}.json").write_text(json.dumps(info))
    sources, probs = discover([str(tmp_path / "run")])
    assert not probs and sorted(s.rank for s in sources) == [0, 1]
    one = analyze([str(small)])
    two = analyze([str(tmp_path / "run")])
    assert two["totals"]["ranks"] == 2
    f1 = {(f["pattern"], tuple(f["kernels"]), json.dumps(f["location"])): f for f in one["fusions"]}
    for f in two["fusions"]:
        key = (f["pattern"], tuple(f["kernels"]), json.dumps(f["location"]))
        assert f["ranks"] == [0, 1] and f["count"] == 2 * f1[key]["count"]
        assert f["share"] == pytest.approx(f1[key]["share"], rel=1e-3)


def test_no_stack_trace_and_any_subset(small: Path, tmp_path: Path) -> None:
    d = _gen(tmp_path / "ns", "--no-stack")
    r = analyze([str(d)])
    assert "rope" in _patterns(r) and not r["module_confirmed"]
    # trace_view.json alone: device kernels from the "Ascend Hardware" lane, stacks from the ops
    only = tmp_path / "only" / "ASCEND_PROFILER_OUTPUT"
    only.mkdir(parents=True)
    shutil.copy(small / "ASCEND_PROFILER_OUTPUT" / "trace_view.json", only)
    r = analyze([str(only.parent)])
    assert r["usable"] and r["module_confirmed"]
    assert {"rms_norm", "rope", "attention", "swiglu"} <= _patterns(r)


# ------------------------------------------------------------------------------ bad input

def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_path_and_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file" in _err(capsys, ["profile", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "no Ascend profiler output" in _err(capsys, ["profile", str(tmp_path / "empty")])


def test_empty_csv_and_unknown_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    e = tmp_path / "kernel_details.csv"
    e.write_text("")
    assert "empty file" in _err(capsys, ["profile", str(e)])
    e.write_text("a,b,c\n1,2,3\n")
    err = _err(capsys, ["profile", str(e)])
    assert "no known kernel columns" in err and "kernel_details.csv" in err


def test_bad_rows_are_named_and_the_rest_is_read(small: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = _kd(small).read_text(encoding="utf-8").splitlines(keepends=True)
    header = next(csv.reader([lines[0]]))
    col = header.index("Duration(us)")
    row = next(csv.reader([lines[5]]))
    row[col] = "abc"
    import io
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(row)
    lines[5] = buf.getvalue()
    bad = tmp_path / "kernel_details.csv"
    bad.write_text("".join(lines[:-1]) + lines[-1][:25], encoding="utf-8")   # last row truncated
    for backend in (["csv", "polars"] if HAS_POLARS else ["csv"]):
        r = analyze([str(bad)], Options(backend=backend))
        msgs = [(p["row"], p["column"], p["message"]) for p in r["problems"]]
        assert (6, "Duration(us)", "'abc' is not a number; row skipped") in msgs, msgs
        assert any("truncated" in m or "not a number" in m for row_, _, m in msgs if row_ == len(lines)), msgs
        assert r["inputs"][0]["ops"] == len(lines) - 3
        assert "rope" in _patterns(r)
    assert main(["profile", str(bad), "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert "row 6, column 'Duration(us)'" in cap.err
    json.loads(cap.out)


def test_trace_not_json(small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "r" / "ASCEND_PROFILER_OUTPUT"
    d.mkdir(parents=True)
    shutil.copy(_kd(small), d)
    (d / "trace_view.json").write_text('[{"ph": "X", "name": ')
    assert main(["profile", str(d.parent), "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert "trace_view.json" in cap.err and "not valid JSON" in cap.err and "line 1" in cap.err
    assert json.loads(cap.out)["fusions"]            # the CSV was still read
    # only a broken trace: nothing usable -> exit 2 with the reason
    (d / "kernel_details.csv").unlink()
    assert "not valid JSON" in _err(capsys, ["profile", str(d.parent)])


def test_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--peak-bw" in _err(capsys, ["profile", str(LLAMA), "--peak-bw", "-1"])
    assert "knowledge base" in _err(capsys, ["profile", str(LLAMA), "--kb", "/nonexistent.yaml"])


def test_custom_knowledge_base(tmp_path: Path) -> None:
    kb = tmp_path / "kb.yaml"
    kb.write_text("patterns:\n  - id: neg_cat\n    api: my.fused\n    kernels: 'Neg - ConcatD'\n"
                  "  - id: broken\n    api: x\n    kernels: 'A(B'\n")
    r = analyze([str(LLAMA)], Options(kb_path=kb))
    assert _patterns(r) == {"neg_cat"}
    assert any("broken" in p["message"] for p in r["problems"])
