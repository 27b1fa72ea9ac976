"""``npufuse verify op ID``: operator-level accuracy of one applied candidate, forward and backward.

The user's *rewritten* function is imported (under the emulator when there is no real
torch_npu: backend "emulated") and called three times on the same inputs
(:mod:`npufuse.verify.inputs`):

1. **golden** — the original branch (switch off) in float64 on the CPU (emulated backend; fp32
   where the code will not run in float64), in fp32 on an NPU;
2. **original** — the original branch in the model's low precision;
3. **fused** — the fused branch (switch on) in the model's low precision — and once more under
   ``torch.no_grad()``: fused code may branch on ``torch.is_grad_enabled()`` (add_rms_norm's
   inference op has no backward), so the inference path is compared too wherever it gives other
   values than the training path.

Off/on: the ``_npufuse_switch("NAME")`` env variable of the guard; for other switch kinds the
module's ``torch_npu`` global is set to ``None`` (``_npufuse_on_npu`` is then False). Each run
seeds torch identically and runs the module in eval mode (dropout would make runs
incomparable). Backward uses one fixed random cotangent per output (``sum()`` would hide
softmax-like bugs: its gradient through a softmax is zero) and collects the gradients of every
floating input and parameter.

Per tensor (outputs, input grads, parameter grads), fused vs golden:

* ``cosine``, ``max_abs``, ``max_rel`` (relative error per element ``|f-g| / max(|g|, 0.25·rms_row(g))``,
  the floor keeping near-zero elements from dominating), ``row_cos_min``; for attention/softmax
  patterns also ``argmax_agree`` (fraction of rows whose argmax matches);
* the **seed criterion**: cosine > 0.999 or max_abs < 1e-4. When the original itself misses it
  at this precision (top-k routing flips against the golden), the fused branch must instead
  be no further from the golden than ``factor`` × the original's cosine distance;
* the **relative-error bound** — the per-element errors ``err_f`` (fused) and ``err_o`` (the
  original code's own low-precision error, against the same golden), compared per row (the
  last dims, at least 16 values):

  - systematic: ``rms_row(err_f) ≤ factor · max(rms_row(err_o), rms(err_o)) + ulp/2`` — a row off by a scale or
    a wrong epsilon shifts every element of the row, so its RMS error stands out, while the
    random rounding of a correct kernel (which differs element by element from the original's)
    does not. Cosine is blind to such a bug: one row 2% off among many barely moves it;
  - isolated: every element ``err_f ≤ factor · max(err_o) + ulp`` — one wrong element (against
    the original's worst anywhere in the tensor: rounding differs element by element);

  ``ulp`` by dtype: bf16 2^-7, fp16 2^-10 (fp32 1e-5, room for reordered reductions);
  ``factor`` defaults to 2.0 (``--factor``). Rows that are zero up to rounding (golden RMS and
  fused error both below the seed's 1e-4: a gradient that cancels exactly, such as a key bias
  through softmax) carry no relative information and are held to that absolute tolerance alone;
* outputs the fused API does not produce by design — the attention probabilities an eager
  ``return attn_output, attn_weights`` hands back, which the fused branch sets to ``None``
  (:meth:`Candidate.not_produced`: recorded by the scan, assigned ``None`` in the fused branch,
  at the same place of every ``return``) — are reported as "not compared: <reason>" instead of
  failing, and carry no cotangent in any run, so the gradients compared are those through the
  outputs the branch does produce. ``None`` anywhere else, or anything but ``None`` there, is
  compared as usual (and fails when it differs);
* finiteness (a NaN/Inf the golden does not have fails), same shape, same dtype as the original
  (DESIGN rule 2; the numbers are still reported), as many output tensors as the original (a
  fused op's result tuple returned without its ``[0]`` is named as such), a gradient wherever
  the original has one; a fused branch whose forward raises fails with the error; one whose
  backward raises fails unless the scan marked the candidate inference-only.

It also requires the emulator/real call counters to show calls *from the candidate's site*
with the switch on, and none with it off ("fused branch never executed" otherwise); a pattern
whose replacement is plain torch (the affinity rewrites: no torch_npu API to count) is proven
by a line trace of the fused branch's own lines instead.
Results: ``.npufuse/op_<ID>.jsonl`` (one line per compared tensor, then a summary line) and the
state evidence ``op``; a failure → ``accuracy_failed`` with the numbers, a pass → ``e2e_checking``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from npufuse.cli import UsageError
from npufuse.emulate.checks import FALLBACK_WARNING
from npufuse.safe_write import write_text_atomic
from npufuse.verify import inputs as inp
from npufuse.verify.candidate import Candidate, update_state
from npufuse.verify.norm_swap import is_construction_swap, swap_switcher, swapped_norm_check
from npufuse.verify.probe import LineTrace, SiteCounter, instrument

SEED_COSINE = 0.999
SEED_MAX_ABS = 1e-4
DEFAULT_FACTOR = 2.0
REL_FLOOR = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5, torch.float64: 1e-12}
DENOM_FRACTION = 0.25  # elements below a quarter of their row RMS are measured against that quarter
ROWWISE_PATTERNS = ("attention", "sdpa", "softmax")


@dataclass
class OpOptions:
    capture: str | None = None
    capture_timeout: float = 600.0
    capture_max_mb: int = 512
    shell: bool = False
    env: dict[str, str] = field(default_factory=dict)
    shapes: list[str] = field(default_factory=list)
    dtype: str | None = None
    init: dict[str, Any] = field(default_factory=dict)
    batch: int | None = None
    seq_len: int | None = None
    factor: float = DEFAULT_FACTOR
    seed: int = 0
    backend: str = "auto"  # auto | emulated (tests; "real" needs an NPU)
    input_notes: list[str] = field(default_factory=list)  # where the inputs came from (npufuse trace)
    autocast: str | None = None  # the autocast pass's dtype; "off": none; None: bfloat16 when the scan saw autocast
    # from `npufuse trace` (issue 16: installed models have no config in the repo): config objects
    # the class was built with (name -> {"type", "config"}), and call arguments --shape cannot say
    init_configs: dict[str, Any] = field(default_factory=dict)
    traced_arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class TensorCheck:
    name: str
    kind: str  # output | grad_input | grad_param
    shape: list[int]
    dtype: str
    golden_dtype: str
    cosine: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    orig_cosine: float | None = None
    orig_max_abs: float | None = None
    orig_max_rel: float | None = None
    bound_floor: float | None = None
    violations: int = 0  # rows_over + elements_over
    rows_over: int = 0
    elements_over: int = 0
    worst: dict[str, Any] | None = None  # the worst row and its worst element
    seed_relative: bool = False  # the original itself misses the seed criterion: judged relative to it
    row_cos_min: float | None = None
    argmax_agree: float | None = None
    seed_ok: bool = False
    rel_ok: bool = False
    passed: bool = False
    problem: str | None = None  # why it failed, in words

    def to_json(self) -> dict[str, Any]:
        return {k: _clean(v) for k, v in asdict(self).items()}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# -- the backend ---------------------------------------------------------------------------------


def real_torch_npu() -> Any:
    """The real torch_npu module when it imports and an NPU is present, else None."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        import torch_npu  # noqa: F401

        return torch_npu if torch.npu.is_available() else None  # type: ignore[attr-defined]
    except Exception:
        return None


