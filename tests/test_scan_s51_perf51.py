"""s51 (perf51): exact cuts of the scan's CPU. Each gate or rewritten test must give the answer of the code it replaced;
these edge cases each fail where the gate would be too strict (checked against mutants: an ASCII-only name reader,
``class (\\w+)`` with one blank, a consuming name group, the regexes without their lookbehinds).

1. ``_attention_s50c.inherited_caller_flag`` parses the other files reading ``.<method>`` only where a base of the
   class can be a top-level class there (``class`` + name in the text, read NFKC-safe): the base-class caller is found
   with the base written after a line continuation, in a fullwidth spelling Python folds to the same name, and after a
   ``class`` word in a comment; no base defined anywhere: the answer is None (as before) without parsing.
2. ``engine._file_holds_any``: capital-led words by one regex, the rest by ``in``: ``any(w in text ...)`` always.
3. add_rms_norm's ``_INLINE_SUM``, ``_S43_MEMBER_NORM_TEXT`` (literal lead + lookbehind) and ``_S42_NORM_CALL_TEXT``
   (lowered ASCII text): whether they match, as the start patterns did, on crafted edges.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from npufuse.patterns import _attention_s50c, add_rms_norm
from npufuse.scan import engine, repo_facts
from npufuse.scan.engine import scan_repo

# -- 1. inherited_caller_flag's ancestor gate ----------------------------------------------------------------------

_BASE = ('import torch\nfrom torch import nn\n\n\nclass AttnBase(nn.Module):\n    def __init__(self, width: int, heads: int, '
         'keep_maps: bool = False):\n        super().__init__()\n        self.width, self.heads = width, heads\n        '
         'self.keep_maps = keep_maps\n\n    def _attend(self, h, pad):\n        raise NotImplementedError\n\n    def forward(self, '
         'h, pad):\n        res, maps = self._attend(h, pad)\n        if self.keep_maps:\n            return res, maps.detach()\n'
         '        return (res,)\n')

_EAGER = ('import math\nimport torch\nfrom torch import nn\nfrom .core import AttnBase\n\n\nclass EagerAttn(AttnBase):\n    '
          'def __init__(self, *a, **kw):\n        super().__init__(*a, **kw)\n        self.qkv = nn.Linear(self.width, 3 * '
          'self.width)\n        self.out = nn.Linear(self.width, self.width)\n\n    def _attend(self, h, pad):\n        B, T, C = '
          'h.shape\n        q, k, v = self.qkv(h).chunk(3, dim=-1)\n        q = q.view(B, T, self.heads, -1).transpose(1, 2)\n  '
          '      k = k.view(B, T, self.heads, -1).transpose(1, 2)\n        v = v.view(B, T, self.heads, -1).transpose(1, 2)\n   '
          '     s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))\n        s = s.masked_fill(~pad[:, None, None, '
          ':], -1e9)\n        p = torch.softmax(s, dim=-1)\n        o = (p @ v).transpose(1, 2).reshape(B, T, C)\n        return '
          'self.out(o), p\n')


def _scan(tmp_path: Path, core: str) -> list[tuple[str, str, str]]:
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "__init__.py").write_text("")
    (tmp_path / "nets" / "core.py").write_text(core, encoding="utf-8")
    (tmp_path / "nets" / "eager.py").write_text(_EAGER)
    res = scan_repo(tmp_path, jobs=1, only=["attention"])
    return [(c["file"], c["qualname"], c["replacement"]) for c in res.candidates]


@pytest.mark.parametrize("core", [
    _BASE,
    # the name after a line continuation
    _BASE.replace("class AttnBase(nn.Module):", "class \\\n        AttnBase(nn.Module):"),
    # a fullwidth first letter: Python reads the identifier in NFKC form, AttnBase
    _BASE.replace("class AttnBase(nn.Module):", "class \uff21ttnBase(nn.Module):"),
    # a ``class`` word in a comment just before: it must not swallow the statement's own word
    _BASE.replace("\n\n\nclass AttnBase", "\n\n\n# the base class\nclass AttnBase"),
    # a comment ending in ``class`` on the line before, and text outside ASCII elsewhere in the file
    _BASE.replace("\n\n\nclass AttnBase", "\n\n\n# caf\u00e9 subclass\nclass AttnBase"),
], ids=["plain", "continuation", "fullwidth", "comment_class_word", "comment_subclass_non_ascii"])
def test_base_class_caller_found_through_the_gate(tmp_path: Path, core: str) -> None:
    got = _scan(tmp_path, core)
    assert [(f, q) for f, q, _ in got] == [("nets/eager.py", "EagerAttn._attend")]
    assert "not self.keep_maps" in got[0][2]


def test_no_base_defined_anywhere_answers_none_without_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = repo_facts._parse_repo_file

    def spy(root: Path, rel: str):  # type: ignore[no-untyped-def]
        parsed.append(rel)
        return real(root, rel)

    monkeypatch.setattr(repo_facts, "_parse_repo_file", spy)
    # the base is renamed in core.py: EagerAttn's base AttnBase is defined nowhere, so no caller counts
    got = _scan(tmp_path, _BASE.replace("class AttnBase(", "class OtherBase("))
    assert not any("not self.keep_maps" in r for _f, _q, r in got)
    assert "nets/core.py" not in parsed


def test_class_word_reader_edges() -> None:
    text = "# class\nclass B(A):\nclass \\\n  C:\nsubclass D\nclass _E:\nx = 'class F'\n"
    assert set(_attention_s50c._CLASS_WORD.findall(text)) >= {"B", "C", "D", "_E", "F"}
    assert _attention_s50c._folded("class \uff21ttn(nn.Module):") == "class Attn(nn.Module):"
    assert "Attn" in _attention_s50c._CLASS_WORD.findall(_attention_s50c._folded("class \uff21ttn(nn.Module):"))


# -- 2. _file_holds_any ----------------------------------------------------------------------------------------------

_WORDS = ("Adam", "SGD", "Adadelta", "RMSprop", "optim", ")(", "_class(", "import_module", "Lamb", "\u00c9x")


@pytest.mark.parametrize("text", ["", "x = 1\n", "torch.optim.AdamW(p)", "f()(x)", "SGD", "sgd adam lamb", "myLambda = 1",
                                  "x = \u00c9x", "cls._class(3)", "importlib.import_module('a')", "RMSprop" * 3,
                                  "\u00e9SGD\u00e9"])
def test_file_holds_any_is_any_in(text: str) -> None:
    for words in (_WORDS, _WORDS[4:], _WORDS[:5], tuple(reversed(_WORDS))):
        assert engine._file_holds_any(text, words) == any(w in text for w in words), (text, words)


# -- 3. add_rms_norm's text gates ------------------------------------------------------------------------------------

_NESTED_PARENS = r"\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)"
_START_INLINE_SUM = re.compile(r"[\w\]]\(\s*(?:[^()\n]|" + _NESTED_PARENS + r")*(?:\n\s*)?\+")
_START_S43 = re.compile(r"\w\.\w*(?:norm|ln_?\d)\w*\(", re.I)
_START_S42 = re.compile(r"rms|\bnorm\w*\(", re.I)

_TEXTS = [
    "", "(a + b)", "norm(x + y)", "x = norm(\n    h + r)\n", "self.norms[i](x + y)", " (x + y)", "f (x + y)",
    "norm(self.attn(x) + x)", "norm(f(g(h(x))) + x)", "norm(\n    f(x)\n    + x)", "n(a,\n\n+ b)", "\u00e9(a + b)",
    "layer.ffn_norm(h)", "block.ln_2(h)", "block.LN_2(h)", ".norm(x)", "x .norm(x)", "x.Norm_1(h)", "x.\u00e9norm(h)",
    "\u00e9.norm(h)", "self.layernorm(x)", "rms", "RMS", "Rms_eps", "norm(x)", "NORM(x)", "xnorm(x)", "_norm(x)", "a.norm(x)",
    "rmſ", "normalize (x)", "normal(x", "\u00e9norm(x)", "x = y.norm_\u00e9(z)", "K norm (x)", "pre_norm2(x)",
]


@pytest.mark.parametrize("text", _TEXTS)
def test_add_rms_norm_text_gates_match_the_start_patterns(text: str) -> None:
    assert bool(add_rms_norm._INLINE_SUM.search(text)) == bool(_START_INLINE_SUM.search(text))
    assert bool(add_rms_norm._S43_MEMBER_NORM_TEXT.search(text)) == bool(_START_S43.search(text))
    assert add_rms_norm._s42_norm_call_text(text) == bool(_START_S42.search(text))


def test_add_rms_norm_text_gates_on_example_code() -> None:
    from npufuse.patterns.registry import all_patterns

    n = 0
    for p in all_patterns():
        for ex in (*p.FUSE, *p.KEEP):
            lines = ex.code.splitlines(True)
            for i in range(0, len(lines), 2):
                s = "".join(lines[i : i + 5])
                n += 1
                assert bool(add_rms_norm._INLINE_SUM.search(s)) == bool(_START_INLINE_SUM.search(s)), s
                assert bool(add_rms_norm._S43_MEMBER_NORM_TEXT.search(s)) == bool(_START_S43.search(s)), s
                assert add_rms_norm._s42_norm_call_text(s) == bool(_START_S42.search(s)), s
    assert n > 1000
