"""``npufuse api NAME`` / ``npufuse api --list``: torch_npu's own API docs, read statically.

torch_npu cannot be imported without the CANN runtime, so nothing here imports it. The wheel is
located with ``importlib.util.find_spec`` (which only searches, never executes; see
``ENV_TORCH_NPU_PATH`` for a wheel unpacked outside site-packages) and these files are parsed:

* ``_op_plugin_docs.py`` - module-level ``_add_torch_npu_docstr("name", doc)`` calls;
* ``op_plugin/atb/_atb_api_docs.py`` - ``_add_torch_npu_atb_docstr`` calls nested in a function;
* ``csrc/aten/npu_native_functions_by_codegen.yaml`` (+ ``npu_native_functions.yaml``) - the
  ATen schemas, which are the authority for signatures (doc prototypes are sometimes stale);
* ``optim/*.py`` - the fused optimizer classes (docstring and ``__init__`` signature).

Without the wheel, or for ops the wheel has no docstring for, npufuse's own summaries
(``api_summaries.yaml``) answer instead, and say where the full docs live.

Module-level imports stay light (no torch, no rich, no yaml) so ``npufuse api`` starts fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# Directories (os.pathsep-separated, like PYTHONPATH) holding an unpacked torch_npu wheel - the
# dev environment puts it in .venv/torch-npu-docs, outside site-packages, because its torch backend
# entry point would make every `import torch` try to load CANN. Searched before sys.path. The
# torch_npu package directory itself is accepted too. Empty string: behave as if torch_npu were absent.
ENV_TORCH_NPU_PATH = "NPUFUSE_TORCH_NPU_PATH"

OP_DOCS_FILE = "_op_plugin_docs.py"
ATB_DOCS_FILE = "op_plugin/atb/_atb_api_docs.py"
SCHEMA_FILES = ("csrc/aten/npu_native_functions_by_codegen.yaml", "csrc/aten/npu_native_functions.yaml")
OPTIM_INIT_FILE = "optim/__init__.py"

SUMMARY_SOURCE = "npufuse summary"
WHEEL_HINT = "pip install --no-deps torch-npu==2.14.0"

# Schema sections whose entries are torch_npu's own ops (exported as torch_npu.<op>). The
# `supported` section lists ATen ops the NPU backend overrides (add, abs, ...): not torch_npu APIs.
_OP_SCHEMA_SECTIONS = ("custom", "quant", "autograd", "symint")


class UnknownApiError(LookupError):
    """The name is neither documented in the wheel, nor in its schema, nor summarised by npufuse."""

    def __init__(self, name: str, suggestions: list[str], hint: str | None = None) -> None:
        self.name = name
        self.suggestions = suggestions
        self.hint = hint
        super().__init__(self.message())

    def message(self) -> str:
        text = f"unknown torch_npu API '{self.name}'"
        if self.hint:
            text += f": {self.hint}"
        if self.suggestions:
            text += "; did you mean " + ", ".join(self.suggestions) + "?"
        return text + " (`npufuse api --list` shows all)"


# --------------------------------------------------------------------------------------------
# locating the wheel


def find_docs_root() -> Path | None:
    """The ``torch_npu`` package directory holding the doc files, or None. Never imports it."""
    candidates: list[Path] = []
    override = os.environ.get(ENV_TORCH_NPU_PATH)
    if override is not None:
        if not override.strip():
            return None
        entries = [e for e in override.split(os.pathsep) if e]
        candidates.extend(Path(e) for e in entries)  # the package directory itself
        spec = importlib.machinery.PathFinder.find_spec("torch_npu", entries)
        candidates.extend(_spec_dirs(spec))
    try:
        # find_spec of a top-level name searches only; nothing is executed
        candidates.extend(_spec_dirs(importlib.util.find_spec("torch_npu")))
    except (ImportError, ValueError):
        # ValueError: sys.modules holds a module without __spec__ - npufuse.emulate's stand-in
        # does that while it is active. PathFinder below looks at sys.path only.
        pass
    candidates.extend(_spec_dirs(importlib.machinery.PathFinder.find_spec("torch_npu")))
    # npufuse's own dev environment unpacks the wheel beside the venv (see the Makefile), so
    # `npufuse api` works there without setting the variable.
    candidates.extend(_spec_dirs(importlib.machinery.PathFinder.find_spec("torch_npu", [str(Path(sys.prefix) / "torch-npu-docs")])))
    for candidate in candidates:
        if (candidate / OP_DOCS_FILE).is_file():
            return candidate.resolve()
    return None


def _spec_dirs(spec: importlib.machinery.ModuleSpec | None) -> list[Path]:
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


@functools.lru_cache(maxsize=8)
def wheel_version(root: Path) -> str:
    """torch_npu's version from ``version.py`` (read, not imported)."""
    try:
        text = (root / "version.py").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.M)
    return match.group(1) if match else "unknown"


def wheel_source(root: Path) -> str:
    return f"torch_npu-{wheel_version(root)} wheel"


# --------------------------------------------------------------------------------------------
# doc files


@dataclass(frozen=True)
class RawDoc:
    """One ``_add_torch_npu*_docstr(name, doc)`` call as written in the wheel."""

    name: str
    text: str  # raw source of the doc literal, quotes stripped: LaTeX escapes survive
    file: str  # relative to the wheel's site-packages, e.g. "torch_npu/_op_plugin_docs.py"
    line: int
    earlier_lines: tuple[int, ...] = ()  # lines of duplicates this later one overrides


