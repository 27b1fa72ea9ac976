"""``npufuse emulate --list``: the emulated torch_npu APIs."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", default=True, help="list the emulated APIs (default)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from npufuse.emulate import REGISTRY, api_names

    rows = [REGISTRY[name] for name in api_names()]
    if args.json:
        print(json.dumps([
            {"name": a.name, "autograd": a.autograd, "spec": a.spec, "summary": a.summary,
             "verified": list(a.verified), "docs_only": list(a.docs_only), "held_by": list(a.held_by)}
            for a in rows
        ], indent=2))  # fmt: skip
        return 0
    table = Table(title=f"{len(rows)} torch_npu APIs emulated in plain PyTorch (numerics only, never NPU speed)")
    table.add_column("API")
    table.add_column("backward")
    table.add_column("spec §")
    table.add_column("what it computes")
    table.add_column("verified against torch_npu's tests")
    table.add_column("from docs/sources only")
    for a in rows:
        table.add_row(
            f"torch_npu.{a.name}", "yes" if a.autograd else "no", a.spec, a.summary,
            "; ".join(a.verified) or "nothing", "; ".join(a.docs_only) or "nothing",
        )
    Console().print(table)
    return 0
