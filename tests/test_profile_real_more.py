"""More of the profile stage on real Ascend profiler output (../shared/fixtures/real_profiles): the
msprof-analyze inputs, affinity evidence, Add + RmsNorm, rows missing a field, rendering.
The AlexNet acceptance (communication, optimizer, Level0, per-rank times) is tests/test_profile_real.py.

Expected findings were written from reading the files, before running npufuse on them:
* AlexNet DDP (2 ranks, one step): most of the step waits on hcom_allReduce. step_trace_time.csv's
  own "Communication(Not Overlapped)" / "Stage" is 70% (rank 0) and 81% (rank 1) at Level0 — the
  exposed communication npufuse measures from the kernels must agree with it; the optimizer is SGD
  (foreach kernels ForeachAddList / ForeachMulScalar; trace span "Optimizer.step#SGD.step").
* Level0 (torch_npu's default) writes Type = N/A and no Stream ID: types come from the names
  (aclnnMuls_MulAiCore_Mul -> Mul, trans_TransData_0 -> TransData, Conv2D1 -> Conv2D).
* The stacks of mp.spawn workers end in "<string>(1): <module>": never a location.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.profile.analysis import analyze
from npufuse.profile.readers import _type_from_name
from npufuse.profile.trace import location_frame, parse_stack

REAL = Path(__file__).parents[1].parent / "shared" / "fixtures" / "real_profiles"
ALEX = REAL / "msinsight_alexnet"
MSPROF = REAL / "msprof_analyze" / "test" / "ut" / "advisor"
pytestmark = pytest.mark.skipif(not ALEX.is_dir(), reason="shared real_profiles fixtures not present")
LEVELS = ("level0", "level1", "level2")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {lv: analyze([str(ALEX / lv)]) for lv in LEVELS}


def _all_inputs() -> list[Path]:
    return [ALEX / lv for lv in LEVELS] + [
        MSPROF / "advisor_backend" / "compute_advice" / "kernel_details.csv",
        MSPROF / "compute_advice" / "data" / "kernel_details.csv",
        MSPROF / "timeline_advice" / "trace_view.json"]


@pytest.mark.parametrize("path", _all_inputs(), ids=lambda p: p.parent.name + "/" + p.name)
def test_no_share_or_gap_exceeds_the_step(path: Path) -> None:
    r = analyze([str(path)])
    assert r["usable"]
    shares = [it["share"] for key in ("fusions", "unmapped") for it in r[key]]
    shares += [it["share"] for lst in r["sequences"].values() for it in lst]
    assert all(0.0 <= s <= 1.0 for s in shares), max(shares)
    g = r["gaps"]
    for k in ("host_bound_share", "wait_share", "communication_wait_share"):
        assert 0.0 <= g.get(k, 0.0) <= 1.0
    if r["communication"]:
        assert 0.0 <= r["communication"]["exposed_share"] <= 1.0


def test_gpt_style_step_separates_its_collectives() -> None:
    r = analyze([str(MSPROF / "advisor_backend" / "compute_advice" / "kernel_details.csv")])
    assert {"hcom_broadcast_", "hcom_allReduce_", "hcom_allGather_", "hcom_reduceScatter_"} <= set(r["communication"]["per_rank"][0]["by_type"])
    assert any(f["pattern"] == "add_layer_norm" for f in r["fusions"])   # Add > LayerNormV3


@pytest.mark.parametrize("name, expected", [
    ("aclnnMuls_MulAiCore_Mul", "Mul"), ("trans_TransData_17", "TransData"), ("trans_Cast_7", "Cast"),
    ("Conv2D1", "Conv2D"), ("ReduceSum7", "ReduceSum"), ("Conv2DBackpropFilter6_MemSet", "MemSet"),
    ("aclnnMm_MatMulCommon_MatMulV2", "MatMulV2"), ("MatMulV3", "MatMulV3"), ("Conv3D", "Conv3D"),
    ("hcom_allReduce__868_0_1", "hcom_allReduce_"), ("42", "42"),   # Level1 writes Type hcom_allReduce_
])
def test_type_from_kernel_name(name: str, expected: str) -> None:
    assert _type_from_name(name) == expected


def test_trace_only_lanes_never_become_numeric_tokens() -> None:
    r = analyze([str(MSPROF / "timeline_advice" / "trace_view.json")])
    kernels = {k for lst in r["sequences"].values() for it in lst for k in it["kernels"]}
    assert kernels and not any(k.isdigit() for k in kernels)


def test_stack_order_is_read_from_its_ends() -> None:
    real = "/x/site-packages/torch/_utils.py(180): _rebuild_tensor;\r\n/h/main.py(366): train;\r\n<string>(1): <module>"
    frames = parse_stack(real)
    assert frames[0].file == "<string>" and frames[-1].func == "_rebuild_tensor"   # outermost first
    assert location_frame(frames).file == "/h/main.py"
    written_outer_first = "/w/train.py(120): <module>;/w/train.py(88): train_step;/w/model.py(9): forward"
    assert parse_stack(written_outer_first)[-1].func == "forward"


def test_add_then_fused_rms_norm_is_npu_add_rms_norm(tmp_path: Path) -> None:
    head = ("Step Id,Stream ID,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),"
            "Input Shapes,Input Data Types,Output Shapes,Output Data Types\n")
    rows = []
    t = 100.0
    for _ in range(3):
        rows.append(f'1,2,aclnnAdd_AddAiCore_Add,Add,AI_VECTOR_CORE,{t},5,0,"""4,128,1024;4,128,1024""",DT_BF16;DT_BF16,"""4,128,1024""",DT_BF16')
        rows.append(f'1,2,aclnnRmsNorm_RmsNorm_RmsNorm,RmsNorm,AI_VECTOR_CORE,{t + 6},6,0,"""4,128,1024;1024""",DT_BF16;DT_BF16,"""4,128,1024;4,128,1""",DT_BF16;FLOAT')
        rows.append(f'1,2,aclnnMm_MatMul_MatMulV2,MatMulV2,AI_CORE,{t + 13},30,0,"""512,1024;1024,1024""",DT_BF16;DT_BF16,"""512,1024""",DT_BF16')
        t += 50
    p = tmp_path / "kernel_details.csv"
    p.write_text(head + "\n".join(rows) + "\n")
    r = analyze([str(p)])
    found = [f for f in r["fusions"] if f["pattern"] == "add_rms_norm"]
    assert found and found[0]["api"] == "torch_npu.npu_add_rms_norm" and found[0]["count"] == 3


def test_profile_markdown_shows_communication(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "p.md"
    assert main(["profile", str(ALEX / "level1"), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "communication" in text.lower() and "exposed" in text.lower()
    json.dumps(analyze([str(ALEX / "level1")]), default=str)   # the result stays plain data


def _csv(tmp_path: Path, rows: list[str]) -> str:
    head = ("Step Id,Stream ID,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),"
            "Input Shapes,Input Data Types,Output Shapes,Output Data Types\n")
    body = []
    t = 100.0
    for _ in range(3):
        for r in rows:
            typ, ins, idt, outs, odt = r.split("|")
            body.append(f'1,2,{typ}_k,{typ},AI_VECTOR_CORE,{t},5,0,"""{ins}""",{idt},"""{outs}""",{odt}')
            t += 6
        body.append(f'1,2,mm,MatMulV2,AI_CORE,{t},30,0,"""8,8;8,8""",FLOAT;FLOAT,"""8,8""",FLOAT')
        t += 40
    p = tmp_path / "kernel_details.csv"
    p.write_text(head + "\n".join(body) + "\n")
    return str(p)


@pytest.mark.parametrize("rows, found", [
    # a + b * c * v: each kernel reads what the one before wrote
    (["Mul|64,128;64,128|FLOAT;FLOAT|64,128|FLOAT", "Muls|64,128|FLOAT|64,128|FLOAT",
      "Add|64,128;64,128|FLOAT;FLOAT|64,128|FLOAT"], True),
    # three unrelated scalar multiplications and an add of other shapes (AlexNet's Level1 step)
    (["Mul|1;1|FLOAT;FLOAT|1|FLOAT", "Mul|7,7|FLOAT|7,7|FLOAT", "Add|3;3|FLOAT;FLOAT|3|FLOAT"], False),
    # index arithmetic in INT64
    (["Mul|64;64|INT64;INT64|64|INT64", "Mul|64|INT64|64|INT64", "Add|64;64|INT64;INT64|64|INT64"], False),
])
def test_affinity_addcmul_needs_dataflow_evidence(tmp_path: Path, rows: list[str], found: bool) -> None:
    r = analyze([_csv(tmp_path, rows)])
    assert any(f["pattern"] == "affinity_addcmul" for f in r["fusions"]) is found


@pytest.mark.parametrize("dtypes, found", [("FLOAT;BOOL;FLOAT", True), ("FLOAT;INT64;FLOAT", False)])
def test_affinity_index_put_needs_a_boolean_mask(tmp_path: Path, dtypes: str, found: bool) -> None:
    r = analyze([_csv(tmp_path, [f"IndexPutV2|64,128;64,128;1|{dtypes}|64,128|FLOAT"])])
    assert any(f["pattern"] == "affinity_index_put" for f in r["fusions"]) is found


def test_level0_claims_no_affinity_without_shapes(results: dict) -> None:
    assert not any(f["pattern"].startswith("affinity_") for f in results["level0"]["fusions"])


@pytest.mark.parametrize("reader", ["auto", "csv"])
def test_a_row_missing_a_middle_field_is_named_never_read_shifted(tmp_path: Path, reader: str) -> None:
    from npufuse.profile.readers import read_kernel_details

    p = tmp_path / "kernel_details.csv"
    p.write_text("Step Id,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),Block Dim\n"
                 "50,a_Mul,N/A,N/A,100,5,0,0\n"
                 "50,b_Add,N/A,100,7,0,0\n"          # Accelerator Core left out: 7 fields
                 "50,c_Mul,N/A,N/A,120,5,0,0\n")
    table, problems = read_kernel_details(p, backend=reader)
    assert table is not None and table.n == 2
    assert list(table.dur) == [5.0, 5.0]               # never 7 (b's start) or 100
    assert any(pr.row == 3 for pr in problems), problems   # named, with the row


def test_markdown_escapes_profiler_text_and_terminal_fits_100_columns(tmp_path: Path) -> None:
    from rich.console import Console

    from npufuse.profile.render import _md_row, render_terminal

    assert _md_row(["<string>:1 <module>", "a|b"]) == "| &lt;string>:1 &lt;module> | a\\|b |"
    con = Console(width=100, record=True, file=open(tmp_path / "out.txt", "w"))
    render_terminal(analyze([str(ALEX / "level1")]), con)
    assert all(len(line) <= 100 for line in con.export_text().splitlines())


def test_sixty_thousand_kernel_types_and_a_huge_shape_cell(tmp_path: Path) -> None:
    """Issue 19.8: more kernel types than the match string's first code-point block holds (they
    reached the surrogates and crashed the decode), and n-gram keys beyond a bincount (3.6e9)."""
    p = tmp_path / "kernel_details.csv"
    with open(p, "w") as f:
        f.write("Type,Duration(us),Start Time(us),Input Shapes\n")
        for i in range(60000):
            f.write(f'K{i},1.0,{2 * i},"""4,4"""\n')
        f.write('Mul,1,120000,"""%s"""\n' % ";".join(["1,2,3,4"] * 250000))   # a 2 MB shape cell
    r = analyze([str(p)])
    assert r["usable"] and r["inputs"][0]["ops"] == 60001
    json.dumps(r)
