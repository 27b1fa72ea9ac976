"""transform.positions: libcst's PositionProvider run on its own gives the mapping the public
``MetadataWrapper.resolve`` route gives (it only skips libcst's empty second walk), and the
block-only walks of the rewriter / reverter / marked-if finder see every statement of every block."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from npufuse.rewrite.transform import SiteEdit, _BlocksOnly, marked_sites, positions, revert_source, rewrite_source

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.py"))

NESTED = '''\
import torch


class Outer:
    class Inner:
        def forward(self, x):
            try:
                with torch.no_grad():
                    for i in range(3):
                        while x.sum() > 0:
                            if i:
                                x = x - 1
                            elif i > 1:
                                x = x * 2
                            else:
                                match i:
                                    case 0:
                                        y = x + 1
                                        x = y * 3
                                    case _:
                                        pass
            except* ValueError:
                z = x.relu()
                x = z + 1
            finally:
                w = x.float()
                x = w.half()
            return x


def plain(x): return x
'''


@pytest.mark.parametrize("path", EXAMPLES[:12], ids=lambda p: p.name)
def test_positions_equal_the_public_resolution(path):
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    ours = positions(module)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    assert dict(ours) == dict(theirs)


def test_positions_equal_on_nested_blocks():
    module = cst.parse_module(NESTED)
    assert dict(positions(module)) == dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))


class _Statements(_BlocksOnly, cst.CSTVisitor):
    def __init__(self) -> None:
        self.seen: list[type] = []
        self.entered: set[type] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        enter = super().on_visit(node)
        if enter:
            self.entered.add(type(node))
        return enter

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.seen.append(type(node))


def test_block_only_walk_meets_every_statement_line_and_enters_no_expression():
    module = cst.parse_module(NESTED)
    walker = _Statements()
    module.visit(walker)
    full = []

    class _All(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
            full.append(type(node))

    module.visit(_All())
    assert len(walker.seen) == len(full) == 11
    # the walk enters blocks and compound statements only: a statement line or an expression is met, not entered
    assert walker.entered <= {cst.Module, cst.ClassDef, cst.FunctionDef, cst.IndentedBlock, cst.Try, cst.TryStar, cst.With,
                              cst.For, cst.While, cst.If, cst.Else, cst.Match, cst.MatchCase, cst.ExceptStarHandler, cst.Finally}
    assert cst.SimpleStatementLine not in walker.entered and cst.Call not in walker.entered


@pytest.mark.parametrize("line,end", [(12, 12), (18, 19), (23, 24), (26, 27)])
def test_sites_in_deeply_nested_blocks_rewrite_find_and_revert(line, end):
    edit = SiteEdit(line=line, end_line=end, fused="x = torch.zeros(1)", guard="False", pattern="rms_norm", tag="t")
    out = rewrite_source(NESTED, [edit])
    assert [e.line for e in out.applied] == [line], out.skipped
    sites = marked_sites(out.text)
    assert len(sites) == 1 and sites[0].qualname == "Outer.Inner.forward"
    first, last = out.spans["t"]
    assert (sites[0].line, sites[0].end_line) == (first, last)
    assert revert_source(out.text).text == NESTED