def _line_starts(data: bytes) -> list[int]:
    """Byte offset of each line as ast numbers them (it treats CRLF, LF and a lone CR as breaks)."""
    starts = [0]
    for match in re.finditer(rb"\r\n|\r|\n", data):
        starts.append(match.end())
    return starts


def _raw_literal(data: bytes, starts: list[int], node: ast.expr) -> str | None:
    """The literal's source text with prefix and quotes removed, or None if not a plain literal.

    ``ast.get_source_segment`` gives the same slice but re-splits the whole 17k-line file on every
    call (17 s for the 220 docs); ast offsets are UTF-8 byte columns, so slice the bytes directly.
    """
    if node.end_lineno is None or node.end_col_offset is None:
        return None
    begin = starts[node.lineno - 1] + node.col_offset
    end = starts[node.end_lineno - 1] + node.end_col_offset
    segment = data[begin:end].decode("utf-8")
    match = re.match(r"(?i)([rub]*)('''|\"\"\"|'|\")", segment)
    if not match:
        return None
    quote = match.group(2)
    inner = segment[match.end():]
    if not inner.endswith(quote):
        return None
    inner = inner[: -len(quote)]
    # implicit concatenation ("a" "b") would leave a quote inside: not one literal
    leftover = quote in inner if len(quote) == 3 else re.search(rf"(?<!\\){quote}", inner) is not None
    if leftover:
        return None
    return inner


def _clean_doc(text: str) -> str:
    """Drop the blank first line(s) and common indentation the triple quotes add."""
    # _op_plugin_docs.py has CRLF line endings; one form for parsing and display
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    return textwrap.dedent("\n".join(lines)).rstrip()


def _parse_quietly(source: str, path: Path) -> ast.Module:
    with warnings.catch_warnings():
        # the wheel's files hold LaTeX like "\end" in non-raw strings: invalid-escape warnings
        # about torch_npu's code, not something our user can act on
        warnings.simplefilter("ignore")
        return ast.parse(source, filename=str(path))


def parse_doc_file(path: Path, helper: str, rel: str, top_level_only: bool) -> list[RawDoc]:
    """All ``helper("name", doc)`` calls of one file, duplicates kept, in file order."""
    data = path.read_bytes()
    source = data.decode("utf-8")
    tree = _parse_quietly(source, path)
    if top_level_only:
        # _op_plugin_docs.py: the calls are module-level statements; walking the whole tree
        # would also find the helper's definition body (which has no such call, but be exact).
        nodes: Iterable[ast.AST] = (stmt.value for stmt in tree.body if isinstance(stmt, ast.Expr))
    else:
        nodes = ast.walk(tree)
    starts = _line_starts(data)
    found: list[RawDoc] = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == helper):
            continue
        if len(node.args) != 2 or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
            continue
        name_node, doc_node = node.args
        raw = _raw_literal(data, starts, doc_node)
        text = raw if raw is not None else doc_node.value  # type: ignore[union-attr]
        found.append(RawDoc(name_node.value, _clean_doc(text), rel, node.lineno))  # type: ignore[union-attr]
    return found


def _keep_later(docs: list[RawDoc]) -> dict[str, RawDoc]:
    """At runtime each call assigns __doc__, so the later duplicate wins; remember the earlier."""
    by_name: dict[str, RawDoc] = {}
    for doc in docs:
        previous = by_name.get(doc.name)
        earlier = (*previous.earlier_lines, previous.line) if previous else ()
        by_name[doc.name] = RawDoc(doc.name, doc.text, doc.file, doc.line, earlier)
    return by_name


# --------------------------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class Section:
    key: str  # description / formula / prototype / parameters / outputs / constraints / versions / socs / examples / preamble
    heading: str  # as written in the doc ("功能描述:"), empty for the preamble
    body: str


SECTION_LABELS: dict[str, tuple[str, str]] = {
    "description": ("功能描述", "description"),
    "formula": ("计算公式", "formula"),
    "parameters": ("参数说明", "parameters"),
    "outputs": ("输出说明", "outputs"),
    "constraints": ("约束说明", "constraints"),
    "versions": ("支持的PyTorch版本", "PyTorch versions"),
    "socs": ("支持的型号", "supported SoCs"),
    "examples": ("调用示例", "examples"),
}

# Heading words as they occur in the 2.14 docs. "Strong" ones are unambiguous section titles and
# may carry inline content after a colon ("功能描述：完成..."); weak ones only count alone on a line.
_STRONG_HEADINGS: dict[str, str] = {
    "接口原型": "prototype", "函数原型": "prototype",
    "功能描述": "description", "功能描述实现": "description", "功能实现描述": "description",
    "计算公式": "formula",
    "参数说明": "parameters",
    "输出说明": "outputs", "返回值说明": "outputs",
    "约束说明": "constraints",
    "支持的PyTorch版本": "versions", "支持版本": "versions",
    "支持的型号": "socs", "支持的芯片型号": "socs",
    "调用示例": "examples",
}
_WEAK_HEADINGS: dict[str, str] = {
    "算子功能": "description", "接口说明": "description", "计算公式为": "formula",
    "参数解释": "parameters", "输入说明": "parameters", "输入": "parameters",
    "输出": "outputs",
    "约束条件": "constraints", "约束": "constraints", "规格约束": "constraints", "输入约束": "constraints",
    "示例": "examples",
}
_ALL_HEADINGS = {**_WEAK_HEADINGS, **_STRONG_HEADINGS}
_HEADING_RE = re.compile(
    r"^\s*(?P<deco>#{1,6}\s*|[-*•·]\s*|\d+\s*[.、)]\s*)?(?:\*\*|【)?"
    r"(?P<word>" + "|".join(sorted(map(re.escape, _ALL_HEADINGS), key=len, reverse=True)) + r")"
    r"(?:\*\*|】)?\s*(?:[(（][^)）]*[)）])?\s*(?:(?P<colon>[:：])\s*(?P<rest>.*))?$"
)


