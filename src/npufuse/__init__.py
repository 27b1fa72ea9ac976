"""npufuse: find hand-written PyTorch that torch_npu fuses, rewrite it safely, prove it."""

__version__ = "0.1.0"
