"""One applied candidate, as verification needs it: scan.json facts + state.json entry + the site
as it stands in the rewritten file now.

The rewritten source is the ground truth for *where* the fused branch is and *which* switch
guards it (the ``_npufuse_switch("NAME")`` call in the marked ``if``): line numbers in the state
file go stale when the user edits the file, the marker comments do not.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from npufuse.cli import UsageError
from npufuse.state import STATE_DIR, CandidateState, State

_ENV_GUARD = re.compile(r"""_npufuse_switch\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\)""")
_SITE_GUARD = re.compile(r"""_npufuse_site\(\s*(\d+)\s*\)""")
_API_NAME = re.compile(r"\b(npu_[A-Za-z0-9_]+|Npu[A-Za-z0-9_]+)\b")


@dataclass
class Site:
    """The marked ``if``/``else`` of one candidate in the current rewritten file."""

    line: int  # the ``if`` line (1-based)
    end_line: int  # last line of the else branch
    pattern: str
    qualname: str
    guard: str  # the if-header text, for messages
    env_switch: str | None  # NAME of ``_npufuse_switch("NAME")`` in the guard, if any
    fused_text: str  # the fused branch's source (to find which torch_npu APIs it calls)
    fused_lines: tuple[int, int] | None = None  # first and last line of the fused branch's body
    site_switch: int | None = None  # the candidate id of ``_npufuse_site(ID)`` in the guard (its own switch), if any


@dataclass
class Candidate:
    id: int
    key: str
    pattern: str
    file: str  # relative to root, as in scan.json
    qualname: str
    root: Path  # absolute repository root
    state_dir: Path
    status: str
    applied: dict[str, Any]
    scan: dict[str, Any] = field(default_factory=dict)  # the scan.json candidate ({} if rescanned away)
    site: Site | None = None

    @property
    def path(self) -> Path:
        return self.root / self.file

    @property
    def apis(self) -> list[str]:
        """torch_npu API names this candidate's fused branch calls (scan's ``api`` first)."""
        names: list[str] = []
        for text in (str(self.scan.get("api", "")), self.site.fused_text if self.site else ""):
            for n in _API_NAME.findall(text):
                if n not in names:
                    names.append(n)
        return names

    @property
    def plain_torch(self) -> bool:
        """The pattern's replacement is plain torch (the affinity rewrites: its API is not a
        torch_npu one), so no torch_npu call can prove that the fused branch ran: a line trace must."""
        from npufuse.patterns.registry import get_pattern

        try:
            return not get_pattern(self.pattern).api.startswith("torch_npu")
        except KeyError:
            return False

    @property
    def training_ok(self) -> bool:
        return bool(self.scan.get("training_ok", True))

    def config_shapes(self) -> dict[str, Any]:
        """Canonical config values (hidden_size, ...) scan read for this candidate's file."""
        shapes = self.scan.get("shapes") or {}
        out = {}
        for k, v in shapes.items():
            out[k] = v.get("value") if isinstance(v, dict) else v
        return out

    def shape_sources(self) -> dict[str, str]:
        shapes = self.scan.get("shapes") or {}
        return {k: str(v.get("from", "")) for k, v in shapes.items() if isinstance(v, dict)}

    def not_produced(self) -> dict[str, tuple[str, str]]:
        """Outputs of the target the fused branch is *designed* not to produce: output path
        (``out[1]``, as :func:`npufuse.verify.inputs.flatten` names it) -> (variable, reason).

        A variable qualifies when the scan recorded it as one the fused API does not produce
        (``params`` keys of :data:`NOT_PRODUCED_PARAMS`; the rendered replacement's own comment
        when scan.json no longer holds the candidate) *and* the fused branch in the file really
        assigns it ``None`` — a branch that computes something there is compared as usual. It
        maps to an output only where every ``return`` of the target puts that very name at that
        place: anything else there (another name, an expression) keeps the output compared, so
        an output that must be produced can never be excused by this."""
        if self.site is None:
            return {}
        wanted = _recorded_not_produced(self.scan.get("params"), self.site.fused_text)
        if not wanted:
            return {}
        wanted = {n: why for n, why in wanted.items() if n in _assigned_none(self.site.fused_text)}
        if not wanted:
            return {}
        try:
            source = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return {}
        return {path: (name, wanted[name]) for path, name in returned_names(source, self.qualname, set(wanted)).items()}

    def file_sha256(self) -> str:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return ""


# scan.json ``params`` keys naming a variable the fused API does not produce (the fused branch
# sets it to None), with the reason verify op reports for it instead of comparing it.
NOT_PRODUCED_PARAMS = {
    "returns_probs": "the attention probabilities: npu_fusion_attention does not produce them, so the fused branch "
                     "returns None in their place (as transformers' sdpa/flash paths do; callers asking for "
                     "output_attentions get None there)",
}  # fmt: skip
# The comment the attention replacement puts on that None assignment (patterns/attention.py):
# the rendered replacement still says so when scan.json no longer holds the candidate.
_NOT_MATERIALISED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*None\s*#\s*the fused op does not materialise the probabilities", re.M)


