"""Renderers over the plain profile result dict: rich terminal tables and the markdown section."""

from __future__ import annotations

from typing import Any


def fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} us"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def location_text(loc: dict[str, Any] | None) -> str:
    """'model.py:31,136 forward' (basename); the module label when there are no frames."""
    if not loc:
        return "unconfirmed"
    if loc.get("file"):
        lines = loc.get("lines") or ([loc["line"]] if loc.get("line") else [])
        name = str(loc["file"]).replace("\\", "/").rsplit("/", 1)[-1]
        text = f"{name}:{','.join(str(x) for x in lines)}"
        if loc.get("function"):
            text += f" {loc['function']}"
        return text
    return str(loc.get("module") or "unconfirmed")


def seq_text(kernels: list[str], limit: int = 8) -> str:
    if len(kernels) <= limit:
        return " > ".join(kernels)
    return " > ".join(kernels[:limit]) + f" > ... ({len(kernels)})"


def _roof_cells(s: dict[str, Any]) -> list[str]:
    r = s["roofline"]
    ai = r.get("intensity")
    return [fmt_pct(s.get("share")), str(s.get("kernels_launched", "")), fmt_bytes(r.get("bytes")),
            fmt_bytes(r.get("bytes_fused")), "-" if ai is None else f"{ai:g}", r["verdict"],
            f"{r['speedup_max']:.2f}x", fmt_pct(s.get("step_saving_max"))]


def assumptions_text(a: dict[str, Any]) -> str:
    return (f"{a['soc']}: peak bandwidth {a['peak_bw_gbs']:g} GB/s, peak {a['peak_tflops']:g} TFLOP/s "
            f"(ridge {a['ridge_flop_per_byte']:g} FLOP/B), shortest fused kernel {a['launch_us']:g} us; "
            f"set with --peak-bw / --peak-tflops / --launch-us")


def input_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for r in result["inputs"]:
        parts = []
        for name, f in r["files"].items():
            if name == "kernel_details.csv":
                cols = f.get("columns") or {}
                used = ", ".join(f"{k}={v}" for k, v in (cols.get("used") or {}).items())
                extra = f"; {cols.get('ignored_metric_columns', 0)} aic_/aiv_ metric columns ignored" if cols else ""
                parts.append(f"{name} ({f['rows']} rows, {f.get('reader')} reader; columns used: {used}{extra})")
                for note in f.get("notes") or []:
                    parts.append(f"  note: {note}")
            elif name == "trace_view.json":
                what = "call stacks" if f.get("call_stacks") else "no call stacks"
                if f.get("module_events"):
                    what += ", nn.Module events"
                parts.append(f"{name} ({f['events']} events, {what})")
            else:
                rows = f.get("rows", f.get("steps", 0))
                parts.append(f"{name} ({rows} rows)")
        out.append(f"rank {r['rank']}: {r['label']}: {r['ops']} {r['level'] or ''} ops, "
                   f"steps from {r['step_source']}")
        out += [f"  {p}" for p in parts]
    return out


