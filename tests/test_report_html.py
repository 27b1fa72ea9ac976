"""``npufuse report html``: one self-contained page from state, scan and per-step JSONL.

Inputs are synthetic (written into tmp_path in the DESIGN.md formats), so these tests do not
depend on the verifier. The browser test renders the page in headless Chromium (Debian's
``chromium`` package; set NPUFUSE_CHROMIUM to another binary) and skips when none is installed.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.report import html as report_html
from npufuse.state import CandidateState, State

XSS = "<script>alert(1)</script>"
XSS_FILE = f"models/{XSS}norm.py"
PWN = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
VENDOR = Path(report_html.__file__).parent / "vendor"

ORIGINAL = """\
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states
"""
REPLACEMENT = """\
        if _npufuse_on_npu(hidden_states) and _npufuse_switch("NPUFUSE_RMS_NORM_1"):  # npufuse: rms_norm
            return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.eps)[0]
        else:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
            return self.weight * hidden_states
"""


def _scan_candidate(cid: int, pattern: str, file: str, line: int, *, code: str = ORIGINAL, replacement: str = REPLACEMENT) -> dict:
    return {
        "id": cid,
        "key": f"{pattern}@{file}:Norm.forward",
        "pattern": pattern,
        "api": f"torch_npu.npu_{pattern}",
        "file": file,
        "qualname": "Norm.forward",
        "line": line,
        "end_line": line + code.count("\n") - 1,
        "confidence": "high",
        "replacement": replacement,
        "code": code,
    }


def _op_evidence(passed: bool = True) -> dict:
    return {
        "backend": "emulated",
        "passed": passed,
        "dtype": "bfloat16",
        "shapes": {"hidden_states": [2, 16, 64]},
        "outputs": [{"name": "out", "cosine": 0.9999871, "max_abs": 3.1e-3, "max_rel": 7.8e-3, "passed": passed}],
        "grads": [
            {"name": "grad hidden_states", "cosine": 0.9999642, "max_abs": 2.2e-3, "max_rel": 9.1e-3, "passed": True},
            {"name": "grad weight", "cosine": 0.9998, "max_abs": 4.4e-3, "max_rel": 1.2e-2, "passed": passed},
        ],
    }


def _steps(cid: int, run: str, n: int, *, base_time: float, loss0: float = 2.5, nan_at: int | None = None) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        loss = loss0 * math.exp(-s / 30.0) + 0.01 * math.sin(s + (0.7 if run == "fused" else 0.0))
        if nan_at is not None and s >= nan_at:
            loss = float("nan")
        t = base_time * (3.0 if s <= 2 else 1.0) * (1.0 + 0.05 * math.sin(s * 1.7))
        out.append({"candidate": cid, "run": run, "step": s, "loss": loss, "step_time": t, "tokens_per_s": 1000.0 / t})
    return out


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder after a typical stage 2: four candidates in every state of evidence.

    1 concluded (op + e2e + perf, JSONL named in the evidence), 2 op check only,
    3 e2e failed early (NaN loss), 4 applied with nothing yet. Candidate 1 sits in a file whose
    name holds a script tag, and its reasons and code hold HTML too.
    """
    sd = tmp_path / ".npufuse"
    scan = {
        "tool": "npufuse",
        "version": "0.1.0",
        "root": ".",
        "files_scanned": 3,
        "candidates": [
            _scan_candidate(1, "rms_norm", XSS_FILE, 20, code=ORIGINAL + f"        # {XSS} {PWN}\n"),
            _scan_candidate(2, "swiglu", "model.py", 40),
            _scan_candidate(3, "rope", "model.py", 60),
            _scan_candidate(4, "attention", "model.py", 80),
            _scan_candidate(5, "geglu", "other.py", 10),
        ],
    }
    sd.mkdir()
    (sd / "scan.json").write_text(json.dumps(scan), encoding="utf-8")
    state = State(path=sd / "state.json", scan_sha256=hashlib.sha256((sd / "scan.json").read_bytes()).hexdigest())
    applied = {"switch": "env", "switch_description": "environment variable NPUFUSE_X", "span": [20, 26]}
    c1 = CandidateState(1, scan["candidates"][0]["key"], "rms_norm", XSS_FILE, "Norm.forward", status="concluded", applied=applied)
    c1.evidence = {
        "op": _op_evidence(),
        "e2e": {"backend": "emulated", "passed": True, "steps": 60, "max_rel_diff": 0.0021, "threshold": 0.01, "jsonl": "runs/c1.jsonl"},
        "perf": {"backend": "emulated", "warmup": 5, "speedup": 1.072, "speedup_ci": [1.031, 1.118], "verdict": "faster"},
    }
    c1.verdict = "replace: faster"
    c1.reasons = ["loss within 0.21% of baseline over 60 steps", f"speed-up 1.07x (emulated) {XSS}", PWN]
    c2 = CandidateState(2, scan["candidates"][1]["key"], "swiglu", "model.py", "Norm.forward", status="e2e_checking", applied=applied)
    c2.evidence = {"op": dict(_op_evidence(), jsonl=f"op/{XSS}.jsonl")}  # named, not there: a warning
    c3 = CandidateState(3, scan["candidates"][2]["key"], "rope", "model.py", "Norm.forward", status="e2e_failed", applied=applied)
    c3.evidence = {
        "op": _op_evidence(),
        "e2e": {"backend": "emulated", "passed": False, "stopped_early": True, "stopped_at": 12, "reason": "fused loss is NaN at step 12"},
    }
    c3.verdict = "do not replace: e2e loss"
    c3.reasons = ["fused loss NaN at step 12: run stopped early"]
    c4 = CandidateState(4, scan["candidates"][3]["key"], "attention", "model.py", "Norm.forward", status="pending", applied=applied)
    for c in (c1, c2, c3, c4):
        state.candidates[c.id] = c
    state.save()
    _write_jsonl(tmp_path / "runs" / "c1.jsonl", _steps(1, "baseline", 60, base_time=0.145) + _steps(1, "fused", 60, base_time=0.135))
    _write_jsonl(sd / "e2e" / "c3.jsonl", _steps(3, "baseline", 60, base_time=0.2) + _steps(3, "fused", 14, base_time=0.19, nan_at=12))
    # an op-check log sharing the folder: not per-step records, ignored
    _write_jsonl(sd / "op" / "c1.jsonl", [{"candidate": 1, "tensor": "out", "cosine": 0.99}])
    return tmp_path