def _match_heading(line: str, in_examples: bool) -> tuple[str, str] | None:
    """(key, inline content) when the line is a section heading."""
    match = _HEADING_RE.match(line.replace("\u200b", ""))
    if not match:
        return None
    word, rest = match.group("word"), (match.group("rest") or "").strip()
    strong = word in _STRONG_HEADINGS
    if rest and not strong:
        return None
    if in_examples:
        # example code has comments like "# 输出" and "# 调用示例": only a bare strong heading
        # (no '#', no bullet) ends the examples
        if not strong or match.group("deco"):
            return None
    return _ALL_HEADINGS[word], rest


def split_sections(text: str) -> list[Section]:
    """Split a Chinese torch_npu doc into sections by its headings (which vary in form)."""
    sections: list[Section] = []
    key, heading, body = "preamble", "", []
    for line in text.split("\n"):
        found = _match_heading(line, in_examples=key == "examples")
        if found is None:
            body.append(line)
            continue
        sections.append(Section(key, heading, _tidy("\n".join(body))))
        key, heading, body = found[0], line.strip(), [found[1]] if found[1] else []
    sections.append(Section(key, heading, _tidy("\n".join(body))))
    return [s for s in sections if s.body or s.key != "preamble"]


def _tidy(text: str) -> str:
    text = textwrap.dedent(text).strip("\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n(?:[ \t\u200b]*\n){2,}", "\n\n", text).strip()


# --------------------------------------------------------------------------------------------
# signatures


@dataclass(frozen=True)
class Param:
    name: str
    type: str | None
    default: str | None
    keyword_only: bool


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets and quotes."""
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the bracket group opening at text[start]."""
    depth, quote = 0, ""
    for index in range(start, len(text)):
        char = text[index]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def split_signature(signature: str) -> tuple[str, str, str | None]:
    """(callable name, argument text, return text) of ``name(args) -> ret``."""
    open_at = signature.index("(")
    close_at = _balanced_end(signature, open_at) or len(signature)
    rest = signature[close_at:].strip()
    returns = rest[2:].strip() if rest.startswith("->") else None
    return signature[:open_at].strip(), signature[open_at + 1 : close_at - 1], returns


def parse_params(signature: str) -> list[Param]:
    """Parameters of a schema or doc prototype (types optional, ``*`` marks keyword-only)."""
    params: list[Param] = []
    keyword_only = False
    for token in _split_top(split_signature(signature)[1]):
        if token == "*":
            keyword_only = True
            continue
        left, _, default = token.partition("=")
        left = left.strip()
        match = re.search(r"(\**[A-Za-z_]\w*)\s*$", left)
        if not match:
            continue
        type_text = left[: match.start()].strip() or None
        params.append(Param(match.group(1), type_text, default.strip() or None if default else None, keyword_only))
    return params


