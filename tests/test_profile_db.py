"""Issue 18 item 11: the sqlite export (ascend_pytorch_profiler*.db) read as real exports lay it out.

Fixtures: tests/fixtures/profiler_db (see its SOURCES.md): two real AlexNet DDP exports (rank 0,
Level0 and Level1) from Ascend/msinsight's published test data, trimmed to the tables npufuse reads.
What they hold, read with plain SQL before running npufuse:
- 187 COMPUTE_TASK_INFO rows joined to TASK (ns times), 4 COMMUNICATION_OP rows (opName ids ->
  hcom_allReduce__576_{0..3}_1 at Level0), whose 296 COMMUNICATION_TASK_INFO tasks run on stream 4;
  compute runs on streams 2 and 3. STEP_TIME holds step 50.
- Level0: opType and the shape columns point at the string "N/A"; Level1 writes them
  (Conv2D1 -> Conv2D, "32,1,224,224,8;121,4,16,8;64").
- The optimizer is SGD with foreach kernels (ForeachAddList, ForeachMulScalar).
- The collectives cover ~90 ms of a ~120 ms kernel span: about three quarters of the step.

The equivalence test builds a DB from the real text export's kernel_details.csv with the CREATE
TABLE statements read from the real DB fixture (not typed by hand), and expects the same findings.
"""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from decimal import Decimal
from pathlib import Path

import pytest

from npufuse.profile.analysis import analyze
from npufuse.profile.profiler_db import read_profiler_db

FIX = Path(__file__).resolve().parent / "fixtures" / "profiler_db"
REAL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "real_profiles" / "msinsight_alexnet"


def _db(level: int) -> Path:
    return FIX / f"level{level}" / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db"


def _sql(level: int, q: str) -> list[tuple]:
    # immutable: no -shm/-wal files beside the fixture, whatever its journal mode
    con = sqlite3.connect(f"file:{_db(level)}?mode=ro&immutable=1", uri=True)
    try:
        return con.execute(q).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("level", [0, 1])
def test_real_db_kernels_types_and_streams(level: int) -> None:
    table, problems = read_profiler_db(_db(level))
    assert table is not None and not problems
    assert table.n == 187 + 4
    n_compute = _sql(level, "SELECT COUNT(*) FROM COMPUTE_TASK_INFO c JOIN TASK t USING (globalTaskId)")[0][0]
    assert n_compute == 187
    types = [table.types[c] for c in table.type_code.tolist()]
    names = [table.names[c] for c in table.name_code.tolist()]
    assert "N/A" not in types and not any(t.isdigit() for t in types)
    # types derived from names at Level0 are those Level1 writes for the same names
    assert types[names.index("Conv2D1")] == "Conv2D"
    assert types[names.index("trans_TransData_0")] == "TransData"
    assert {"ForeachAddList", "ForeachMulScalar", "MatMulV2"} <= set(types)
    # times: ns integers in the DB, us here, in start order
    first_ns = _sql(level, "SELECT MIN(startNs) FROM TASK t JOIN COMPUTE_TASK_INFO c USING (globalTaskId)")[0][0]
    # epoch times in us as float64 are 0.25 us apart (kernel_details.csv's values are the same floats)
    assert table.start[0] == pytest.approx(first_ns / 1000.0, abs=0.25)
    assert (table.dur >= 0).all() and (table.start[1:] >= table.start[:-1]).all()
    # collectives on their HCCL stream (from COMMUNICATION_TASK_INFO), compute on its own streams
    comm = [i for i, t in enumerate(types) if t.startswith("hcom_")]
    assert len(comm) == 4 and {int(table.stream[i]) for i in comm} == {4}
    assert {int(s) for i, s in enumerate(table.stream.tolist()) if i not in comm} <= {2, 3}
    assert set(table.step.tolist()) == {50}
    keys = {table.shape_keys[c] for c in table.shape_code.tolist()}
    if level == 0:
        assert keys == {("", "", "", "")}    # "N/A" is no shape
    else:
        assert ('"32,1,224,224,8;121,4,16,8;64"', "FLOAT;FLOAT;FLOAT", '"32,8,55,55,8"', "FLOAT") in keys


