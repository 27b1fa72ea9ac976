"""Sequence mining over one rank's op stream: knowledge-base matches, frequent n-grams, gaps.

The one invariant: a reported sequence never stitches ops of two modules together.

* Every op carries a *scope chain* (see trace.py). A window of ops is one module's when its
  chains share a non-empty common prefix (the scope) **and at least one op of the window sits
  directly in that scope**: the scope is the code that issued the sequence, the rest are its
  callees (``apply_rotary_pos_emb`` calling ``rotate_half``; a decoder layer's residual add followed
  by its child norm). Two sibling modules under one parent fail the second condition, two
  unrelated modules the first.
* Frequent n-grams are stricter still: counted only inside runs of ops with the *same* innermost
  scope, so they never need the check.
* Without call stacks the scope is unknown: windows are only bounded by stream and step, and every
  finding says its module could not be confirmed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npufuse.profile.kb import SURROGATES, TOKEN_BASE, KnowledgeBase, token_code, RegionRule, SequenceRule, compile_for_vocab, sanitize
from npufuse.profile.readers import KernelTable
from npufuse.profile.roofline import parse_shapes
from npufuse.profile.trace import HostOp, TraceInfo, kernel_links, kernel_links_by_time, location_frame


COMMUNICATION_PREFIXES = ("hcom_", "hccl", "lccl")


def is_communication(op_type: str) -> bool:
    """HCCL collectives and their waits (hcom_allReduce_, HcclAllReduce, ...): time spent on
    communication, reported apart from compute and never mined as a fusion sequence."""
    return op_type.lower().startswith(COMMUNICATION_PREFIXES)


@dataclass
class OpStream:
    """One rank's ops in (stream, start) order, column-wise."""

    rank: int
    level: str                    # "kernel" (device kernels) or "host" (aten ops, no device data)
    vocab: list[str]
    code: np.ndarray
    start: np.ndarray
    dur: np.ndarray
    stream: np.ndarray
    step: np.ndarray
    op: np.ndarray                # index into trace.ops, -1 unknown
    shape_code: np.ndarray
    shape_keys: list[tuple[str, str, str, str]]
    trace: TraceInfo | None = None
    name_vocab: list[str] = field(default_factory=list)
    name_code: np.ndarray | None = None
    step_source: str = "none"

    def __post_init__(self) -> None:
        self.end = self.start + self.dur
        n = self.code.shape[0]
        hard = np.ones(n, dtype=bool)
        if n > 1:
            hard[1:] = (self.stream[1:] != self.stream[:-1]) | (
                (self.step[1:] != self.step[:-1]) & (self.step[1:] >= 0) & (self.step[:-1] >= 0))
        # collectives are communication, never part of a fusable sequence: each one is a run of its own,
        # so neither the knowledge base nor the n-gram miner can take a window across one
        comm_vocab = np.array([is_communication(t) for t in self.vocab] + [False], dtype=bool)
        self.comm = comm_vocab[self.code] if n else np.zeros(0, dtype=bool)
        if n > 1:
            hard |= self.comm
            hard[1:] |= self.comm[:-1]
        self.hard = hard
        self.chains: list[tuple[int, ...] | None] | None = None
        self.scope = np.full(n, -1, dtype=np.int64)
        if self.trace is not None and (self.op >= 0).any():
            ops = self.trace.ops
            chains: list[tuple[int, ...] | None] = [None] * n
            for i in np.flatnonzero(self.op >= 0).tolist():
                c = ops[self.op[i]].chain
                chains[i] = c
                if c:
                    self.scope[i] = c[-1]
            self.chains = chains
        self.has_chain = self.scope >= 0
        self._cs = np.concatenate([[0], np.cumsum(self.has_chain)])

    @property
    def n(self) -> int:
        return int(self.code.shape[0])

    @property
    def confirmed_fraction(self) -> float:
        return float(self.has_chain.mean()) if self.n else 0.0

    def tokens(self, i: int, j: int) -> tuple[str, ...]:
        return tuple(self.vocab[c] for c in self.code[i:j].tolist())

    def host_op(self, i: int) -> HostOp | None:
        o = int(self.op[i])
        return self.trace.ops[o] if (self.trace is not None and o >= 0) else None

    # ------------------------------------------------------------------ module rule
    def scope_of(self, i: int, j: int) -> tuple[str, Any, Any]:
        """("ok", site, key) | ("unconfirmed", None, None) | ("reject", reason, None) for ops [i, j)."""
        known = int(self._cs[j] - self._cs[i])
        if known == 0:
            return "unconfirmed", None, None
        if known < j - i:
            return "reject", "some ops have no call stack / module while others do", None
        assert self.chains is not None
        chs = [c for c in self.chains[i:j] if c is not None]
        first = chs[0]
        depth = len(first)
        for c in chs[1:]:
            m = min(depth, len(c))
            k = 0
            while k < m and c[k] == first[k]:
                k += 1
            depth = k
            if depth == 0:
                break
        labels = self.trace.invocation_labels  # type: ignore[union-attr]
        if depth == 0:
            names = list(dict.fromkeys(labels[c[-1]] for c in chs))
            return "reject", "spans modules " + " | ".join(names), None
        if not any(len(c) == depth for c in chs):
            names = list(dict.fromkeys(labels[c[depth]] for c in chs))
            return "reject", f"spans sibling modules {' | '.join(names)} inside {labels[first[depth - 1]]}", None
        return "ok", *self._site(i, j, depth)

    def _site(self, i: int, j: int, depth: int) -> tuple[dict[str, Any], Any]:
        ops = [self.host_op(k) for k in range(i, j)]
        op0 = ops[0]
        assert op0 is not None and op0.chain is not None
        labels = self.trace.invocation_labels  # type: ignore[union-attr]
        if op0.chain_kind == "stack" and op0.frames:
            fr = op0.frames[depth - 1]
            lines = sorted({o.frames[depth - 1].line for o in ops if o and o.frames and len(o.frames) >= depth})
            inner = list(dict.fromkeys(str(o.frames[-1]) for o in ops if o and o.frames))
            site = {"file": fr.file, "line": fr.line, "lines": lines, "function": fr.func,
                    "frames": inner, "module": None, "stack": [str(f) for f in op0.frames[: depth - 1]]}
            return site, ("stack", fr.file, fr.func, tuple(lines))
        label = labels[op0.chain[depth - 1]]
        site = {"module": label, "file": None, "line": None, "lines": [], "function": None, "frames": [],
                "stack": []}
        if op0.frames:
            fr = location_frame(op0.frames)
            site.update(file=fr.file, line=fr.line, lines=[fr.line], function=fr.func,
                        frames=list(dict.fromkeys(str(location_frame(o.frames)) for o in ops if o and o.frames)))
        return site, (op0.chain_kind, label, site["file"], site["line"])


