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


# -- presets (issue 17 item 5): each framework's own lines, as its logging code prints them ---

NANOGPT = [  # train.py: the eval print at iter 0, then `iter {n}: loss {:.4f}, time {:.2f}ms, mfu {:.2f}%`
    "tokens per iteration will be: 491,520",
    "step 0: train loss 10.9876, val loss 10.9912",
    "iter 0: loss 10.9801, time 31562.11ms, mfu -100.00%",
    "iter 10: loss 9.1234, time 412.50ms, mfu 31.20%",
    "step 10: train loss 9.0, val loss 9.1",  # eval_interval hit: not a step
    "iter 20: loss 8.0001, time 410.00ms, mfu 31.25%",
]
LITGPT = [  # pretrain/finetune fabric.print; validate() prints `iter N: val loss X, val time: Y ms`
    "Seed set to 42",
    "iter 0: val loss 10.8123, val time: 812.33 ms",
    "Epoch 1 | iter 1 step 0 | loss train: 10.873, val: n/a | iter time: 1532.77 ms remaining time: 0:41:12",
    "Epoch 1 | iter 2 step 1 | loss train: 10.812, val: n/a | iter time: 512.20 ms (step) remaining time: 0:30:01",
    "Epoch 1 | iter 3 step 1 | loss train: 10.790, val: 10.812 | iter time: 0.51 s remaining time: 0:30:00",
]
TORCHTITAN = [  # metrics.py log(): coloured f-string through logging; log_validation: `validate step:`
    "[titan] 2025-03-10 09:12:01,233 - root - INFO - Training starts at step 1.",
    "[titan] 2025-03-10 09:12:05,101 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25160  \x1b[38;2;180;60;0mgrad_norm:  3.9876  "
    "\x1b[38;2;54;234;195mmemory: 24.71GiB(26.01%)  \x1b[34mtps: 1,034  \x1b[36mtflops: 60.02  \x1b[35mmfu: 6.07%\x1b[39m",
    "[titan] 2025-03-10 09:12:06,002 - root - INFO - \x1b[33mvalidate step:  1  \x1b[32mloss:  9.9000  \x1b[38;2;54;234;195mmemory: 24.71GiB(26.01%)  \x1b[34mtps: 3,100\x1b[39m",
    "[titan] 2025-03-10 09:12:06,900 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss: 11.90021  \x1b[38;2;180;60;0mgrad_norm:  3.5000  "
    "\x1b[38;2;54;234;195mmemory: 25.00GiB(26.30%)  \x1b[34mtps: 9,811  \x1b[36mtflops: 569.31  \x1b[35mmfu: 57.56%\x1b[39m",
]
MEGATRON = [  # training_log(); evaluate_and_print_results(): `validation loss at iteration N | lm loss value: ...`
    " [2024-11-02 10:01:12] iteration        1/    1000 | consumed samples:          256 | elapsed time per iteration (ms): 8412.3 | "
    "throughput per GPU (TFLOP/s/GPU): 181.2 | learning rate: 3.000000E-06 | global batch size:   256 | lm loss: 1.088762E+01 | "
    "loss scale: 1.0 | grad norm: 9.812 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "-" * 100,
    " validation loss at iteration 1 | lm loss value: 1.077000E+01 | lm loss PPL: 4.752101E+04 | ",
    " [2024-11-02 10:01:14] iteration        2/    1000 | consumed samples:          512 | elapsed time per iteration (ms): 2015.0 | "
    "learning rate: 6.000000E-06 | global batch size:   256 | lm loss: 1.071234E+01 | loss scale: 1.0 | grad norm: 8.100 |",
]
HF = [  # ProgressCallback.on_log → training_bar.write(str(logs)); tqdm redraws split at \r by the runner
    "  0%|          | 0/300 [00:00<?, ?it/s]",
    " 3%|▎         | 10/300 [00:05<02:25,  2.00it/s]",
    "{'loss': 2.5123, 'grad_norm': 4.1250, 'learning_rate': 4.9e-05, 'epoch': 0.03}",
    "{'eval_loss': 2.4, 'eval_runtime': 3.1, 'eval_samples_per_second': 64.5, 'eval_steps_per_second': 8.1, 'epoch': 0.03}",
    "{'loss': '2.301', 'grad_norm': '3.9', 'learning_rate': '4.8e-05', 'epoch': '0.07'}",
    "{'train_runtime': 150.2, 'train_samples_per_second': 16.0, 'train_steps_per_second': 2.0, 'train_loss': 2.2, 'epoch': 1.0}",
]
DEEPSPEED = [  # PipelineEngine.train_batch: `steps: N loss: X iter time (s): Y samples/sec: Z`
    "[2024-05-01 12:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]",
    "steps: 10 loss: 6.1234 iter time (s): 0.512 samples/sec: 62.500",
    "steps: 20 loss: 5.9001 iter time (s): 0.498 samples/sec: 64.257",
]