@pytest.mark.parametrize("level", [0, 1])
def test_real_db_findings(level: int) -> None:
    r = analyze([str(FIX / f"level{level}")])
    assert r["usable"] and not r["problems"]
    assert r["inputs"][0]["files"]["profiler.db"]["rows"] == 191
    opt = [f for f in r["fusions"] if f["pattern"] == "fused_optimizer"]
    # the foreach SGD kernels; which optimizer class it is needs the host side (trace_view.json's
    # "Optimizer.step#SGD.step"; the DB's PYTORCH_API is not read), so the API stays generic
    assert opt and opt[0]["kernels"] == ["ForeachAddList", "ForeachMulScalar"]
    assert opt[0]["api"].startswith("torch_npu.optim.NpuFused")
    c = r["communication"]
    assert c["kernels"] == 4 and list(c["per_rank"][0]["by_type"]) == ["hcom_allReduce_"]
    # the collectives' cover, from the DB with plain SQL (they do not overlap each other here)
    spans = _sql(level, "SELECT startNs, endNs FROM COMMUNICATION_OP ORDER BY startNs")
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # each span is a difference of two epoch floats (0.25 us apart each)
    assert c["time_us"] == pytest.approx(sum(e - s for s, e in spans) / 1000.0, abs=0.5 * len(spans))
    assert 0.65 <= c["share"] <= 0.85
    mined = [f["kernels"] for f in r["fusions"]] + [s["kernels"] for s in r["sequences"]["by_time"]]
    assert mined and not any(k.startswith("hcom") for ks in mined for k in ks)
    t = r["totals"]["per_rank"][0]
    compute_us = _sql(level, "SELECT SUM(endNs - startNs) FROM TASK t JOIN COMPUTE_TASK_INFO c "
                             "USING (globalTaskId)")[0][0] / 1000.0
    assert t["device_time_us"] == pytest.approx(compute_us, abs=0.01)


