import os
import sys
from pathlib import Path

# tests import their shared harness modules (pattern_harness) by name
sys.path.insert(0, str(Path(__file__).parent))

# The real torch_npu wheel is unpacked (never imported) into .venv/torch-npu-docs by the Makefile;
# `npufuse api` reads its docs from there. Set the path when running pytest directly.
_DOCS = Path(__file__).resolve().parents[1] / ".venv" / "torch-npu-docs"
if "NPUFUSE_TORCH_NPU_PATH" not in os.environ and _DOCS.is_dir():
    os.environ["NPUFUSE_TORCH_NPU_PATH"] = str(_DOCS)

# A shell that starts a command in the background without job control (`make test &` in a script, a CI step run
# with `&`) starts it with SIGINT ignored, and every process it starts inherits that: the Ctrl-C tests (which send
# SIGINT to a scan or a run) would then test nothing but the ignore. Python installs its own handler only where
# SIGINT is not ignored, so put the default back here: pytest's workers and the processes they start behave as
# in a terminal.
import signal as _signal

if hasattr(_signal, "SIGINT") and _signal.getsignal(_signal.SIGINT) is _signal.SIG_IGN:
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)


# Bytecode (s47). This machine's environment, and CI's, sets PYTHONDONTWRITEBYTECODE=1: every interpreter the
# suite starts (each pytest worker, every `python -m npufuse` and verify subprocess) compiled npufuse's modules from
# source again, about 8 s of CPU each for the detectors alone (measured: importing the registry took 10.0 s without
# .pyc files, 2.0 s with them, at load 6). The variable forbids writing .pyc files, not reading them: compile the
# package once here, before pytest-xdist starts its workers (only where writing is off, and only what is stale).
# And pytest keeps its assertion-rewritten test modules only where writing bytecode is allowed: allow it while the
# test modules are collected, nothing else (no test runs then, so no temporary repository gets a __pycache__).
_SRC = Path(__file__).resolve().parents[1] / "src"


def pytest_configure(config) -> None:
    if sys.dont_write_bytecode and not hasattr(config, "workerinput") and _SRC.is_dir():
        import compileall

        compileall.compile_dir(str(_SRC), quiet=2, workers=0)


import pytest as _pytest


@_pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


# The cyclic garbage collector (s49). Each pytest process (every xdist worker) holds ~300,000 objects once it has
# collected the suite (torch, the detectors, all test modules and their parameters), and the tests allocate
# millions more (libcst trees in apply / revert, AST trees, exec'd examples): every automatic full collection
# traversed all of it again. Measured on test_apply_patterns (400 of its tests, one process): 9.8 s of ~40 s CPU
# in the collector, 1.7 s after this. What exists once collection is done lives for the whole session: moved out
# of the collector's reach (gc.freeze), and the collector runs less often (thresholds 7000 / 10 / 10 instead of
# 700 / 10 / 10). Only when cycles are reclaimed changes: no test's outcome depends on that, and tests that look
# at the collector (test_scan_structure_speed's garbage check, test_detect_s42_speed's freeze count) see the
# objects they make themselves, which are never frozen here. A test that unfreezes everything (s42's `keeping`
# fixture undoes engine's own freeze) gets the session's objects frozen again after it.
_GC_THRESHOLD = (7000, 10, 10)


def _freeze_session_objects() -> None:
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session) -> None:
    import gc

    _freeze_session_objects()
    gc.set_threshold(*_GC_THRESHOLD)


@_pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    import gc

    yield  # after the test's fixtures are torn down
    if gc.get_freeze_count() == 0 and nextitem is not None:
        _freeze_session_objects()


# Longest tests first (s45). pytest-xdist hands tests out in collection order; a 40-60 s test that a worker
# starts when the queue is nearly empty keeps the run going alone for that long while the other core idles.
# These tests (>= ~4 s each on 2 cores, measured at the end of s44) are moved to the front, longest first,
# so the last tests handed out are the short ones. Only the order changes: every test still runs. A name
# that no longer exists moves nothing; a new long test only costs its own tail until it is listed here.
_LONG_TESTS = (
    "test_installed_packages_flow.py::test_installed_model_full_flow",
    "test_example_nano_gpt.py::test_verify_op_then_e2e_all_gives_a_verdict_per_candidate",
    "test_installed_packages.py::test_patch_mode_scan_apply_verify_revert_keeps_site_packages_identical",
    "test_scan_prefilter.py::test_every_example_and_sample_file_analyses_the_same_with_the_fast_paths_off",
    "test_scan_prefilter.py::test_scope_listing_index_and_reads_match_the_references",
    "test_scan_prefilter.py::test_report_filters_remember_nothing_wrong",
    "test_verify_demo.py::test_demo_op_capture_e2e_and_broken_branch",
    "test_verify_demo.py::test_demo_killed_run_resumes",
    "test_fuzz_rewrite.py::test_random_spans_rewrite_and_revert_exactly",
    "test_scan_speed_paths.py::test_every_scope_words_declaration_holds_on_examples_and_files",
    "test_scan_speed_paths.py::test_called_more_often_matches_reference_on_every_detector_finding",
    "test_scan_bench.py::test_bench_scan_with_windows_line_ends_checks_every_replacement",
    "test_fuzz_rewrite.py::test_generated_programs_rewrite_and_revert_exactly",
    "test_scan_bench.py::test_bench_scan_ab_compares_two_source_trees",
    "test_installed_packages.py::test_wrapped_experts_forward_is_patched_inside_the_librarys_dispatch",
    "test_scan_prefilter.py::test_plain_classifier_agrees_with_the_tokenizer",
    "test_verify_e2e_process.py::test_cli_timeout_with_a_daemon_holding_the_output",
    "test_hostile_repo.py::test_two_concurrent_applies_keep_both_records",
    "test_example_nano_gpt.py::test_attention_under_autocast_fails_without_the_dtype_cast",
    "test_detect_s42_speed.py::test_torch_name_is_memoised_and_answers_as_the_alias_scan",
    "test_scan_speed_paths.py::test_every_example_scans_the_same_with_gates_on_and_off",
    "test_scan_speed_paths.py::test_every_declaration_holds_on_every_example_of_every_pattern",
    "test_verify_norm_swap.py::test_construction_swap_e2e_and_report_html",
    "test_apply_demo.py::test_demo_scan_apply_train_on_and_off",
    "test_fuzz_rewrite.py::test_page_breaks_between_definitions_change_no_finding",
    "test_fuzz_rewrite.py::test_findings_rewrite_and_revert_exactly",
    "test_fuzz_scan.py::test_scan_repo_reports_every_problem_per_file",
    "test_verify_trust.py::test_op_check_runs_in_the_users_interpreter",
    "test_emulate_install_probes.py::test_accelerate_and_peft_see_an_npu_under_install",
    "test_emulate_install_probes.py::test_accelerate_and_peft_see_no_npu_without_install",
)
_LONG_RANK = {name: rank for rank, name in enumerate(_LONG_TESTS)}


def pytest_collection_modifyitems(config, items) -> None:
    """Listed long tests first, in the list's order; every other test keeps its place (a stable sort).
    Every xdist worker collects and sorts alike, so the workers' lists agree."""

    def rank(item) -> int:
        file_and_function = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        return _LONG_RANK.get(file_and_function, len(_LONG_TESTS))

    items.sort(key=rank)