def _render(project: Path, *ids: str, extra: tuple[str, ...] = ()) -> tuple[int, str, Path]:
    out = project / "report.html"
    old = os.getcwd()
    os.chdir(project)
    try:
        rc = main(["report", "html", *ids, "-o", str(out), *extra])
    finally:
        os.chdir(old)
    return rc, out.read_text(encoding="utf-8") if out.exists() else "", out


class _Refs(HTMLParser):
    """Every attribute that could load something, and every element, for the checks below."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: list[str] = []
        self.scripts: list[dict] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "script":
            self.scripts.append(a)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "action", "poster", "data", "formaction", "xlink:href") and value is not None:
                self.refs.append((tag, name, value))


# -- page structure and data -----------------------------------------------------------------------


def test_one_self_contained_file(project: Path) -> None:
    rc, page, out = _render(project)
    assert rc == 0
    assert sorted(p.name for p in project.iterdir()) == [".npufuse", "report.html", "runs"]
    parser = _Refs()
    parser.feed(page)
    # links only within the page, no external script, stylesheet, image or frame
    assert parser.refs and all(v.startswith("#") for _, name, v in parser.refs if name == "href"), parser.refs
    assert not [r for r in parser.refs if r[1] != "href"], parser.refs
    assert not {"link", "iframe", "img", "object", "embed", "base"} & set(parser.tags)
    assert all("src" not in s for s in parser.scripts)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//", page, re.I)
    assert "@import" not in page
    # the only URL in the file is uPlot's own banner comment (text, not a resource)
    assert set(re.findall(r"https?://[^\s\"')*]+", page)) <= {"https://github.com/leeoniya/uPlot"}
    csp = html.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1))
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert len(page) < 400_000


def test_report_data_round_trips(project: Path) -> None:
    data = report_html.build_report_data(project / ".npufuse", generated_at="fixed")
    page = report_html.render_html(data)
    assert report_html.extract_report_data(page) == json.loads(json.dumps(data))
    assert page.count('id="report-data"') == 1
    assert data["schema"] == "npufuse.report/1"
    assert [c["id"] for c in data["candidates"]] == [1, 2, 3, 4]  # default: all in state, not scan-only 5


def test_json_block_cannot_be_broken_out_of() -> None:
    nasty = {"s": "</script><script>alert(1)</script><!-- & \u2028"}
    text = report_html.json_for_script(nasty)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == nasty


def test_repo_text_is_shown_as_text(project: Path) -> None:
    rc, page, _ = _render(project)
    assert rc == 0
    assert XSS not in page and "alert(1)</script>" not in page
    assert "<img" not in page and "onerror=\"document" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # file name, code and reasons, escaped
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 6
    assert any(XSS in w for w in report_html.extract_report_data(page)["warnings"])
    parser = _Refs()
    parser.feed(page)
    assert parser.tags.count("script") == 3  # REPORT_DATA, uPlot, the page script
    assert "img" not in parser.tags
    data = report_html.extract_report_data(page)
    assert data["candidates"][0]["file"] == XSS_FILE  # the data keeps the exact text


def test_sections_and_numbers(project: Path) -> None:
    data = report_html.build_report_data(project / ".npufuse")
    c1, c2, c3, c4 = data["candidates"]
    assert data["any_emulated"] and all(c["emulated"] for c in (c1, c2, c3))
    # candidate 2 has only an emulated op check: any later times count as emulated too
    assert all(c["timing_emulated"] for c in (c1, c2, c3)) and not c4["emulated"]
    # candidate 1: everything; its step times are emulated, so they are no chart (not evidence)
    assert c1["charts"] == ["loss"]
    assert c1["series"]["steps"] == list(range(1, 61))
    assert c1["warmup"] == 5 and not c1["warmup_assumed"] and c1["series"]["warmup_end"] == 6
    assert [r["kind"] for r in c1["op"]["rows"]] == ["forward", "backward", "backward"]
    assert c1["op"]["passed"] is True and c1["perf"]["speedup"] == 1.072
    assert sum(c1["hist"]["baseline"]) == 55 and sum(c1["hist"]["fused"]) == 55
    base = next(r for r in c1["run_summary"] if r["run"] == "baseline")
    assert base["timed_steps"] == 55 and 0.13 < base["median_time"] < 0.16
    diff_tags = {row[0] for row in c1["code"]["diff"]}
    assert diff_tags == {" ", "+", "-"} or diff_tags == {" ", "+"}
    # the original statements are matched (as the else branch), not shown as removed
    kept = [row for row in c1["code"]["diff"] if row[0] == " "]
    assert any("torch.rsqrt" in row[2] for row in kept)
    # candidate 2: op check only
    assert c2["op"]["present"] and not c2["e2e"]["present"] and c2["charts"] == []
    assert "npufuse verify e2e 2" in c2["e2e"]["missing"] and "was started" in c2["e2e"]["missing"]
    assert "npufuse verify e2e 2" in c2["perf"]["missing"]
    # candidate 3: e2e failed early, NaN loss kept out of the series but reported
    assert c3["e2e"]["passed"] is False and c3["series"]["nonfinite_loss"]["fused"] == [12, 13, 14]
    assert c3["series"]["fused_loss"][11] is None and c3["series"]["fused_loss"][10] is not None
    assert "loss check failed" in c3["perf"]["missing"]
    assert "loss" in c3["charts"]
    fused3 = next(r for r in c3["run_summary"] if r["run"] == "fused")
    assert fused3["last_step"] == 14 and fused3["final_loss"] == "nan"  # not the last finite value
    # candidate 4: nothing yet
    assert "npufuse verify op 4" in c4["op"]["missing"]
    assert "npufuse verify op 4" in c4["e2e"]["missing"]
    assert c4["charts"] == [] and c4["verdict"] is None


def test_page_shows_verdicts_missing_parts_and_emulation(project: Path) -> None:
    rc, page, _ = _render(project)
    assert rc == 0
    assert 'id="emulated-banner"' in page and "never NPU performance" in page
    assert page.count('id="summary-table"') == 1 and page.count('<tr data-candidate="') == 4
    for text in ("replace: faster", "do not replace: e2e loss", "0.9999871", "0.0031", "1.072", "1.031", "1.118"):
        assert text in page, text
    # an emulated run's step time is no headline: "not judged", the figures only in the raw records
    assert "×1.072" not in page and "not judged (emulated)" in page and 'id="step-time-emulated-1"' in page
    raw = page[page.index('id="raw-1"') :]
    assert "1.072" in raw[: raw.index("</details>")]
    assert "Run <code>npufuse verify op 4</code>." in page  # commands in messages are set as code
    assert "npufuse verify e2e 2 --cmd" in page
    assert "fused loss is NaN at step 12" in page
    assert "fused loss not finite at step(s)" in page and "fused loss not finite from step 12" in page
    assert "environment variable NPUFUSE_X" in page


def test_selected_ids_and_scan_only_candidate(project: Path) -> None:
    rc, page, _ = _render(project, "1,5")
    assert rc == 0
    data = report_html.extract_report_data(page)
    assert [c["id"] for c in data["candidates"]] == [1, 5]
    c5 = data["candidates"][1]
    assert not c5["in_state"] and c5["status"] == "not_applied"
    assert "npufuse apply --accept 5" in c5["op"]["missing"]
    assert c5["code"]["present"] and "npufuse apply --accept 5" in page


def test_non_emulated_run_has_no_banner(project: Path, tmp_path: Path) -> None:
    state = State.load(project / ".npufuse")
    for c in state.candidates.values():
        for section in c.evidence.values():
            section["backend"] = "npu"
    state.save()
    data = report_html.build_report_data(project / ".npufuse", ids=[1])
    assert not data["any_emulated"] and data["candidates"][0]["backend"] == "npu"
    assert not data["candidates"][0]["timing_emulated"]
    # real step times are evidence: charted, and the speed-up is a headline
    assert data["candidates"][0]["charts"] == ["loss", "step_time", "step_time_hist"]
    page = report_html.render_html(data)
    assert 'id="emulated-banner"' not in page and "speed-up ×1.072" in page


def test_jsonl_flag_resume_duplicates_and_partial_line(project: Path) -> None:
    extra = project / "extra.jsonl"
    recs = _steps(2, "baseline", 10, base_time=0.1) + _steps(2, "fused", 10, base_time=0.09)
    text = "".join(json.dumps(r) + "\n" for r in recs) + json.dumps(recs[-1]) + "\n" + '{"candidate": 2, "run": "fu'
    extra.write_text(text, encoding="utf-8")
    data = report_html.build_report_data(project / ".npufuse", jsonl=[extra], ids=[2])
    c2 = data["candidates"][0]
    # candidate 2's op check ran emulated: its times count as emulated and are not charted
    assert c2["series"]["steps"] == list(range(1, 11)) and c2["charts"] == ["loss"]
    assert c2["warmup_assumed"]  # no perf/e2e evidence says how many steps were warm-up
    assert any("recorded more than once" in w and "first record" in w for w in data["warnings"])
    assert any("incomplete last line" in w for w in data["warnings"])


def test_reads_the_verifiers_own_formats(project: Path) -> None:
    """Interop with npufuse.verify: NaN written as "nan", merge-jsonl's metrics array, the
    PerfResult and LossCheck JSON as evidence, the probe's backend words."""
    from npufuse.verify import jsonl as vjsonl
    from npufuse.verify import stats

    base = _steps(2, "baseline", 30, base_time=0.1)
    fused = _steps(2, "fused", 30, base_time=0.08)
    fused[-1]["loss"] = "nan"
    metrics = project / "merged.json"
    metrics.write_text(json.dumps(vjsonl.merge_runs(base, fused)), encoding="utf-8")
    state = State.load(project / ".npufuse")
    times = {run: {r["step"]: r["step_time"] for r in recs} for run, recs in (("baseline", base), ("fused", fused))}
    perf = stats.compare_step_times(times["baseline"], times["fused"], warmup=3, n_boot=200).to_json()
    loss = stats.compare_losses({r["step"]: r["loss"] for r in base}, {r["step"]: r["loss"] for r in base}).to_json()
    state.candidates[2].evidence.update(e2e=dict(loss, backend="real"), perf=dict(perf, backend="real"))
    state.save()
    data = report_html.build_report_data(project / ".npufuse", jsonl=[metrics], ids=[2])
    c2 = data["candidates"][0]
    assert c2["series"]["steps"] == list(range(1, 31)) and c2["series"]["nonfinite_loss"]["fused"] == []  # merge made it null
    assert c2["warmup"] == 3 and c2["series"]["warmup_end"] == 4
    assert c2["perf"]["speedup"] == perf["speedup"] and c2["perf"]["ci"] == [perf["ci_low"], perf["ci_high"]]
    assert ["baseline.median", perf["baseline"]["median"]] in c2["perf"]["details"]
    # op check emulated, runs on a real NPU: the times are not labelled emulated
    assert c2["emulated"] and not c2["timing_emulated"] and c2["backends"]["perf"].startswith("npu")
    assert c2["e2e"]["passed"] is True
    assert c2["charts"] == ["loss", "step_time", "step_time_hist"]
    page = report_html.render_html(data)
    assert f"×{perf['speedup']:.4g}" in page
    # straight from the JSONL writer: "nan" strings are non-finite losses
    raw = project / ".npufuse" / "e2e" / "c2.jsonl"
    with vjsonl.JsonlWriter(raw) as w:
        for r in base + fused:
            w.write(r)
    c2 = report_html.build_report_data(project / ".npufuse", ids=[2])["candidates"][0]
    assert c2["series"]["nonfinite_loss"]["fused"] == [30] and c2["series"]["fused_loss"][-1] is None


