"""Attention's cross-file reads (softmax modules, mask functions, constructor callers) read files of the
repo only: a link inside an untrusted repo that leads out of it is never read, the same rule
repo_symbols keeps."""

from __future__ import annotations

from pathlib import Path

from npufuse.scan import repo_facts


def test_a_link_out_of_the_repo_is_not_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_text("class Secret:\n    pass\n")
    root = tmp_path / "repo"
    root.mkdir()
    (root / "model.py").write_text("class Block:\n    pass\n")
    (root / "evil.py").symlink_to(outside)
    (root / "inside.py").symlink_to(root / "model.py")
    assert repo_facts._repo_text(root, "model.py") == "class Block:\n    pass\n"
    assert repo_facts._repo_text(root, "inside.py") == "class Block:\n    pass\n"  # a link within the repo
    assert repo_facts._repo_text(root, "evil.py") is None
    repo_facts.reset()
    assert repo_facts._parse_repo_file(root, "evil.py") is None
    assert repo_facts._parse_repo_file(root, "model.py") is not None


def test_a_file_over_the_limit_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("x = 1\n" * (repo_facts._DEF_MAX_BYTES // 6 + 10))
    assert repo_facts._repo_text(tmp_path, "big.py") is None
