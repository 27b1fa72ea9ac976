"""Per-step loss and step time out of a trainer's output.

Built-in presets (``--log-format NAME``; by default every preset is tried on each line in this
order until one matches, then the parser keeps to that preset, so a progress bar or an eval
line in another shape cannot interleave, and the chosen one is reported). Step times are
normalised to seconds whatever unit the trainer prints (``us``, ``ms``, ``s``). Eval/validation
lines are never steps.

``megatron`` (alias ``mindspeed``)
    Megatron-LM / MindSpeed ``training_log`` lines::

        [2024-06-01 10:00:00] iteration       10/     100 | consumed samples: 80 | elapsed time per iteration (ms): 123.4 | ... | lm loss: 2.345E+00 | loss scale: 1.0 | grad norm: 1.234 |

    step = the iteration, step_time = elapsed ms, loss = ``lm loss`` (or ``loss``), grad_norm.
    ``validation loss at iteration N | lm loss value: ...`` is an eval line (no ``/total``).
``torchtitan``
    the metrics logger's line (ANSI colours stripped)::

        [titan] ... - INFO - step:  10  loss:  7.1234  grad_norm:  1.2345  memory: 10.50GiB(11.04%)  tps: 1,234  tflops: 56.78  mfu: 5.74%

    ``validate step: N  loss: X`` is eval. No step time printed: arrival times are used.
``litgpt``
    ``fabric.print`` of pretrain/finetune::

        Epoch 1 | iter 10 step 5 | loss train: 4.123, val: n/a | iter time: 345.67 ms (step) remaining time: 0:12:34

    step = ``iter`` (unique per line; ``step`` repeats under gradient accumulation); also the
    older ``iter 10: loss 4.1234, iter time: 123.45ms``. ``iter N: val loss X`` is eval.
``nanogpt``
    ``iter 10: loss 4.2345, time 123.45ms, mfu 12.34%``; the eval line
    ``step 0: train loss X, val loss Y`` is not a step.
``deepspeed``
    the pipeline engine's ``steps: 10 loss: 6.1234 iter time (s): 0.512 samples/sec: 62.500``
    (also ``step: 10 / 100 loss: ...``).
``hf``
    Hugging Face Trainer log dicts: ``{'loss': 2.3, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.01}``
    (numbers may be quoted). They carry no step number: steps are numbered 1, 2, ... in order of
    appearance (one per logged dict, i.e. per ``logging_steps``), and no step time (see
    ``step_time_source``). Dicts without ``loss`` (``eval_loss``, the final ``train_runtime``
    summary) are skipped; tqdm bar redraws (split at ``\\r`` by the runner) are progress, not steps.
``step``
    the generic ``step N loss X [step_time Y[s|ms]]`` with ``:``/``=`` separators, ``|`` or ``,``
    between fields and an optional ``/total`` after N (npufuse's demo, many hand-written loops).
    A line naming val/eval/test anywhere is not a step.

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
    # each parser first looks for a literal keyword: `in` is ~50x cheaper than a regex scan
    # on a long non-matching line, and most lines of a noisy launch match nothing
    if "iteration" not in line:
        return None
    m = _MEGA_ITER.search(line)
    if not m:
        return None
    loss = _MEGA_LOSS.search(line)
    if not loss:
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(loss.group(1)))
    t = _MEGA_TIME.search(line)
    if t:
        rec.step_time = seconds(t.group(2), t.group(1))
    g = _MEGA_GRAD.search(line)
    if g:
        rec.extra["grad_norm"] = to_float(g.group(1))
    tp = _MEGA_TPUT.search(line)
    if tp:
        rec.extra["throughput"] = to_float(tp.group(1))
    return rec


_MEGA_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+")
_MEGA_LOSS = re.compile(rf"\|\s*(?:lm\s+)?loss\s*:\s*({NUM})", re.I)
_MEGA_TIME = re.compile(rf"elapsed time per iteration \((us|ms|s)\)\s*:\s*({NUM})", re.I)
_MEGA_GRAD = re.compile(rf"grad norm\s*:\s*({NUM})", re.I)
_MEGA_TPUT = re.compile(rf"throughput[^:|]*:\s*({NUM})", re.I)

_HF_DICT = re.compile(r"\{[^{}]*['\"]loss['\"]\s*:[^{}]*\}")
# newer Trainers may print the values as strings ('loss': '2.303'); numpy scalars as np.float64(x)
_HF_PAIR = re.compile(rf"['\"](\w+)['\"]\s*:\s*['\"]?(?:np\.float\d*\()?({NUM})")


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


_UNIT_S = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "": 1.0}


def seconds(value: str, unit: str | None) -> float:
    """A printed duration in seconds (``us``/``ms``/``s``; no unit: seconds)."""
    return to_float(value) * _UNIT_S[(unit or "").lower()]


# a line that names an evaluation is never a training step (nanoGPT's "step 0: train loss X, val loss Y")
_EVAL = re.compile(r"(?<![A-Za-z])(?:val|valid|validation|validate|eval|evaluation|evaluating|test)(?![A-Za-z])", re.I)
_STEP = re.compile(rf"\bstep\b[\s:=#]*(\d+)(?:\s*/\s*\d+)?\b.*?\bloss\b\s*[:=]?\s*({NUM})", re.I)
_STEP_TIME = re.compile(rf"\bstep[_ ]?time\b\s*[:=]?\s*({NUM})\s*(us|ms|s)?\b", re.I)
_TOKENS = re.compile(rf"\btokens?[_/ ]?(?:per[_ ])?s(?:ec)?\b\s*[:=]?\s*({NUM})", re.I)
_GRAD = re.compile(rf"\bgrad[_ ]norm\b\s*[:=]?\s*({NUM})", re.I)


def _step(line: str) -> StepRecord | None:
    low = line.lower()
    if "step" not in low or "loss" not in low:
        return None
    m = _STEP.search(line)
    if not m or _EVAL.search(line):
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)))
    t = _STEP_TIME.search(line)
    if t:
        rec.step_time = seconds(t.group(1), t.group(2))
    tok = _TOKENS.search(line)
    if tok:
        rec.extra["tokens_per_s"] = to_float(tok.group(1))
    g = _GRAD.search(line)
    if g:
        rec.extra["grad_norm"] = to_float(g.group(1))
    return rec


_NANOGPT = re.compile(rf"\biter\s+(\d+):\s*loss\s+({NUM}),\s*time\s+({NUM})\s*(us|ms|s)\b(?:,\s*mfu\s+({NUM})%)?")


def _nanogpt(line: str) -> StepRecord | None:
    if "iter" not in line:
        return None
    m = _NANOGPT.search(line)
    if not m:
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)), step_time=seconds(m.group(3), m.group(4)))
    if m.group(5) is not None:
        rec.extra["mfu_percent"] = to_float(m.group(5))
    return rec


_LITGPT = re.compile(rf"\biter\s+(\d+)\s+step\s+\d+\s*\|\s*loss train:\s*({NUM})")
_LITGPT_OLD = re.compile(rf"\biter\s+(\d+):\s*loss\s+({NUM}),\s*iter time:\s*({NUM})\s*(us|ms|s)\b")
_LITGPT_TIME = re.compile(rf"\biter time:\s*({NUM})\s*(us|ms|s)\b")


def _litgpt(line: str) -> StepRecord | None:
    if "iter" not in line:
        return None
    m = _LITGPT.search(line)
    if m:
        rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)))
        t = _LITGPT_TIME.search(line, m.end())
        if t:
            rec.step_time = seconds(t.group(1), t.group(2))
        return rec
    m = _LITGPT_OLD.search(line)
    if m:
        return StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)), step_time=seconds(m.group(3), m.group(4)))
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TITAN = re.compile(rf"(?<!validate )\bstep:\s*(\d+)\s+loss:\s*({NUM})")
_TITAN_HINT = re.compile(r"\b(?:tps|wps|memory|mfu|tflops):")
_TITAN_TIME = re.compile(rf"\belapsed_time_per_step:\s*({NUM})\s*(us|ms|s)\b")


def _torchtitan(line: str) -> StepRecord | None:
    if "step:" not in line:
        return None
    plain = _ANSI.sub("", line)
    m = _TITAN.search(plain)
    if not m or not _TITAN_HINT.search(plain, m.end()):
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)))
    g = _GRAD.search(plain, m.end())
    if g:
        rec.extra["grad_norm"] = to_float(g.group(1))
    t = _TITAN_TIME.search(plain, m.end())
    if t:
        rec.step_time = seconds(t.group(1), t.group(2))
    return rec


_DS = re.compile(rf"\bsteps?:\s*(\d+)(?:\s*/\s*\d+)?\s+loss:\s*({NUM})")
_DS_TIME = re.compile(rf"\biter time \((us|ms|s)\):\s*({NUM})")
_DS_TPUT = re.compile(rf"\bsamples/sec:\s*({NUM})")


def _deepspeed(line: str) -> StepRecord | None:
    if "iter time (" not in line:
        return None
    m = _DS.search(line)
    if not m:
        return None
    t = _DS_TIME.search(line, m.end())
    if not t:
        return None
    rec = StepRecord(step=int(m.group(1)), loss=to_float(m.group(2)), step_time=seconds(t.group(2), t.group(1)))
    tp = _DS_TPUT.search(line, t.end())
    if tp:
        rec.extra["samples_per_s"] = to_float(tp.group(1))
    return rec


# Auto-detection order: the most specific shapes first, the generic `step N loss X` last.
PRESETS: dict[str, Callable[[str], StepRecord | None]] = {
    "megatron": _megatron,
    "torchtitan": _torchtitan,
    "litgpt": _litgpt,
    "nanogpt": _nanogpt,
    "deepspeed": _deepspeed,
    "hf": _hf,
    "step": _step,
}
ALIASES = {"mindspeed": "megatron", "transformers": "hf"}
PRESET_NAMES = sorted([*PRESETS, *ALIASES])
BUILTIN = PRESETS  # the name older callers used

_PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+")  # a tqdm bar redraw


def preset_name(name: str) -> str:
    """``--log-format`` value → preset name; raises ``ValueError`` (one line) when unknown."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"--log-format {name!r}: unknown; choose from {', '.join(PRESET_NAMES)} (or auto, or --log-regex)")
    return key


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
    """Feed lines, get :class:`StepRecord` s with step numbers and step times filled in.

    ``preset`` (a :data:`PRESETS` name or alias) fixes the format; without it and without
    ``regex``, every preset is tried until one matches (``format`` says which, ``detected_from``
    the line it matched). ``unread`` keeps a few lines that mention a loss but that no format
    could read: the failure message shows them."""

    MAX_UNREAD = 5

    def __init__(self, regex: str | None = None, clock: Callable[[], float] = time.monotonic, preset: str | None = None) -> None:
        self.format: str | None = None
        self.detected_from: str | None = None
        self.unread: list[str] = []
        if regex:
            self._parsers: dict[str, Callable[[str], StepRecord | None]] = {"regex": _regex_parser(compile_regex(regex))}
        elif preset and preset != "auto":
            name = preset_name(preset)
            self._parsers = {name: PRESETS[name]}
        else:
            self._parsers = dict(PRESETS)
        self.auto = not regex and (not preset or preset == "auto")
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
                if self.format is None:
                    self.format, self.detected_from = name, line[:200]
                break
        if rec is None:
            if len(self.unread) < self.MAX_UNREAD and "loss" in line.lower() and not _PROGRESS.search(line):
                self.unread.append(line[:200])
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