@pytest.mark.parametrize(
    "evidence, verdict, reasons",
    [
        ({"op": "passed"}, {"text": "odd"}, "one reason as a string"),
        ({"op": {"checks": {"out": {"cos": 0.99, "max_abs_error": 1e-3, "ok": True}}}}, "replace", []),
        ({"op": {"results": [1, 2]}, "e2e": [], "perf": {"speedup": "fast", "ci": [1]}}, None, None),
        ([], "", [3]),
    ],
)
def test_odd_evidence_shapes_render(project: Path, evidence, verdict, reasons) -> None:
    path = project / ".npufuse" / "state.json"
    raw = json.loads(path.read_text(encoding="utf-8"))  # edited as a user would, not via State.save
    c = next(c for c in raw["candidates"] if c["id"] == 2)
    c["evidence"], c["verdict"], c["reasons"] = evidence, verdict, reasons
    path.write_text(json.dumps(raw), encoding="utf-8")
    data = report_html.build_report_data(project / ".npufuse", ids=[2])
    page = report_html.render_html(data)
    assert report_html.extract_report_data(page) == json.loads(json.dumps(data))
    if isinstance(evidence, dict) and isinstance(evidence.get("op"), dict) and "checks" in evidence["op"]:
        row = data["candidates"][0]["op"]["rows"][0]
        assert row["name"] == "out" and row["cosine"] == 0.99 and row["passed"] is True