def _recorded_not_produced(params: Any, fused_text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(params, dict):
        for key, why in NOT_PRODUCED_PARAMS.items():
            names = params.get(key)
            for name in [names] if isinstance(names, str) else (names if isinstance(names, list) else []):
                if isinstance(name, str) and name.isidentifier():
                    out[name] = why
        return out
    # no scan facts for this candidate (rescanned after apply): what the replacement itself says
    return {m.group(1): NOT_PRODUCED_PARAMS["returns_probs"] for m in _NOT_MATERIALISED.finditer(fused_text)}


def _assigned_none(fused_text: str) -> set[str]:
    """Names the fused branch's own statements (not nested functions) set to ``None``."""
    try:
        tree = ast.parse(textwrap.dedent(fused_text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    return {t.id for n in _own_nodes(tree.body) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value is None
            for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip


def _own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``body`` outside nested functions, lambdas and classes."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    todo: list[ast.AST] = [n for n in body if not isinstance(n, nested)]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node) if not isinstance(child, nested)]


def _find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function whose class/function nesting spells ``qualname`` (as the scan names it)."""
    found = None

    def walk(body: list[ast.stmt], stack: list[str]) -> None:
        nonlocal found
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                here = [*stack, node.name]
                if found is None and not isinstance(node, ast.ClassDef) and ".".join(here) == qualname:
                    found = node
                walk(node.body, here)
            else:  # a def under if/for/with/try/match keeps the enclosing qualname
                for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for part in getattr(node, name, None) or []:
                        # except handlers and match cases are no statements: their bodies are
                        walk([part] if isinstance(part, ast.stmt) else list(getattr(part, "body", [])), stack)

    walk(tree.body, [])
    return found


def _returned_places(node: ast.expr, prefix: str) -> Iterator[tuple[str, ast.expr]]:
    """(output path, expression) of a returned value, paths as ``inputs.flatten`` names them."""
    if isinstance(node, (ast.Tuple, ast.List)):
        for i, elt in enumerate(node.elts):
            if isinstance(elt, ast.Starred):
                return  # the places after it depend on the run
            yield from _returned_places(elt, f"{prefix}[{i}]")
    elif isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        for k, v in zip(node.keys, node.values):
            assert isinstance(k, ast.Constant)
            yield from _returned_places(v, f"{prefix}[{k.value!r}]")
    else:
        yield prefix, node


def returned_names(source: str, qualname: str, names: set[str]) -> dict[str, str]:
    """Output path -> name, for the places where every ``return`` of ``qualname`` in ``source``
    that fills the place puts one of ``names`` there (a literal ``None`` fills no place)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}
    fn = _find_function(tree, qualname)
    if fn is None:
        return {}
    at: dict[str, set[str | None]] = {}
    for node in _own_nodes(fn.body):
        if isinstance(node, ast.Return) and node.value is not None:
            for path, expr in _returned_places(node.value, "out"):
                if isinstance(expr, ast.Constant) and expr.value is None:
                    continue
                at.setdefault(path, set()).add(expr.id if isinstance(expr, ast.Name) else None)
    return {path: next(iter(seen)) for path, seen in at.items() if len(seen) == 1 and next(iter(seen)) in names}  # type: ignore[misc]


def _scan_candidates(state_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from npufuse.rewrite.apply import Refused, read_scan_json

    try:
        got = read_scan_json(state_dir)  # no symlink, no FIFO, no deep JSON (untrusted input)
    except Refused as exc:
        raise UsageError(str(exc)) from None
    if got is None:
        return {}, []
    data = got[0]
    if not isinstance(data, dict) or not isinstance(data.get("candidates", []), list):
        raise UsageError(f"{state_dir / 'scan.json'}: not an npufuse scan.json; run `npufuse scan` again")
    return data, [c for c in data.get("candidates", []) if isinstance(c, dict)]


def resolve_root(state_dir: Path, scan: dict[str, Any], root: str | os.PathLike[str] | None) -> Path:
    """The scanned repository: ``--root``, else scan.json's ``root`` (relative to the folder that
    holds the state dir, where scan was run), else that folder."""
    if root is not None:
        return Path(root).resolve()
    from npufuse.rewrite.apply import Refused, _check_root

    base = state_dir.resolve().parent
    label = scan.get("root")
    found = base
    if isinstance(label, str) and label and "\0" not in label:
        p = Path(label)
        found = (p if p.is_absolute() else base / p).resolve()
    try:
        _check_root(found, base, state_dir)  # a shipped scan.json may not point verify elsewhere
    except Refused as exc:
        raise UsageError(str(exc)) from None
    return found


def load_state(state_dir: Path) -> State:
    try:
        return State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_candidate(cid: int, state_dir: str | os.PathLike[str] = STATE_DIR, root: str | os.PathLike[str] | None = None, *, need_site: bool = True) -> Candidate:
    """The applied candidate ``cid``. Raises :class:`UsageError` (one line) when there is no state,
    the candidate is unknown or not applied, or its marked site is gone from the file."""
    sd = Path(state_dir)
    state = load_state(sd)
    entry = state.candidates.get(cid)
    if entry is None:
        known = ", ".join(str(i) for i in sorted(state.candidates)) or "none"
        raise UsageError(f"{sd / 'state.json'}: no candidate {cid} (known: {known}); run `npufuse apply --accept {cid}` first")
    if not entry.applied:
        raise UsageError(f"candidate {cid} ({entry.pattern} in {entry.file}) is not applied; run `npufuse apply --accept {cid}` first")
    scan, cands = _scan_candidates(sd)
    # ids are per scan: trust the id only when the key agrees, else find the key
    match = next((c for c in cands if c.get("id") == cid and c.get("key") == entry.key), None)
    match = match or next((c for c in cands if c.get("key") == entry.key), None) or {}
    cand = Candidate(
        id=cid,
        key=entry.key,
        pattern=entry.pattern,
        file=entry.file,
        qualname=entry.qualname or str(match.get("qualname", "")),
        root=resolve_root(sd, scan, root),
        state_dir=sd,
        status=entry.status,
        applied=dict(entry.applied),
        scan=match,
    )
    _refuse_escape(cand, sd)
    if not cand.path.is_file():
        raise UsageError(f"{cand.path}: file of candidate {cid} not found (wrong --root?)")
    if need_site:
        cand.site = locate_site(cand)
    return cand


def _refuse_escape(cand: Candidate, state_dir: Path) -> None:
    """A hand-edited state.json/scan.json must not make verify read or import a file outside
    the scanned root (``../``, absolute, or a symlink out): the same rule apply and revert use."""
    from npufuse.rewrite.files import FileProblem, safe_path

    if not isinstance(cand.file, str):
        raise UsageError(f"{state_dir / 'state.json'}: candidate {cand.id} has no file path; run `npufuse apply` again")
    try:
        safe_path(cand.root, cand.file)
    except FileProblem as exc:
        raise UsageError(f"{state_dir / 'state.json'}: candidate {cand.id}: {exc}") from None


def locate_site(cand: Candidate) -> Site:
    from npufuse.rewrite.transform import marked_sites

    try:
        source = cand.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{cand.path}: cannot read ({exc})") from None
    from npufuse.rewrite.nesting import TooDeep

    try:
        sites = [s for s in marked_sites(source) if s.pattern == cand.pattern]
    except TooDeep as exc:  # refused before libcst could overflow the C stack on it
        raise UsageError(f"{cand.path}: {exc}") from None
    except Exception as exc:  # libcst parse error: the user broke the file after apply
        raise UsageError(f"{cand.path}: does not parse ({type(exc).__name__}); fix the file first") from None
    if not sites:
        raise UsageError(f"{cand.path}: no `# npufuse: {cand.pattern}` branch found (reverted or edited by hand?)")
    from npufuse.rewrite.codegen import source_lines

    # numbered as libcst numbers them (str.splitlines also breaks at form feeds: one line off after a page break)
    lines = [ln.rstrip("\r\n") for ln in source_lines(source)]

    def header_of(site: Any) -> list[str]:
        header = []
        for text in lines[site.line - 1 : site.end_line]:
            header.append(text)
            if "# npufuse:" in text:
                break
        return header

    def own_id(site: Any) -> int | None:
        m = _SITE_GUARD.search("\n".join(header_of(site)))
        return int(m.group(1)) if m else None

    # a site carrying this candidate's own switch is this candidate's, wherever it moved
    mine = [s for s in sites if own_id(s) == cand.id]
    same = mine or [s for s in sites if s.qualname == cand.qualname] or sites
    span = cand.applied.get("span")
    anchor = int(span[0]) if isinstance(span, (list, tuple)) and span else int(cand.scan.get("line", same[0].line))
    site = min(same, key=lambda s: abs(s.line - anchor))
    header = header_of(site)
    fused: list[str] = []
    indent = len(lines[site.line - 1]) - len(lines[site.line - 1].lstrip())
    for text in lines[site.line - 1 + len(header) : site.end_line]:
        stripped = text.lstrip()
        if stripped.startswith("else:") and len(text) - len(stripped) == indent:
            break
        fused.append(text)
    guard = "\n".join(header)
    m = _ENV_GUARD.search(guard)
    first = site.line + len(header)
    span = (first, first + len(fused) - 1) if fused else None
    return Site(site.line, site.end_line, site.pattern, site.qualname, guard.strip(), m.group(1) if m else None, "\n".join(fused), span, own_id(site))


def update_state(cand: Candidate, mutate: Callable[[CandidateState], None] | None = None, status: str | None = None, note: str = "") -> CandidateState:
    """Reload state.json, change this candidate only, save (state.json + CONCLUSIONS.md).

    Reloading first keeps a concurrent verification of another candidate from being overwritten."""
    state = load_state(cand.state_dir)
    entry = state.candidates.get(cand.id)
    if entry is None:
        raise UsageError(f"{cand.state_dir / 'state.json'}: candidate {cand.id} disappeared during verification")
    if mutate is not None:
        mutate(entry)
    if status is not None:
        state.set_status(cand.id, status, note)
    state.save()
    cand.status = entry.status
    return entry