@pytest.mark.parametrize(
    "name, lines, steps, losses, times",
    [
        ("nanogpt", NANOGPT, [0, 10, 20], [10.9801, 9.1234, 8.0001], [31.56211, 0.4125, 0.41]),
        ("litgpt", LITGPT, [1, 2, 3], [10.873, 10.812, 10.790], [1.53277, 0.5122, 0.51]),
        ("torchtitan", TORCHTITAN, [1, 2], [12.2516, 11.90021], [None, "arrival"]),
        ("megatron", MEGATRON, [1, 2], [10.88762, 10.71234], [8.4123, 2.015]),
        ("hf", HF, [1, 2], [2.5123, 2.301], [None, "arrival"]),
        ("deepspeed", DEEPSPEED, [10, 20], [6.1234, 5.9001], [0.512, 0.498]),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "preset"])
def test_framework_presets(name: str, lines: list[str], steps: list[int], losses: list[float], times: list, mode: str) -> None:
    clock = iter(float(i) for i in range(100))
    p = LogParser(preset=None if mode == "auto" else name, clock=lambda: next(clock))
    recs = feed(p, lines)
    assert p.format == name  # auto-detection picks the framework's own preset, never a generic one
    assert [r.step for r in recs] == steps  # eval/validation lines are not steps
    assert [r.loss for r in recs] == pytest.approx(losses)
    for r, t in zip(recs, times):
        if t == "arrival":
            assert r.extra["step_time_source"] == "arrival"
        elif t is None:
            assert r.step_time is None
        else:
            assert r.step_time == pytest.approx(t)  # seconds, whatever the printed unit


def test_auto_detection_records_the_line_it_matched() -> None:
    p = LogParser()
    feed(p, NANOGPT)
    assert p.auto and p.detected_from == "iter 0: loss 10.9801, time 31562.11ms, mfu -100.00%"


def test_nanogpt_eval_line_no_longer_locks_the_generic_format() -> None:
    # before presets, "step 0: train loss X, val loss Y" locked `step` and every `iter` line was lost
    p = LogParser()
    assert p.feed("step 0: train loss 10.9876, val loss 10.9912") is None and p.format is None
    assert p.feed("iter 1: loss 10.5, time 400.00ms, mfu 30.00%") is not None and p.format == "nanogpt"


@pytest.mark.parametrize(
    "line, seconds",
    [
        ("step 3 loss 1.0 step_time 250us", 0.00025),
        ("step 3 loss 1.0 step_time 250ms", 0.25),
        ("step 3 loss 1.0 step_time 2.5s", 2.5),
        ("step 3 loss 1.0 step_time 2.5", 2.5),
        ("iter 3: loss 1.0, time 1.5s, mfu 1.00%", 1.5),
        (" iteration        3/      10 | elapsed time per iteration (s): 1.25 | lm loss: 1.0E+00 |", 1.25),
    ],
)
def test_units_are_normalised_to_seconds(line: str, seconds: float) -> None:
    (r,) = feed(LogParser(), [line])
    assert r.step_time == pytest.approx(seconds)


@pytest.mark.parametrize(
    "line",
    [
        "step 100 | val loss 2.31",
        "eval step 5: loss 1.2",
        "step 7 test_loss 0.4",
        "validation loss at iteration 20 | lm loss value: 2.0E+00 |",
        "iter 50: val loss 3.9, val time: 100.00 ms",
        "validate step: 4  loss: 3.1  memory: 1.00GiB(1.00%)  tps: 10",
        "{'eval_loss': 2.1, 'epoch': 1.0}",
    ],
)
def test_eval_lines_are_not_steps(line: str) -> None:
    p = LogParser()
    assert p.feed(line) is None and p.format is None


