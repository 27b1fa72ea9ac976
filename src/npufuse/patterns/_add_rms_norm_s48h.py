"""s48 ho25fix: a forward installed on a transformers Gemma-family decoder layer (HO25b mamba-vla paligemma/utils.py:78
and :131: ``def _gemma_decoder_layer_custom_forward(self: "GemmaDecoderLayer", ...)`` in a file importing
``transformers.models.gemma.modeling_gemma`` / ``gemma2``).

s37 reads such forwards for files importing a Llama-family model (the norm checked at run time to be one of
transformers' Llama-style RMSNorm classes). The Gemma families build their decoder norms from GemmaRMSNorm /
Gemma2RMSNorm / Gemma3RMSNorm, one forward in transformers 4.38 - 4.5x: ``output = self._norm(x.float()); output =
output * (1.0 + self.weight.float()); return output.type_as(x)`` with ``_norm = x * rsqrt(x.pow(2).mean(-1,
keepdim=True) + self.eps)``: float32 statistics and gain, rounded once to x's dtype, eps in ``eps``. That is
npu_rms_norm(x, 1 + weight.float(), eps)[0] (spec 2.1 names the ``1 + weight`` gamma; a float32 gamma with a half x
is the mixed mode), the reading add_rms_norm's external-norm path already renders for a class whose name says Gemma
(``_OFFSET_NAME``: gamma ``(1.0 + w.float())``, output in the sum's dtype). Fused only under a run-time check that the
module's type is exactly one of those classes from transformers (a Gemma3n norm, whose forward differs, or any
other class runs the original call). Read only where the file imports a Gemma family and no Llama family (a file
importing both keeps s37's Llama reading: its run-time check then never holds for a Gemma norm, so it is exact).
"""

from __future__ import annotations

import ast
import re
from typing import Any

_HF_GEMMA_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm", "GemmaRMSNorm")
_HF_GEMMA_FAMILY = re.compile(r"transformers\.(?:models\.(?:gemma|gemma2|gemma3|paligemma)(?:\.modeling_\w+)?"
                              r"(?:\.(?:Gemma|Gemma2|Gemma3|PaliGemma)\w*)?|(?:Gemma|Gemma2|Gemma3|PaliGemma)\w*)$")


def gemma_installed_norm(module: Any, scope: Any, call: ast.Call, attr: str, installed: Any, NormCall: Any) -> Any:
    """The external-norm reading of ``self.<attr>`` in a forward installed on a Gemma-family layer, or None."""
    from npufuse.patterns import _site as S

    if S.torch_name(module) is None or not installed_on_gemma(module, scope, installed):
        return None
    mod = f"self.{attr}"
    names = ", ".join(f'"{n}"' for n in _HF_GEMMA_NORMS)
    check = f'type({mod}).__name__ in ({names}) and type({mod}).__module__.startswith("transformers.")'
    return NormCall(call, attr, "external",
                    cls=f"a transformers Gemma-style RMSNorm ((1 + weight) gain) at run time (`self` of `{scope.qualname}`, "
                        "a forward installed on another module)",
                    conditions=[check])


def installed_on_gemma(module: Any, scope: Any, installed: Any) -> bool:
    """A function of no class installed on a Gemma-family layer (see :func:`gemma_installed_norm`)."""
    return any(_HF_GEMMA_FAMILY.match(v) for v in module.aliases.values()) and installed(module, scope, _HF_GEMMA_FAMILY)
