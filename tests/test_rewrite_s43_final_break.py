"""A file whose last line ends in a line break other than its default newline (CRLF lines, the last
one ending in a bare "\\r": editors that mix endings write this) is rewritten and reverted byte for
byte. libcst drops such a final break when it reproduces the module, which made every site of the
file a render error ("libcst does not reproduce this file byte for byte") -- found on a real
repository in s43."""

from __future__ import annotations

import libcst as cst
import pytest

from apply_support import MODEL, make_repo, npufuse, scan, state_of
from npufuse.rewrite.transform import dropped_final_break, marked_sites, revert_source


def _crlf(text: str, last: str) -> str:
    return text.rstrip("\n").replace("\n", "\r\n") + last


@pytest.mark.parametrize("last", ["\r", "\n", "\r\n\r"])
def test_dropped_final_break_is_the_missing_tail(last):
    source = _crlf("x = 1\ny = 2\n", last)
    module = cst.parse_module(source)
    tail = dropped_final_break(source, module)
    assert tail is not None and module.code + tail == source


def test_no_tail_when_libcst_reproduces_the_file():
    source = _crlf("x = 1\ny = 2\n", "\r\n")
    assert dropped_final_break(source, cst.parse_module(source)) == ""


def test_other_differences_are_not_a_tail():
    # a module whose reproduction differs inside the text is still refused (not a tail of line breaks)
    module = cst.parse_module("x = 1\n")
    assert dropped_final_break("x = 1\n# gone\n", module) is None


@pytest.mark.parametrize("last", ["\r", "\n"])
def test_apply_and_revert_keep_a_mixed_final_break(tmp_path, last):
    text = _crlf(MODEL, last)
    root = make_repo(tmp_path / "repo", {"model.py": text})
    sd = tmp_path / "state"
    data = scan(root, sd)
    assert data["candidates"], "the fixture sites are candidates"
    assert npufuse("apply", "--state-dir", str(sd), "--accept", "all") == 0
    raw = (root / "model.py").read_bytes()
    assert raw.endswith(last.encode()) and not raw.endswith(b"\r\n" + last.encode() if last == "\r" else b"\r\n")
    rewritten = raw.decode()
    assert marked_sites(rewritten), "the sites were rewritten"
    applied = [c for c in state_of(sd)["candidates"] if c.get("applied")]
    assert len(applied) == len(data["candidates"])
    assert revert_source(rewritten).text == text  # revert puts every byte back, the final break included
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    assert (root / "model.py").read_bytes() == text.encode()


def test_scan_renders_sites_of_such_a_file(tmp_path):
    # the real detectors' render path goes through the same rewrite: no render error, a replacement
    from npufuse.scan.engine import scan_repo

    root = make_repo(tmp_path / "repo", {"model.py": _crlf(MODEL, "\r")})
    result = scan_repo(root, jobs=1).to_json()
    assert any(c["pattern"] == "rms_norm" for c in result["candidates"])
    assert not [p for p in result.get("problems", []) if "byte for byte" in str(p)]