def build_kernel_stream(rank: int, table: KernelTable, trace: TraceInfo | None) -> OpStream:
    stream_col = table.stream
    linked_by_time = None
    if trace is not None and "stream" not in table.columns.used:
        # no Stream ID column (Level0): the trace's device lanes say which stream each kernel ran on
        ops_t, lanes = kernel_links_by_time(trace, table.start)
        if (lanes >= 0).any():
            # kernels the trace does not show keep lane -1: one stream of their own, never joined to another
            stream_col = lanes
            linked_by_time = ops_t
    order = np.lexsort((table.start, stream_col))
    start = table.start[order]
    stream = stream_col[order]
    if linked_by_time is not None:
        op = linked_by_time[order]
    else:
        op = kernel_links(trace, stream, start) if trace is not None else np.full(order.shape[0], -1, np.int64)
    step_src = "none"
    if table.step is not None and (table.step >= 0).any():
        step = table.step[order]
        step_src = "Step Id column"
    else:
        step = np.full(order.shape[0], -1, dtype=np.int64)
        if trace is not None and trace.steps:
            ops = trace.ops
            for i in np.flatnonzero(op >= 0).tolist():
                s = ops[op[i]].step
                if s is not None:
                    step[i] = s
            if (step >= 0).any():
                step_src = "ProfilerStep spans of trace_view.json"
    return OpStream(rank=rank, level="kernel", vocab=table.types, code=table.type_code[order], start=start,
                    dur=table.dur[order], stream=stream, step=step, op=op, shape_code=table.shape_code[order],
                    shape_keys=table.shape_keys, trace=trace, name_vocab=table.names,
                    name_code=table.name_code[order] if table.name_code is not None else None,
                    step_source=step_src)


def build_host_stream(rank: int, trace: TraceInfo) -> OpStream | None:
    """Top-level aten ops per thread: the op stream of a trace that has no device kernels."""
    idx: list[int] = []
    sid: list[int] = []
    for k, tid in enumerate(sorted(trace.host_streams, key=str)):
        idx.extend(trace.host_streams[tid])
        sid.extend([k] * len(trace.host_streams[tid]))
    if not idx:
        return None
    ops = trace.ops
    vocab: dict[str, int] = {}
    code = np.array([vocab.setdefault(sanitize(ops[i].name), len(vocab)) for i in idx], dtype=np.int32)
    start = np.array([ops[i].ts for i in idx])
    dur = np.array([ops[i].end - ops[i].ts for i in idx])
    stream = np.array(sid, dtype=np.int64)
    order = np.lexsort((start, stream))
    step = np.array([ops[i].step if ops[i].step is not None else -1 for i in idx], dtype=np.int64)
    return OpStream(rank=rank, level="host", vocab=list(vocab), code=code[order], start=start[order],
                    dur=dur[order], stream=stream[order], step=step[order],
                    op=np.array(idx, dtype=np.int64)[order], shape_code=np.zeros(len(idx), dtype=np.int32),
                    shape_keys=[("", "", "", "")], trace=trace,
                    step_source="ProfilerStep spans of trace_view.json" if (step >= 0).any() else "none")


# ---------------------------------------------------------------------------------- findings

@dataclass
class Finding:
    """All occurrences of one pattern with one token sequence at one source site."""

    pattern: str
    api: str
    kind: str
    tokens: tuple[str, ...]
    level: str
    first: int
    length: int
    site: dict[str, Any] | None
    confirmed: bool
    caveat: str | None = None
    source: str = ""
    count: int = 0
    kernel_us: float = 0.0
    span_us: float = 0.0
    kernels: int = 0
    steps: set[int] = field(default_factory=set)
    subsumed: Counter[str] = field(default_factory=Counter)
    aten: list[str] = field(default_factory=list)
    note: str | None = None
    longest_us: float = 0.0    # summed over occurrences: the longest kernel of each


class _MatchSpans:
    """The spans of one regex match, kept as numbers (start, end, then each checked element's)."""

    def __init__(self, row: np.ndarray, col: dict[int, int]) -> None:
        self.row, self.col = row, col

    def span(self, group: str | None = None) -> tuple[int, int]:
        if group is None:
            return int(self.row[0]), int(self.row[1])
        c = self.col[int(group[1:])]
        return int(self.row[c]), int(self.row[c + 1])


def _check_groups(checks: list[tuple[str, int]]) -> list[int]:
    """The pattern elements whose spans the checks read."""
    need: set[int] = set()
    for name, k in checks:
        if name == "feeds":
            need |= {k, k + 1}
        elif name != "no_int64":
            need.add(k)
    return sorted(need)


