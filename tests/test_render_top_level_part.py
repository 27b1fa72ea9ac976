"""render_site renders a site from the top-level statements holding it (codegen.top_level_part):
the text must equal the whole-file render byte for byte, and the shortcut must step aside wherever
a whole-file property could make them differ."""

from __future__ import annotations

import pytest

from npufuse.patterns.base import Finding
from npufuse.rewrite import codegen

HEAD = '''import torch


class Model(torch.nn.Module):
  def forward(self, x):
    return x


# helpers below are scripted
'''

JIT = '''@torch.jit.script
def reward(a, b):
    # keep the sign
    d = torch.where(a > 0, a, b)
    return d * 2
'''


def _finding(source: str) -> Finding:
    line = source.splitlines().index("    d = torch.where(a > 0, a, b)") + 1
    return Finding("affinity_where", "reward", line, line, {}, "d = torch.lerp(b, a, (a > 0).to(a.dtype))", "a")


def _whole(source: str, f: Finding) -> str:
    saved = codegen.top_level_part
    codegen.top_level_part = lambda *a: None
    try:
        return codegen.render_site(source, f, codegen.env_switch(f.pattern))
    finally:
        codegen.top_level_part = saved


def test_site_in_a_decorated_function_renders_as_in_the_whole_file() -> None:
    src = HEAD.replace("  ", "    ") + "\n\n" + JIT + "\n\nX = 1\n"
    f = _finding(src)
    assert codegen.top_level_part(src, f.line, f.end_line) is not None
    assert codegen.render_site(src, f, codegen.env_switch(f.pattern)) == _whole(src, f)


def test_file_indented_by_two_but_site_by_four_renders_the_whole_file() -> None:
    # libcst re-indents the fused code by the file's first indentation unit (two spaces here)
    src = HEAD + "\n\n" + JIT
    f = _finding(src)
    assert codegen.top_level_part(src, f.line, f.end_line) is None
    assert codegen.render_site(src, f, codegen.env_switch(f.pattern)) == _whole(src, f)


@pytest.mark.parametrize("spoil", ["crlf", "backslash_line", "bom"])
def test_whole_file_properties_decline_the_shortcut(spoil: str) -> None:
    src = HEAD.replace("  ", "    ") + "\n\n" + JIT
    if spoil == "crlf":
        src = src.replace("\n", "\r\n")
    elif spoil == "backslash_line":
        src = src.replace("X = 1", "") + "Y = (1 +\n\\\n 2)\n"
    else:
        src = "\ufeff" + src
    f = _finding(src.replace("\r\n", "\n").lstrip("\ufeff"))
    assert codegen.top_level_part(src, f.line, f.end_line) is None
