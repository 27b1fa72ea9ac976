"""The fast replacement renderer gives exactly render_site's text (or declines)."""

from __future__ import annotations

import ast
import random
import textwrap

import pytest

from npufuse.patterns.base import Finding
from npufuse.rewrite.codegen import Switch, env_switch, render_site
from npufuse.scan.dataflow import ModuleInfo
from npufuse.rewrite.transform import parse_module
from npufuse.scan.replacement import crlf_lines, decorated_lines, default_indent, fast_body, libcst_body, render, splitlines_match
from scan_fakes import FIXTURE

FUSED = {
    "one": "y = torch_npu.npu_rms_norm(x, w, epsilon=1e-6)[0]",
    "multi": 'y = torch_npu.npu_fusion_attention(\n    q, k, v, 8, "BNSD",\n    scale=0.1)[0]  # tail',
    "block": "for i in range(2):\n    y = f(\n        i)\n    if y:\n        z = 1\nw = 2",
    "semicolon": "y = g(x); z = h(y)",
    "comment": "# the fused op\ny = f(x)\n\nz = g(\n    y,\n  1)",
    "string": 's = """a\n  b\n"""\ny = 1',
    "indented": "    y = 1\n    z = 2",
    "lead_comment": "# why this is fused\n\n_g = w if w.dtype == x.dtype else w.to(x.dtype)\nreturn f(x, _g)\n# trailing note",
    "nested_blank": "if x:\n    y = 1\n\n    # c\n    z = 2\nreturn y",
}
SWITCHES = [env_switch("rms_norm"), Switch("existing", expr='getattr(self.config, "use_fused_rmsnorm", False)'), Switch("none")]

SOURCES = {
    "function": '''
        def f(t, q):
            a = 1

            # comment at the block level
            b = (1,
          2)
            c = """x
        y"""  # trailing
            for i in range(3):
                d = i

                # inside
                e = g(
                    i,
                    # in brackets
                )
            # after the loop
            return a
        ''',
    "method": '''
        class C:
            def forward(self, x):
                variance = x.pow(2).mean(-1, keepdim=True)
                x = x * torch.rsqrt(
                    variance + self.eps
                )
                return self.weight * x

            def other(self):
                pass
        ''',
    "module_level": '''
        import torch

        x = 1

        y = torch.zeros(
            3)
        z = [
        1,
        ]
        ''',
    "decorated": '''
        import functools


        @functools.lru_cache
        def f(x):
            return x


        class C:
            @property
            def p(self):
                return 1

            y = 2
        ''',
    "two_space": '''
        def f(x):
          if x:
            y = x + 1
            z = y * 2
          return z
        ''',
    "match_top_level": '''
        import torch

        match command:
          # a comment before the first case
          case [x, y] if x:
            a = x + 1
            b = (a,
                 2)
          case (
                  1 | 2):
            c = 3
          case _:
            pass
        z = 1
        ''',
    "match_in_function": '''
        def f(x):
            match x:
                case {"k": v}:
                    y = v * 2
                    return y
                case Point(x=0):
                    return 0
            return x
        ''',
    "comment_after_deeper": '''
        def f(x):
            y = x + 1
                # a deeper comment after the site
            return y
        ''',
}


def _spans(module):
    for scope in module.scopes:
        for block, i, stmt in scope.statements():
            yield stmt.lineno, stmt.end_lineno
            for j in range(i + 1, min(len(block), i + 4)):
                yield stmt.lineno, block[j].end_lineno


def _check(source: str, limit: int | None = None, seed: int = 0, newline: str = "\n") -> tuple[int, int]:
    """Every span (and a few multi-statement ones) of ``source`` with every FUSED text: the fast
    path's text is render_site's or it declines. ``newline`` "\r\n": the same with ``source``
    written with Windows line ends (render_site on those bytes, fast_body on crlf_lines)."""
    if newline != "\n":
        source = source.replace("\n", newline)
    module = ModuleInfo.from_source("m.py", source)
    lines = source.splitlines(keepends=True)
    if newline != "\n":
        lines = crlf_lines(source, lines)
        assert lines is not None
    indent = default_indent(module.tree, lines)
    decorated = decorated_lines(module.tree)
    spans = sorted(set(_spans(module)))
    rnd = random.Random(seed)
    if limit is not None:
        rnd.shuffle(spans)
        spans = spans[:limit]
    same = declined = 0
    for k, (a, b) in enumerate(spans):
        for name, fused in FUSED.items():
            f = Finding("rms_norm", "q", a, b, {}, fused, "x")
            switch = SWITCHES[(k + len(name)) % len(SWITCHES)]
            body = fast_body(lines, f, indent, decorated, newline)
            if body is None:
                declined += 1
                continue
            try:
                want = render_site(source, f, switch)
            except (ValueError, KeyError):
                # render_site itself fails here (see the final report): the fast path must decline too
                pytest.fail(f"fast path rendered a site render_site cannot: lines {a}-{b}, fused {name!r}")
            assert render(source, f, switch, body) == want, f"lines {a}-{b}, fused {name!r}"
            same += 1
    return same, declined


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_fast_equals_render_site_on_constructs(name):
    source = textwrap.dedent(SOURCES[name]).lstrip("\n")
    same, declined = _check(source)
    assert same > 0


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_fast_equals_render_site_with_windows_line_ends(name):
    # libcst writes the file's "\r\n" after the code it adds: the fast path must too (it used to
    # decline every such file, sending each of its sites to libcst: 0.6 s a site)
    source = textwrap.dedent(SOURCES[name]).lstrip("\n")
    same, declined = _check(source, newline="\r\n")
    assert same > 0