def _norm_default(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip().strip("'\"")
    power = re.fullmatch(r"(\d+)\s*\^\s*(\d+)\s*-\s*(\d+)", value)  # docs write 2^63-1
    if power:
        base, exp, minus = map(int, power.groups())
        value = str(base**exp - minus)
    try:
        return repr(float(value))
    except ValueError:
        return value


def compare_prototype(doc_prototype: str, schemas: list[str]) -> list[str]:
    """How a doc prototype disagrees with the closest schema overload; empty when it matches."""
    doc_params = parse_params(doc_prototype)
    doc_names = [p.name for p in doc_params]
    best: tuple[int, list[Param]] | None = None
    for schema in schemas:
        params = parse_params(schema)
        score = len(set(doc_names) & {p.name for p in params}) - abs(len(params) - len(doc_params))
        if best is None or score > best[0]:
            best = (score, params)
    if best is None:
        return []
    schema_params = best[1]
    schema_names = [p.name for p in schema_params]
    notes: list[str] = []
    if len(doc_names) == len(schema_names) and set(doc_names) != set(schema_names):
        # same arity: report renames position by position (keyword callers care)
        renamed = [(d, s) for d, s in zip(doc_names, schema_names) if d != s]
        notes.append("parameter names differ: " + ", ".join(f"doc {d} / schema {s}" for d, s in renamed))
    else:
        missing = [n for n in schema_names if n not in doc_names]
        extra = [n for n in doc_names if n not in schema_names]
        if missing:
            notes.append("the doc prototype omits " + ", ".join(missing))
        if extra:
            notes.append("the doc prototype has parameters the schema lacks: " + ", ".join(extra))
    positional = [p.name for p in schema_params if not p.keyword_only]
    if set(doc_names) == set(schema_names) and [n for n in doc_names if n in positional] != positional:
        # keyword-only parameters may come in any order; only positional order matters
        notes.append("the doc prototype orders the positional parameters differently")
    by_name = {p.name: p for p in schema_params}
    for param in doc_params:
        other = by_name.get(param.name)
        if other is None or param.default is None:
            continue
        if other.default is None:
            notes.append(f"default of {param.name}: doc {param.default}, schema has none (must be passed)")
        elif _norm_default(param.default) != _norm_default(other.default):
            notes.append(f"default of {param.name}: doc {param.default}, schema {other.default}")
    common = set(doc_names) & set(schema_names)
    doc_kw = {p.name for p in doc_params if p.keyword_only} & common
    schema_kw = {p.name for p in schema_params if p.keyword_only} & common
    if schema_kw - doc_kw:
        notes.append("keyword-only in the schema, not in the doc: " + ", ".join(n for n in schema_names if n in schema_kw - doc_kw))
    if doc_kw - schema_kw:
        notes.append("keyword-only in the doc, not in the schema: " + ", ".join(n for n in doc_names if n in doc_kw - schema_kw))
    return notes


# "torch_npu. npu_geglu(" (sic) occurs in 2.14; custom./func: prefixes in a few docs
_PROTO_PREFIX = r"(?:torch_npu\.\s*(?:atb\.|npu\.)?|custom\.|func:\s*)?"
_RETURN_RE = re.compile(r"\s*->\s*(?:(?=\()|([A-Za-z_][\w.]*(?:\([a-z]!?\))?(?:\[\])?\??))")


def _prototype_spans(text: str, name: str) -> list[tuple[int, int, str]]:
    """(start, end, normalized prototype) of each ``torch_npu.name(...) -> ret`` in a doc text."""
    short = name.split(".", 1)[1] if name.startswith("atb.") else name
    pattern = re.compile(r"(?<![\w.])" + _PROTO_PREFIX + re.escape(short) + r"\s*\(")
    spans: list[tuple[int, int, str]] = []
    position = 0
    while match := pattern.search(text, position):
        open_at = match.end() - 1
        close_at = _balanced_end(text, open_at)
        if close_at is None:
            break
        end = close_at
        ret = _RETURN_RE.match(text, close_at)
        if ret:
            end = ret.end()
            if not ret.group(1):  # tuple return "(Tensor, Tensor)"
                end = _balanced_end(text, end) or end
        proto = re.sub(r"\s+", " ", text[match.start() : end]).strip()
        proto = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", proto))
        proto = re.sub(r"^(?:custom\.|func:\s*)", "", proto)
        proto = re.sub(r"^torch_npu\.\s+", "torch_npu.", proto)
        if not proto.startswith("torch_npu."):
            proto = ("torch_npu.atb." if name.startswith("atb.") else "torch_npu.") + proto
        spans.append((match.start(), end, proto))
        position = end
    return spans


def find_prototypes(text: str, name: str) -> list[str]:
    """``torch_npu.name(...) -> ret`` prototypes in a doc text, whitespace collapsed, unique."""
    found: list[str] = []
    for _, _, proto in _prototype_spans(text, name):
        if proto not in found:
            found.append(proto)
    return found


def _strip_prototypes(text: str, name: str) -> str:
    for start, end, _ in reversed(_prototype_spans(text, name)):
        text = text[:start] + text[end:]
    return _tidy(text)


# --------------------------------------------------------------------------------------------
# schema yaml


@dataclass(frozen=True)
class SchemaIndex:
    by_name: dict[str, list[str]]  # base op name -> schema strings ("npu_x.overload(...) -> ...")
    op_names: frozenset[str]  # names that are torch_npu ops (torch.ops.npu.*)


def _yaml_loader() -> Any:
    import yaml  # lazy: only lookups that need a signature pay for it

    # libyaml parses the 250 KB schema in ~30 ms; the pure-Python loader needs ~270 ms
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=8)
def load_schemas(root: Path) -> SchemaIndex:
    """All ``func:`` schemas of the wheel's native-functions yaml files, parsed once per process."""
    import yaml

    by_name: dict[str, list[str]] = {}
    op_names: set[str] = set()
    loader = _yaml_loader()
    for rel in SCHEMA_FILES:
        path = root / rel
        if not path.is_file():
            continue
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}
        for section, entries in data.items():
            if not isinstance(entries, list):
                continue  # backend: NPU, cpp_namespace: ...
            for entry in entries:
                func = entry.get("func") if isinstance(entry, dict) else None
                if not isinstance(func, str) or "(" not in func:
                    continue  # bare names in `supported` are ATen ops without a schema here
                full = func.split("(", 1)[0].strip()
                base = full.split(".", 1)[0]
                schemas = by_name.setdefault(base, [])
                if func not in schemas:
                    schemas.append(func)
                if section in _OP_SCHEMA_SECTIONS or "npu" in base:
                    op_names.add(base)
    return SchemaIndex(by_name, frozenset(op_names))


def _schemas_for(index: SchemaIndex, name: str) -> list[str]:
    """Schemas of an API name; ``x.out`` selects that overload, a plain name lists all overloads
    with the overload-less one first."""
    base, _, overload = name.partition(".")
    schemas = index.by_name.get(base, [])
    if overload:
        return [s for s in schemas if s.split("(", 1)[0].strip() == name]
    return sorted(schemas, key=lambda s: "." in s.split("(", 1)[0])


def schema_signature(name: str, root: Path | None = None) -> str | None:
    """The schema signature of a torch_npu op as ``torch_npu.name(...) -> ...``, or None."""
    root = root or find_docs_root()
    if root is None:
        return None
    schemas = _schemas_for(load_schemas(root), _canonical(name))
    return "torch_npu." + schemas[0] if schemas else None


# --------------------------------------------------------------------------------------------
# summaries


@dataclass(frozen=True)
class Summary:
    name: str
    summary: str
    signature: str
    returns: str
    constraints: list[str]
    pitfalls: list[str]
    autograd: bool
    autograd_note: str | None
    spec: str
    wheel_doc: bool

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@functools.lru_cache(maxsize=1)
def load_summaries() -> dict[str, Summary]:
    """npufuse's own summaries shipped as package data."""
    import importlib.resources

    import yaml

    text = importlib.resources.files("npufuse").joinpath("api_summaries.yaml").read_text(encoding="utf-8")
    data = yaml.load(text, Loader=_yaml_loader())
    summaries: dict[str, Summary] = {}
    for name, entry in data["apis"].items():
        summaries[name] = Summary(
            name=name,
            summary=entry["summary"],
            signature=entry["signature"],
            returns=entry["returns"],
            constraints=list(entry.get("constraints") or []),
            pitfalls=list(entry.get("pitfalls") or []),
            autograd=bool(entry["autograd"]),
            autograd_note=entry.get("autograd_note"),
            spec=entry["spec"],
            wheel_doc=bool(entry.get("wheel_doc", True)),
        )
    return summaries


