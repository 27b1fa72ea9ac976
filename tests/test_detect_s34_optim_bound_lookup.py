"""s34 optim34: a torch.optim class looked up at run time and bound to a name, called later
(stable-audio-tools' ``optimizer_fn = getattr(torch.optim, optimizer_type)``, equiformer_v2's
``optimizer = getattr(optim, optimizer)``, Sophia's ``opt_func = optimizer_dict[name]``, a dict literal read at
once). The guard tests the bound name's value, so a third-party entry of the table, or any class that is not
torch.optim's, runs the original call; a ``*tuple`` of positional arguments after params and lr is checked to
fit the fused class's positional slots (a generator, or a tuple too long, runs the original call)."""

from __future__ import annotations

import pytest

from npufuse.patterns.fused_optimizer import _TRAIN_RUN, FusedOptimizer
from pattern_harness import check_fuse_found, check_rewrite_runs, detect_all, example_cases

PATTERN = FusedOptimizer()

_RUN = _TRAIN_RUN  # build(model), three steps with a plain zero_grad(), the parameters out


def _example(name: str):
    return next(e for e in PATTERN.FUSE if e.name == name)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, prefix="s34_", kind="fuse"))
def test_s34_examples_are_found(pattern, example):
    check_fuse_found(pattern, example)


def test_table_entry_that_is_not_torch_optim_runs_the_original():
    """`signsgd` picks the repository's own class from the table: the guard keeps it, the result is the same."""
    code = _example("s34_table_entry_not_torch_is_guarded").code
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, _RUN, findings)
    assert facts["calls"] == 0, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999


def test_starred_generator_runs_the_original():
    """A `*` argument that is not a list or tuple (a generator has no len) fails the guard's test."""
    code = _example("s34_dict_literal_lookup_with_starred_positional").code.replace(
        "extra = (0.9,) if cls is torch.optim.SGD else ()", "extra = (m for m in (0.9,) if cls is torch.optim.SGD)")
    findings, _ = detect_all(PATTERN, code)
    assert findings
    facts = check_rewrite_runs(PATTERN, code, _RUN, findings)
    assert facts["calls"] == 0, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999


def test_starred_tuple_runs_the_fused_class_with_momentum():
    code = _example("s34_dict_literal_lookup_with_starred_positional").code
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, _RUN, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999


def test_binding_is_no_near_miss_of_its_own():
    """The construction reports itself: the getattr binding line gets no 'looked up by name' near miss."""
    code = _example("s34_config_lookup_bound_then_called_with_config_kwargs").code
    findings, near = detect_all(PATTERN, code)
    assert [f.line for f in findings] == [code.splitlines().index(
        '    optimizer = optimizer_fn(parameters, **optimizer_config["config"])') + 1]
    assert not [n for n in near if "looked up by name" in n.reason]


def test_local_table_read_by_a_bound_lookup_is_no_registry_near_miss():
    """`table = {...}` then `cls = table[name]`, `cls(...)` in one function: the construction is the candidate and
    the table's line no 'handed around as a value' near miss."""
    code = _example("s34_dict_literal_lookup_with_starred_positional").code.replace(
        '    cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]\n',
        '    table = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}\n    cls = table[name]\n')
    findings, near = detect_all(PATTERN, code)
    assert [f.params["class_looked_up"] for f in findings] == ["cls"]
    assert not [n for n in near if "handed around as a value" in n.reason], [n.reason for n in near]