@contextlib.contextmanager
def backend(choice: str) -> Iterator[tuple[str, str, Any]]:
    """(label, device, torch_npu module) with the stand-in installed when emulating."""
    real = None if choice == "emulated" else real_torch_npu()
    if real is not None:
        yield "real", "npu", real
        return
    from npufuse import emulate

    with emulate.install() as emu:
        yield "emulated", "cpu", emu.module


# -- one run -------------------------------------------------------------------------------------


def _flatten(out: Any, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    return inp.flatten(out, prefix)


@dataclass
class RunResult:
    outputs: list[tuple[str, torch.Tensor]]
    grads: dict[str, torch.Tensor | None]
    backward_error: str | None = None
    # torch_npu's autograd fallback warned: an op without a derivative silently dropped gradients
    backward_dropped: str | None = None
    site_calls: int = 0


class Switcher:
    """Turns one site's fused branch on or off: its own per-candidate switch (``NPUFUSE_OFF`` /
    ``NPUFUSE_ONLY``, read by ``_npufuse_site``) when the guard has one, plus the env switch;
    without either, the module's torch_npu global."""

    _SITE_VARS = ("NPUFUSE_OFF", "NPUFUSE_ONLY")

    def __init__(self, module: Any, env_name: str | None, npu_module: Any, site_id: int | None = None) -> None:
        self.module, self.env_name, self.npu_module, self.site_id = module, env_name, npu_module, site_id
        self.saved_env = os.environ.get(env_name) if env_name else None
        self.saved_site = {k: os.environ.get(k) for k in self._SITE_VARS}

    @staticmethod
    def _ids(value: str | None) -> list[str]:
        return [x for x in (value or "").replace(" ", "").split(",") if x]

    def set(self, on: bool) -> None:
        if self.site_id is not None:
            me = str(self.site_id)
            off = [x for x in self._ids(self.saved_site["NPUFUSE_OFF"]) if x != me] + ([] if on else [me])
            os.environ["NPUFUSE_OFF"] = ",".join(off)
            only = self.saved_site["NPUFUSE_ONLY"]
            if only is not None and on and me not in self._ids(only):
                os.environ["NPUFUSE_ONLY"] = ",".join([*self._ids(only), me])
        if self.env_name:
            os.environ[self.env_name] = "1" if on else "0"
        elif self.site_id is None:
            self.module.torch_npu = self.npu_module if on else None

    def restore(self) -> None:
        if self.site_id is not None:
            for k, v in self.saved_site.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if self.env_name:
            if self.saved_env is None:
                os.environ.pop(self.env_name, None)
            else:
                os.environ[self.env_name] = self.saved_env
        else:
            self.module.torch_npu = self.npu_module


def _run(target: inp.Target, inputs: inp.CallInputs, dtype: torch.dtype | None, device: str, seed: int, cotangent_seed: int, counter: SiteCounter, do_backward: bool, trace: LineTrace | None = None,
         no_cotangent: frozenset[str] = frozenset(), amp: torch.dtype | None = None) -> RunResult:  # fmt: skip
    """One call of the target (and its backward). ``amp``: the forward runs inside
    ``torch.autocast(<device>, dtype=amp)``, as a training step under AMP runs it."""
    args, kwargs, instance = inp.clone_inputs(inputs, dtype)
    if device != "cpu":
        args, kwargs = _to(args, device), _to(kwargs, device)
        if isinstance(instance, torch.nn.Module):
            instance = instance.to(device)
    leaves = inputs.named_leaves(args, kwargs)
    for _, t in leaves:
        t.requires_grad_(True)
    if isinstance(instance, torch.nn.Module):
        instance.eval()
    before = counter.site_total
    lines_before = trace.hits if trace is not None else 0
    torch.manual_seed(seed)
    call_args = ([instance] if target.owner is not None else []) + list(args)
    region = torch.autocast(device.split(":")[0], dtype=amp) if amp is not None else contextlib.nullcontext()
    with trace if trace is not None else contextlib.nullcontext(), region:
        out = target.fn(*call_args, **kwargs)
    outs = _flatten(out)
    result = RunResult(outs, {})
    # outputs the fused branch is designed not to produce carry no cotangent in any run: the
    # gradients compared are those through the outputs it does produce
    diff = [(n, o) for n, o in outs if o.is_floating_point() and o.requires_grad and n not in no_cotangent]
    if do_backward and diff:
        gen = torch.Generator().manual_seed(cotangent_seed)
        # rounded to the low precision first: the golden must see the very cotangent the
        # low-precision runs see, or its own rounding would count as their error
        cots = [torch.randn(o.shape, generator=gen).to(inputs.dtype).to(device=o.device, dtype=o.dtype) for _, o in diff]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                torch.autograd.backward([o for _, o in diff], cots)
            except Exception as exc:
                result.backward_error = f"{type(exc).__name__}: {exc}"
        for w in caught:
            if FALLBACK_WARNING in str(w.message):
                result.backward_dropped = str(w.message)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        named = list(leaves)
        if isinstance(instance, torch.nn.Module):
            named += [(f"param:{n}", p) for n, p in instance.named_parameters() if p.is_floating_point()]
        result.grads = {n: (t.grad.detach() if t.grad is not None else None) for n, t in named}
    result.site_calls = counter.site_total - before + (trace.hits - lines_before if trace is not None else 0)
    return result


def _to(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


# -- comparing ------------------------------------------------------------------------------------


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten(), b.flatten()
    na, nb = a.norm(), b.norm()
    if a.numel() == 0 or (na == 0 and nb == 0):
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(torch.dot(a, b) / (na * nb))


ROW_MIN = 16  # rows shorter than this are merged with the next dims: an RMS over 2 values is noise


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, row) with the row the last dims, merged until it holds ``ROW_MIN`` values."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    k = t.dim() - 1
    while k > 0 and math.prod(t.shape[k:]) < ROW_MIN:
        k -= 1
    n = math.prod(t.shape[k:])
    return t.reshape(-1, n) if n else t.reshape(-1, 1)


def rel_errors(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per element ``|x-g| / max(|g|, 0.25·rms_row(g))`` as (rows, row), float64."""
    gr = _rows(g)
    rms = gr.pow(2).mean(dim=-1, keepdim=True).sqrt()
    denom = torch.maximum(gr.abs(), DENOM_FRACTION * rms).clamp_min(torch.finfo(torch.float64).tiny)
    return (_rows(x) - gr).abs() / denom


def _rms(e: torch.Tensor) -> torch.Tensor:
    return e.pow(2).mean(dim=-1, keepdim=True).sqrt()


def compare(name: str, kind: str, golden: torch.Tensor, orig: torch.Tensor, fused: torch.Tensor, factor: float, rowwise: bool) -> TensorCheck:
    c = TensorCheck(name, kind, list(fused.shape), str(fused.dtype).replace("torch.", ""), str(golden.dtype).replace("torch.", ""))
    if fused.shape != orig.shape:
        c.problem = f"shape {tuple(fused.shape)} differs from the original's {tuple(orig.shape)}"
        return c
    # a dtype change fails whatever the numbers (DESIGN rule 2); they are still measured, for the
    # evidence (a dropped cast usually leaves them close: the seed criterion alone would pass it)
    dtype_problem = f"dtype {c.dtype} differs from the original's {str(orig.dtype).replace('torch.', '')}" if fused.dtype != orig.dtype else None
    g = golden.detach().double().cpu()
    o = orig.detach().double().cpu()
    f = fused.detach().double().cpu()
    g_ok = torch.isfinite(g)
    bad = ~torch.isfinite(f) & g_ok
    if bool(bad.any()):
        c.problem = f"{int(bad.sum())} non-finite values (NaN/Inf) where the {c.golden_dtype} golden is finite"
        return c
    # compare only where the golden is finite (e.g. a fully masked row may be NaN in both)
    mask = g_ok & torch.isfinite(f) & torch.isfinite(o)
    g, o, f = (torch.where(mask, t, torch.zeros_like(t)) for t in (g, o, f))
    c.cosine, c.orig_cosine = _cos(f, g), _cos(o, g)
    c.max_abs = float((f - g).abs().max()) if f.numel() else 0.0
    c.orig_max_abs = float((o - g).abs().max()) if o.numel() else 0.0
    ef, eo = rel_errors(f, g), rel_errors(o, g)
    c.max_rel = float(ef.max()) if ef.numel() else 0.0
    c.orig_max_rel = float(eo.max()) if eo.numel() else 0.0
    ulp = REL_FLOOR.get(orig.dtype, 1e-5)
    c.bound_floor = ulp
    # systematic error (a row off by a scale, a wrong eps): the row's RMS error, against the
    # original's own level there — or across the tensor, where its row happens to be lucky
    rms_f, rms_o = _rms(ef), _rms(eo)
    level_o = torch.maximum(rms_o, eo.pow(2).mean().sqrt())
    row_bound = factor * level_o + ulp / 2
    # isolated error (one wrong element): each element against the original's worst anywhere in
    # the tensor — a correct kernel's rounding differs element by element from the original's, so
    # only the tensor-wide worst is a fair yardstick for a single element
    elem_bound = (factor * eo.max() + ulp).expand_as(ef) if eo.numel() else torch.full_like(ef, ulp)
    # rows that are zero up to rounding (a gradient that cancels exactly, e.g. of a key bias through
    # softmax, or of a query row that sees a single key): a relative error means nothing there, so
    # they are held to the seed criterion's absolute tolerance alone
    g_rows = _rows(g)
    silent = (_rms(g_rows) < SEED_MAX_ABS) & ((_rows(f) - g_rows).abs().amax(dim=-1, keepdim=True) < SEED_MAX_ABS) if g_rows.numel() else torch.zeros(g_rows.shape[0], 1, dtype=torch.bool)
    bad_rows = (rms_f > row_bound) & ~silent
    bad_elems = (ef > elem_bound) & ~silent
    c.violations = int(bad_rows.sum()) + int(bad_elems.sum())
    c.rows_over = int(bad_rows.sum())
    c.elements_over = int(bad_elems.sum())
    if c.violations:
        if c.rows_over:  # the row furthest over its bound, and its largest element
            r = int(torch.where(bad_rows, rms_f - row_bound, -math.inf).flatten().argmax())
            j = int(ef[r].argmax())
        else:  # the element furthest over its bound
            flat = int(torch.where(bad_elems, ef - elem_bound, -math.inf).flatten().argmax())
            r, j = divmod(flat, ef.shape[-1])
        idx = r * ef.shape[-1] + j
        pos = [int(p) for p in torch.unravel_index(torch.tensor(idx), g.shape)] if g.dim() else []
        c.worst = {
            "index": pos,
            "golden": float(g.flatten()[idx]),
            "fused": float(f.flatten()[idx]),
            "original": float(o.flatten()[idx]),
            "rel_err": float(ef[r, j]),
            "row_rms_rel_err": float(rms_f[r, 0]),
            "row_rms_rel_err_original": float(level_o[r, 0]),
            "row_bound": float(row_bound[r, 0]),
            "element_bound": float(elem_bound[r, 0]),
        }
    if g.dim() >= 1 and g.shape[-1] > 1 and g.numel():
        gr, fr = g.reshape(-1, g.shape[-1]), f.reshape(-1, f.shape[-1])
        norms = gr.norm(dim=-1) * fr.norm(dim=-1)
        live = norms > 0
        if bool(live.any()):
            rc = (gr * fr).sum(-1)[live] / norms[live]
            c.row_cos_min = float(rc.min())
        if rowwise:
            c.argmax_agree = float((gr.argmax(-1) == fr.argmax(-1)).double().mean())
    seed = lambda cos, mx: cos > SEED_COSINE or mx < SEED_MAX_ABS  # noqa: E731
    c.seed_ok = seed(c.cosine, c.max_abs)
    if not c.seed_ok and not seed(c.orig_cosine, c.orig_max_abs):
        # The original itself misses the seed criterion at this precision (discrete decisions such
        # as top-k routing flip against the golden): hold the fused branch to the original's
        # own distance instead, so the rule stays "no worse than the code it replaces".
        c.seed_relative = True
        c.seed_ok = (1 - c.cosine) <= factor * (1 - c.orig_cosine) + 1e-6
    c.rel_ok = c.violations == 0
    c.passed = c.seed_ok and c.rel_ok and dtype_problem is None
    if dtype_problem:
        c.problem = f"{dtype_problem} (values: cosine {c.cosine:.6f}, max abs error {c.max_abs:.3g})"
    elif not c.seed_ok:
        c.problem = (f"cosine {c.cosine:.6f} ≤ {SEED_COSINE} and max abs error {c.max_abs:.3g} ≥ {SEED_MAX_ABS}"
                     + (f" (the original's cosine is {c.orig_cosine:.6f}: fused is more than {factor}× as far)" if c.seed_relative else ""))  # fmt: skip
    elif not c.rel_ok:
        w = c.worst or {}
        what = []
        if c.rows_over:
            what.append(f"{c.rows_over} of {ef.shape[0]} rows over the row bound (worst row: RMS rel err {w.get('row_rms_rel_err', 0):.3g} > "
                        f"{factor}×original's {w.get('row_rms_rel_err_original', 0):.3g} + {ulp / 2:.3g})")  # fmt: skip
        if c.elements_over:
            what.append(f"{c.elements_over} elements over the element bound ({factor}×the original's worst error {c.orig_max_rel:.3g} + {ulp:.3g})")
        c.problem = f"relative error vs the {c.golden_dtype} golden: {'; '.join(what)} at {w.get('index')}; cosine {c.cosine:.6f} alone would have passed"
    return c


# -- the check ------------------------------------------------------------------------------------


@dataclass
class OpReport:
    candidate: int
    pattern: str
    qualname: str
    file: str
    backend: str
    passed: bool
    reasons: list[str]
    checks: list[TensorCheck]
    inputs: dict[str, Any]
    calls: dict[str, Any]
    factor: float
    backward: str  # "checked" | "skipped: ..."
    jsonl: str = ""
    notes: list[str] = field(default_factory=list)
    # outputs the fused branch is designed not to produce (attention probabilities) and returned
    # as None: "<output> (<variable>): not compared: <reason>"
    not_compared: list[str] = field(default_factory=list)
    # why nothing was compared (no floating-point output or gradient): then the check is "not
    # checked", never passed: zero compared tensors prove nothing
    not_checked: str | None = None

    @property
    def outcome(self) -> str:
        """"passed" | "failed" | "not checked"."""
        if self.not_checked:
            return "not checked"
        return "passed" if self.passed else "failed"

    def summary(self) -> dict[str, Any]:
        worst = max((c for c in self.checks if c.max_rel is not None), key=lambda c: c.max_rel or 0, default=None)
        return {
            "candidate": self.candidate,
            "check": "op",
            "summary": True,
            "pattern": self.pattern,
            "qualname": self.qualname,
            "file": self.file,
            "backend": self.backend,
            "passed": self.passed,
            "outcome": self.outcome,
            "not_checked": self.not_checked,
            "reasons": self.reasons,
            "factor": self.factor,
            "seed_criterion": f"cosine > {SEED_COSINE} or max_abs < {SEED_MAX_ABS}",
            "rel_rule": "per row vs the golden: rms_row(err_f) <= factor*max(rms_row(err_o), rms(err_o)) + ulp/2 and every err_f <= factor*max(err_o) + ulp",
            "backward": self.backward,
            "notes": self.notes,
            "not_compared": self.not_compared,
            "inputs": self.inputs,
            "calls": self.calls,
            "tensors": len(self.checks),
            "min_cosine": min((c.cosine for c in self.checks if c.cosine is not None), default=None),
            "max_rel": worst.max_rel if worst else None,
            "jsonl": self.jsonl,
        }


def run_op_check(cand: Candidate, opts: OpOptions, capture_path: Path | None = None) -> OpReport:
    """The check itself (no state changes): import, build inputs, three runs, compare."""
    assert cand.site is not None
    dtype = inp.parse_dtype(opts.dtype) if opts.dtype else None
    values = cand.config_shapes()
    with backend(opts.backend) as (label, device, npu_module):
        counter = SiteCounter(str(cand.path), (cand.site.line, cand.site.end_line))
        undo = instrument(npu_module, counter)
        try:
            from npufuse.rewrite.patch_module import op_check_view, target_qualname  # issue 16: patched methods

            with inp.user_module(cand.root, cand.file) as patches, op_check_view(patches, cand.applied) as module:
                target = inp.resolve_target(module, target_qualname(cand))
                init = dict(opts.init)
                for name, spec in opts.init_configs.items():
                    if name not in init:
                        init[name] = inp.traced_config(module, spec)
                        # its sizes also feed the naming heuristics (the scan read no config of an installed model)
                        values = {**{k: v for k, v in spec["config"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}, **values}
                if is_construction_swap(cand.site.fused_text):
                    # an nn.RMSNorm swapped where it is built: the module's forward is the operator
                    # (npufuse.verify.norm_swap), not the __init__ holding the site
                    switch = swap_switcher(Switcher(module, cand.site.env_switch, npu_module, cand.site.site_switch))
                    try:
                        target, inputs = swapped_norm_check(cand, module, target, values, opts, init, switch)
                        if capture_path is not None:
                            inputs.notes.append("the captured call is that of the function holding the site; the module's input is synthesised (its shape from the module)")
                        golden_dtype = torch.float64 if inputs.dtype == torch.float64 or device == "cpu" else torch.float32
                        return _three_runs(cand, opts, target, inputs, golden_dtype, device, label, counter, switch)
                    finally:
                        switch.restore()
                if capture_path is not None:
                    inputs = inp.from_capture(capture_path, module, target, values, dtype, init, opts.seed)
                else:
                    inputs = inp.from_config_or_shapes(module, target, values, opts.shapes, dtype, init, opts.batch, opts.seq_len, opts.seed, opts.traced_arguments)
                # float64 on the CPU: an fp32 model's own error then has a yardstick (against an fp32
                # golden it is zero, and any reordered reduction in a small, cancelling row fails);
                # float32 on an NPU, whose float64 kernels are missing or slow
                golden_dtype = torch.float64 if inputs.dtype == torch.float64 or device == "cpu" else torch.float32
                switch = Switcher(module, cand.site.env_switch, npu_module, cand.site.site_switch)
                try:
                    return _three_runs(cand, opts, target, inputs, golden_dtype, device, label, counter, switch)
                finally:
                    switch.restore()
        finally:
            undo()


def _three_runs(cand: Candidate, opts: OpOptions, target: inp.Target, inputs: inp.CallInputs, golden_dtype: torch.dtype, device: str, label: str, counter: SiteCounter, switch: Switcher) -> OpReport:
    reasons: list[str] = []
    seed, cot = opts.seed, opts.seed + 1
    assert cand.site is not None
    # a plain-torch replacement (the affinity rewrites) is proven by its own lines running
    trace = LineTrace(str(cand.path), cand.site.fused_lines) if cand.plain_torch and cand.site.fused_lines else None
    # outputs the fused API does not produce by design (attention probabilities: the branch
    # returns None there); known before any run, so that no run backpropagates through them
    unproduced = cand.not_produced()
    skip = frozenset(unproduced)
    # the autocast region the captured call ran in: the low-precision runs replay it (the golden
    # never: it is the float64 truth)
    replay = inp.parse_dtype(inputs.autocast) if inputs.autocast else None
    switch.set(False)
    try:
        try:
            golden = _run(target, inputs, golden_dtype, device, seed, cot, counter, True, trace, skip)
        except Exception:
            if golden_dtype != torch.float64 or inputs.dtype == torch.float64:
                raise
            golden = _run(target, inputs, torch.float32, device, seed, cot, counter, True, trace, skip)  # code that will not run in float64
        orig = _run(target, inputs, None, device, seed, cot, counter, True, trace, skip, replay)
    except UsageError:
        raise
    except SystemExit as exc:  # the "function" is a script's main(): argparse, sys.exit
        raise UsageError(f"{target.qualname} exited (SystemExit {exc.code}) when called: it is not an operator-level function; verify this candidate end to end") from None
    except Exception as exc:
        shapes = json.dumps(inputs.shapes)[:300]
        raise UsageError(f"the original {target.qualname} raised {type(exc).__name__}: {exc} on the {inputs.source} inputs {shapes}; give --shape/--init or use --capture") from None
    off_calls = golden.site_calls + orig.site_calls
    switch.set(True)
    try:
        fused = _run(target, inputs, None, device, seed, cot, counter, True, trace, skip, replay)
    except (Exception, SystemExit) as exc:
        fused = None
        reasons.append(f"the fused branch raised {type(exc).__name__}: {exc}")
    calls = {"site_calls_on": fused.site_calls if fused else counter.site_total - off_calls, "site_calls_off": off_calls, "by_api": dict(counter.calls), "site_by_api": dict(counter.site_calls),
             "proof": "line trace of the fused branch (a plain-torch replacement)" if trace is not None else "torch_npu calls from the site"}  # fmt: skip
    # Inference: fused code may branch on torch.is_grad_enabled() (add_rms_norm's inference op has
    # no backward), and a path the check never takes is a path it never proves. One more forward
    # without autograd; compared only where it gives other values than the forward above.
    inference: RunResult | None = None
    if fused is not None:
        try:
            with torch.no_grad():
                inference = _run(target, inputs, None, device, seed, cot, counter, False, trace, skip, replay)
        except (Exception, SystemExit) as exc:
            reasons.append(f"the fused branch raised {type(exc).__name__} under torch.no_grad() (the inference path): {exc}")
    checks: list[TensorCheck] = []
    not_compared: list[str] = []
    backward = "checked"
    differentiable = bool(golden.grads) and any(g is not None for g in golden.grads.values())
    backward_ok = differentiable
    if not differentiable:
        backward = "skipped: the original is not differentiable on these inputs"
    elif fused is not None and (fused.backward_error or fused.backward_dropped) and not cand.training_ok:
        # an inference-only candidate (the scan said so): forward is what it promises
        why = fused.backward_error or fused.backward_dropped or ""
        backward, backward_ok = f"skipped: inference-only candidate, the fused branch has no backward ({why[:120]})", False
    if fused is not None:
        guard = cand.site.guard.splitlines()[0].strip()
        if off_calls:
            what = "line(s) of it ran" if trace is not None else "torch_npu call(s) from the site"
            reasons.append(f"the switch did not turn the fused branch off: {off_calls} {what} with it off")
        if fused.site_calls == 0:
            if trace is not None:
                lo, hi = cand.site.fused_lines or (cand.site.line, cand.site.end_line)
                reasons.append(f"fused branch never executed: none of its lines ({cand.file}:{lo}-{hi}) ran with the switch on (guard: {guard})")
            else:
                apis = ", ".join(cand.apis) or "torch_npu"
                reasons.append(f"fused branch never executed: no {apis} call from {cand.file}:{cand.site.line}-{cand.site.end_line} with the switch on (guard: {guard})")
        rowwise = cand.pattern in ROWWISE_PATTERNS
        gold_outs, orig_outs, excused = _excuse_unproduced(golden.outputs, orig.outputs, fused.outputs, unproduced)
        not_compared += excused
        structure = _structure_problem(orig_outs, fused.outputs)
        if structure:
            reasons.append(structure)
        checks += _compare_outputs(gold_outs, orig_outs, fused.outputs, opts.factor, rowwise)
        if inference is not None and not _same_values(fused.outputs, inference.outputs):
            gold_outs, orig_outs, excused = _excuse_unproduced(golden.outputs, orig.outputs, inference.outputs, unproduced)
            not_compared += [f"{e} (under torch.no_grad())" for e in excused if e not in not_compared]
            structure = _structure_problem(orig_outs, inference.outputs)
            if structure:
                reasons.append(f"under torch.no_grad() (the inference path) {structure}")
            checks += _compare_outputs(gold_outs, orig_outs, inference.outputs, opts.factor, rowwise, " (no_grad)")
        if differentiable and backward_ok:
            if fused.backward_error:
                reasons.append(f"the fused backward raised {fused.backward_error} (the candidate is marked training-safe)")
            if fused.backward_dropped:
                # loud on purpose: on NPU this trains on silently missing gradients
                reasons.append(f"the fused branch drops gradients the original produces (an op without a derivative: {fused.backward_dropped[:160]})")
            for name, gg in golden.grads.items():
                og, fg = orig.grads.get(name), fused.grads.get(name)
                kind = "grad_param" if name.startswith("param:") else "grad_input"
                if gg is None:
                    if fg is not None and bool((fg != 0).any()):
                        checks.append(TensorCheck(f"grad {name}", kind, list(fg.shape), str(fg.dtype), "", problem="the fused branch gives a gradient where the original has none"))
                    continue
                if fg is None or og is None:
                    checks.append(TensorCheck(f"grad {name}", kind, list(gg.shape), "", str(gg.dtype), problem="no gradient reaches it through the fused branch (the original has one)"))
                    continue
                checks.append(compare(f"grad {name}", kind, gg, og, fg, opts.factor, False))
        amp = _amp_for(cand, opts, inputs) if replay is None else None
        if amp is not None:
            checks += _autocast_pass(target, inputs, golden, amp, device, seed, cot, counter, trace, unproduced, switch, opts.factor, cand.pattern in ROWWISE_PATTERNS, reasons, not_compared)
        for c in checks:
            if c.problem:
                reasons.append(f"{c.name}: {c.problem}")
    not_checked = None
    if not reasons and not checks:
        produced = ", ".join(f"{n} ({str(t.dtype).replace('torch.', '')})" for n, t in orig.outputs[:4]) or "no tensor"
        not_checked = (f"0 tensors compared: {target.qualname} returned {produced} and no gradient reaches its inputs, so nothing "
                       "the fused branch computed was compared; check a function that returns the site's result (e.g. the "
                       "module's forward) or use --capture on a training command")  # fmt: skip
    passed = not reasons and not_checked is None
    notes = []
    if checks and all(c.cosine is None and not c.problem for c in checks):
        notes.append("only integer outputs were compared (exactly equal): a floating-point difference inside the function shows "
                     "in them only where it flips a value (argmax, sampling); check a function returning the floating-point result too")  # fmt: skip
    relative = [c.name for c in checks if c.seed_relative]
    if relative:
        notes.append(f"the original itself misses the seed criterion against the golden for {', '.join(relative[:4])}"
                     f"{' …' if len(relative) > 4 else ''} (discrete decisions such as top-k routing flip at "
                     f"{str(inputs.dtype).replace('torch.', '')}): those are judged by cosine distance relative to the original")  # fmt: skip
    if skip and backward == "checked":
        backward = f"checked (through the outputs the fused branch produces; not through {', '.join(sorted(skip))})"
    return OpReport(cand.id, cand.pattern, cand.qualname, cand.file, label, passed, reasons, checks, inputs.describe(), calls, opts.factor, backward, notes=opts.input_notes + notes,
                    not_compared=not_compared, not_checked=not_checked)  # fmt: skip


def _amp_for(cand: Candidate, opts: OpOptions, inputs: inp.CallInputs) -> torch.dtype | None:
    """The autocast dtype of the op check's autocast pass: ``--autocast``, else bfloat16 when the
    scan found the site (or the repo) running under autocast; None: no such pass."""
    if opts.autocast:
        return None if opts.autocast == "off" else inp.parse_dtype(opts.autocast)
    if any(isinstance(r, dict) and r.get("kind") == "autocast" for r in cand.scan.get("risks") or []):
        return torch.bfloat16
    return None


def _autocast_pass(target: inp.Target, inputs: inp.CallInputs, golden: RunResult, amp: torch.dtype, device: str, seed: int, cot: int, counter: SiteCounter,
                   trace: LineTrace | None, unproduced: dict[str, tuple[str, str]], switch: "Switcher", factor: float, rowwise: bool, reasons: list[str],
                   not_compared: list[str]) -> list[TensorCheck]:  # fmt: skip
    """The matrix's autocast row: float32 inputs and parameters (as AMP training keeps them), the
    original and the fused forward inside ``torch.autocast(dtype=amp)``, both against the same
    float64 golden; the fused output must come out in the dtype the original's ops give there."""
    label = f" (autocast {str(amp).replace('torch.', '')})"
    skip = frozenset(unproduced)
    switch.set(False)
    try:
        orig = _run(target, inputs, torch.float32, device, seed, cot, counter, False, trace, skip, amp)
    except Exception as exc:  # the original itself does not run under autocast: no evidence against the fused branch
        not_compared.append(f"outputs{label}: not compared: the original itself raised {type(exc).__name__} under autocast: {str(exc)[:160]}")
        return []
    finally:
        switch.set(True)
    try:
        fused = _run(target, inputs, torch.float32, device, seed, cot, counter, False, trace, skip, amp)
    except Exception as exc:
        reasons.append(f"the fused branch raised {type(exc).__name__} under autocast{label}: {exc}")
        return []
    gold, orig_outs, _excused = _excuse_unproduced(golden.outputs, orig.outputs, fused.outputs, unproduced)
    structure = _structure_problem(orig_outs, fused.outputs)
    if structure:
        reasons.append(f"under autocast{label} {structure}")
        return []
    return _compare_outputs(gold, orig_outs, fused.outputs, factor, rowwise, label)


def _excuse_unproduced(golden: list[tuple[str, torch.Tensor]], orig: list[tuple[str, torch.Tensor]], fused: list[tuple[str, torch.Tensor]],
                       unproduced: dict[str, tuple[str, str]]) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]], list[str]]:  # fmt: skip
    """Golden and original outputs without those the fused branch is designed not to produce and
    indeed returns as None, plus a "not compared: <reason>" line for each. An output it does
    produce there (a tensor) stays and is compared like any other."""
    have = {n for n, _ in fused}
    gone = {n for n, _ in orig if n in unproduced and n not in have}
    excused = [f"{n} (`{unproduced[n][0]}`): not compared: {unproduced[n][1]}" for n, _ in orig if n in gone]
    return [x for x in golden if x[0] not in gone], [x for x in orig if x[0] not in gone], excused