# Names people ask for that are not torch_npu APIs at all (spec §0): why, and what to use instead.
_NOT_TORCH_NPU: dict[str, tuple[str, str]] = {
    "npu_gmm": ("npu_gmm is MindSpeed's (mindspeed.ops.gmm.npu_gmm), not part of torch_npu", "npu_grouped_matmul"),
    "npu_rotary_position_embedding": (
        "npu_rotary_position_embedding is MindSpeed's (mindspeed.ops), not part of torch_npu",
        "npu_rotary_mul",
    ),
}


# --------------------------------------------------------------------------------------------
# the index


@dataclass
class ApiDoc:
    """Everything npufuse knows about one torch_npu API."""

    name: str  # canonical: "npu_rms_norm", "atb.npu_ring_mla", "optim.NpuFusedAdamW"
    source: str  # "torch_npu-2.14.0 wheel" or "npufuse summary"
    doc: str | None = None  # the wheel's doc text (raw source, escapes preserved)
    doc_file: str | None = None  # path inside site-packages, e.g. "torch_npu/_op_plugin_docs.py"
    doc_line: int | None = None
    doc_path: str | None = None  # absolute path of the installed file
    schemas: list[str] = field(default_factory=list)  # "torch_npu."-qualified schema signatures
    summary: Summary | None = None
    notes: list[str] = field(default_factory=list)
    python_signature: str | None = None  # optim classes: the __init__ signature from the wheel

    @property
    def qualified_name(self) -> str:
        return "torch_npu." + self.name

    @functools.cached_property
    def sections(self) -> list[Section]:
        if self.doc is None:
            return []
        if self.name.startswith("optim."):
            return _optim_sections(self.doc)
        return split_sections(self.doc)

    def section(self, key: str) -> str:
        """Body of all sections with this key (repeated headings are joined)."""
        bodies = [s.body for s in self.sections if s.key == key and s.body]
        if key == "parameters" and not bodies and not self.name.startswith("optim."):
            # some docs list the parameters right under the prototype, without a heading
            rest = _strip_prototypes("\n".join(s.body for s in self.sections if s.key == "prototype"), self.name)
            bodies = [rest] if rest else []
        if key == "description":
            # text before the first heading is the prototype and/or (npu_mish) the description
            preamble = "\n".join(s.body for s in self.sections if s.key == "preamble")
            if preamble and not self.name.startswith("optim."):
                preamble = _strip_prototypes(preamble, self.name)
                # sibling prototypes (npu_iou's doc also shows npu_ptiou's) are not description
                preamble = _tidy(re.sub(r"(?m)^\s*torch_npu\.[\w.]+\s*\(.*\)\s*->.*$", "", preamble))
            if preamble:
                bodies.insert(0, preamble)
        return "\n\n".join(bodies)

    @functools.cached_property
    def prototypes(self) -> list[str]:
        if self.python_signature:
            return [self.python_signature]
        if self.doc is None:
            return []
        # prefer the prototype section, then the text before the first heading, then anywhere
        # but the examples (their calls have no "->" and would pass for prototypes)
        for keys in (("prototype",), ("preamble",), None):
            text = "\n".join(s.body for s in self.sections if (s.key != "examples" if keys is None else s.key in keys))
            found = find_prototypes(text, self.name)
            if found:
                return found
        return []

    @property
    def signature(self) -> str | None:
        if self.schemas:
            return self.schemas[0]
        if self.prototypes:
            return self.prototypes[0]
        if self.summary:
            return self.qualified_name.rsplit(".", 1)[0] + "." + self.summary.signature
        return None

    @property
    def signature_source(self) -> str | None:
        if self.schemas:
            return "schema"
        if self.python_signature:
            return "wheel python source"
        if self.prototypes:
            return "doc prototype"
        return SUMMARY_SOURCE if self.summary else None

    @functools.cached_property
    def signature_notes(self) -> list[str]:
        """Where the doc's prototype disagrees with the schema (the authority)."""
        if not self.schemas or self.doc is None:
            return []
        if not self.prototypes:
            other = re.search(r"torch_npu\.[\w.]+(?=\s*\()", self.doc)
            if other:
                # npu_yolo_boxes_encode's doc in 2.14 is npu_transpose's, pasted
                return [f"the doc has no prototype for this API; the one it shows is {other.group(0)}"]
            return ["the doc has no prototype"]
        notes: list[str] = []
        for proto in self.prototypes:
            notes.extend(n for n in compare_prototype(proto, self.schemas) if n not in notes)
        return notes

    def parameters(self) -> list[dict[str, Any]]:
        """Signature parameters, each with the doc's description line(s) where found."""
        signature = self.signature
        if not signature:
            return []
        params = parse_params(signature)
        docs = _param_docs(self.section("parameters"), [p.name for p in params])
        return [
            {"name": p.name, "type": p.type, "default": p.default, "keyword_only": p.keyword_only, "doc": docs.get(p.name)}
            for p in params
        ]

    def returns(self) -> str:
        text = self.section("outputs")
        if text:
            return text
        if self.summary:
            return self.summary.returns
        if self.signature:
            return split_signature(self.signature)[2] or ""
        return ""

    def constraints(self) -> list[str]:
        text = self.section("constraints")
        if text:
            return _lines(text)
        return list(self.summary.constraints) if self.summary else []

    def socs(self) -> list[str]:
        return _lines(self.section("socs"))

    def as_json(self) -> dict[str, Any]:
        location = None
        if self.doc_file:
            location = {"file": self.doc_file, "line": self.doc_line, "path": self.doc_path}
        return {
            "name": self.name,
            "qualified_name": self.qualified_name,
            "source": self.source,
            "signature": self.signature,
            "signature_source": self.signature_source,
            "schema_signatures": self.schemas,
            "doc_prototypes": self.prototypes,
            "signature_differs": bool(self.signature_notes),
            "signature_notes": self.signature_notes,
            "parameters": self.parameters(),
            "returns": self.returns(),
            "return_type": split_signature(self.signature)[2] if self.signature else None,
            "constraints": self.constraints(),
            "socs": self.socs(),
            "description": self.section("description") or (self.summary.summary if self.summary else ""),
            "formula": self.section("formula"),
            "examples": self.section("examples"),
            "sections": {s.key: self.section(s.key) for s in self.sections if s.key != "preamble"},
            "doc": self.doc,
            "doc_location": location,
            "summary": self.summary.as_dict() if self.summary else None,
            "notes": self.notes,
        }


