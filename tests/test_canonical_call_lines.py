"""The respelling of tensor functions (``canonicalise_tensor_functions``) walks only the statements on
the lines whose text holds such a call: it must change exactly what the whole-tree walk changes."""

from __future__ import annotations

import ast
import re

import pytest

from npufuse.patterns.registry import all_patterns
from npufuse.scan.dataflow import _TENSOR_FIRST_FUNCTIONS, canonicalise_tensor_functions, tensor_call_lines

# the reference: the text of a call the respelling may change, as one regex
CALL_TEXT = re.compile(r"\btorch\s*\.\s*(?:" + "|".join(sorted(_TENSOR_FIRST_FUNCTIONS)) + r")\s*\(|\.\s*(?:sigmoid|bmm|baddbmm)\s*\(")

SOURCES = [
    "import torch\ny = torch.unsqueeze(\n    torch.transpose(b, -1, -2),\n    1,\n)\n",
    "import torch\n\n\n@deco(torch.unsqueeze(w, 0))\ndef f(x=torch.flatten(z)):\n    return [torch.neg(t) for t in x]\n",
    "import torch\nclass A(torch.nn.Module):\n    def f(self, x):\n        if torch.sum(x) > 0:\n            return x.sigmoid()\n        while torch.amax(x) > 1:\n            x = x / 2\n        return x\n",
    "import torch\ntry:\n    y = torch.clone(x)\nexcept ValueError as e:\n    y = torch.detach(x)\nfinally:\n    z = a.baddbmm(b, c)\n",
    "import torch\nmatch x:\n    case [a] if torch.sum(a) > 0:\n        y = torch.tril(a)\n",
    "import torch\nf = lambda x: torch.softmax(x, -1)\ng = h .sigmoid ()\nk = p.\\\n    bmm(q)\n",
    "import torch\nwith torch.no_grad():\n    y = torch.roll(x, 1)\nfor i in torch.unbind(x):\n    pass\n",
    "import torch\n# torch.unsqueeze( in a comment\ns = 'torch.flip('\ny = x.xbmm(z)\n",
    "import torch\n\n\ndef f(torch):\n    return torch.unsqueeze(x, 0)\n",
    "import torch\ntorch = other\ny = torch.unsqueeze(x, 0)\n",
    "import torch\nfor torch in xs:\n    y = torch.unsqueeze(x, 0)\n",
    "import torch\ndel torch\ny = torch.unsqueeze(x, 0)\n",
    "import torch\ny = torch.unsqueeze(x, 0)\r\nz = torch.flip(y, (0,))\r\n",
    "import torch\ry = torch.unsqueeze(x, 0)\rz = torch.flip(y, (0,))\r",
]


def _respelled(src: str, with_text: bool) -> tuple[int, str]:
    tree = ast.parse(src)
    n = canonicalise_tensor_functions(tree, src if with_text else None)
    return n, ast.dump(tree, include_attributes=True)


@pytest.mark.parametrize("src", SOURCES)
def test_lines_walk_respells_what_the_whole_walk_does(src):
    assert _respelled(src, True) == _respelled(src, False)


def test_pattern_examples_respelled_alike():
    """Every Fuse/Keep example of every pattern: the same tree both ways, and the same lines as the regex."""
    count = 0
    codes = [ex.code for p in all_patterns() for ex in (*p.FUSE, *p.KEEP)]
    for code in codes:
        src = "import torch\n" + code
        try:
            ast.parse(src)
        except SyntaxError:
            continue
        assert _respelled(src, True) == _respelled(src, False), code
        lines, _binds = tensor_call_lines(src)
        assert lines == sorted({src.count("\n", 0, m.start()) + 1 for m in CALL_TEXT.finditer(src)}), code
        count += 1
    assert count > 500


@pytest.mark.parametrize("src, binds", [
    ("import torch\nx = torch.zeros(1)\n", False),
    (">>> import torch\n# a torch tensor, torch's\n", False),
    ("torch = 1\n", True),
    ("def f(torch):\n    pass\n", True),
    ("f = lambda torch: 1\n", True),
    ("for torch in x:\n    pass\n", True),
    ("del torch\n", True),
    ("x == torch\n", True),  # (the line's end: conservative)
    ("if torch == x:\n    pass\n", False),
])
def test_binding_text(src, binds):
    assert tensor_call_lines(src)[1] is binds
