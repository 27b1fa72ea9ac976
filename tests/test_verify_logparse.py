"""Log parsing: every built-in trainer format, --log-regex, and the step bookkeeping."""

from __future__ import annotations

import math

import pytest

from npufuse.verify.logparse import LogParser, compile_regex, record_json


def feed(parser: LogParser, lines: list[str]):
    return [r for r in (parser.feed(ln) for ln in lines) if r is not None]


def test_megatron_iteration_lines() -> None:
    lines = [
        "building GPT model ...",
        " iteration       10/     100 | consumed samples:           80 | elapsed time per iteration (ms): 123.4 | learning rate: 1.000E-04 | global batch size:     8 | lm loss: 2.345678E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |",
        " iteration       20/     100 | consumed samples:          160 | elapsed time per iteration (ms): 120.0 | lm loss: 2.100000E+00 | grad norm: 0.9 |",
        " [after training is done] datetime: 2024-01-01",
    ]
    p = LogParser()
    recs = feed(p, lines)
    assert p.format == "megatron"
    assert [r.step for r in recs] == [10, 20]
    assert recs[0].loss == pytest.approx(2.345678) and recs[0].step_time == pytest.approx(0.1234)
    assert recs[0].extra["grad_norm"] == pytest.approx(1.234)


def test_mindspeed_plain_loss_and_nan() -> None:
    p = LogParser()
    (r,) = feed(p, [" iteration        3/      50 | elapsed time per iteration (ms): 99.0 | loss: nan | grad norm: inf |"])
    assert r.step == 3 and math.isnan(r.loss) and math.isinf(r.extra["grad_norm"])


def test_hf_trainer_dicts() -> None:
    lines = [
        "  2%|▏         | 10/500 [00:05<04:05,  2.00it/s]",
        "{'loss': 2.3021, 'grad_norm': 1.52, 'learning_rate': 4.9e-05, 'epoch': 0.02}",
        "{'eval_loss': 2.1, 'eval_runtime': 1.0}",
        "{'loss': 2.1, 'grad_norm': np.float64(1.1), 'learning_rate': 4.8e-05, 'epoch': 0.04}",
        "{'loss': nan, 'grad_norm': nan, 'learning_rate': 4.7e-05, 'epoch': 0.06}",
        "{'train_runtime': 10.0, 'train_samples_per_second': 5.0, 'train_loss': 2.2, 'epoch': 1.0}",
    ]
    clock = iter([0.0, 1.0, 3.0])
    p = LogParser(clock=lambda: next(clock))
    recs = feed(p, lines)
    assert p.format == "hf"
    assert [r.step for r in recs] == [1, 2, 3]  # numbered in order: HF dicts carry no step
    assert recs[0].loss == pytest.approx(2.3021) and recs[1].extra["grad_norm"] == pytest.approx(1.1)
    assert math.isnan(recs[2].loss)
    # no step time in HF dicts: arrival deltas, marked as such
    assert recs[0].step_time is None and recs[1].step_time == pytest.approx(1.0) and recs[2].step_time == pytest.approx(2.0)
    assert recs[1].extra["step_time_source"] == "arrival"


@pytest.mark.parametrize(
    "line, step, loss, step_time",
    [
        ("step 1 loss 5.5432 step_time 0.0123", 1, 5.5432, 0.0123),
        ("Step 7/100 | loss: 2.5e+00 | step_time: 45ms", 7, 2.5, 0.045),
        ("[rank0] step=12, loss=0.75, tokens_per_s=1234.5", 12, 0.75, None),
        ("step: 3 loss = -inf", 3, -math.inf, None),
    ],
)
def test_step_loss_lines(line: str, step: int, loss: float, step_time: float | None) -> None:
    (r,) = feed(LogParser(), [line])
    assert r.step == step and r.loss == loss
    assert r.step_time == (pytest.approx(step_time) if step_time is not None else None)


def test_step_format_ignores_step_time_word_and_duplicates() -> None:
    p = LogParser()
    recs = feed(p, ["warmup: step_time 0.1 loss 3", "step 1 loss 2.0", "step 1 loss 2.0", "step 2 loss 1.9"])
    # "step_time ... loss" is not a step line; the second rank's copy of step 1 is dropped
    assert [(r.step, r.loss) for r in recs] == [(1, 2.0), (2, 1.9)]


def test_format_locks_after_first_match() -> None:
    p = LogParser()
    recs = feed(p, ["step 1 loss 2.0 step_time 0.1", "{'loss': 9.9}", "step 2 loss 1.9 step_time 0.1"])
    assert p.format == "step" and [r.loss for r in recs] == [2.0, 1.9]


def test_log_regex_named_groups() -> None:
    p = LogParser(r"it (?P<step>\d+) \| l=(?P<loss>\S+) \| t=(?P<step_time>\S+)s \| gn=(?P<grad_norm>\S+)")
    recs = feed(p, ["noise", "it 4 | l=1.25 | t=0.5s | gn=0.3", "step 5 loss 9"])
    assert p.format == "regex" and len(recs) == 1
    r = recs[0]
    assert (r.step, r.loss, r.step_time, r.extra["grad_norm"]) == (4, 1.25, 0.5, 0.3)
    assert record_json(2, "fused", r) == {"candidate": 2, "run": "fused", "step": 4, "loss": 1.25, "step_time": 0.5, "grad_norm": 0.3}


def test_log_regex_without_step_numbers_in_order() -> None:
    recs = feed(LogParser(r"loss=(?P<loss>[\d.]+)"), ["loss=3.0", "loss=2.0"])
    assert [r.step for r in recs] == [1, 2]


@pytest.mark.parametrize("bad, why", [(r"(?P<step>\d+)", "named group `loss`"), (r"(?P<loss>", "does not compile")])
def test_log_regex_validation(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        compile_regex(bad)


def test_record_json_nonfinite_as_strings() -> None:
    (r,) = feed(LogParser(), ["step 1 loss nan step_time inf"])
    assert record_json(1, "baseline", r)["loss"] == "nan" and record_json(1, "baseline", r)["step_time"] == "inf"
