"""torch_npu's own comparison rule, re-implemented for the ported upstream goldens.

``torch_npu.testing.testcase.TestCase.assertRtolEqual(x, y, prec=1e-4, prec16=1e-3)`` is what
op-plugin's and torch_npu's op tests assert with; porting their tolerances means porting this
rule, not substituting ``torch.testing.assert_close``:

* two bfloat16 tensors: ``torch.allclose(x, y, rtol=prec16, atol=prec16)``;
* float16 arrays use ``prec16``, float32/float64/int arrays ``prec``: an element passes when
  ``|y - x| <= prec`` (absolute) or ``|y - x| / (max(|x|, |y|) + tiny) <= prec`` (relative); the
  comparison fails only if both criteria have more than ``size * prec`` failing elements;
* shapes and (numpy) dtypes must be equal; NaNs must be in the same places.
"""

from __future__ import annotations

import numpy as np
import torch

_TINY16 = 6e-8
_TINY = 10e-10


def _numpy(t: object) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy()
    return np.asarray(t)


def rtol_equal(x: object, y: object, prec: float = 1e-4, prec16: float = 1e-3) -> bool:
    """True when torch_npu's ``assertRtolEqual(x, y, prec, prec16)`` would pass."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16:
            return x.shape == y.shape and torch.allclose(x.float().cpu(), y.float().cpu(), rtol=prec16, atol=prec16)
    a, b = _numpy(x), _numpy(y)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.bool_:
        return bool(np.equal(a, b).all())
    pre, tiny = (prec16, _TINY16) if a.dtype == np.float16 else (prec, _TINY)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    nan = np.isnan(a64)
    if not np.equal(nan, np.isnan(b64)).all():
        return False
    diff = np.abs(np.where(nan, 0.0, b64 - a64))
    deno = np.maximum(np.abs(a64), np.abs(b64))
    atol_fail = int((diff > pre).sum())
    rtol_fail = int((diff / (deno + tiny) > pre).sum())
    if atol_fail == 0 or rtol_fail == 0:
        return True
    return not (rtol_fail > a.size * pre and atol_fail > a.size * pre)


def assert_rtol_equal(x: object, y: object, prec: float = 1e-4, prec16: float = 1e-3) -> None:
    assert rtol_equal(x, y, prec, prec16), f"assertRtolEqual(prec={prec}, prec16={prec16}) fails"
