"""Structural cuts of the cold scan's cost (issue 14, item 3) give what the plain code gave.

* ``dataflow.literal_eval_node``: ``ast.literal_eval`` on a node, without the reference cycle
  each call of it leaves (its nested functions refer to one another): the same value or the
  same exception type on every literal form; a scan of a file full of literals leaves no cyclic
  garbage behind (freed by reference counting as the file is done, not by the collector that
  ``engine.analyze_file`` keeps off).
* ``follow._may_import_transformers``: the bytes test before the text regex never turns away a
  file whose text the regex finds an import of transformers in; ``follow_imports`` finds the
  same with and without it.
"""

from __future__ import annotations

import ast
import gc
import re
from pathlib import Path

import pytest

from npufuse.scan import engine, follow
from npufuse.scan.dataflow import const_value, literal_eval_node

LITERALS = [
    "1", "-1", "+2.5", "-1j", "- -1", "-x", "not 1", "~1", "-True", "-'a'", "set()", "set(1)", "set(x=1)",
    "frozenset()", "f(x)", "x", "a.b", "a[1]", "1+2j", "1-2j", "1+2", "-1 - 2j", "+(-1)", "(1,-2)", "[1,{2:3}]",
    "{1,2}", "{'a': -1e-6}", "x if y else z", "None", "...", "b'x'", "'s'", "lambda: 1", "(1, x)", "[*a]",
    "{**a}", "f'{x}'", "x == 1", "1 * 2", "-(1 + 2j)", "True", "-0.0", "{[1]: 2}", "{1: [1], 2: x}", "{[1], 2}", "([1, 2], {3: (4,)})",
    "1 + 2 + 3j", "-1 + -2j", "2j + 1", "1.5 - 3j", "((((1,),),),)",
]


def _outcome(fn, node):
    try:
        value = fn(node)
    except Exception as exc:  # the type is what callers tell apart (they catch and fall back)
        return ("raised", type(exc))
    return ("value", type(value), repr(value))


@pytest.mark.parametrize("text", LITERALS)
def test_literal_eval_node_is_ast_literal_eval(text: str) -> None:
    node = ast.parse(text, mode="eval").body
    for given in (node, ast.Expression(node)):
        assert _outcome(literal_eval_node, given) == _outcome(ast.literal_eval, given), text


def test_const_value_keeps_its_sentinel_for_non_literals() -> None:
    assert const_value(ast.parse("-1e-6", mode="eval").body) == -1e-6
    assert const_value(ast.parse("f(x)", mode="eval").body) is ...
    assert const_value(ast.parse("-x", mode="eval").body) is ...
    assert const_value(None) is ...


LITERAL_HEAVY = '''
import torch
from torch import nn


class TinyConfig:
    def __init__(self, hidden_size=64, num_heads=-4, eps=-1e-6, dims=(1, -2), table={"a": -1}, flag=True):
        self.hidden_size = hidden_size
        self.eps = -eps
        self.dims = dims


class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
'''


def test_a_scan_of_a_file_leaves_no_cyclic_garbage_of_literals_or_rotations(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(LITERAL_HEAVY * 3)
    patterns = list(engine.registry_patterns())
    outcome = engine.analyze_file(tmp_path, "m.py", patterns, engine.ScanOptions())
    assert {h.finding.pattern for h in outcome.hits} >= {"rms_norm", "rope"}  # the code paths in question ran
    gc.collect()
    was = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to look at it
    try:
        engine.analyze_file(tmp_path, "m.py", patterns, engine.ScanOptions())
        gc.collect()
        names = sorted({getattr(o, "__qualname__", "") for o in gc.garbage if callable(o)})
    finally:
        gc.set_debug(was)
        gc.garbage.clear()
    assert not [n for n in names if n.startswith("literal_eval.")], names
    assert not [n for n in names if n.startswith("RopePattern._candidates.")], names


# -- follow: the bytes test ------------------------------------------------------------------------

IMPORT_TEXTS = [
    b"import transformers\n", b"  from transformers import x\n", b"x = 1\rimport transformers\r", b"x\r\nfrom  transformers.models import y\r\n",
    b"# from transformers\n", b">>> from transformers import A\n", b"from\xc3\xa9 transformers\n", b"from x import \xc3\xa9transformers\n",
    b"import os, transformers\n", b"\xef\xbb\xbfimport transformers\n", b"from \\\n transformers import x\n", b"import\ttransformers\r",
    b"\x80\nimport transformers\x80\n", b"fromtransformers\n", b"import transformersX\n", b'"""\n    from transformers import X\n"""\n',
    b"transformers = 1\nimport transformers\n", b"import x  # transformers\n", b"import x\ntransformers\n", b"\ttransformers; import transformers\n",
    b"import \xe2\x80\x8btransformers\n", b"from . import transformers\n", b"", b"transformers",
]


def _text_finds_an_import(data: bytes) -> bool:
    # follow_imports' own reading: UTF-8 with bad bytes replaced, universal newlines
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    return "transformers" in text and follow._IMPORTS_TRANSFORMERS.search(text) is not None


@pytest.mark.parametrize("data", IMPORT_TEXTS)
def test_bytes_test_never_turns_away_what_the_text_test_finds(data: bytes) -> None:
    if _text_finds_an_import(data):
        assert follow._may_import_transformers(data)


def test_bytes_test_turns_away_files_without_an_import_line() -> None:
    assert not follow._may_import_transformers(b"x = 'transformers'\n# transformers\n")
    assert not follow._may_import_transformers(b'"""see huggingface/transformers"""\n')
    assert follow._may_import_transformers(b"import os\nfrom transformers import AutoModel\n")


def test_bytes_test_agrees_on_the_sample_files() -> None:
    root = Path(__file__).resolve().parent.parent / "src"
    seen = 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if _text_finds_an_import(data):
            assert follow._may_import_transformers(data), path
        seen += 1
    assert seen > 20


def test_follow_imports_finds_the_same_with_and_without_the_bytes_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {
        "train.py": "from transformers import AutoModelForCausalLM, LlamaConfig\nm = AutoModelForCausalLM.from_config(LlamaConfig())\n",
        "mac.py": "x = 1\rimport transformers.models.llama.modeling_llama as m\rm.LlamaModel(None)\r",
        "doc.py": '"""\n    from transformers import BertModel\n"""\nx = 1\n',
        "other.py": "import torch\nprint('transformers')\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_bytes(text.encode())
    rels = sorted(files)
    seen: list[str] = []
    real = follow._uses

    def uses(repo, rel, text):
        seen.append(rel)
        return real(repo, rel, text)

    monkeypatch.setattr(follow, "_uses", uses)
    fast = follow.follow_imports(tmp_path, rels, [])
    fast_seen = list(seen)
    seen.clear()
    monkeypatch.setattr(follow, "_may_import_transformers", lambda data: True)
    plain = follow.follow_imports(tmp_path, rels, [])
    assert (fast.files, fast.unresolved, fast.missing, fast.trainer) == (plain.files, plain.unresolved, plain.missing, plain.trainer)
    assert fast.missing == ["transformers"]  # the uses were found (no site given: not installed)
    assert fast_seen == seen == ["doc.py", "mac.py", "train.py"]  # other.py: turned away by the bytes test
    assert re.search(r"\btransformers\b", files["other.py"])  # ... although it holds the word
