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
