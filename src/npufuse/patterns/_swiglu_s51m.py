"""s51 (late51misc, HO28a myllm): a sigmoid called through an activation *object* is the sigmoid form of SiLU.

``self.sigmoid = nn.Sigmoid()`` in ``__init__`` and ``x * self.sigmoid(x)`` in ``forward`` (or an inline
``ACT2FN["sigmoid"](x)``): :func:`swiglu.classify_call` read the object's kind as SIGMOID but put its argument in
``gate`` (the slot of an activation applied to its operand), so the sigmoid-form pairing (``z * sigmoid(z)``), which
reads ``sigmoid_arg``, never saw it: no finding and no near miss. The call computes ``sigmoid(arg)`` exactly as
``torch.sigmoid(arg)`` does (an ``nn.Sigmoid`` has no state), so it is given the same shape as the functional
spelling; the product checks (same operand, beta 1) then decide as for ``torch.sigmoid``. Every reader of
``classify_call`` (swiglu, geglu, add_rms_norm, moe_experts) sees the same canonical SiLU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .swiglu import Act


def sigmoid_object_as_form(act: Act | None) -> Act | None:
    """``act`` with a sigmoid object's operand moved from ``gate`` to ``sigmoid_arg`` (the functional form's shape).

    Only a plain SIGMOID kind read from an object (``obj`` set, no config key, no beta): a config-chosen activation
    stays what it is (its kind is decided at run time)."""
    if act is None or act.kind != "sigmoid" or act.gate is None or act.sigmoid_arg is not None or act.config_key is not None:
        return act
    act.sigmoid_arg, act.gate = act.gate, None
    return act