def test_records_without_candidate_field(project: Path) -> None:
    bare = project / "bare.jsonl"
    _write_jsonl(bare, [{k: v for k, v in r.items() if k != "candidate"} for r in _steps(9, "baseline", 5, base_time=0.1)])
    data = report_html.build_report_data(project / ".npufuse", jsonl=[bare], ids=[4])
    assert data["candidates"][0]["e2e"]["steps"]["baseline"] == 5
    with pytest.raises(report_html.ReportInputError, match="no \"candidate\" field"):
        report_html.build_report_data(project / ".npufuse", jsonl=[bare], ids=[2, 4])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["report"], "name the report format"),
        (["report", "html", "x"], "not a positive integer"),
        (["report", "html", "42"], "no candidate 42"),
        (["report", "html", "--jsonl", "missing.jsonl"], "missing.jsonl"),
        (["report", "html", "--jsonl", "bad.jsonl"], "bad.jsonl:1:"),
    ],
)
def test_usage_errors_are_one_line(project: Path, capsys, argv: list[str], needle: str) -> None:
    (project / "bad.jsonl").write_text('{"candidate": 1, "run": "other", "step": 1}\n{}\n', encoding="utf-8")
    old = os.getcwd()
    os.chdir(project)
    try:
        rc = main(argv)
    finally:
        os.chdir(old)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_empty_or_missing_inputs(tmp_path: Path, capsys) -> None:
    with pytest.raises(report_html.ReportInputError, match="npufuse scan"):
        report_html.build_report_data(tmp_path / ".npufuse")
    sd = tmp_path / ".npufuse"
    sd.mkdir()
    (sd / "state.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(report_html.ReportInputError, match="state.json"):
        report_html.build_report_data(sd)
    (sd / "state.json").write_text(json.dumps({"candidates": []}), encoding="utf-8")
    with pytest.raises(report_html.ReportInputError, match="npufuse apply --accept"):
        report_html.build_report_data(sd)


def test_state_without_scan_still_renders(project: Path) -> None:
    (project / ".npufuse" / "scan.json").unlink()
    data = report_html.build_report_data(project / ".npufuse", ids=[1])
    c1 = data["candidates"][0]
    assert not c1["code"]["present"] and "npufuse scan PATH" in c1["code"]["missing"]
    assert c1["charts"] == ["loss"]
    assert "npufuse scan PATH" in report_html.render_html(data)


def test_scan_changed_since_apply_is_warned(project: Path) -> None:
    scan = project / ".npufuse" / "scan.json"
    scan.write_text(scan.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    data = report_html.build_report_data(project / ".npufuse", ids=[2])
    assert any("changed since `npufuse apply`" in w for w in data["warnings"])


def test_vendored_library_is_the_recorded_release() -> None:
    readme = (VENDOR / "README.md").read_text(encoding="utf-8")
    assert f"uplot@{report_html.UPLOT_VERSION}" in readme
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE"):
        digest = hashlib.sha256((VENDOR / name).read_bytes()).hexdigest()
        assert digest in readme, f"{name} differs from the release recorded in vendor/README.md"
    assert f"(v{report_html.UPLOT_VERSION})" in (VENDOR / "uPlot.iife.min.js").read_text(encoding="utf-8")[:200]


def test_package_data_ships_the_vendor_files() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]["npufuse"]
    for suffix in ("*.js", "*.css", "*.j2", "*.md"):
        assert f"**/{suffix}" in globs
    assert "**/LICENSE" in globs


def test_command_module_is_light() -> None:
    code = "import sys, npufuse.report.command; print(sorted(m for m in ('jinja2', 'torch') if m in sys.modules))"
    out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- in a real browser -----------------------------------------------------------------------------


def _chromium() -> str | None:
    env = os.environ.get("NPUFUSE_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _headless(binary: str, page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--window-size=1280,4000",
            "--virtual-time-budget=5000",
            *extra,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_renders_in_headless_chromium_with_charts_drawn(project: Path, tmp_path: Path) -> None:
    binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary found (install Debian's `chromium`, or set NPUFUSE_CHROMIUM)")
    rc, page, out = _render(project)
    assert rc == 0
    done = _headless(binary, out, tmp_path / "profile", "--dump-dom")
    dom = done.stdout
    assert done.returncode == 0 and "<body" in dom, done.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body))
    assert "data-chart-error" not in attrs, attrs
    # 1 and 3: the loss overlay only (their step times are emulated: not charted)
    assert attrs.get("data-charts-expected") == "2" and attrs.get("data-charts-drawn") == "2", attrs
    assert attrs.get("data-charts-failed") == "0"
    assert "data-pwned" not in attrs  # the repo's HTML did not run
    m = re.search(r'<div class="chart" id="chart-loss-1"[^>]*>', dom)
    assert m and 'data-drawn="1"' in m.group(0)
    ink = int(re.search(r'data-series-ink="(-?\d+)"', m.group(0)).group(1))
    assert ink > 50, f"the loss lines did not reach the canvas ({ink} pixels)"
    assert dom.count("<canvas") == 2 and "chart-step_time" not in dom
    # no horizontal overflow in a 1280 px window (the page measured itself after layout)
    assert 0 < int(attrs["data-scroll-width"]) <= 1280, attrs
    # verdict first: the verdict box comes before the evidence in each candidate section
    sec = dom[dom.index('id="candidate-1-'):]
    assert sec.index("verdict-box") < sec.index("Operator check") < sec.index("End-to-end loss") < sec.index("Raw records")
    # the DOM holds the numbers and shows the repo's script tag as text
    for text in ("0.9999871", "not judged (emulated)", "replace: faster"):
        assert text in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and XSS not in dom
    shot = tmp_path / "shot.png"
    done = _headless(binary, out, tmp_path / "profile2", f"--screenshot={shot}")
    assert shot.is_file() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    # the screenshot is the 1280 px window asked for (PNG IHDR: width, height big-endian)
    width = int.from_bytes(shot.read_bytes()[16:20], "big")
    assert width == 1280, width


# -- the redesign (issue 17 item 7, issue 16 item 5) ----------------------------------------------


def test_no_machine_paths_in_the_page(project: Path) -> None:
    state = State.load(project / ".npufuse")
    c1 = state.candidates[1]
    c1.evidence["e2e"]["jsonl"] = str(project / ".npufuse" / "e2e_1_fused.jsonl")
    c1.evidence["e2e"]["cwd"] = str(project)
    c1.evidence["e2e"]["python"] = "/opt/conda/envs/train/bin/python3"
    c1.reasons.append(f"e2e loss: log at {project}/.npufuse/e2e_1_fused.log")
    state.save()
    rc, page, _ = _render(project)
    assert rc == 0
    assert str(project) not in page and str(project.parent) not in page  # neither in the HTML nor in REPORT_DATA
    assert "/opt/conda" not in page and "…/python3" in page
    assert ".npufuse/e2e_1_fused.log" in page  # the project's own files keep their relative names


def test_tolerance_band_and_forced_and_unchecked_verdicts(project: Path) -> None:
    state = State.load(project / ".npufuse")
    c1 = state.candidates[1]
    c1.evidence["e2e"]["thresholds"] = {"tolerance": 0.02}
    c1.evidence["e2e"]["forced"] = True
    c1.evidence["op"] = {"backend": "emulated", "passed": False, "outcome": "not checked", "not_checked": "0 tensors compared"}
    c1.verdict = "op check skipped (forced); loss ok; speed not judged (emulated)"
    state.save()
    data = report_html.build_report_data(project / ".npufuse", ids=[1])
    c = data["candidates"][0]
    # the e2e evidence's own "threshold" (0.01) wins over thresholds.tolerance, as the check used it
    assert c["tolerance"] == 0.01
    base = [v for v in c["series"]["baseline_loss"] if v is not None]
    lo = [v for v in c["series"]["band_lo"] if v is not None]
    assert lo and abs(lo[0] - base[0] * 0.99) < 1e-12
    page = report_html.render_html(data)
    row = page[page.index('<tr data-candidate="1"') :]
    row = row[: row.index("</tr>")]
    cells = re.findall(r"<td>(.*?)</td>", row, re.S)
    verdict_cell, op_cell = cells[1], cells[4]  # #, verdict, pattern, site, op check, ...
    assert "op check skipped (forced)" in verdict_cell and "accuracy ok" not in page
    assert "not checked" in op_cell and "pass" not in op_cell


def test_bidi_and_control_characters_are_shown_escaped_with_a_warning(project: Path) -> None:
    """Issue 19.8 (Trojan source) in the HTML report: repo text with a bidi override is shown
    escaped, and the page says why."""
    data = report_html.build_report_data(project / ".npufuse")
    data["candidates"][0]["qualname"] = "Attn.forward\u202e)dlrow(\x1b[31m"
    page = report_html.render_html(data)
    assert "\u202e" not in page and "\x1b" not in page
    assert "\\u202e" in page and "trojan-warning" in page
    assert "trojan-warning" not in report_html.render_html(report_html.build_report_data(project / ".npufuse"))