def _lines(text: str) -> list[str]:
    out = []
    for line in text.split("\n"):
        line = re.sub(r"^\s*[-*•·]\s*", "", line.replace("\u200b", "")).strip()
        if line:
            out.append(line)
    return out


def _param_docs(text: str, names: list[str]) -> dict[str, str]:
    """Map parameter names to the doc lines that describe them ("name: ...", "- **name** (...)")."""
    if not text or not names:
        return {}
    starts = re.compile(
        r"^\s*(?:[-*•·]\s*)?(?:\*\*)?(?:[A-Za-z][\w\[\]?]*\s+)?(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?:\*\*)?\s*(?:[(（:：]|\s-\s)"
    )
    docs: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.split("\n"):
        match = starts.match(line)
        if match and match.group(1) not in docs:
            current = match.group(1)
            docs[current] = [line.strip()]
        elif current is not None and line.strip():
            if re.match(r"^\s*(?:[-*•·]\s*)?(?:\*\*)?[A-Za-z_]\w*(?:\*\*)?\s*[(（:：]", line):
                current = None  # a parameter we do not know (doc-only): stop attaching
            else:
                docs[current].append(line.strip())
    return {k: "\n".join(v) for k, v in docs.items()}


def _optim_sections(doc: str) -> list[Section]:
    """Google-style class docstrings: the text, then "Args:" (or "Arguments:")."""
    parts = re.split(r"^\s*(Args|Arguments):\s*$", doc, maxsplit=1, flags=re.M)
    sections = [Section("description", "", _tidy(parts[0]))]
    if len(parts) == 3 and parts[2].strip():
        sections.append(Section("parameters", parts[1] + ":", _tidy(parts[2])))
    return sections


# ---- optim classes (Python source in the wheel)


def _optim_docs(root: Path) -> dict[str, tuple[str, str, int, str]]:
    """``optim.X`` -> (docstring, file, line, signature) from torch_npu/optim, statically."""
    init = root / OPTIM_INIT_FILE
    if not init.is_file():
        return {}
    exported: list[str] = []
    modules: dict[str, str] = {}
    for stmt in _parse_quietly(init.read_text(encoding="utf-8"), init).body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            exported = [e.value for e in getattr(stmt.value, "elts", []) if isinstance(e, ast.Constant)]
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
            for alias in stmt.names:
                modules[alias.asname or alias.name] = stmt.module
    result: dict[str, tuple[str, str, int, str]] = {}
    for cls_name in exported:
        module = modules.get(cls_name)
        path = root / "optim" / f"{module}.py"
        if not module or not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        tree = _parse_quietly(source, path)
        constants = {
            t.id: ast.get_source_segment(source, s.value)
            for s in tree.body
            if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
            for t in s.targets
            if isinstance(t, ast.Name)
        }
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls_name:
                doc = ast.get_docstring(node) or ""
                signature = f"torch_npu.optim.{cls_name}(" + _init_args(node, source, constants) + ")"
                result[f"optim.{cls_name}"] = (doc, f"torch_npu/optim/{module}.py", node.lineno, signature)
    return result


def _init_args(cls: ast.ClassDef, source: str, constants: dict[str, str | None]) -> str:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args.args[1:]  # drop self
            defaults = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
            parts = []
            for arg, default in zip(args, defaults):
                if default is None:
                    parts.append(arg.arg)
                    continue
                text = ast.get_source_segment(source, default) or "?"
                # module constants (MOMENTUM_MIN = 0.0) read better as their value
                if isinstance(default, ast.Name) and constants.get(default.id):
                    text = constants[default.id] or text
                parts.append(f"{arg.arg}={text}")
            return ", ".join(parts)
    return "..."


# ---- building


