"""s51 perf51b: an exact gate for rms_norm's root parse in scopes whose only ``sqrt`` is ``math.sqrt``.

``rms_norm._reaches_root`` let every scope whose text holds "sqrt" through to the statement-by-statement parse
(``scope_results``). Attention's ``scores / math.sqrt(head_dim)`` put most attention forwards there, where the parse
yields nothing. Why it cannot yield anything there, reader by reader:

* every finding and near miss of ``scope_results`` hangs on an inverse-square-root node (the proof in
  ``_reaches_root``'s docstring); a ``math.sqrt(e)`` call is such a node only by its spelling ``.sqrt(...)``:
  ``_call_of(node, "torch.sqrt", "sqrt")`` then gives the operand ``math`` (the receiver, not ``e``);
* ``_rstd`` peels that operand: ``math`` bound only by ``import math`` peels to no ``+`` (no BinOp, no ``.add``
  call), so ``_rstd`` returns None -- no match, no near miss;
* the eps-outside branch (``x / (math.sqrt(..) + eps)``) asks ``_reads_a_mean(math)``: the peeled name holds no
  call, False, so its near miss is not raised;
* ``_root_text`` / ``_root_lines`` (``_attribute_misses``, ``_already_fused_statistics`` through ``_rstd_sites``)
  exclude ``math.sqrt`` by name (the regex's lookbehind; ``_rstd_sites`` by canonical name).

So "sqrt" counts for the gate unless every occurrence of it in the scope's text is a bare ``math.sqrt`` (no word
character or ``.`` before ``math``, nothing but ``.`` between), the scope never spells the name ``math`` otherwise
(a parameter, an assignment, ``import`` inside it, ``global``: any binding has ``math`` not followed by ``.``), and
the file spells the bare name ``math`` without a following ``.`` only in ``import math`` lines (so the parse's name
following finds the module, never a value). Anything else -- a comment "sqrt(d)", ``x.sqrt()``, ``self.math.sqrt``,
``math .sqrt``, ``from math import sqrt`` -- keeps the old answer (True). The other conditions of ``_reaches_root``
(``pow``, aliases, helper names, ``**``) are asked as before.
"""

from __future__ import annotations

import re

from npufuse.scan.dataflow import ModuleInfo

_MATH_SQRT = re.compile(r"(?<![\w.])math\.sqrt")
_BARE_MATH_NOT_DOTTED = re.compile(r"(?<![\w.])math(?![\w.])")
_IMPORT_MATH_LINE = re.compile(r"^[ \t]*import[ \t]+math[ \t]*(?:#[^\n]*)?$", re.M)


def _file_binds_math_by_import_only(module: ModuleInfo) -> bool:
    """Every bare ``math`` of the file not followed by ``.`` is an ``import math`` line's (cached per file)."""
    cached = module.__dict__.get("_npufuse_s51b_math_import_only")
    if cached is None:
        src = module.source
        bare = len(_BARE_MATH_NOT_DOTTED.findall(src))
        cached = module.__dict__["_npufuse_s51b_math_import_only"] = bare > 0 and bare == len(_IMPORT_MATH_LINE.findall(src))
    return cached


def sqrt_only_of_math(module: ModuleInfo, text: str) -> bool:
    """True where every "sqrt" of ``text`` (a scope's text) is a ``math.sqrt`` of the math module (see above):
    then "sqrt" is no reason for the root parse. False (the old answer) in every other case."""
    n = text.count("sqrt")
    if n == 0 or n != len(_MATH_SQRT.findall(text)):
        return False
    if _BARE_MATH_NOT_DOTTED.search(text):
        return False  # the scope spells ``math`` as a name of its own (a binding can)
    return _file_binds_math_by_import_only(module)


# --- 2. a helper's NAME counts as a whole identifier only -----------------------------------------------------------
#
# ``_reaches_root`` also lets a scope through when its text holds the NAME of a function of the file that looks like a
# norm (``S.functions_matching(module, "rms_norm", _norm_text)``): the parse enters such a helper only through a call
# ``self.NAME(...)`` / ``NAME(...)`` (the docstring's proof), and in that call's text NAME is a whole identifier -- the
# characters beside it are not word characters (a word character there would make the identifier another one, and a
# number cannot touch a name: ``1forward`` is a syntax error). ``name in text`` also counted NAME inside longer names:
# a norm class's ``forward`` made every attention ``forward`` of the file that reads ``eager_attention_forward`` go
# through the whole parse. A character Python joins to an identifier that ``\w`` does not match (a combining mark)
# counts as a boundary here: more occurrences, the old answer.

_TOKEN_RES: dict[str, re.Pattern[str]] = {}


def name_occurrences(text: str, name: str) -> int:
    """How many times ``name`` appears in ``text`` as a whole identifier (no ``\\w`` on either side)."""
    if name not in text:
        return 0
    rx = _TOKEN_RES.get(name)
    if rx is None:
        rx = _TOKEN_RES[name] = re.compile(r"(?<!\w)" + re.escape(name) + r"(?!\w)")
    return len(rx.findall(text))
