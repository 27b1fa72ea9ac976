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