@functools.lru_cache(maxsize=8)
def load_api_docs(root: Path) -> dict[str, ApiDoc]:
    """Every API documented in the wheel at `root` (op docs, atb docs, optim classes), by name."""
    site = "torch_npu/"
    source = wheel_source(root)
    raw: dict[str, RawDoc] = _keep_later(parse_doc_file(root / OP_DOCS_FILE, "_add_torch_npu_docstr", site + OP_DOCS_FILE, True))
    atb_path = root / ATB_DOCS_FILE
    atb = _keep_later(parse_doc_file(atb_path, "_add_torch_npu_atb_docstr", site + ATB_DOCS_FILE, False)) if atb_path.is_file() else {}
    summaries = load_summaries()
    docs: dict[str, ApiDoc] = {}
    for name, entry in [*raw.items(), *((f"atb.{n}", e) for n, e in atb.items())]:
        notes = []
        if entry.earlier_lines:
            lines = ", ".join(map(str, entry.earlier_lines))
            notes.append(
                f"documented more than once in the wheel (also at line {lines}); the later doc (line {entry.line}) is shown, as at runtime"
            )
        if "." in name and not name.startswith("atb."):
            notes.append("a name with an overload suffix: torch_npu's getattr never finds it, so this doc is not attached at runtime")
        docs[name] = ApiDoc(
            name=name,
            source=source,
            doc=entry.text,
            doc_file=entry.file,
            doc_line=entry.line,
            doc_path=str(root / entry.file.removeprefix(site)),
            summary=summaries.get(name),
            notes=notes,
        )
    for name, (doc, rel, line, signature) in _optim_docs(root).items():
        docs[name] = ApiDoc(
            name=name,
            source=source,
            doc=doc,
            doc_file=rel,
            doc_line=line,
            doc_path=str(root / rel.removeprefix(site)),
            summary=summaries.get(name),
            python_signature=signature,
        )
    return docs


def _attach_schemas(api: ApiDoc, root: Path) -> ApiDoc:
    """A copy of `api` with its schemas. Done per lookup, not while indexing, so --list never
    parses the yaml; a copy, so the cached index is never mutated."""
    if api.name.startswith(("optim.", "atb.")):
        return api
    schemas = ["torch_npu." + s for s in _schemas_for(load_schemas(root), api.name)]
    notes = list(api.notes)
    if not schemas and api.doc is not None:
        notes.append(f"the schema yaml has no op named {api.name}; the signature is the doc's prototype")
    return dataclasses.replace(api, schemas=schemas, notes=notes)


def _summary_doc(summary: Summary, root: Path | None) -> ApiDoc:
    """An API answered from npufuse's summary (no wheel, or no doc for it in the wheel)."""
    api = ApiDoc(name=summary.name, source=SUMMARY_SOURCE, summary=summary)
    if root is None:
        api.notes.append(f"torch_npu is not installed here: this is npufuse's summary ({summary.spec} of its torch_npu spec)")
        where = OP_DOCS_FILE if summary.wheel_doc else SCHEMA_FILES[0]
        if summary.name.startswith("optim."):
            where = "optim/"
        api.notes.append(f"full docs: install torch_npu ({WHEEL_HINT}); they live in torch_npu/{where} inside the wheel")
    else:
        api.notes.append(
            f"the {wheel_source(root)} has no doc for this API; shown: the schema from torch_npu/{SCHEMA_FILES[0]} and npufuse's summary ({summary.spec})"
        )
    return api


def _canonical(name: str) -> str:
    name = name.strip()
    for prefix in ("torch.ops.npu.", "torch_npu."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def api_names(root: Path | None = None, *, use_wheel: bool = True) -> list[str]:
    """Documented names plus schema-only names npufuse summarises, sorted (``--list``)."""
    return sorted(_index(root, use_wheel))


def _index(root: Path | None, use_wheel: bool) -> dict[str, str]:
    """name -> source, without building sections."""
    root = (root or find_docs_root()) if use_wheel else None
    names: dict[str, str] = {}
    if root is not None:
        names.update({n: d.source for n, d in load_api_docs(root).items()})
        ops = load_schemas(root).by_name
        for name in load_summaries():
            if name not in names and name.split(".")[0] in ops:
                names[name] = wheel_source(root) + " schema + " + SUMMARY_SOURCE
    else:
        names.update({n: SUMMARY_SOURCE for n in load_summaries()})
    return names


def lookup(name: str, root: Path | None = None, *, use_wheel: bool = True) -> ApiDoc:
    """Everything known about one API. Accepts ``torch_npu.`` / ``torch_npu.optim.`` / ``atb.``
    prefixes. Raises UnknownApiError (with close matches) for names nobody knows."""
    root = (root or find_docs_root()) if use_wheel else None
    key = _canonical(name)
    summaries = load_summaries()
    candidates: list[str]
    if root is not None:
        docs = load_api_docs(root)
        schema = load_schemas(root)
        resolved = _resolve(key, docs.keys() | summaries.keys())
        if resolved in docs:
            return _attach_schemas(docs[resolved], root)
        if resolved in summaries:
            return _attach_schemas(_summary_doc(summaries[resolved], root), root)
        if key in schema.op_names or (key.partition(".")[0] in schema.op_names and _schemas_for(schema, key)):
            api = ApiDoc(name=key, source=wheel_source(root) + " schema")
            api.notes.append(f"the {wheel_source(root)} has no doc for this op and npufuse has no summary: schema only")
            return _attach_schemas(api, root)
        candidates = sorted(docs.keys() | schema.op_names | summaries.keys())
    else:
        resolved = _resolve(key, summaries.keys())
        if resolved in summaries:
            return _summary_doc(summaries[resolved], None)
        candidates = sorted(summaries)
    if key in _NOT_TORCH_NPU:
        hint, instead = _NOT_TORCH_NPU[key]
        raise UnknownApiError(name, [instead], hint)
    hint = "torch_npu is not installed, so only npufuse's summaries are known" if root is None else None
    raise UnknownApiError(name, _suggest(key, candidates), hint)


def _resolve(key: str, names: Iterable[str]) -> str:
    """Bare optimizer / atb names ("NpuFusedAdamW", "npu_ring_mla") find their namespace."""
    names = set(names)
    if key in names:
        return key
    for namespace in ("optim.", "atb."):
        if namespace + key in names:
            return namespace + key
    return key


def _suggest(key: str, candidates: list[str], limit: int = 5) -> list[str]:
    close = difflib.get_close_matches(key, candidates, n=limit, cutoff=0.6)
    contains = [c for c in candidates if key and key.lower() in c.lower() and c not in close]
    found = (close + contains)[:limit]
    # always offer something: a loose match beats an empty "did you mean"
    return found or difflib.get_close_matches(key, candidates, n=3, cutoff=0.0)


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help="API name, e.g. npu_rms_norm, torch_npu.npu_fusion_attention, torch_npu.optim.NpuFusedAdamW")
    parser.add_argument("--list", action="store_true", help="list every documented API (plus schema-only ones npufuse summarises)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--summary", action="store_true", help="show npufuse's own summary even when torch_npu is installed")