def _structure_problem(orig: list[tuple[str, torch.Tensor]], fused: list[tuple[str, torch.Tensor]]) -> str | None:
    def names(outs: list[tuple[str, torch.Tensor]]) -> str:
        return ", ".join(n for n, _ in outs[:4]) + (" …" if len(outs) > 4 else "")

    if [n for n, _ in fused] == [n for n, _ in orig]:
        return None
    if len(fused) == len(orig):
        # outputs are compared place by place: a None moved to another place of the result
        # would pair unrelated tensors
        return f"the fused branch returns its tensors at other places ({names(fused)}) than the original ({names(orig)})"

    msg = f"the fused branch returns {len(fused)} tensors ({names(fused)}), the original {len(orig)} ({names(orig)})"
    if len(orig) == 1 and orig[0][0] == "out" and len(fused) > 1:
        msg += ": a tuple where the original returns one tensor (a fused op's result tuple without its [0]?)"
    return msg


def _compare_outputs(golden: list[tuple[str, torch.Tensor]], orig: list[tuple[str, torch.Tensor]], fused: list[tuple[str, torch.Tensor]], factor: float, rowwise: bool, suffix: str = "") -> list[TensorCheck]:
    checks = []
    for (name, g), (_, o), (_, f) in zip(golden, orig, fused):
        if g.is_floating_point():
            checks.append(compare(name + suffix, "output", g, o, f, factor, rowwise))
        elif not (o.shape == f.shape and o.dtype == f.dtype and torch.equal(o.cpu(), f.cpu())):
            checks.append(TensorCheck(name + suffix, "output", list(f.shape), str(f.dtype), str(g.dtype), problem="integer output differs from the original"))
        else:  # compared, exactly: a row, so the count of compared tensors is honest
            checks.append(TensorCheck(name + suffix, "output", list(f.shape), str(f.dtype), str(g.dtype), max_abs=0.0, violations=0, seed_ok=True, rel_ok=True, passed=True))
    return checks