def render_terminal(result: dict[str, Any], console: Any = None) -> None:
    import shutil

    from rich.console import Console
    from rich.table import Table

    # a pipe gets 80 columns from rich; the roofline table needs more to stay readable
    con = console or Console(width=max(shutil.get_terminal_size((160, 24)).columns, 140))
    t = result["totals"]
    con.print(f"[bold]npufuse profile[/bold]: {t['ranks']} rank(s), step time {fmt_us(t['step_time_us'])}, "
              f"device kernel time {fmt_us(t['device_time_us'])}" + (" (per rank, the largest)" if t['ranks'] > 1 else ""))
    for line in input_lines(result):
        con.print(line, highlight=False, markup=False)
    con.print(f"module: {result['module_note']}", highlight=False)
    con.print(f"assumptions: {assumptions_text(result['assumptions'])}", highlight=False, markup=False)

    def roof(s: dict[str, Any]) -> list[str]:
        r = s["roofline"]
        ai = r.get("intensity")
        return [fmt_pct(s.get("share")), fmt_bytes(r.get("bytes")), "-" if ai is None else f"{ai:g}",
                r["verdict"], f"{r['speedup_max']:.2f}x"]

    heads = ["share", "bytes", "FLOP/B", "verdict", "speed-up<="]
    tab = Table(title="Fusion candidates (knowledge base)", title_justify="left")
    for h in ["id", "pattern / fused API", "sequence", "count", "time"] + heads + ["location"]:
        tab.add_column(h, overflow="fold")
    for f in result["fusions"]:
        tab.add_row(f["id"], f"{f['pattern']}\n{f['api']}", seq_text(f["kernels"], 6), str(f["count"]),
                    fmt_us(f["time_us"]), *roof(f), location_text(f.get("location")))
    con.print(tab)
    if result["rejected"]:
        rt = Table(title="Not reported: the match spans modules", title_justify="left")
        for h in ("pattern", "sequence", "count", "reason"):
            rt.add_column(h, overflow="fold")
        for r in result["rejected"]:
            rt.add_row(r["pattern"], seq_text(r["kernels"]), str(r["count"]), r["reason"])
        con.print(rt)
    ut = Table(title="Frequent sequences no fused API covers (where a new fusion could pay)", title_justify="left")
    for h in ["sequence", "count", "time"] + heads + ["location"]:
        ut.add_column(h, overflow="fold")
    for s in result["unmapped"]:
        ut.add_row(seq_text(s["kernels"], 6), str(s["count"]), fmt_us(s["time_us"]), *roof(s),
                   location_text(s.get("location")))
    con.print(ut)
    ct = Table(title="Most repeated sequences (by count)", title_justify="left")
    for h in ("sequence", "count", "time", "pattern"):
        ct.add_column(h, overflow="fold")
    for s in result["sequences"]["by_count"]:
        ct.add_row(seq_text(s["kernels"]), str(s["count"]), fmt_us(s["time_us"]), s.get("pattern") or "-")
    con.print(ct)
    g = result["gaps"]
    con.print(f"gaps between kernels: wait {fmt_us(g['wait_us'])} ({fmt_pct(g.get('wait_share'))} of step time); "
              f"host-bound {fmt_us(g['host_bound_us'])} in {g['host_bound_gaps']} gaps "
              f"({fmt_pct(g.get('host_bound_share'))}; {g['method']}); between steps {fmt_us(g['between_steps_us'])}",
              highlight=False)
    c = result.get("communication") or {}
    if c.get("kernels"):
        con.print(f"communication (HCCL collectives, not fusable): {fmt_us(c['time_us'])} "
                  f"({fmt_pct(c.get('share'))} of step time), exposed {fmt_us(c['exposed_us'])} "
                  f"({fmt_pct(c.get('exposed_share'))}), overlapped by compute {fmt_us(c['overlapped_us'])}",
                  highlight=False)
    for p in result["problems"]:
        con.print(f"[yellow]problem[/yellow]: {_problem_text(p)}", highlight=False)


def _problem_text(p: dict[str, Any]) -> str:
    where = p["file"]
    if p.get("row") is not None:
        where += f", row {p['row']}"
    if p.get("column"):
        where += f", column '{p['column']}'"
    return f"{where}: {p['message']}"


MD_WIDTH = 100