def _classes(source: str, names: set[str]) -> str:
    """The named top-level classes of a file, as a module of their own (render_site's cost
    grows with the file; these keep the check quick)."""
    import ast

    lines = source.splitlines(keepends=True)
    keep = [n for n in ast.parse(source).body if getattr(n, "name", None) in names]
    return "import torch\n\n\n" + "\n\n".join("".join(lines[n.lineno - 1 : n.end_lineno]) for n in keep)


@pytest.mark.parametrize("rel,names", [
    ("model/modeling_tiny.py", {"TinyAttention", "TinySparseMoeBlock"}),
    ("model/modeling_tiny.py", {"TinyRotaryEmbedding", "TinyRMSNorm"}),
    ("ops/npu_ops.py", None),
])
def test_fast_equals_render_site_on_the_fixture(rel, names):
    source = (FIXTURE / rel).read_text()
    if names:
        source = _classes(source, names)
    same, declined = _check(source, limit=4)
    assert same > declined


@pytest.mark.parametrize("name", ["method", "function", "decorated"])
def test_libcst_body_serves_every_simple_guard(name):
    # sites the fast path declines (here: tab indentation) get their body from one render_site
    # run in the scan's worker; render() with it must be render_site's text for any switch
    source = textwrap.dedent(SOURCES[name]).lstrip("\n").replace("    ", "\t")
    module = ModuleInfo.from_source("m.py", source)
    spans = sorted(set(_spans(module)))[:6]
    served = 0
    for a, b in spans:
        for fused in (FUSED["one"], FUSED["multi"], FUSED["block"]):
            f = Finding("rms_norm", "q", a, b, {}, fused, "x")
            assert fast_body(source.splitlines(keepends=True), f, "\t") is None  # tabs: the fast path declines
            body = libcst_body(source, f)
            if body is None:
                continue
            served += 1
            for switch in SWITCHES:
                assert render(source, f, switch, body) == render_site(source, f, switch), (a, b, fused, switch)
    assert served > 0


def test_declines_tabs_crlf_and_unusual_line_breaks():
    tabbed = "def f(x):\n\ty = x\n\treturn y\n"
    lines = tabbed.splitlines(keepends=True)
    assert fast_body(lines, Finding("rms_norm", "f", 2, 2, {}, "y = 1", "x"), "\t") is None
    assert not splitlines_match("a = 1\r\nb = 2\r\n")
    assert not splitlines_match("a = 1\x0cb = 2\n")
    assert splitlines_match("a = 1\nb = 2\n")
    # Windows line ends are read as "\n" lines (fast_body puts "\r\n" back); any mix is declined
    windows = "a = 1\r\nb = (2,\r\n 3)\r\nc = 4"
    assert crlf_lines(windows, windows.splitlines(keepends=True)) == ["a = 1\n", "b = (2,\n", " 3)\n", "c = 4"]
    for other in ["a = 1\nb = 2\n", "a = 1\r\nb = 2\n", "a = 1\rb = 2\r\n", "a = 1\r\n\x0cb = 2\x0c\r\n", "a = 1\r\r\nb = 2\r\n", "a = 1\r\n\u2028\r\n"]:
        assert crlf_lines(other, other.splitlines(keepends=True)) is None, repr(other)


def test_render_falls_back_to_render_site_for_complex_guards():
    source = "def f(x):\n    y = x\n    return y\n"
    f = Finding("rms_norm", "f", 2, 2, {}, "y = g(x)", "x")
    sw = Switch("existing", expr='os.environ.get("A#B")')
    lines = source.splitlines(keepends=True)
    body = fast_body(lines, f, "    ")
    assert body is not None
    assert render(source, f, sw, body) == render_site(source, f, sw)
    assert render(lambda: source, f, sw, None) == render_site(source, f, sw)


@pytest.mark.parametrize("source, expected", [
    ("match x:\n  case 1:\n        y = 1\n", "  "),  # the case line, not the deeper body
    ("match x:\n\n    # note\n    case [a, *_] if a:\n        pass\n", "    "),
    ("import a\nmatch (x,\n       y):\n   case _:\n      pass\nif a:\n  b = 1\n", "   "),
    ("def f():\n  match x:\n      case 1:\n          pass\n", "  "),  # a nested match: its own line first
    ("match x:\n    case (\n        1\n    ):\n        y = 1\n", ""),  # the pattern on a later line: libcst decides
    ("match x:\n    case (case):\n        pass\n", "    "),
])
def test_default_indent_of_match_files_is_libcsts(source, expected):
    """A top-level match before any indented statement: the first INDENT is its first `case`
    line (files with one went to libcst for every site before, ~27 s a site on a 300 KB file)."""
    ast.parse(source)
    got = default_indent(ast.parse(source), source.splitlines(keepends=True))
    assert got == expected
    if got:
        assert got == parse_module(source).default_indent
