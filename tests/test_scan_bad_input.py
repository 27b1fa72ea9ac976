"""Bad input gets a clear per-file entry (or exit 2 for a missing path); nothing crashes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import engine
from npufuse.scan.engine import scan_repo
from scan_fakes import FAKES, FakeRmsNorm

GOOD = "import torch\n\n\ndef norm(x):\n    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n    return y\n"


def _failures(tmp_path, **kw):
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm()], **kw)
    return res, {f.file: f for f in res.files_failed}


def test_binary_file(tmp_path):
    (tmp_path / "blob.py").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)))
    (tmp_path / "good.py").write_text(GOOD)
    res, failed = _failures(tmp_path)
    assert failed["blob.py"].kind == "binary" and "binary file" in failed["blob.py"].error
    assert res.files_scanned == 1 and len(res.candidates) == 1


def test_non_utf8_without_cookie(tmp_path):
    (tmp_path / "latin.py").write_bytes(b'NAME = "caf\xe9"\n')
    _, failed = _failures(tmp_path)
    f = failed["latin.py"]
    assert f.kind == "encoding"
    assert "not valid UTF-8" in f.error and "0xe9" in f.error and "line 1" in f.error


def test_coding_cookie_is_honoured(tmp_path):
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\n" + GOOD.encode() + b'NAME = "caf\xe9"\n')
    res, failed = _failures(tmp_path)
    assert failed == {} and res.files_scanned == 1 and len(res.candidates) == 1


def test_unknown_coding_cookie(tmp_path):
    (tmp_path / "odd.py").write_bytes(b"# coding: no-such-codec\nx = 1\n")
    _, failed = _failures(tmp_path)
    assert failed["odd.py"].kind == "encoding"


def test_utf8_bom(tmp_path):
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    res, failed = _failures(tmp_path)
    assert failed == {} and len(res.candidates) == 1


@pytest.mark.parametrize("code,hint", [
    ('print "hello"\n', "print statement"),
    ("try:\n    pass\nexcept ValueError, e:\n    pass\n", "except X, e"),
    ("exec 'x = 1'\n", "exec statement"),
    ("x = 0777\n", "octal"),
])
def test_python2_syntax(tmp_path, code, hint):
    (tmp_path / "old.py").write_text(code)
    _, failed = _failures(tmp_path)
    f = failed["old.py"]
    assert f.kind == "syntax" and f.error.startswith("SyntaxError: line ")
    assert "Python 2" in f.error and hint in f.error


def test_syntax_error_names_the_line(tmp_path):
    (tmp_path / "bad.py").write_text("x = 1\n\ndef broken(:\n    pass\n")
    _, failed = _failures(tmp_path)
    assert failed["bad.py"].error.startswith("SyntaxError: line 3:")
    assert "Python 2" not in failed["bad.py"].error


def test_huge_file_is_skipped_with_the_limit(tmp_path):
    big = tmp_path / "huge.py"
    with big.open("wb") as fh:
        line = b"x = 1  # padding padding padding padding padding padding padding padding\n"
        fh.write(line * (50 * 1024 * 1024 // len(line) + 1))
    assert big.stat().st_size >= 50 * 1024 * 1024
    (tmp_path / "good.py").write_text(GOOD)
    res, failed = _failures(tmp_path)
    f = failed["huge.py"]
    assert f.kind == "too_large" and "skipped" in f.error and "10 MB" in f.error
    assert res.files_scanned == 1
    big.unlink()
    # the limit is configurable
    res2, failed2 = _failures(tmp_path, max_file_bytes=40)
    assert failed2["good.py"].kind == "too_large" and "limit" in failed2["good.py"].error
    res3, failed3 = _failures(tmp_path, max_file_bytes=4096)
    assert failed3 == {} and res3.files_scanned == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads every file; see the simulated test below")
def test_unreadable_file_permission(tmp_path):
    p = tmp_path / "secret.py"
    p.write_text(GOOD)
    p.chmod(0)
    try:
        _, failed = _failures(tmp_path)
    finally:
        p.chmod(0o644)
    assert failed["secret.py"].kind == "unreadable" and "permission denied" in failed["secret.py"].error


def test_unreadable_file_simulated(tmp_path, monkeypatch):
    (tmp_path / "secret.py").write_text(GOOD)
    (tmp_path / "good.py").write_text(GOOD)
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "secret.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    res, failed = _failures(tmp_path)
    assert failed["secret.py"].kind == "unreadable" and failed["secret.py"].error == "unreadable: permission denied"
    assert res.files_scanned == 1


def test_symlink_loop_entry(tmp_path):
    (tmp_path / "pkg").mkdir()
    os.symlink(tmp_path / "pkg", tmp_path / "pkg" / "again")
    os.symlink("me.py", tmp_path / "me.py")
    _, failed = _failures(tmp_path)
    assert failed["pkg/again/"].kind == "symlink_loop"
    assert failed["me.py"].kind == "symlink_loop"


def test_missing_path_exits_2_with_one_line(tmp_path, capsys):
    rc = main(["scan", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "no such file or folder" in err and "nope" in err
    with pytest.raises(FileNotFoundError):
        scan_repo(tmp_path / "nope")


def test_unknown_pattern_id_exits_2(tmp_path, capsys):
    (tmp_path / "a.py").write_text("x = 1\n")
    assert main(["scan", str(tmp_path), "--only", "rms_norm,nonsense", "--state-dir", str(tmp_path / "st"), "-o", str(tmp_path / "r.md")]) == 2
    assert "nonsense" in capsys.readouterr().err


class _Raising(FakeRmsNorm):
    id = "swiglu"

    def detect(self, module, scope):
        if scope.qualname == "norm":
            raise RecursionError("maximum recursion depth exceeded")
        return iter(())


class _BadSpan(FakeRmsNorm):
    id = "geglu"

    def detect(self, module, scope):
        from npufuse.patterns.base import Finding

        if scope.qualname == "norm":
            yield Finding("geglu", "norm", 5, 5, {}, "", "x")  # no fused code
            yield Finding("geglu", "norm", 4, 5, {}, "y = 1", "x")  # a def line and a body line
            yield "not a result"


def test_detector_errors_are_reported_per_file_and_the_scan_goes_on(tmp_path):
    (tmp_path / "m.py").write_text(GOOD)
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm(), _Raising(), _BadSpan()])
    assert len(res.candidates) == 1 and res.candidates[0]["pattern"] == "rms_norm"
    errors = sorted(f.error for f in res.files_failed if f.kind == "detector_error")
    assert len(errors) == 2
    assert errors[0].startswith("detector geglu yielded") and "and 2 more problem(s), 1 scope(s)" in errors[0]
    assert errors[1].startswith("detector swiglu raised RecursionError")


def test_assess_error_keeps_the_candidate(tmp_path):
    (tmp_path / "train.py").write_text("import torch\n\n\ndef main(model):\n    optimizer = torch.optim.AdamW(model.parameters())\n    return optimizer\n")
    res = scan_repo(tmp_path, patterns=FAKES)
    (c,) = res.candidates
    assert c["value"]["verdict"] == "unknown"
    assert [f.kind for f in res.files_failed] == ["assess_error"]


def test_render_failure_becomes_a_near_miss(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(GOOD)
    from npufuse.scan import replacement

    def boom(*a, **k):
        raise ValueError("lines 5-5 are not whole statements of one block")

    monkeypatch.setattr(replacement, "render", boom)
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm()])
    assert res.candidates == []
    assert "could not generate the replacement" in res.near_misses[0]["reason"]
    assert [f.kind for f in res.files_failed] == ["render_error"]


def test_pathological_nesting_does_not_crash(tmp_path):
    (tmp_path / "deep.py").write_text("x = " + "(" * 300 + "1" + ")" * 300 + "\n")
    (tmp_path / "deeper.py").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    res = scan_repo(tmp_path, patterns=FAKES)
    assert res.files_scanned + len({f.file for f in res.files_failed}) == 2


def test_empty_and_whitespace_files(tmp_path):
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "blank.py").write_text("\n\n   \n")
    res = scan_repo(tmp_path, patterns=FAKES)
    assert res.files_scanned == 2 and res.files_failed == []


def test_engine_never_raises_on_a_mixed_tree(tmp_path):
    (tmp_path / "a.py").write_bytes(b"\x00\x01")
    (tmp_path / "b.py").write_bytes(b"\xff\xfe bad")
    (tmp_path / "c.py").write_text('print "x"\n')
    (tmp_path / "d.py").write_text(GOOD)
    res = engine.scan_repo(tmp_path, patterns=FAKES)
    assert res.files_scanned == 1
    assert sorted(f.kind for f in res.files_failed) == ["binary", "encoding", "syntax"]


class _RaisingElsewhere(FakeRmsNorm):
    id = "swiglu"

    def detect(self, module, scope):
        if scope.qualname == "norm":
            raise RecursionError("maximum recursion depth exceeded while calling a Python object")
        return iter(())


def test_a_recursion_error_reads_the_same_however_deep_it_hit(tmp_path):
    # The limit's text and innermost frame depend on the stack depth when it hit (pool worker vs
    # in-process; fuzzing found cold and uncached scans disagreeing): the report must not.
    (tmp_path / "m.py").write_text(GOOD)
    messages = set()
    for detector in (_Raising(), _RaisingElsewhere()):
        res = scan_repo(tmp_path, patterns=[FakeRmsNorm(), detector])
        messages |= {f.error for f in res.files_failed if f.kind == "detector_error"}
    assert len(messages) == 1, messages
    assert "nested too deep" in messages.pop()
