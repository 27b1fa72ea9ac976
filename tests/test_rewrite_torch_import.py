"""The fused code names ``torch``; a module that never binds that name (it imports only
``torch.nn as nn`` / ``torch.nn.functional as F``) gets ``import torch`` inside the prelude block,
so the fused branch runs, and revert still restores the file byte for byte."""

from __future__ import annotations

import textwrap

import torch

from npufuse.rewrite.transform import TORCH_IMPORT_LINE, SiteEdit, revert_source, rewrite_source

NO_TORCH_NAME = textwrap.dedent(
    '''\
    """A model file that never binds the name torch."""
    import torch.nn as nn
    import torch.nn.functional as F


    class Gate(nn.Module):
        def forward(self, a, b):
            y = F.silu(a) * b
            return y
    '''
)

TORCH_NAMED = NO_TORCH_NAME.replace("import torch.nn as nn\n", "import torch\nimport torch.nn as nn\n")

EDIT = SiteEdit(line=8, end_line=8, fused="y = torch.mul(F.silu(a), b)", guard="a.dim() > 0", pattern="swiglu")


def _run(code: str) -> torch.Tensor:
    ns: dict = {}
    exec(compile(code, "<rewritten>", "exec"), ns)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    return ns["Gate"]()(a, b), torch.nn.functional.silu(a) * b


def test_module_without_torch_name_gets_the_import_and_runs_the_fused_branch() -> None:
    out = rewrite_source(NO_TORCH_NAME, [EDIT])
    assert out.applied == [EDIT]
    assert TORCH_IMPORT_LINE in out.text
    got, want = _run(out.text)
    torch.testing.assert_close(got, want)
    assert revert_source(out.text).text == NO_TORCH_NAME


def test_module_that_binds_torch_gets_no_extra_import() -> None:
    edit = SiteEdit(line=9, end_line=9, fused=EDIT.fused, guard=EDIT.guard, pattern="swiglu")
    out = rewrite_source(TORCH_NAMED, [edit])
    assert out.applied == [edit]
    assert TORCH_IMPORT_LINE not in out.text
    assert revert_source(out.text).text == TORCH_NAMED


def test_fused_code_without_torch_gets_no_import() -> None:
    edit = SiteEdit(line=8, end_line=8, fused="y = F.silu(a) * b", guard="a.dim() > 0", pattern="swiglu")
    out = rewrite_source(NO_TORCH_NAME, [edit])
    assert TORCH_IMPORT_LINE not in out.text
    assert revert_source(out.text).text == NO_TORCH_NAME


def test_a_guard_naming_torch_also_needs_the_import() -> None:
    edit = SiteEdit(line=8, end_line=8, fused="y = F.silu(a) * b", guard="a.dtype != torch.float64", pattern="swiglu")
    out = rewrite_source(NO_TORCH_NAME, [edit])
    assert TORCH_IMPORT_LINE in out.text
    got, want = _run(out.text)
    torch.testing.assert_close(got, want)


def test_second_apply_upgrades_a_plain_prelude() -> None:
    plain = rewrite_source(NO_TORCH_NAME, [SiteEdit(line=8, end_line=8, fused="y = F.silu(a) * b", guard="a.dim() > 0", pattern="swiglu")]).text
    assert TORCH_IMPORT_LINE not in plain
    line = plain.splitlines().index("        return y") + 1
    again = rewrite_source(plain, [SiteEdit(line=line, end_line=line, fused="return torch.clone(y)", guard="y.dim() > 0", pattern="swiglu")])
    assert again.applied and TORCH_IMPORT_LINE in again.text
    got, want = _run(again.text)
    torch.testing.assert_close(got, want)
    assert revert_source(again.text).text == NO_TORCH_NAME


def test_a_function_local_import_of_torch_does_not_bind_it_for_the_module() -> None:
    source = NO_TORCH_NAME + "\n\ndef make_mask(n):\n    import torch\n\n    return torch.ones(n)\n"
    out = rewrite_source(source, [EDIT])
    assert TORCH_IMPORT_LINE in out.text
    got, want = _run(out.text)
    torch.testing.assert_close(got, want)
    assert revert_source(out.text).text == source


def test_torch_imported_under_a_top_level_try_counts() -> None:
    source = NO_TORCH_NAME.replace("import torch.nn as nn\n", "try:\n    import torch\nexcept ImportError:\n    torch = None\nimport torch.nn as nn\n")
    edit = SiteEdit(line=EDIT.line + 4, end_line=EDIT.line + 4, fused=EDIT.fused, guard=EDIT.guard, pattern="swiglu")
    out = rewrite_source(source, [edit])
    assert out.applied == [edit]
    assert TORCH_IMPORT_LINE not in out.text