def _same_values(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.detach(), y.detach()) for (_, x), (_, y) in zip(a, b))


# -- capture --------------------------------------------------------------------------------------


def capture_inputs(cand: Candidate, opts: OpOptions, progress: Any = None) -> Path:
    """Run ``--capture`` with the probe; returns the saved first call of the target."""
    from npufuse.verify import probe, runner

    assert opts.capture is not None
    work = cand.state_dir / f"op_{cand.id}.capture"
    _clean_dir(work)
    out = work / "call.pt"
    cfg = {
        "mode": "capture",
        "out_dir": str(work / "probe"),
        "runner_pid": os.getpid(),
        "runner_pgid": os.getpgrp(),
        "emulate": "auto",
        "capture": {"file": str(cand.path.resolve()), "qualname": cand.qualname, "out": str(out), "max_bytes": opts.capture_max_mb << 20},
    }
    cfg_path = work / "probe.json"
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    try:
        cmd = runner.split_command(opts.capture, opts.shell)
    except ValueError as exc:
        raise UsageError(f"--capture: {exc}") from None
    env = runner.child_env(opts.env, cfg_path, work / "site")
    if progress:
        progress(f"capturing the inputs of {cand.qualname}: {opts.capture}")
    try:
        res = runner.run_child(cmd, env=env, cwd=cand.root, timeout_s=opts.capture_timeout, log_path=work / "capture.log", should_stop=lambda: "captured" if out.exists() else None)
    except OSError as exc:
        raise UsageError(f"--capture: cannot start {opts.capture!r}: {exc}") from None
    if not out.exists():
        errors = probe.read_counters(work / "probe")["errors"]
        why = errors[0] if errors else f"the command ended ({res.describe_exit()}) without calling {cand.qualname} of {cand.file}"
        tail = " | ".join(res.tail[-3:])
        hint = "" if errors else f" (is {cand.file} imported by the command? a target in the launched script itself, run as __main__, cannot be hooked)"
        raise UsageError(f"--capture: {why}" + (f"; last output: {tail}" if tail else "") + hint)
    return out