def run(args: argparse.Namespace) -> int:
    from npufuse.cli import UsageError

    use_wheel = not args.summary
    if args.list:
        if args.name:
            raise UsageError("give either NAME or --list, not both")
        return _print_list(use_wheel, args.json)
    if not args.name:
        raise UsageError("give an API name (e.g. `npufuse api npu_rms_norm`) or --list")
    try:
        api = lookup(args.name, use_wheel=use_wheel)
    except UnknownApiError as exc:
        raise UsageError(exc.message()) from None
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        root = find_docs_root()
        raise UsageError(f"cannot read torch_npu's docs under {root}: {exc.__class__.__name__}: {exc}") from None
    if args.json:
        print(json.dumps(api.as_json(), ensure_ascii=False, indent=2))
        return 0
    _render(api)
    return 0


def _print_list(use_wheel: bool, as_json: bool) -> int:
    root = find_docs_root() if use_wheel else None
    index = _index(root, use_wheel)
    if as_json:
        summaries = load_summaries()
        rows = [{"name": n, "qualified_name": "torch_npu." + n, "source": s, "summarised": n in summaries} for n, s in sorted(index.items())]
        print(json.dumps(rows, ensure_ascii=False, indent=2))
        return 0
    sys.stdout.write("".join(f"{name}\n" for name in sorted(index)))
    if root is None:
        print(f"(torch_npu not installed: npufuse's summaries only; {WHEEL_HINT} for the full list)", file=sys.stderr)
    return 0


def _render(api: ApiDoc) -> None:
    """Terminal rendering with rich; text goes in as Text objects so '[...]' is never markup.

    On a terminal, text wraps with a hanging indent; piped (grep, less, a file), lines are left
    whole so signatures and code can be copied.
    """
    from rich.console import Console
    from rich.padding import Padding
    from rich.syntax import Syntax
    from rich.text import Text

    console = Console(highlight=False)
    tty = console.is_terminal

    def heading(title: str) -> None:
        console.print()
        console.print(Text(title, style="bold magenta"), soft_wrap=not tty)

    def body(text: str, style: str = "") -> None:
        if tty:
            console.print(Padding(Text(text, style=style), (0, 0, 0, 2), expand=False))
        else:
            console.print(Text(textwrap.indent(text, "  "), style=style), soft_wrap=True)

    def code(text: str) -> None:
        if tty:
            syntax = Syntax(text, "python", theme="ansi_dark", background_color="default", word_wrap=True)
            console.print(Padding(syntax, (0, 0, 0, 2), expand=False))
        else:
            body(text)

    title = Text(api.qualified_name, style="bold")
    where = api.source
    if api.doc_file:
        where += f" · {api.doc_file}:{api.doc_line}"
    title.append(f"   ({where})", style="dim")
    console.print(title, soft_wrap=not tty)

    heading("Signature" + (f" ({api.signature_source})" if api.signature_source else ""))
    for signature in api.schemas or ([api.signature] if api.signature else []):
        body(signature, "cyan")
    if api.signature_notes:
        body("doc prototype differs from the schema: " + "; ".join(api.signature_notes), "yellow")
        for proto in api.prototypes:
            body("doc: " + proto, "dim")

    if api.doc is not None:
        for key, (zh, en) in SECTION_LABELS.items():
            text = api.section(key)
            if not text:
                continue
            heading(en if api.name.startswith("optim.") else f"{zh} · {en}")
            if key == "examples":
                code(text)
            else:
                body(text)
    if api.summary is not None:
        _render_summary(api.summary, heading, body, full=api.doc is None, constraints=not api.section("constraints"))
    for note in api.notes:
        console.print()
        console.print(Text("note: " + note, style="dim"), soft_wrap=not tty)


def _render_summary(summary: Summary, heading: Any, body: Any, *, full: bool, constraints: bool) -> None:
    """Our own summary: all of it when the wheel has no doc, else the notes (and our constraints
    where the wheel's doc has none, e.g. the optimizers' docstrings)."""
    autograd = ("yes" if summary.autograd else "no") + (f" ({summary.autograd_note})" if summary.autograd_note else "")
    if full:
        heading("Summary")
        body(summary.summary)
        heading("Returns")
        body(summary.returns)
    if (full or constraints) and summary.constraints:
        heading("Constraints" + ("" if full else " (npufuse)"))
        body("\n".join(f"• {c}" for c in summary.constraints))
    heading(f"npufuse notes ({summary.spec} of the npufuse torch_npu spec)")
    lines = [f"autograd: {autograd}"] + [f"• {p}" for p in summary.pitfalls]
    body("\n".join(lines))
