"""Per-step loss and step time out of a trainer's output.

Built-in formats (tried in this order on each line until one matches; then the parser keeps to
that format, so a progress bar or an eval line in another shape cannot interleave):

``megatron``
    Megatron-LM / MindSpeed iteration lines::

        iteration       10/     100 | consumed samples: 80 | elapsed time per iteration (ms): 123.4 | ... | lm loss: 2.345E+00 | loss scale: 1.0 | grad norm: 1.234 |

    step = the iteration, step_time = elapsed ms / 1000, loss = ``lm loss`` (or ``loss``), grad_norm.
``hf``
    Hugging Face Trainer log dicts: ``{'loss': 2.3, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.01}``.
    They carry no step number: steps are numbered 1, 2, ... in order of appearance (one per
    logged dict, i.e. per ``logging_steps``), and no step time (see ``step_time_source``).
    Dicts without ``loss`` (eval, the final ``train_runtime`` summary) are skipped.
``step``
    ``step N loss X [step_time Y[s|ms]]`` with ``:``/``=`` separators, ``|`` or ``,`` between fields and
    an optional ``/total`` after N (npufuse's demo, many hand-written loops).

``--log-regex R`` replaces them all: a Python regex with named groups ``loss`` (required) and
optionally ``step`` and ``step_time`` (seconds); other named groups become extra numeric fields.

Only the first record of each step is kept: multi-rank launches print every step once per rank.
When the log gives no step time, the time between consecutive records' arrival (divided by
the steps between them) is used and marked ``step_time_source: "arrival"``; it includes logging
and is only as good as the trainer's flushing.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf(?:inity)?"


def to_float(text: str) -> float:
    return float(text.strip().lower())


@dataclass
class StepRecord:
    step: int | None
    loss: float
    step_time: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def _megatron(line: str) -> StepRecord | None:
    m = _MEGA_ITER.search(line)
    if not m:
        return None
    loss = _MEGA_LOSS.search(line)
    if not loss:
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(loss.group(1)))
    t = _MEGA_TIME.search(line)
    if t:
        rec.step_time = to_float(t.group(1)) / 1000.0
    g = _MEGA_GRAD.search(line)
    if g:
        rec.extra["grad_norm"] = to_float(g.group(1))
    tp = _MEGA_TPUT.search(line)
    if tp:
        rec.extra["throughput"] = to_float(tp.group(1))
    return rec


_MEGA_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+")
_MEGA_LOSS = re.compile(rf"\|\s*(?:lm\s+)?loss\s*:\s*({NUM})", re.I)
_MEGA_TIME = re.compile(rf"elapsed time per iteration \(ms\)\s*:\s*({NUM})", re.I)
_MEGA_GRAD = re.compile(rf"grad norm\s*:\s*({NUM})", re.I)
_MEGA_TPUT = re.compile(rf"throughput[^:|]*:\s*({NUM})", re.I)

_HF_DICT = re.compile(r"\{[^{}]*['\"]loss['\"]\s*:[^{}]*\}")
_HF_PAIR = re.compile(rf"['\"](\w+)['\"]\s*:\s*(?:np\.float\d*\()?({NUM})")


def _hf(line: str) -> StepRecord | None:
    m = _HF_DICT.search(line)
    if not m:
        return None
    pairs = {k: to_float(v) for k, v in _HF_PAIR.findall(m.group(0))}
    if "loss" not in pairs:
        return None
    step = pairs.pop("step", None)
    rec = StepRecord(step=int(step) if step is not None and math.isfinite(step) else None, loss=pairs.pop("loss"))
    for key in ("grad_norm", "learning_rate", "epoch"):
        if key in pairs:
            rec.extra[key] = pairs[key]
    return rec


_STEP = re.compile(rf"\bstep\b[\s:=#]*(\d+)(?:\s*/\s*\d+)?\b.*?\bloss\b\s*[:=]?\s*({NUM})", re.I)
_STEP_TIME = re.compile(rf"\bstep[_ ]?time\b\s*[:=]?\s*({NUM})\s*(ms|s)?\b", re.I)
_TOKENS = re.compile(rf"\btokens?[_/ ]?(?:per[_ ])?s(?:ec)?\b\s*[:=]?\s*({NUM})", re.I)
_GRAD = re.compile(rf"\bgrad[_ ]norm\b\s*[:=]?\s*({NUM})", re.I)


def _step(line: str) -> StepRecord | None:
    m = _STEP.search(line)
    if not m:
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)))
    t = _STEP_TIME.search(line)
    if t:
        rec.step_time = to_float(t.group(1)) / (1000.0 if (t.group(2) or "").lower() == "ms" else 1.0)
    tok = _TOKENS.search(line)
    if tok:
        rec.extra["tokens_per_s"] = to_float(tok.group(1))
    g = _GRAD.search(line)
    if g:
        rec.extra["grad_norm"] = to_float(g.group(1))
    return rec


BUILTIN: dict[str, Callable[[str], StepRecord | None]] = {"megatron": _megatron, "hf": _hf, "step": _step}


def compile_regex(pattern: str) -> re.Pattern[str]:
    """Validate ``--log-regex``: raises ``ValueError`` (a one-line reason) when it is unusable."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--log-regex does not compile: {exc}") from None
    if "loss" not in rx.groupindex:
        raise ValueError("--log-regex needs a named group `loss`, e.g. r'it (?P<step>\\d+) loss=(?P<loss>\\S+)'")
    return rx


