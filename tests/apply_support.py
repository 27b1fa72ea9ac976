"""Shared pieces of the apply/revert tests: a small model repo, two detectors that only need
plain syntax (so these tests do not wait on the real ones), and helpers that run the real scan
engine and the real CLI on it.

The fake detectors emit production-shaped fused code (``torch_npu.npu_rms_norm`` /
``npu_swiglu``) that is exact for the fixture code, so the rewritten modules can be executed
under ``npufuse.emulate`` and compared with the originals.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
import types
from pathlib import Path
from typing import Any

from npufuse.cli import main as cli_main
from npufuse.patterns.base import Finding, Pattern
from npufuse.scan.engine import scan_repo

MODEL = textwrap.dedent('''\
    """A small Llama-style block, written the way model repos write it."""

    import torch
    import torch.nn.functional as F
    from torch import nn


    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            # mean of squares over the hidden dim
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)


    class MLP(nn.Module):
        def __init__(self, hidden_size, intermediate_size):
            super().__init__()
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


    class Block(nn.Module):
        def __init__(self, hidden_size=32, intermediate_size=64):
            super().__init__()
            self.norm = RMSNorm(hidden_size)
            self.mlp = MLP(hidden_size, intermediate_size)

        def forward(self, x):
            return x + self.mlp(self.norm(x))


    def final_norm(hidden_states, weight, eps=1e-5):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + eps)
        return weight * hidden_states.to(input_dtype)
    ''')

HEAD = textwrap.dedent('''\
    import torch.nn.functional as F


    def gated(gate, up, x):
        return F.silu(gate(x)) * up(x)
    ''')


def _text(module, stmt: ast.stmt) -> str:
    return ast.get_source_segment(module.source, stmt) or ""


class FakeRmsNorm(Pattern):
    """HF LlamaRMSNorm spelling: `variance = h.pow(2).mean(...)` ... `return w * h.to(dtype)`."""

    id = "rms_norm"
    api = "torch_npu.npu_rms_norm"
    title = "RMSNorm (test detector)"

    def detect(self, module, scope):
        body = list(scope.body)
        for i, stmt in enumerate(body):
            text = _text(module, stmt)
            m = re.match(r"variance = (\w+)\.pow\(2\)\.mean\(-1, keepdim=True\)$", text)
            if not m or i + 2 >= len(body) or not isinstance(body[i + 2], ast.Return):
                continue
            h = m.group(1)
            norm = _text(module, body[i + 1])
            eps = re.search(r"torch\.rsqrt\(variance \+ ([\w.]+)\)", norm)
            ret = re.match(r"return ([\w.]+) \* " + h + r"\.to\((\w+)\)$", _text(module, body[i + 2]))
            if not eps or not ret:
                continue
            weight, dtype = ret.groups()
            fused = (
                f"return {weight} * torch_npu.npu_rms_norm({h}, torch.ones_like({weight}, dtype={h}.dtype), "
                f"epsilon={eps.group(1)})[0].to({dtype})"
            )
            yield Finding(self.id, scope.qualname, stmt.lineno, body[i + 2].end_lineno, {"eps": eps.group(1), "weight": weight}, fused, h)


class FakeSwiglu(Pattern):
    """`F.silu(gate(x)) * up(x)` returned directly (optionally inside down(...))."""

    id = "swiglu"
    api = "torch_npu.npu_swiglu"
    title = "SwiGLU (test detector)"

    def detect(self, module, scope):
        for stmt in scope.body:
            text = _text(module, stmt)
            m = re.match(r"return (?:([\w.]+)\()?F\.silu\(([\w.]+)\((\w+)\)\) \* ([\w.]+)\((\w+)\)\)?$", text)
            if not m or m.group(3) != m.group(5):
                continue
            down, gate, x, up = m.group(1), m.group(2), m.group(3), m.group(4)
            inner = f"torch_npu.npu_swiglu(torch.cat([{gate}({x}), {up}({x})], dim=-1).contiguous(), dim=-1)"
            fused = f"return {down}({inner})" if down else f"return {inner}"
            if "import torch\n" not in module.source:
                fused = "import torch\n" + fused
            yield Finding(self.id, scope.qualname, stmt.lineno, stmt.end_lineno, {"order": "gate,up"}, fused, x)


FAKES = (FakeRmsNorm(), FakeSwiglu())


def make_repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    return root


def scan(root: Path, state_dir: Path | None = None, patterns=FAKES, **kwargs: Any) -> dict[str, Any]:
    """Run the real scan engine with ``patterns`` and write ``<state_dir>/scan.json``."""
    state_dir = state_dir or root / ".npufuse"
    result = scan_repo(root, patterns=patterns, jobs=1, **kwargs)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "scan.json").write_text(result.dumps(), encoding="utf-8")
    return result.to_json()


def npufuse(*argv: str) -> int:
    return cli_main(list(argv))


def state_of(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "state.json").read_text(encoding="utf-8"))


def load_module(code: str, name: str) -> dict[str, Any]:
    mod = types.ModuleType(name)
    mod.__file__ = f"<{name}>"
    exec(compile(code, f"<{name}>", "exec"), mod.__dict__)
    return mod.__dict__


def block_of(text: str, span: list[int] | tuple[int, int]) -> str:
    from npufuse.rewrite.codegen import source_lines

    return "".join(source_lines(text)[span[0] - 1 : span[1]])


def fallback_of(block: str) -> str:
    """The ``else:`` branch of a rendered site block (its lines, as written)."""
    from npufuse.rewrite.codegen import source_lines

    lines = source_lines(block)
    indent = len(lines[0]) - len(lines[0].lstrip())
    for i, ln in enumerate(lines):
        if ln.strip() == "else:" and len(ln) - len(ln.lstrip()) == indent:
            return "".join(lines[i + 1 :])
    raise AssertionError("no else branch in the block")


def same_statements(fallback: str, original: str) -> bool:
    """The fallback is the original statements byte for byte, one indentation level deeper:
    every line gains the same prefix, except lines inside a multi-line string, which must be
    unchanged (libcst never touches string contents)."""
    from npufuse.rewrite.codegen import source_lines

    a, b = source_lines(fallback), source_lines(original)
    if len(a) != len(b) or not a:
        return False
    prefix = a[0][: len(a[0]) - len(b[0])]
    if prefix.strip() or not a[0].endswith(b[0]):
        return False
    in_string = _string_lines(original)
    return all(x == y if (i in in_string or not y.strip()) else x == prefix + y for i, (x, y) in enumerate(zip(a, b)))


def _string_lines(code: str) -> set[int]:
    """0-based lines that continue a multi-line string token."""
    import io
    import tokenize

    inside: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0], tok.end[0]))  # rows after the first, 0-based
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return inside