def md_text(text: str) -> str:
    """Plain text for markdown: '<module>' and '<string>' would be read as HTML tags and vanish.
    Escaping '<' is enough to keep it text ('A > B' mid-line is plain text). Code spans (`...`) are
    left as they are: markdown shows them literally."""
    parts = text.split("`")
    return "`".join(p if k % 2 else p.replace("&", "&amp;").replace("<", "&lt;") for k, p in enumerate(parts))


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(md_text(c).replace("|", "\\|") for c in cells) + " |"


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table when every line fits MD_WIDTH columns; else each row folded into a list item
    with one wrapped line per column (a 15-column table cannot fit)."""
    lines = [_md_row(head), _md_row(["---"] * len(head))] + [_md_row(r) for r in rows]
    if all(len(x) <= MD_WIDTH for x in lines):
        return lines
    import textwrap

    out: list[str] = []
    for r in rows:
        out += textwrap.wrap(f"- {md_text(r[0])}", MD_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
        for h, c in zip(head[1:], r[1:]):
            out += textwrap.wrap(f"{h}: {md_text(c)}", MD_WIDTH, initial_indent="  - ", subsequent_indent="    ",
                                 break_on_hyphens=False, break_long_words=True)
    return out


def render_markdown(result: dict[str, Any], title: str = "Profile: fusable operator sequences") -> str:
    """The report section for ``npufuse profile --markdown FILE``."""
    t = result["totals"]
    out = [f"## {title}", "",
           f"{t['ranks']} rank(s), step time {fmt_us(t['step_time_us'])}, device kernel time "
           f"{fmt_us(t['device_time_us'])}{' (per rank, the largest)' if t['ranks'] > 1 else ''}. "
           f"Module attribution: {result['module_note']}.", "",
           f"Assumptions: {assumptions_text(result['assumptions'])}. Bytes are estimated from kernel shapes and "
           f"dtypes; the speed-up is an upper bound (the fused kernel reads the sequence's external inputs and "
           f"writes its last outputs once, at peak rate, or at the shortest kernel time).", "",
           "### Fusion candidates (roofline)", ""]
    heads = ["share of step", "kernels", "bytes", "fused bytes", "FLOP/B", "verdict", "speed-up <=", "step saving <="]
    out += _md_table(["id", "pattern", "fused API", "sequence", "count", "time"] + heads + ["location"],
                     [[f["id"], f"`{f['pattern']}`", f"`{f['api']}`", seq_text(f["kernels"], 12),
                       str(f["count"]), fmt_us(f["time_us"]), *_roof_cells(f), location_text(f.get("location"))]
                      for f in result["fusions"]])
    notes = [f for f in result["fusions"] if f.get("caveat") or f.get("note") or f["roofline"].get("notes")]
    if notes:
        out.append("")
        for f in notes:
            bits = [x for x in (f.get("caveat"), f.get("note")) if x] + list(f["roofline"].get("notes") or [])
            out.append(f"- {f['id']} `{f['pattern']}`: " + md_text("; ".join(bits)))
    out += ["", "### Frequent sequences no fused API covers", ""]
    if result["unmapped"]:
        out += _md_table(["sequence", "count", "time"] + heads + ["location"],
                         [[seq_text(s["kernels"], 12), str(s["count"]), fmt_us(s["time_us"]), *_roof_cells(s),
                           location_text(s.get("location"))] for s in result["unmapped"]])
        # where the measured pipe utilisation contradicts a verdict, the table alone would mislead
        said = [s for s in result["unmapped"] if (s["roofline"].get("pipes") or {}).get("note")]
        if said:
            out.append("")
            out += [f"- {md_text(seq_text(s['kernels'], 12))}: {md_text(s['roofline']['pipes']['note'])}"
                    for s in said]
    else:
        out.append("None.")
    if result["rejected"]:
        out += ["", "### Matches not reported because they span modules", ""]
        for r in result["rejected"]:
            out.append(f"- `{r['pattern']}` {md_text(seq_text(r['kernels']))} ({r['count']}x): {md_text(r['reason'])}")
    g = result["gaps"]
    out += ["", "### Waiting and host-bound time (not fusion)", "",
            f"- wait between kernels: {fmt_us(g['wait_us'])} ({fmt_pct(g.get('wait_share'))} of step time)",
            f"- host-bound gaps: {fmt_us(g['host_bound_us'])} in {g['host_bound_gaps']} gaps "
            f"({fmt_pct(g.get('host_bound_share'))}); method: {g['method']}",
            f"- between steps: {fmt_us(g['between_steps_us'])}"]
    c = result.get("communication") or {}
    if c.get("kernels"):
        out += [f"- communication (HCCL collectives, not fusable): {fmt_us(c['time_us'])} "
                f"({fmt_pct(c.get('share'))} of step time); exposed {fmt_us(c['exposed_us'])} "
                f"({fmt_pct(c.get('exposed_share'))}), overlapped by compute {fmt_us(c['overlapped_us'])}"]
    out += ["", "### Inputs", ""] + [f"- {line.strip()}" for line in input_lines(result)]
    if result["problems"]:
        out += ["", "### Input problems", ""] + [f"- {md_text(_problem_text(p))}" for p in result["problems"]]
    return "\n".join(out) + "\n"