def _regex_parser(rx: re.Pattern[str]) -> Callable[[str], StepRecord | None]:
    def parse(line: str) -> StepRecord | None:
        m = rx.search(line)
        if not m or m.group("loss") is None:
            return None
        try:
            groups = m.groupdict()
            rec = StepRecord(step=int(groups["step"]) if groups.get("step") else None, loss=to_float(groups["loss"]))
            if groups.get("step_time"):
                rec.step_time = to_float(groups["step_time"])
            for k, v in groups.items():
                if k not in ("step", "loss", "step_time") and v is not None:
                    try:
                        rec.extra[k] = to_float(v)
                    except ValueError:
                        pass
        except ValueError:
            return None
        return rec

    return parse


class LogParser:
    """Feed lines, get :class:`StepRecord` s with step numbers and step times filled in."""

    def __init__(self, regex: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.format: str | None = None
        self._parsers: dict[str, Callable[[str], StepRecord | None]] = {"regex": _regex_parser(compile_regex(regex))} if regex else dict(BUILTIN)
        self._seen: set[int] = set()
        self._count = 0
        self._clock = clock
        self._last: tuple[int, float] | None = None  # (step, arrival) of the previous record

    def feed(self, line: str) -> StepRecord | None:
        rec = None
        names = [self.format] if self.format else list(self._parsers)
        for name in names:
            try:
                rec = self._parsers[name](line)
            except (ValueError, OverflowError):
                rec = None
            if rec is not None:
                self.format = name
                break
        if rec is None:
            return None
        now = self._clock()
        if rec.step is None:
            rec.step = self._count + 1
        if rec.step in self._seen:
            return None
        self._seen.add(rec.step)
        self._count = max(self._count, rec.step)
        if rec.step_time is None and self._last is not None and rec.step > self._last[0]:
            rec.step_time = (now - self._last[1]) / (rec.step - self._last[0])
            rec.extra["step_time_source"] = "arrival"  # type: ignore[assignment]
        self._last = (rec.step, now)
        return rec


def record_json(candidate: int, run: str, rec: StepRecord) -> dict[str, Any]:
    """The DESIGN.md JSONL object for one step (extras after the documented fields)."""
    out: dict[str, Any] = {"candidate": candidate, "run": run, "step": rec.step, "loss": _json_float(rec.loss), "step_time": _json_float(rec.step_time)}
    for k, v in rec.extra.items():
        out[k] = _json_float(v) if isinstance(v, float) else v
    return out


def _json_float(v: float | None) -> float | str | None:
    """JSON has no NaN/Inf: they are written as the strings "nan"/"inf"/"-inf" (read back by jsonl)."""
    if v is None:
        return None
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v
