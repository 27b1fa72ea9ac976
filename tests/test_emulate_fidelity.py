"""Every emulated API carries its fidelity record next to its code, and the record is true.

The record (``@emulated(..., verified=, docs_only=, held_by=)``) says which behaviours are held
against torch_npu's / op-plugin's own tests and which come from docs only; ``npufuse emulate``
prints it and the op's docstring names the tests. Here: each named test exists, and the
listing shows the record.
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import pytest

from npufuse.emulate import REGISTRY, api_names

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _test_functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))


@pytest.mark.parametrize("name", api_names())
def test_record_names_existing_tests_and_the_docstring_names_them(name):
    api = REGISTRY[name]
    assert api.held_by, f"{name}: no test holds it"
    assert api.verified or api.docs_only, f"{name}: empty fidelity record"
    for ref in api.held_by:
        file, _, func = ref.partition("::")
        assert func in _test_functions(ROOT / file), f"{name}: {ref} does not exist"
        assert ref in (api.fn.__doc__ or ""), f"{name}: docstring does not name {ref}"


def test_upstream_test_files_are_all_referenced():
    # every ported upstream test is attached to some API (none orphaned from the listing)
    held = {ref.partition("::")[2] for api in REGISTRY.values() for ref in api.held_by}
    for file in ("tests/test_emulate_upstream.py", "tests/test_emulate_upstream_attention.py"):
        orphans = _test_functions(ROOT / file) - held
        assert not orphans, f"{file}: not named by any API's held_by: {sorted(orphans)}"


def test_listing_shows_verified_and_docs_only_per_api(capsys, monkeypatch):
    from npufuse.cli import main

    assert main(["emulate", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(api_names())
    assert rows["npu_swiglu"]["verified"] and "bf16" in rows["npu_swiglu"]["verified"][0]
    assert rows["npu_moe_finalize_routing"]["verified"] == [] and rows["npu_moe_finalize_routing"]["docs_only"]
    assert any("sparse_mode" in d for d in rows["npu_fusion_attention"]["docs_only"])
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["emulate"]) == 0
    table = capsys.readouterr().out
    assert "verified against torch_npu's tests" in table and "from docs/sources only" in table