def _broken_copy(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    p = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db"
    p.parent.mkdir(parents=True)
    shutil.copy(_db(1), p)
    con = sqlite3.connect(p)
    gids = [g for (g,) in con.execute("SELECT globalTaskId FROM COMPUTE_TASK_INFO ORDER BY globalTaskId")]
    picked = {"name": gids[10], "endNs": gids[20], "opType": gids[30]}
    rowid = {k: con.execute("SELECT rowid FROM COMPUTE_TASK_INFO WHERE globalTaskId = ?", (g,)).fetchone()[0]
             for k, g in picked.items()}
    task_rowid = con.execute("SELECT rowid FROM TASK WHERE globalTaskId = ?", (picked["endNs"],)).fetchone()[0]
    con.execute("UPDATE COMPUTE_TASK_INFO SET name = NULL WHERE globalTaskId = ?", (picked["name"],))
    con.execute("UPDATE TASK SET endNs = NULL WHERE globalTaskId = ?", (picked["endNs"],))
    con.execute("UPDATE COMPUTE_TASK_INFO SET opType = 99999999 WHERE globalTaskId = ?", (picked["opType"],))
    con.commit()
    con.close()
    return p, {"name": rowid["name"], "endNs": task_rowid, "opType": rowid["opType"],
               **{f"gid_{k}": g for k, g in picked.items()}}


def test_a_row_missing_a_middle_field_is_named_never_read_shifted(tmp_path: Path) -> None:
    good, _ = read_profiler_db(_db(1))
    p, at = _broken_copy(tmp_path)
    table, problems = read_profiler_db(p)
    assert table is not None and good is not None
    named = {(q.column, q.message.split(":")[0]) for q in problems}
    # the NULL name: COMPUTE_TASK_INFO's row and its column
    assert ("COMPUTE_TASK_INFO.name", f"COMPUTE_TASK_INFO row {at['name']} (globalTaskId {at['gid_name']})") in named
    assert any(c == "TASK.endNs" and f"globalTaskId {at['gid_endNs']}" in m for c, m in named)
    assert any(c == "COMPUTE_TASK_INFO.opType" and f"globalTaskId {at['gid_opType']}" in m for c, m in named)
    assert len(problems) == 3
    # the two rows without a name or an end are skipped; the one with an unknown opType keeps its
    # kernel, typed from its name; every other kernel is exactly as before
    assert table.n == good.n - 2

    def rows(t):  # (name, type, start, dur) per kernel
        return [(t.names[n], t.types[c], s, d) for n, c, s, d in
                zip(t.name_code.tolist(), t.type_code.tolist(), t.start.tolist(), t.dur.tolist())]

    before, after = rows(good), rows(table)
    assert set(after) <= set(before)
    assert len(set(before) - set(after)) == 2


def test_db_problems_reach_the_result(tmp_path: Path) -> None:
    _broken_copy(tmp_path)
    r = analyze([str(tmp_path)])
    assert r["usable"]
    cols = {q["column"] for q in r["problems"]}
    assert {"COMPUTE_TASK_INFO.name", "TASK.endNs", "COMPUTE_TASK_INFO.opType"} <= cols


# ------------------------------------------------------------------- the same findings as the CSV

def _real_ddl() -> dict[str, str]:
    """CREATE TABLE statements of the real export (the Level1 fixture)."""
    rows = _sql(1, "SELECT name, sql FROM sqlite_master WHERE type = 'table'")
    return dict(rows)


def _db_from_kernel_details(csv_path: Path, db_path: Path) -> int:
    """The kernels of a real kernel_details.csv written into a DB with the real export's tables."""
    ddl = _real_ddl()
    db_path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db_path)
    for t in ("STRING_IDS", "TASK", "COMPUTE_TASK_INFO", "COMMUNICATION_OP", "STEP_TIME"):
        con.execute(ddl[t])
    ids: dict[str, int] = {}

    def sid(v: str) -> int:
        if v not in ids:
            ids[v] = len(ids) + 1
            con.execute("INSERT INTO STRING_IDS (id, value) VALUES (?, ?)", (ids[v], v))
        return ids[v]

    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    lo, hi, steps = None, None, set()
    for g, r in enumerate(rows, 1):
        # kernel_details writes us with 3 decimals (a tab may end the cell): exactly these ns (a
        # float of an epoch time in us is only good to 0.25 us)
        s = int(Decimal(r["Start Time(us)"].strip()) * 1000)
        e = s + int(Decimal(r["Duration(us)"]) * 1000)
        lo, hi = min(lo or s, s), max(hi or e, e)
        steps.add(int(r["Step Id"]))
        if r["Name"].startswith("hcom_"):
            con.execute("INSERT INTO COMMUNICATION_OP (opName, startNs, endNs, opId, opType) VALUES (?, ?, ?, ?, ?)",
                        (sid(r["Name"]), s, e, g, sid(r["Type"])))
            continue
        stream = r.get("Stream ID", "2")
        con.execute("INSERT INTO TASK (startNs, endNs, globalTaskId, streamId) VALUES (?, ?, ?, ?)",
                    (s, e, g, int(stream) if stream.isdigit() else 2))
        con.execute("INSERT INTO COMPUTE_TASK_INFO (name, globalTaskId, opType, inputShapes, inputDataTypes, "
                    "outputShapes, outputDataTypes) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (sid(r["Name"]), g, sid(r["Type"]), sid(r.get("Input Shapes", "N/A")),
                     sid(r.get("Input Data Types", "N/A")), sid(r.get("Output Shapes", "N/A")),
                     sid(r.get("Output Data Types", "N/A"))))
    (step,) = steps
    con.execute("INSERT INTO STEP_TIME VALUES (?, ?, ?)", (step, lo, hi + 1))
    con.commit()
    con.close()
    return len(rows)