def _clean_dir(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


# -- the verb -------------------------------------------------------------------------------------


# Candidates with no operator to call on inputs: the fused optimizer replaces a construction in
# the training script; its evidence is the e2e run (same loss curve, then step time).
NOT_OP_LEVEL = {"fused_optimizer": "a fused optimizer replaces a constructor call in the training script, not an operator: it is verified end to end"}


def skip_op_check(cand: Candidate) -> dict[str, Any]:
    """Record that the op check does not apply and hand the candidate on to e2e."""
    why = NOT_OP_LEVEL[cand.pattern]
    evidence = {"candidate": cand.id, "check": "op", "summary": True, "pattern": cand.pattern, "passed": None, "skipped": why}

    def mutate(entry: Any) -> None:
        entry.evidence["op"] = evidence
        entry.verdict = None
        entry.reasons = [f"op check not applicable: {why}"]

    update_state(cand, mutate, status="e2e_checking", note="op check not applicable")
    return evidence


def verify_op(cand: Candidate, opts: OpOptions, progress: Any = None) -> OpReport:
    """Run the op check with state transitions: accuracy_checking → accuracy_failed | e2e_checking."""
    previous = cand.status if cand.status != "accuracy_checking" else "pending"
    update_state(cand, status="accuracy_checking", note="op check started")
    try:
        capture_path = capture_inputs(cand, opts, progress) if opts.capture else None
        report = run_op_check(cand, opts, capture_path)
    except BaseException as exc:
        # a usage problem or an interrupt is no verdict on the candidate: back to where it was
        update_state(cand, status=previous, note=f"op check not completed: {type(exc).__name__}: {exc}"[:300])
        raise
    path = cand.state_dir / f"op_{cand.id}.jsonl"
    lines = [json.dumps({"candidate": cand.id, "check": "op", "backend": report.backend, **c.to_json()}) for c in report.checks]
    report.jsonl = str(path)
    lines.append(json.dumps(report.summary()))
    write_text_atomic(path, "\n".join(lines) + "\n")
    evidence = report.summary()
    evidence["checks"] = [c.to_json() for c in report.checks]

    def mutate(entry: Any) -> None:
        entry.evidence["op"] = evidence
        if report.passed:
            worst = evidence.get("max_rel")
            # a new op check restarts the candidate's validation (the e2e evidence stays: its
            # completed baseline can be reused)
            entry.verdict = None
            entry.evidence.pop("perf", None)
            entry.reasons = []
            entry.reasons.append(
                f"op check passed ({report.backend}): {len(report.checks)} tensors, min cosine {evidence['min_cosine']:.6f}, "
                f"max rel error {worst:.3g}, within the bound of {report.factor}× the original's own error; backward {report.backward}"
                if evidence["min_cosine"] is not None and worst is not None
                else f"op check passed ({report.backend}); backward {report.backward}"
            )
            entry.reasons += report.not_compared  # shown with the verdict (status, report html)
            entry.reasons += [n for n in report.notes if n.startswith("only integer outputs")]
        elif report.not_checked:
            entry.verdict = "not checked: op check compared 0 tensors"
            entry.reasons = [f"op check not checked ({report.backend}): {report.not_checked}"]
        else:
            entry.verdict = "do not replace: accuracy"
            entry.reasons = [f"op check failed ({report.backend}): {r}" for r in report.reasons]

    if report.passed:
        update_state(cand, mutate, status="e2e_checking", note="op check passed")
    elif report.not_checked:
        # no evidence either way: the candidate stays where an op check has not passed yet
        update_state(cand, mutate, status="pending", note="op check compared 0 tensors: not checked")
    else:
        update_state(cand, mutate, status="accuracy_failed", note="; ".join(report.reasons)[:300])
    return report
