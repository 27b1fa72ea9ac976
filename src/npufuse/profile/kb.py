"""Loading and compiling knowledge_base.yaml (op-sequence patterns -> fused API).

A sequence pattern becomes one regular expression over a token string in which every op is its
type name followed by a space, and stream/step boundaries are a ``|`` no pattern can match. The
regex engine then does the scanning in C, which keeps a million-kernel file fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npufuse.profile.readers import Problem

DEFAULT_KB = Path(__file__).with_name("knowledge_base.yaml")
_QUANT = re.compile(r"(\?|\+|\{\d+(?:,\d*)?\})$")
_NAME = re.compile(r"^[\w*]+$")


def sanitize(token: str) -> str:
    """Token as it appears in the match string: aten::mul -> mul; odd characters -> '_'."""
    if token.startswith("aten::"):
        token = token[6:]
    return re.sub(r"\W", "_", token) or "_"


def _alt(names: str, where: str) -> str:
    parts = []
    for name in names.split("|"):
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(f"{where}: '{name}' is not a name (letters, digits, _, * allowed)")
        parts.append(re.escape(name).replace(r"\*", r"\w*"))
    return "(?:" + "|".join(parts) + ")"


def compile_sequence(text: str, where: str, followed_by: str | None = None) -> re.Pattern[str]:
    """'A|B - C? - D{0,2}' -> a regex with one group e0, e1, ... per element."""
    out = [r"(?<![^ ])"]
    for k, elem in enumerate(e.strip() for e in text.split(" - ")):
        m = _QUANT.search(elem)
        quant = m.group(1) if m else ""
        names = elem[: m.start()] if m else elem
        out.append(f"(?P<e{k}>(?:{_alt(names, where)} ){quant})")
    if followed_by:
        out.append(f"(?={_alt(followed_by, where)} )")
    return re.compile("".join(out))


@dataclass
class SequenceRule:
    id: str
    api: str
    what: str
    kernels: re.Pattern[str] | None
    aten: re.Pattern[str] | None
    checks: list[tuple[str, int]] = field(default_factory=list)
    subsumes: list[str] = field(default_factory=list)
    caveat: str | None = None
    source: str = ""
    kernels_text: str = ""
    aten_text: str = ""
    kernel_elems: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    aten_elems: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    followed_by: re.Pattern[str] | None = None


def elements(text: str, where: str) -> list[tuple[re.Pattern[str], str]]:
    """'A|B - C?' -> [(regex matching one token name, quantifier), ...]."""
    out = []
    for elem in (e.strip() for e in text.split(" - ")):
        m = _QUANT.search(elem)
        quant = m.group(1) if m else ""
        names = elem[: m.start()] if m else elem
        out.append((re.compile(_alt(names, where) + "$"), quant))
    return out


def compile_for_vocab(elems: list[tuple[re.Pattern[str], str]], vocab: list[str],
                      followed_by: re.Pattern[str] | None = None) -> re.Pattern[str] | None:
    """The pattern as a regex over a string with one character per token (see mining.Miner):
    each element becomes a character class of the vocabulary entries it matches. None when a
    required element matches nothing in this vocabulary (the rule cannot fire)."""
    def cls(rx: re.Pattern[str]) -> str | None:
        chars = [token_char(c) for c, name in enumerate(vocab) if rx.match(name)]
        return "[" + "".join(chars) + "]" if chars else None

    out = []
    for k, (rx, quant) in enumerate(elems):
        c = cls(rx)
        if c is None:
            if quant in ("?",) or quant.startswith("{0"):
                continue
            return None
        out.append(f"(?P<e{k}>{c}{quant})")
    if followed_by is not None:
        c = cls(followed_by)
        if c is None:
            return None
        out.append(f"(?={c})")
    return re.compile("".join(out))


TOKEN_BASE = 0x4E00   # CJK block: thousands of code points that are never regex syntax


SURROGATES = (0xD800, 0xE000)   # not characters: a vocabulary past ~35k kernel types would land there


def token_point(code: int) -> int:
    """The code point of kernel type ``code`` in the match string, skipping the surrogates."""
    p = TOKEN_BASE + code
    return p + (SURROGATES[1] - SURROGATES[0]) if p >= SURROGATES[0] else p


def token_code(ch: str) -> int:
    p = ord(ch)
    return (p - (SURROGATES[1] - SURROGATES[0]) if p >= SURROGATES[1] else p) - TOKEN_BASE


def token_char(code: int) -> str:
    return chr(token_point(code))


@dataclass
class LoopRule:
    id: str
    api: str
    what: str
    contains: re.Pattern[str]
    min_repeats: int = 4
    max_period: int = 16
    source: str = ""


@dataclass
class RegionRule:
    id: str
    api: str
    what: str
    span: re.Pattern[str] | None
    skip_optimizer: re.Pattern[str] | None
    kernel_names: re.Pattern[str] | None
    small_min: int = 64
    small_max_us: float = 20.0
    small_types: re.Pattern[str] | None = None
    source: str = ""


@dataclass
class KnowledgeBase:
    path: str
    sequences: list[SequenceRule]
    loops: list[LoopRule]
    regions: list[RegionRule]

    def ids(self) -> list[str]:
        return [r.id for r in self.sequences] + [r.id for r in self.loops] + [r.id for r in self.regions]

    def fullmatch(self, tokens: list[str], level: str) -> str | None:
        """The first sequence rule matching exactly these tokens (for naming mined n-grams)."""
        s = "".join(sanitize(t) + " " for t in tokens)
        for r in self.sequences:
            rx = r.kernels if level == "kernel" else r.aten
            if rx is not None:
                m = rx.match(s)
                if m and m.end() == len(s):
                    return r.id
        return None


def _glob(text: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(text).replace(r"\*", ".*").replace(r"\{optimizer\}", r"(?P<opt>[\w.]+)")
                      + "$")


def load_kb(path: Path | None = None) -> tuple[KnowledgeBase | None, list[Problem]]:
    """Parse and compile the knowledge base; a broken rule is a Problem, the others still load."""
    import yaml  # imported here: only the profile verb needs it

    path = path or DEFAULT_KB
    fname = str(path)
    try:
        with open(path, encoding="utf-8") as fp:
            data = yaml.safe_load(fp)
    except OSError as exc:
        return None, [Problem(fname, f"cannot read: {exc.strerror or exc}")]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return None, [Problem(fname, f"not valid YAML: {getattr(exc, 'problem', exc)}",
                              row=(mark.line + 1) if mark else None)]
    if not isinstance(data, dict) or not isinstance(data.get("patterns"), list):
        return None, [Problem(fname, "expected a mapping with a 'patterns' list")]
    seqs: list[SequenceRule] = []
    loops: list[LoopRule] = []
    regions: list[RegionRule] = []
    problems: list[Problem] = []
    for k, p in enumerate(data["patterns"]):
        where = f"pattern {k + 1}"
        try:
            if not isinstance(p, dict) or "id" not in p or "api" not in p:
                raise ValueError("needs at least 'id' and 'api'")
            where = f"pattern '{p['id']}'"
            kind = p.get("kind", "sequence")
            if kind == "sequence":
                if not p.get("kernels") and not p.get("aten"):
                    raise ValueError("a sequence needs 'kernels' and/or 'aten'")
                checks = []
                for c in p.get("checks") or []:
                    name, _, arg = str(c).partition(":")
                    if name not in ("residual_add", "feeds", "no_int64", "bool_mask"):
                        raise ValueError(f"unknown check '{c}'")
                    checks.append((name, int(arg or 0)))
                seqs.append(SequenceRule(
                    id=str(p["id"]), api=str(p["api"]), what=str(p.get("what", "")),
                    kernels=compile_sequence(p["kernels"], where, p.get("followed_by")) if p.get("kernels") else None,
                    aten=compile_sequence(p["aten"], where) if p.get("aten") else None,
                    checks=checks, subsumes=[str(x) for x in p.get("subsumes") or []],
                    caveat=p.get("caveat"), source=str(p.get("source", "")),
                    kernels_text=str(p.get("kernels", "")), aten_text=str(p.get("aten", "")),
                    kernel_elems=elements(p["kernels"], where) if p.get("kernels") else [],
                    aten_elems=elements(p["aten"], where) if p.get("aten") else [],
                    followed_by=re.compile(_alt(p["followed_by"], where) + "$") if p.get("followed_by") else None))
            elif kind == "loop":
                loops.append(LoopRule(str(p["id"]), str(p["api"]), str(p.get("what", "")),
                                      re.compile("^" + _alt(p["contains"], where) + "$"),
                                      int(p.get("min_repeats", 4)), int(p.get("max_period", 16)),
                                      str(p.get("source", ""))))
            elif kind == "region":
                small = p.get("small_kernel_run") or {}
                regions.append(RegionRule(
                    str(p["id"]), str(p["api"]), str(p.get("what", "")),
                    span=_glob(p["span"]) if p.get("span") else None,
                    skip_optimizer=_glob(p["skip_if_optimizer"]) if p.get("skip_if_optimizer") else None,
                    kernel_names=_glob(p["kernel_names"]) if p.get("kernel_names") else None,
                    small_min=int(small.get("min_kernels", 64)), small_max_us=float(small.get("max_us", 20)),
                    small_types=re.compile("^" + _alt(small["types"], where) + "$") if small.get("types") else None,
                    source=str(p.get("source", ""))))
            else:
                raise ValueError(f"unknown kind '{kind}'")
        except (ValueError, KeyError, TypeError, re.error) as exc:
            problems.append(Problem(fname, f"{where}: {exc}; rule skipped"))
    return KnowledgeBase(fname, seqs, loops, regions), problems