def _summary(r: dict) -> dict:
    return {
        "fusions": sorted((f["pattern"], f["api"], tuple(f["kernels"]), f["count"], round(f["time_us"], 1))
                          for f in r["fusions"]),
        "sequences": [(tuple(s["kernels"]), s["count"], round(s["time_us"], 1)) for s in r["sequences"]["by_time"]],
        "by_count": [(tuple(s["kernels"]), s["count"]) for s in r["sequences"]["by_count"]],
        "communication": {k: round(r["communication"][k], 1) for k in ("time_us", "exposed_us", "overlapped_us")}
        | {"kernels": r["communication"]["kernels"]},
        "per_rank": [(p["rank"], round(p["step_time_us"], 1), round(p["device_time_us"], 1))
                     for p in r["totals"]["per_rank"]],
        "rejected": sorted((x["pattern"], tuple(x["kernels"]), x["count"]) for x in r["rejected"]),
    }


@pytest.mark.skipif(not REAL.is_dir(), reason="shared real profiler fixtures not present")
@pytest.mark.parametrize("level", [1, 2])   # Level0's CSV has no Stream ID column: not the same data
def test_db_gives_the_same_findings_as_kernel_details(tmp_path: Path, level: int) -> None:
    csv_root, db_root = tmp_path / "csv", tmp_path / "db"
    for rank in (0, 1):
        src = REAL / f"level{level}" / f"rank{rank}_ascend_pt"
        for root in (csv_root, db_root):
            (root / src.name / "ASCEND_PROFILER_OUTPUT").mkdir(parents=True)
            shutil.copy(src / f"profiler_info_{rank}.json", root / src.name)
        kd = src / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
        shutil.copy(kd, csv_root / src.name / "ASCEND_PROFILER_OUTPUT")
        n = _db_from_kernel_details(kd, db_root / src.name / "ASCEND_PROFILER_OUTPUT" /
                                    f"ascend_pytorch_profiler_{rank}.db")
        assert n > 150
    by_csv, by_db = analyze([str(csv_root)]), analyze([str(db_root)])
    assert by_db["usable"] and not by_db["problems"], by_db["problems"]
    assert [i["ops"] for i in by_db["inputs"]] == [i["ops"] for i in by_csv["inputs"]]
    a, b = _summary(by_csv), _summary(by_db)
    assert a["fusions"] and a["sequences"] and a["communication"]["kernels"] == 8
    assert b == a
    json.dumps(by_db)


def test_a_wal_mode_export_is_read_without_writing_beside_it(tmp_path: Path) -> None:
    # the published Level1 export was in WAL mode: a reader that opens it as a plain read-only
    # connection leaves -shm/-wal files in the profiler's folder (or fails where it is read-only)
    p = tmp_path / "ascend_pytorch_profiler_0.db"
    shutil.copy(_db(1), p)
    con = sqlite3.connect(p)
    assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    con.close()
    before = sorted(x.name for x in tmp_path.iterdir())
    table, problems = read_profiler_db(p)
    assert table is not None and table.n == 191 and not problems
    assert sorted(x.name for x in tmp_path.iterdir()) == before


def test_a_folder_name_with_uri_characters(tmp_path: Path) -> None:
    # the DB is opened through a sqlite URI: "?", "#" and "%" in the path must not cut it short
    d = tmp_path / "run?mode=rwc#1 %41"
    d.mkdir()
    shutil.copy(_db(0), d / "ascend_pytorch_profiler_0.db")
    table, problems = read_profiler_db(d / "ascend_pytorch_profiler_0.db")
    assert table is not None and table.n == 191 and not problems
    assert sorted(x.name for x in d.iterdir()) == ["ascend_pytorch_profiler_0.db"]