@dataclass
class Rejected:
    pattern: str
    tokens: tuple[str, ...]
    reason: str
    count: int = 0
    first_site: list[str] = field(default_factory=list)


class Miner:
    """Runs the knowledge base over one OpStream; results in ``findings`` / ``rejected``."""

    def __init__(self, st: OpStream, kb: KnowledgeBase) -> None:
        self.st = st
        self.kb = kb
        self.claimed = np.full(st.n, -1, dtype=np.int32)     # index into self.findings
        self.findings: list[Finding] = []
        self._by_key: dict[Any, int] = {}
        self.rejected: dict[Any, Rejected] = {}
        self._string()

    # token string: one character per op (its vocabulary code) and '|' at stream/step boundaries,
    # so every pattern is a sequence of character classes and the regex engine scans in C
    def _string(self) -> None:
        st = self.st
        self.words = [sanitize(t) for t in st.vocab]
        before = st.hard.copy()
        if st.n:
            before[0] = False
        pos = np.arange(st.n, dtype=np.int64) + np.cumsum(before)
        total = int(pos[-1]) + 1 if st.n else 0
        buf = np.full(total, ord("|"), dtype=np.uint32)
        pts = TOKEN_BASE + st.code.astype(np.uint32)
        # skip the surrogate code points (a vocabulary of more than ~35k kernel types reaches them)
        pts = np.where(pts >= SURROGATES[0], pts + (SURROGATES[1] - SURROGATES[0]), pts)
        buf[pos] = pts
        self.text = buf.astype("<u4").tobytes().decode("utf-32-le")
        self.tok_of = np.full(total + 1, -1, dtype=np.int64)
        self.tok_of[pos] = np.arange(st.n)
        self.pos_of = np.append(pos, total)

    def _tok(self, p: int) -> int:
        return int(self.tok_of[p])

    def _tok_end(self, p: int) -> int:
        return int(self.tok_of[p - 1]) + 1

    def _rx(self, rule: SequenceRule) -> Any:
        elems = rule.kernel_elems if self.st.level == "kernel" else rule.aten_elems
        if not elems:
            return None
        return compile_for_vocab(elems, self.words, rule.followed_by if self.st.level == "kernel" else None)

    def _add(self, rule_id: str, api: str, kind: str, i: int, j: int, site: Any, site_key: Any, confirmed: bool,
             caveat: str | None = None, source: str = "", tokens: tuple[str, ...] | None = None,
             note: str | None = None) -> int:
        st = self.st
        toks = tokens if tokens is not None else st.tokens(i, j)
        key = (rule_id, toks, site_key)
        g = self._by_key.get(key)
        if g is None:
            aten = []
            for k in range(i, j):
                op = st.host_op(k)
                aten.append(op.name if op else "")
            f = Finding(rule_id, api, kind, toks, st.level, i, j - i, site, confirmed, caveat, source,
                        aten=aten if any(aten) else [], note=note)
            g = self._by_key[key] = len(self.findings)
            self.findings.append(f)
        f = self.findings[g]
        f.count += 1
        f.kernels += j - i
        f.kernel_us += float(st.dur[i:j].sum())
        f.longest_us += float(st.dur[i:j].max())
        f.span_us += float(st.end[i:j].max() - st.start[i])
        s = int(st.step[i])
        if s >= 0:
            f.steps.add(s)
        self.claimed[i:j] = g
        return g

    def _reject(self, rule_id: str, i: int, j: int, reason: str) -> None:
        toks = self.st.tokens(i, j)
        r = self.rejected.setdefault((rule_id, toks, reason), Rejected(rule_id, toks, reason))
        r.count += 1
        if not r.first_site:
            for k in range(i, j):
                op = self.st.host_op(k)
                if op and op.frames:
                    r.first_site.append(str(location_frame(op.frames)))

    def _io(self, t: int) -> tuple[list[tuple[Any, str]], list[tuple[Any, str]]]:
        """(inputs, outputs) of kernel t as (shape, dtype) pairs; empty where the file has none."""
        key = self.st.shape_keys[int(self.st.shape_code[t])]
        def pairs(shapes: str, dtypes: str) -> list[tuple[Any, str]]:
            sh = parse_shapes(shapes)
            dt = [d.strip().strip('"').upper() for d in dtypes.strip().strip('"').split(";")] if dtypes.strip() else []
            return [(sh[k] if k < len(sh) else None, dt[k] if k < len(dt) else "") for k in range(max(len(sh), len(dt)))]
        return pairs(key[0], key[1]), pairs(key[2], key[3])

    def _element_tokens(self, m: Any, k: int) -> tuple[int, int] | None:
        a, b = m.span(f"e{k}")
        if a == b:
            return None
        return self._tok(a), self._tok_end(b) - 1

    def _check(self, rule: SequenceRule, m: Any, i: int) -> bool:
        return self._checks_hold(rule.checks, m)

    def _checks_hold(self, checks: list[tuple[str, int]], m: Any) -> bool:
        for name, k in checks:
            if name == "feeds":
                # dataflow evidence: the last kernel of element k produces a tensor (same shape and
                # dtype) that the first kernel of element k+1 takes in; no shapes is no evidence
                prod, cons = self._element_tokens(m, k), self._element_tokens(m, k + 1)
                if prod is None or cons is None:
                    return False
                outs = [o for o in self._io(prod[1])[1] if o[0] is not None and o[1]]
                ins = [x for x in self._io(cons[0])[0] if x[0] is not None and x[1]]
                if not outs or not ins or outs[0] not in ins:
                    return False
                continue
            if name == "no_int64":
                # index and counter arithmetic (INT64) is no candidate for a float affinity rewrite
                a, b = m.span()
                for t in range(self._tok(a), self._tok_end(b)):
                    ins, outs = self._io(t)
                    if any(d in ("INT64", "UINT64", "DT_INT64") for _, d in ins + outs):
                        return False
                continue
            if name == "bool_mask":
                el = self._element_tokens(m, k)
                if el is None or not any(d in ("BOOL", "DT_BOOL") for _, d in self._io(el[0])[0]):
                    return False   # integer indices (or no dtypes): not the boolean-mask form
                continue
            if name == "residual_add":
                a, b = m.span(f"e{k}")
                if a == b:
                    return False
                t = self._tok(a)
                key = self.st.shape_keys[int(self.st.shape_code[t])]
                shapes = parse_shapes(key[0])
                if shapes and (len(shapes) < 2 or shapes[0] != shapes[1] or not shapes[0]):
                    return False   # "+ eps" or a broadcast bias, not a residual add
        return True

    # ------------------------------------------------------------------ sequence rules
    def run_sequences(self) -> None:
        """Each rule scans the whole token string once (finditer, in C); matches are then
        accepted in bulk where the module is unknown, and one by one where call stacks exist."""
        st = self.st
        for rule in self.kb.sequences:
            rx = self._rx(rule)
            if rx is None:
                continue
            if rule.checks:
                need = _check_groups(rule.checks)
                col = {g: 2 + 2 * n for n, g in enumerate(need)}
                gs = [f"e{k}" for k in need]
                spans = [(m.start(), m.end(), *(x for g in gs for x in m.span(g))) for m in rx.finditer(self.text)
                         if m.end() > m.start()]
            else:
                spans = [m.span() for m in rx.finditer(self.text) if m.end() > m.start()]
            if not spans:
                continue
            arr = np.array(spans, dtype=np.int64)
            texts = None
            i = self.tok_of[arr[:, 0]]
            j = self.tok_of[arr[:, 1] - 1] + 1
            cc = self._claimed_cs()
            overlap = (cc[j] - cc[i]) > 0
            if overlap.any():
                self._count_subsumed(rule, i[overlap], j[overlap])
            ok = ~overlap
            for name, k in rule.checks:
                if name != "residual_add":
                    continue
                a_, b_ = arr[:, col[k]], arr[:, col[k] + 1]
                tok = self.tok_of[a_]
                ok &= (b_ > a_) & self._residual()[st.shape_code[np.clip(tok, 0, st.n - 1)]]
            # dataflow checks run after the module check, so a match across modules is reported as that
            dataflow = [c for c in rule.checks if c[0] != "residual_add"]
            known = st._cs[j] - st._cs[i]
            bulk = np.flatnonzero(ok & (known == 0))
            if dataflow:
                bulk = np.array([r for r in bulk.tolist() if self._checks_hold(dataflow, _MatchSpans(arr[r], col))],
                                dtype=np.int64)
            if bulk.size:
                self._add_bulk(rule, i[bulk], j[bulk], arr[bulk, 0], arr[bulk, 1])
            retry: list[tuple[int, int]] = []
            for k in np.flatnonzero(ok & (known > 0)).tolist():
                ii, jj = int(i[k]), int(j[k])
                status, site, key = st.scope_of(ii, jj)
                if status == "reject":
                    self._reject(rule.id, ii, jj, site)
                    retry.append((ii + 1, jj))
                    continue
                if dataflow and not self._checks_hold(dataflow, _MatchSpans(arr[k], col)):
                    continue
                self._add(rule.id, rule.api, "sequence", ii, jj, site, key, status == "ok", rule.caveat,
                          rule.source)
            for start_tok, stop_tok in retry:
                self._search_from(rule, rx, start_tok, stop_tok)

    def _search_from(self, rule: SequenceRule, rx: Any, start_tok: int, stop_tok: int) -> None:
        """After a cross-module rejection: a shorter match may start inside the rejected one."""
        st = self.st
        pos = int(self.pos_of[start_tok])
        stop = int(self.pos_of[stop_tok])
        while pos < stop:
            m = rx.search(self.text, pos)
            if m is None or m.start() >= stop:
                return
            i, j = self._tok(m.start()), self._tok_end(m.end())
            if m.end() == m.start() or (self.claimed[i:j] >= 0).any() or not self._check(rule, m, i):
                pos = int(self.pos_of[i + 1])
                continue
            status, site, key = st.scope_of(i, j)
            if status == "reject":
                self._reject(rule.id, i, j, site)
                pos = int(self.pos_of[i + 1])
                continue
            self._add(rule.id, rule.api, "sequence", i, j, site, key, status == "ok", rule.caveat, rule.source)
            pos = m.end()

    def _same_run(self, members: np.ndarray, a: np.ndarray, b: np.ndarray) -> bool:
        """All matches in ``members`` spell the same tokens (checked exactly, vectorised)."""
        codes = self.st.code
        i = self.tok_of[a[members]]
        n = int(b[members[0]] - a[members[0]])
        if n <= 0:
            return True
        win = codes[(i[:, None] + np.arange(n)[None, :]).clip(0, codes.size - 1)]
        return bool((win == win[0]).all())

    def _claimed_cs(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.claimed >= 0)])

    def _residual(self) -> np.ndarray:
        """Per shape key: does the kernel look like a residual add (two equal, non-scalar inputs)?
        Unknown shapes pass, so data without shapes still matches."""
        if getattr(self, "_res", None) is None:
            res = []
            for key in self.st.shape_keys:
                sh = parse_shapes(key[0])
                res.append(not sh or (len(sh) >= 2 and sh[0] == sh[1] and bool(sh[0])))
            self._res = np.array(res, dtype=bool)
        return self._res

    def _count_subsumed(self, rule: SequenceRule, i: np.ndarray, j: np.ndarray) -> None:
        own = np.where(self.claimed[i] >= 0, self.claimed[i], self.claimed[np.maximum(j - 1, 0)])
        for g, n in Counter(own.tolist()).items():
            if g >= 0 and rule.id in self.kb_subsumes(self.findings[g].pattern):
                self.findings[g].subsumed[rule.id] += n

    def _add_bulk(self, rule: SequenceRule, i: np.ndarray, j: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """Accept many unconfirmed-module matches at once, grouped by their token sequence."""
        st = self.st
        if getattr(self, "_csum", None) is None:
            self._csum = np.concatenate([[0.0], np.cumsum(st.dur)])
        kt = self._csum[j] - self._csum[i]
        end_pad = np.append(st.end, -np.inf)
        idx = np.empty(2 * i.size, dtype=np.int64)
        idx[0::2], idx[1::2] = i, j
        span = np.maximum.reduceat(end_pad, idx)[0::2] - st.start[i]
        longest = np.maximum.reduceat(np.append(st.dur, -np.inf), idx)[0::2]
        # the matches of one rule differ only in optional elements: few distinct texts, found by
        # (length, first, last token) and then confirmed on the text itself
        sig = (j - i) * (1 << 40) + st.code[i].astype(np.int64) * (1 << 20) + st.code[j - 1]
        by_text: dict[str, list[int]] = {}
        _, first_of, inv = np.unique(sig, return_index=True, return_inverse=True)
        for u, f0 in enumerate(first_of.tolist()):
            members = np.flatnonzero(inv == u)
            if members.size == 1 or len({self.text[a[k]:b[k]] for k in members[:: max(1, members.size // 64)]
                                         .tolist()}) == 1 and self._same_run(members, a, b):
                by_text.setdefault(self.text[a[f0]:b[f0]], []).extend(members.tolist())
            else:
                for k in members.tolist():
                    by_text.setdefault(self.text[a[k]:b[k]], []).append(k)
        for t, ks in by_text.items():
            sel = np.array(ks, dtype=np.int64)
            toks = tuple(st.vocab[token_code(ch)] for ch in t)
            key = (rule.id, toks, None)
            g = self._by_key.get(key)
            if g is None:
                i0 = int(i[sel[0]])
                g = self._by_key[key] = len(self.findings)
                self.findings.append(Finding(rule.id, rule.api, "sequence", st.tokens(i0, int(j[sel[0]])),
                                             st.level, i0, int(j[sel[0]] - i0), None, False, rule.caveat,
                                             rule.source))
            f = self.findings[g]
            f.count += int(sel.size)
            f.kernels += int((j[sel] - i[sel]).sum())
            f.kernel_us += float(kt[sel].sum())
            f.longest_us += float(longest[sel].sum())
            f.span_us += float(span[sel].sum())
            steps = st.step[i[sel]]
            f.steps |= set(np.unique(steps[steps >= 0]).tolist())
            lens = j[sel] - i[sel]
            flat = np.repeat(i[sel] - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
            self.claimed[flat] = g

    def kb_subsumes(self, pattern: str) -> list[str]:
        for r in self.kb.sequences:
            if r.id == pattern:
                return r.subsumes
        return []

    # ------------------------------------------------------------------ loops (per-expert matmuls)
    def run_loops(self) -> None:
        st = self.st
        if st.level != "kernel" or st.n < 8:
            return
        cb = np.cumsum(st.hard)
        for rule in self.kb.loops:
            hit = np.array([bool(rule.contains.match(sanitize(t))) for t in st.vocab], dtype=bool)
            for p in range(2, rule.max_period + 1):
                if st.n <= p * rule.min_repeats:
                    break
                eq = (st.code[p:] == st.code[:-p]) & (st.scope[p:] == st.scope[:-p]) & (cb[p:] == cb[:-p])
                for r, length in _runs(eq, p * (rule.min_repeats - 1)):
                    total = length + p
                    reps = total // p
                    block = st.code[r:r + p]
                    if not hit[block].any() or (self.claimed[r:r + reps * p] >= 0).mean() > 0.5:
                        continue
                    pos = [q for q in range(p) if hit[block[q]]]
                    varied = False
                    known = False
                    for q in pos:
                        codes = {int(st.shape_code[r + k * p + q]) for k in range(reps)}
                        if any(st.shape_keys[c][0].strip('" ') for c in codes):
                            known = True
                        varied |= len(codes) > 1
                    if (known and not varied) or (not known and st.scope[r] < 0):
                        continue   # identical repeats (layers) or nothing to tell experts apart
                    status, site, key = st.scope_of(r, r + reps * p)
                    if status == "reject":
                        self._reject(rule.id, r, r + p, site)
                        continue
                    g = self._add(rule.id, rule.api, "loop", r, r + reps * p, site, key, status == "ok",
                                  source=rule.source, tokens=st.tokens(r, r + p),
                                  note=f"{reps} repeats of a {p}-kernel block")
                    self.findings[g].note = f"{reps} repeats of a {p}-kernel block (per-expert loop)"

    # ------------------------------------------------------------------ regions (optimizers)
    def run_regions(self) -> None:
        for rule in self.kb.regions:
            self._optimizer_spans(rule)
            self._named_runs(rule)
            self._small_runs(rule)

    def _region_add(self, rule: RegionRule, i_idx: np.ndarray, label: str | None, note: str) -> None:
        st = self.st
        i, j = int(i_idx[0]), int(i_idx[-1]) + 1
        api = rule.api.replace("{optimizer}", label) if label else \
            rule.api.replace("{optimizer}", "<Optimizer>") + " (the NpuFused* class of the optimizer in use)"
        op = st.host_op(i)
        site, key = None, None
        if op is not None and op.frames:
            # the innermost frame of the user's code: a spawn bootstrap "<string>:1 <module>" or
            # torch/optim/sgd.py is no place to rewrite
            fr = location_frame(op.frames)
            site = {"file": fr.file, "line": fr.line, "lines": [fr.line], "function": fr.func,
                    "frames": [str(fr)], "module": op.module, "stack": [str(f) for f in op.frames[:-1]]}
            key = ("stack", fr.file, fr.func, fr.line)
        elif op is not None and op.module:
            site = {"module": op.module, "file": None, "line": None, "lines": [], "function": None,
                    "frames": [], "stack": []}
            key = ("module", op.module)
        types = list(dict.fromkeys(st.vocab[c] for c in st.code[i_idx].tolist()))
        g = self._add(rule.id, api, "region", i, j, site, key, site is not None, source=rule.source,
                      tokens=tuple(types), note=note)
        f = self.findings[g]
        # _add counted the whole [i, j) range; a region counts only its own kernels
        extra = (j - i) - i_idx.size
        if extra:
            f.kernels -= extra
            f.kernel_us -= float(st.dur[i:j].sum() - st.dur[i_idx].sum())
            f.longest_us -= float(st.dur[i:j].max() - st.dur[i_idx].max())
        self.claimed[i_idx] = g

    def _optimizer_spans(self, rule: RegionRule) -> None:
        st = self.st
        tr = st.trace
        if rule.span is None or tr is None or not tr.optimizer_spans or not (st.op >= 0).any():
            return
        linked = np.flatnonzero(st.op >= 0)
        ops = tr.ops
        ts = np.array([ops[o].ts for o in st.op[linked].tolist()])
        tids = [ops[o].tid for o in st.op[linked].tolist()]
        for cls, tid, a, b in tr.optimizer_spans:
            if rule.skip_optimizer is not None and rule.skip_optimizer.match(cls):
                continue
            mask = (ts >= a) & (ts <= b) & np.array([t == tid for t in tids])
            idx = linked[mask]
            idx = idx[self.claimed[idx] < 0]
            if idx.size:
                self._region_add(rule, idx, cls, f"Optimizer.step#{cls}.step: {idx.size} kernels per step")

    def _named_runs(self, rule: RegionRule) -> None:
        st = self.st
        if rule.kernel_names is None or st.name_code is None or not st.name_vocab:
            return
        hit = np.array([bool(rule.kernel_names.match(n)) for n in st.name_vocab], dtype=bool)[st.name_code]
        hit &= self.claimed < 0
        for r, length in _runs(hit, 2, breaks=st.hard):
            idx = np.arange(r, r + length)
            self._region_add(rule, idx, None, f"{length} multi-tensor (foreach) optimizer kernels in a row")

    def _small_runs(self, rule: RegionRule) -> None:
        st = self.st
        if rule.small_types is None or st.level != "kernel":
            return
        ok_t = np.array([bool(rule.small_types.match(sanitize(t))) for t in st.vocab], dtype=bool)
        hit = ok_t[st.code] & (st.dur <= rule.small_max_us) & (self.claimed < 0)
        for r, length in _runs(hit, rule.small_min, breaks=st.hard):
            idx = np.arange(r, r + length)
            self._region_add(rule, idx, None, f"{length} small element-wise kernels in a row "
                                              f"(per-parameter optimizer updates?)")


def _runs(mask: np.ndarray, min_len: int, breaks: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(start, length) of runs of True at least ``min_len`` long; ``breaks[i]`` starts a new run."""
    if mask.size == 0:
        return []
    m = mask.astype(bool)
    prev_off = np.concatenate([[True], ~m[:-1]])
    first = m & (prev_off | breaks) if breaks is not None else m & prev_off
    starts = np.flatnonzero(first)
    if starts.size == 0:
        return []
    run_id = np.cumsum(first)[m]          # 1-based run number of every True position
    lens = np.bincount(run_id, minlength=starts.size + 1)[1:]
    keep = lens >= min_len
    return list(zip(starts[keep].tolist(), lens[keep].tolist()))


# ---------------------------------------------------------------------------------- n-grams

@dataclass
class NGram:
    tokens: tuple[str, ...]
    first: int
    count: int
    kernel_us: float
    span_us: float
    pattern: str | None = None     # knowledge-base pattern claiming most of its occurrences
    mapped_by: str = ""            # "kb" (all occurrences inside a KB match) | "fullmatch" | ""
    longest_us: float = 0.0        # summed over occurrences: the longest kernel of each


BINCOUNT_KEYS = 1 << 25   # above this many n-gram keys, ids come from a sort instead of a bincount


def mine_ngrams(st: OpStream, claimed: np.ndarray, findings: list[Finding], kb: KnowledgeBase,
                nmin: int = 2, nmax: int = 8, top: int = 10, min_count: int = 2
                ) -> tuple[list[NGram], list[NGram]]:
    """Most frequent n-grams (by count, by total time) inside same-scope runs of one stream."""
    n_all = st.n
    if n_all < nmin:
        return [], []
    v = max(2, len(st.vocab))
    nmax = max(nmin, min(nmax, int(62 // math.log2(v + 1))))
    seg_start = st.hard | np.concatenate([[True], st.scope[1:] != st.scope[:-1]])
    seg = np.cumsum(seg_start)
    codes = st.code.astype(np.int64)
    csum = np.concatenate([[0.0], np.cumsum(st.dur)])
    # level by level, an n-gram id is (id of its (n-1)-gram prefix, last code): the key space stays
    # (distinct prefixes x vocabulary), small enough for bincount, so no level needs a sort
    prev = codes + 1                     # 1-gram ids, 0 = not a valid window
    cands: list[tuple[int, int, int, float, float, Any]] = []   # (n, id, count, kt, span, positions)
    for n in range(2, nmax + 1):
        m = n_all - n + 1
        if m <= 0:
            break
        valid = (prev[:m] > 0) & (seg[:m] == seg[n - 1:])
        key = np.where(valid, prev[:m] * v + codes[n - 1:], 0)
        if int(key.max(initial=0)) < BINCOUNT_KEYS:
            present = np.bincount(key, minlength=1) > 0
            present[0] = False
            remap = np.cumsum(present)
            ids = np.where(valid, remap[key], 0)
            d = int(remap[-1]) + 1
        else:
            # a huge vocabulary (tens of thousands of kernel types): the key space would not fit a
            # bincount (3.6e9 keys for 60k types); a sort of the keys present does the same
            uniq, inv = np.unique(key, return_inverse=True)
            ids = np.where(valid, inv + (0 if uniq[0] == 0 else 1), 0)
            d = int(uniq.size) + (0 if uniq[0] == 0 else 1)
        counts = np.bincount(ids, minlength=d)
        counts[0] = 0
        w_kt = np.where(valid, csum[n:n + m] - csum[:m], 0.0)
        w_span = np.where(valid, st.end[n - 1:n - 1 + m] - st.start[:m], 0.0)
        kt = np.bincount(ids, weights=w_kt, minlength=d)
        span = np.bincount(ids, weights=w_span, minlength=d)
        prev = ids
        good = counts >= min_count
        if not good.any():
            break
        sel = set(np.argsort(-np.where(good, kt, -1))[: top * 2].tolist())
        sel |= set(np.argsort(-np.where(good, counts, -1))[: top * 2].tolist())
        level_ids = ids
        for u in sel:
            if good[u]:
                cands.append((n, int(u), int(counts[u]), float(kt[u]), float(span[u]),
                              _Positions(level_ids, int(u))))
    by_time = _diverse(st, sorted(cands, key=lambda c: -c[3]), top)
    by_count = _diverse(st, sorted(cands, key=lambda c: (-c[2], -c[0])), top)
    out: list[list[NGram]] = []
    for lst in (by_time, by_count):
        res = []
        for n, _, count, kt, span, lazy in lst:
            positions = _non_overlapping(lazy.get(), n)
            p0 = int(positions[0])
            # count and time over distinct kernels: overlapping windows of a repeating run ("A A A A"
            # holds three "A A") would count a kernel twice and push the share past the step time
            count = int(positions.size)
            kt = float((csum[positions + n] - csum[positions]).sum())
            span = float((st.end[positions + n - 1] - st.start[positions]).sum())
            win = positions[:, None] + np.arange(n)[None, :]
            g = NGram(st.tokens(p0, p0 + n), p0, count, kt, span, longest_us=float(st.dur[win].max(axis=1).sum()))
            owners = claimed[win.ravel()]
            if (owners >= 0).all():
                c = Counter(owners.tolist()).most_common(1)[0][0]
                g.pattern, g.mapped_by = findings[c].pattern, "kb"
            else:
                name = kb.fullmatch(list(g.tokens), st.level)
                if name:
                    g.pattern, g.mapped_by = name, "fullmatch"
            res.append(g)
        out.append(res)
    return out[0], out[1]


def _non_overlapping(positions: np.ndarray, n: int) -> np.ndarray:
    """Leftmost-first occurrences that share no kernel (positions ascending)."""
    if positions.size < 2 or not (np.diff(positions) < n).any():
        return positions
    keep = []
    nxt = -1
    for p in positions.tolist():
        if p >= nxt:
            keep.append(p)
            nxt = p + n
    return np.array(keep, dtype=np.int64)


class _Positions:
    """Start positions of one n-gram, computed only when the greedy pick looks at it."""

    def __init__(self, ids: np.ndarray, u: int) -> None:
        self.ids, self.u, self._pos = ids, u, None

    def get(self) -> np.ndarray:
        if self._pos is None:
            self._pos = np.flatnonzero(self.ids == self.u)
        return self._pos


def _diverse(st: OpStream, ranked: list[tuple[int, int, int, float, float, np.ndarray]], top: int
             ) -> list[tuple[int, int, int, float, float, np.ndarray]]:
    """Greedy pick: skip an n-gram whose occurrences are mostly inside already picked ones, so the
    list is not ten shifted windows of the same repeating layer."""
    covered = np.zeros(st.n, dtype=bool)
    out = []
    for c in ranked:
        n, positions = c[0], c[5].get()
        win = (positions[:, None] + np.arange(n)[None, :]).ravel()
        if covered[win].mean() > 0.5:
            continue
        covered[win] = True
        out.append(c)
        if len(out) >= top:
            break
    return out


# ---------------------------------------------------------------------------------- gaps

def gap_report(st: OpStream, host_gap_us: float) -> dict[str, Any]:
    """Idle device time between consecutive compute kernels of each stream, split into host-bound
    gaps (the next kernel was launched only after the previous one ended) and other waits.

    Communication kernels are left out (their time is reported by ``communication_report``). The
    rank's figures are those of its main compute stream (most kernel time): idle time on a side
    stream (a DSA mask generator, a copy stream) overlaps the main one, and adding the streams up
    gave more than 100% of the step. Every compute stream is listed in ``per_stream``."""
    empty = {"wait_us": 0.0, "host_bound_us": 0.0, "host_bound_gaps": 0, "between_steps_us": 0.0,
             "method": "none", "largest": [], "stream": None, "per_stream": []}
    if st.level != "kernel" or st.n < 2:
        return empty
    compute = np.flatnonzero(~st.comm)
    if compute.size < 2:
        return empty
    launch = np.full(st.n, np.nan)
    if st.trace is not None:
        ops = st.trace.ops
        for i in np.flatnonzero(st.op >= 0).tolist():
            o = ops[st.op[i]]
            launch[i] = o.launch if o.launch is not None else o.ts
    per_stream = []
    for sid in np.unique(st.stream[compute]).tolist():
        idx = compute[st.stream[compute] == sid]
        r = _stream_gaps(st, idx, launch, host_gap_us)
        r["stream"] = int(sid)
        r["kernel_us"] = round(float(st.dur[idx].sum()), 3)
        per_stream.append(r)
    main = max(per_stream, key=lambda r: r["kernel_us"])
    return dict(main, per_stream=[{k: v for k, v in r.items() if k != "largest"} for r in per_stream])


def _stream_gaps(st: OpStream, idx: np.ndarray, launch: np.ndarray, host_gap_us: float) -> dict[str, Any]:
    if idx.size < 2:
        return {"wait_us": 0.0, "host_bound_us": 0.0, "host_bound_gaps": 0, "between_steps_us": 0.0,
                "method": "none", "largest": []}
    start, end, step = st.start[idx], st.end[idx], st.step[idx]
    # kernels of one stream run one after another; the idle time is what the running end leaves
    run_end = np.maximum.accumulate(end)
    step_change = step[1:] != step[:-1]
    gap = np.clip(start[1:] - run_end[:-1], 0, None)
    between = float(gap[step_change].sum())
    gap = np.where(step_change, 0.0, gap)
    nxt_launch = launch[idx[1:]]
    by_trace = ~np.isnan(nxt_launch)
    host = np.where(by_trace, nxt_launch >= run_end[:-1] - 1e-3, gap > host_gap_us) & (gap > 0)
    host_us = float(gap[host].sum())
    order = np.argsort(-gap)[:5]
    largest = []
    for k in order.tolist():
        if gap[k] <= 0:
            break
        largest.append({"gap_us": round(float(gap[k]), 3), "after": st.vocab[st.code[idx[k]]],
                        "before": st.vocab[st.code[idx[k + 1]]], "step": int(step[k + 1]),
                        "host_bound": bool(host[k])})
    method = "trace launch times" if by_trace.any() else f"gaps > {host_gap_us:g} us (no trace: suspected)"
    if by_trace.any() and not by_trace.all():
        method = f"trace launch times where linked, else gaps > {host_gap_us:g} us"
    # the host's time to dispatch one kernel, where the trace shows it: the median interval between
    # the launches of consecutive kernels of this stream
    lt = launch[idx]
    steps_ = np.diff(lt)
    steps_ = steps_[np.isfinite(steps_) & (steps_ > 0)]
    dispatch = float(np.median(steps_)) if steps_.size else 0.0
    idle = gap[gap > 0]
    return {"wait_us": round(float(gap[~host].sum()), 3), "host_bound_us": round(host_us, 3),
            "host_bound_gaps": int(host.sum()), "between_steps_us": round(between, 3), "method": method,
            "largest": largest, "dispatch_us": round(dispatch, 3),
            "median_gap_us": round(float(np.median(idle)), 3) if idle.size else 0.0}


def _union_us(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged [a, b) intervals."""
    if a.size == 0:
        return a, b
    o = np.argsort(a, kind="stable")
    a, b = a[o], np.maximum.accumulate(b[o])
    new = np.concatenate([[True], a[1:] > b[:-1]])
    starts = a[new]
    ends = np.maximum.reduceat(b, np.flatnonzero(new))
    return starts, ends


def _overlap_us(s1: np.ndarray, e1: np.ndarray, s2: np.ndarray, e2: np.ndarray) -> float:
    """Time covered by both sets of disjoint, sorted intervals."""
    total = 0.0
    j = 0
    for a, b in zip(s1.tolist(), e1.tolist()):
        while j < s2.size and e2[j] <= a:
            j += 1
        k = j
        while k < s2.size and s2[k] < b:
            total += min(b, float(e2[k])) - max(a, float(s2[k]))
            k += 1
    return total


def communication_report(st: OpStream) -> dict[str, Any]:
    """Time on HCCL collectives: its wall-clock cover, the part overlapped by compute kernels and
    the exposed rest (which no kernel fusion can shorten)."""
    if st.level != "kernel" or not st.comm.any():
        return {"kernels": 0, "time_us": 0.0, "overlapped_us": 0.0, "exposed_us": 0.0, "by_type": {}}
    c = st.comm
    cs, ce = _union_us(st.start[c], st.end[c])
    ks, ke = _union_us(st.start[~c], st.end[~c])
    cover = float((ce - cs).sum())
    overlapped = _overlap_us(cs, ce, ks, ke) if ks.size else 0.0
    by_type: dict[str, float] = {}
    for code, d in zip(st.code[c].tolist(), st.dur[c].tolist()):
        by_type[st.vocab[code]] = by_type.get(st.vocab[code], 0.0) + d
    return {"kernels": int(c.sum()), "time_us": round(cover, 3), "overlapped_us": round(overlapped, 3),
            "exposed_us": round(cover - overlapped, 3),
            "by_type": {k: round(v, 3) for k, v in sorted(by_type.items(), key=lambda x: -x[1])}}