def test_fixed_preset_reads_only_its_own_shape() -> None:
    p = LogParser(preset="mindspeed")  # alias of megatron
    assert feed(p, ["step 1 loss 2.0", MEGATRON[0]])[0].step == 1 and p.format == "megatron"
    assert p.unread == ["step 1 loss 2.0"]


def test_unread_lines_are_kept_for_the_failure_message() -> None:
    p = LogParser()
    lines = ["starting", "epoch 1 batch 3 | training-loss=2.5", " 10%|#         | 1/10 [00:01<00:09, loss=2.5]"] + [f"it {i} loss~{i}" for i in range(10)]
    assert feed(p, lines) == []
    # only lines that mention a loss, not progress bars, at most MAX_UNREAD of them
    assert p.unread[0] == "epoch 1 batch 3 | training-loss=2.5" and len(p.unread) == LogParser.MAX_UNREAD


def test_unknown_preset_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="--log-format 'fairseq': unknown; choose from"):
        LogParser(preset="fairseq")


# -- through `verify e2e` -------------------------------------------------------------------

NANOGPT_WRAPPER = '''\
import subprocess, sys
print("step 0: train loss 9.9, val loss 9.9", flush=True)  # nanoGPT's eval line comes first
p = subprocess.Popen([sys.executable, "train.py"] + sys.argv[1:], stdout=subprocess.PIPE, text=True)
for line in p.stdout:
    _, step, _, loss, _, t = line.split()
    print(f"iter {step}: loss {loss}, time {float(t) * 1000:.2f}ms, mfu 1.00%", flush=True)
sys.exit(p.wait())
'''


def _e2e(sd, *extra: str, cmd: str) -> int:
    from npufuse.cli import main

    return main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", cmd, "--min-effect", "1000", *extra])


def test_e2e_auto_detects_nanogpt_and_says_so(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_verify_helpers import PY, fake_repo

    from npufuse.state import State

    sd = fake_repo(tmp_path)
    (tmp_path / "nano.py").write_text(NANOGPT_WRAPPER)
    assert _e2e(sd, "--steps", "20", cmd=f"{PY} nano.py --steps 40") == 0
    err = capsys.readouterr().err  # progress lines go to stderr
    assert "log format nanogpt (auto-detected from: 'iter 1: loss" in err
    runs = State.load(sd).candidates[1].evidence["e2e"]["runs"]
    assert runs["baseline"]["format"] == runs["fused"]["format"] == "nanogpt"
    assert runs["baseline"]["format_detected_from"].startswith("iter 1: loss")
    assert runs["fused"]["steps"] == 20 and runs["fused"]["output"]["truncated_lines"] == 0


def test_e2e_unreadable_log_names_the_options_and_shows_the_lines(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_verify_helpers import PY, fake_repo

    sd = fake_repo(tmp_path)
    (tmp_path / "odd.py").write_text("import fakemodel\nfor i in range(30):\n    print(f'epoch 1 batch {i} | training-loss=2.{i}', flush=True)\n")
    assert _e2e(sd, "--steps", "20", "--quiet", cmd=f"{PY} odd.py") == 2
    err = capsys.readouterr().err
    assert "--log-regex" in err and "--log-format" in err
    assert "could not read e.g. 'epoch 1 batch 0 | training-loss=2.0'" in err
    assert "lines that mention a loss but no format could read" in err and "epoch 1 batch 4 | training-loss=2.4" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--log-format", "fairseq"), "--log-format 'fairseq': unknown"),
        (("--log-format", "nanogpt", "--log-regex", "loss=(?P<loss>\\S+)"), "exclude each other"),
    ],
)
def test_e2e_log_format_errors_are_one_line(tmp_path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str) -> None:
    from test_verify_helpers import PY, fake_repo

    sd = fake_repo(tmp_path)
    assert _e2e(sd, "--quiet", *extra, cmd=f"{PY} train.py") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
