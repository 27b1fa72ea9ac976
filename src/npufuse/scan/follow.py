"""Follow the user's imports into installed packages (Hugging Face transformers first).

Most training scripts build their model from a library: the fusable code lives in site-packages,
not in the repo. This module reads the repo's Python files *statically* (nothing of the user's or
of the library is imported: importing transformers costs seconds and may probe hardware) and names
the installed modeling files the repo instantiates:

- ``AutoModelForCausalLM.from_config(Qwen2MoeConfig(...))`` / ``from_config(cfg)`` with a config
  class named anywhere in the repo, ``from_pretrained("some/path")`` whose ``config.json`` sits in
  the repo (its ``model_type``), ``AutoConfig.for_model("llama")``;
- direct use of a model or config class (``LlamaForCausalLM(...)``, ``Qwen2MoeConfig(...)``);
- ``import transformers.models.llama.modeling_llama`` / ``from transformers.models.x... import``.

Class names map to a ``model_type`` through transformers' own auto tables, read as text from the
installed copy, and a ``model_type`` to ``transformers/models/<type>/modeling_<type>.py``.

Where packages live: ``--site PATH`` (repeatable), else ``--python EXE``'s ``sys.path`` (asked in a
subprocess that imports nothing), else this interpreter's ``sys.path``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from npufuse.scan.dataflow import _statements_bfs, dotted, fast_walk

# transformers' auto tables: ("model_type", "ClassName") pairs, read as text
_PAIR = re.compile(r"\(\s*\"([\w\-]+)\"\s*,\s*\"(\w+)\"\s*\)")
_AUTO_TABLE_FILES = ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py", "models/auto/modeling_auto.py")
_MAX_CONFIG_BYTES = 1 << 20
_MAX_SOURCE_BYTES = 4 << 20


@dataclass(frozen=True)
class InstalledPackage:
    """An installed distribution found on the search path."""

    name: str  # the import name, e.g. "transformers"
    version: str  # from its dist-info METADATA, else its __version__ line, else "unknown"
    site: Path  # the folder holding the package folder (a site-packages)

    @property
    def root(self) -> Path:
        return self.site / self.name


@dataclass(frozen=True)
class FollowedFile:
    package: InstalledPackage
    rel: str  # path inside the site folder, posix, e.g. "transformers/models/llama/modeling_llama.py"
    reason: str  # why it is followed: "LlamaForCausalLM(...) at train.py:12"

    @property
    def path(self) -> Path:
        return self.package.site / self.rel


@dataclass
class FollowResult:
    files: list[FollowedFile] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # what the repo uses that was not found installed
    package: InstalledPackage | None = None  # the transformers found, if the repo uses it
    trainer: str | None = None
    missing: list[str] = field(default_factory=list)  # packages the repo imports that are not on the search path  # where the repo uses transformers' Trainer/TrainingArguments ("train.py:12")


class FollowError(ValueError):
    """Bad --python / --site input (exit 2 at the CLI)."""


# -- where packages live ---------------------------------------------------------------------------


def search_path(python: str | None = None, sites: Iterable[str] | None = None) -> list[Path]:
    """The folders to look for packages in: ``sites`` if given, else ``python``'s sys.path, else ours."""
    sites = list(sites or [])
    if sites:
        for s in sites:
            if not Path(s).is_dir():
                raise FollowError(f"--site {s}: no such folder")
        return [Path(s) for s in sites]
    if python:
        try:
            # -S -I would hide site-packages; -E keeps PYTHONPATH from our environment out of it
            out = subprocess.run([python, "-E", "-c", "import sys, json; print(json.dumps(sys.path))"],
                                 capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FollowError(f"--python {python}: cannot run it ({exc})") from None
        try:
            paths = json.loads(out.stdout.strip().splitlines()[-1])
            if not isinstance(paths, list):
                raise ValueError
        except (ValueError, IndexError):
            raise FollowError(f"--python {python}: did not print its sys.path (exit {out.returncode})") from None
        return [Path(p) for p in paths if isinstance(p, str) and p]
    return default_search_path()


def default_search_path() -> list[Path]:
    """Where this interpreter finds installed packages when it starts: PYTHONPATH, then its
    site-packages. Not this process's live sys.path: what a caller appended at run time (a test,
    a plugin) is not where the user's training script looks."""
    import site

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        paths += list(site.getsitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user, str):
        paths.append(user)
    return [Path(p) for p in dict.fromkeys(paths)]


def digest(found: FollowResult | None) -> str:
    """What the followed files add to the scan's cache key: their paths, versions and bytes."""
    if found is None or not (found.files or found.unresolved or found.trainer):
        return ""
    h = hashlib.sha256()
    for f in found.files:
        try:
            data = f.path.read_bytes()
        except OSError:
            data = b"\0unreadable"
        h.update(f"{f.package.site}\0{f.package.version}\0{f.rel}\0{f.reason}\0".encode("utf-8", "surrogatepass") + hashlib.sha256(data).digest())
    h.update(json.dumps([found.unresolved, found.trainer, str(found.package.site) if found.package else None]).encode("utf-8", "surrogatepass"))
    return "+follow:" + h.hexdigest()


def _version(site: Path, name: str) -> str:
    """The installed version: dist-info METADATA (what importlib.metadata reads), else __version__."""
    try:
        infos = sorted(site.glob(f"{name}-*.dist-info"))
    except OSError:
        infos = []
    for info in infos:
        try:
            for line in (info / "METADATA").read_text(encoding="utf-8", errors="replace").splitlines()[:40]:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            continue
    try:
        m = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", (site / name / "__init__.py").read_text(encoding="utf-8", errors="replace"), re.M)
    except OSError:
        m = None
    return m.group(1) if m else "unknown"


def find_package(name: str, paths: Iterable[Path]) -> InstalledPackage | None:
    """The first ``paths`` entry holding ``name/__init__.py`` (the import system's order), located
    without importing it (importlib.util.find_spec on a dotted name would import the parents)."""
    for p in paths:
        try:
            if (p / name / "__init__.py").is_file():
                return InstalledPackage(name, _version(p, name), p.resolve())
        except OSError:
            continue
    return None


# -- transformers' tables ------------------------------------------------------------------------


def _class_to_model_type(pkg: InstalledPackage) -> dict[str, str]:
    table: dict[str, str] = {}
    for rel in _AUTO_TABLE_FILES:
        try:
            text = (pkg.root / rel).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for model_type, cls in _PAIR.findall(text):
            table.setdefault(cls, model_type)
    return table


def modeling_file(pkg: InstalledPackage, model_type: str) -> str | None:
    """``transformers/models/<type>/modeling_<type>.py`` relative to the site, if installed."""
    mod = model_type.replace("-", "_")
    if not re.fullmatch(r"\w+", mod):
        return None
    rel = f"{pkg.name}/models/{mod}/modeling_{mod}.py"
    return rel if (pkg.site / rel).is_file() else None


# -- reading the repo ----------------------------------------------------------------------------


def _model_type_from_config_json(repo: Path, arg: str) -> str | None:
    """``from_pretrained("x")``: the ``model_type`` of ``x/config.json`` when ``x`` is a folder in the repo."""
    try:
        base = repo.resolve()
        folder = (repo / arg).resolve()
        if not folder.is_relative_to(base):
            return None  # only the repo's own files are read
        cfg = folder / "config.json"
        if not cfg.is_file() or cfg.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        data = json.loads(cfg.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    mt = data.get("model_type") if isinstance(data, dict) else None
    return mt if isinstance(mt, str) else None


def _uses(repo: Path, rel: str, text: str) -> list[tuple[str, str, str]]:
    """(kind, value, where) for each library use: kind "class" (a class name), "model_type", "module"."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out: list[tuple[str, str, str]] = []
    # only a file that imports transformers by its absolute name uses the installed copy (the
    # library's own files import each other relatively: a copy of them is the repo's own code)
    # (imports are statements: _statements_bfs skips the expressions; fast_walk is ast.walk's
    # order at a fraction of its cost. A library's files pass the text test on import lines in
    # their docstrings, and each was walked twice here with ast.walk)
    if not any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "transformers") for n in _statements_bfs(tree)):
        return out
    for node in fast_walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("transformers.models."):
                    out.append(("module", a.name, where))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("transformers.models."):
                out.append(("module", node.module, where))
            if node.module.split(".")[0] == "transformers":
                for a in node.names:
                    out.append(("class", a.name, where))
        elif isinstance(node, ast.Call):
            name = dotted(node.func) or ""
            last = name.rsplit(".", 1)[-1]
            if last in ("from_pretrained", "from_config", "for_model"):
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        if last == "for_model":
                            out.append(("model_type", arg.value, where))
                        else:
                            mt = _model_type_from_config_json(repo, arg.value)
                            if mt:
                                out.append(("model_type", mt, where))
                            else:
                                out.append(("unresolved", f"{name}({arg.value!r})", where))
                    elif isinstance(arg, ast.Call):
                        inner = (dotted(arg.func) or "").rsplit(".", 1)[-1]
                        if inner:
                            out.append(("class", inner, where))
            elif last:
                out.append(("class", last, where))
    return out


# An absolute import of transformers on some line (a cheap test before ast.parse; _uses decides).
# Over-inclusive on purpose (`import os, transformers`, a docstring line): a false hit only costs a parse.
_IMPORTS_TRANSFORMERS = re.compile(r"^[ \t]*(?:from|import)\b[^\n]*\btransformers\b", re.M)


# _IMPORTS_TRANSFORMERS on one line of the file's bytes, from the line's start (after "\n" or "\r").
_IMPORT_LINE_BYTES = re.compile(rb"[ \t]*(?:from|import)\b[^\n\r]*\btransformers\b")


def _may_import_transformers(data: bytes) -> bool:
    """False where ``_IMPORTS_TRANSFORMERS`` cannot find an import in the file's text (read as
    ``follow_imports`` reads it: UTF-8, bad bytes replaced, universal newlines), told from the
    bytes without decoding them: only the lines holding the word are tried. The regex on the
    text tried every position of every file (a scan of a library's own tree decoded and
    searched all of it: ~0.1x a plain ``ast.parse`` of the files, in the scan's parent). True
    is no answer (the text test decides): ``\b`` on bytes is ASCII-only, so a letter outside
    ASCII next to a word passes here and not there, never the reverse; a text line, ended by
    "\n", "\r\n" or "\r", is a run of the bytes holding neither "\n" nor "\r"."""
    find, rfind = data.find, data.rfind
    i = find(b"transformers")
    if i < 0:
        return False
    cr = b"\r" in data  # (else looking back for one would read back to the file's start)
    checked = -1  # the start of the last line tried
    while i >= 0:
        start = (max(rfind(b"\n", 0, i), rfind(b"\r", 0, i)) if cr else rfind(b"\n", 0, i)) + 1
        if start != checked:
            if _IMPORT_LINE_BYTES.match(data, start) is not None:
                return True
            checked = start
        i = find(b"transformers", i + 12)
    return False


def follow_imports(repo: Path, files: Iterable[str], paths: list[Path]) -> FollowResult:
    """The installed modeling files the repo's ``files`` (paths relative to ``repo``) use."""
    result = FollowResult()
    pkg = find_package("transformers", paths)
    uses: list[tuple[str, str, str]] = []
    for rel in files:
        try:
            p = repo / rel
            if p.stat().st_size > _MAX_SOURCE_BYTES:
                continue
            if not _may_import_transformers(p.read_bytes()):
                continue  # (the text test below would fail too)
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if "transformers" not in text or not _IMPORTS_TRANSFORMERS.search(text):
            # the only library followed so far, and only an absolute import uses the installed
            # copy: the library's own files (relative imports) are not parsed a second time here
            continue
        uses += _uses(repo, rel, text)
    if not uses:
        return result
    result.package = pkg
    if pkg is None:
        # not in scan.json: a repo scanned where its packages are not installed keeps its scan as it was
        result.missing.append("transformers")
        return result
    try:
        inside = repo.resolve().is_relative_to(pkg.root) or pkg.root.is_relative_to(repo.resolve())
    except OSError:
        inside = False
    if inside:  # the scan already covers the installed package itself
        return result
    classes = _class_to_model_type(pkg)
    seen: dict[str, FollowedFile] = {}

    def add(rel: str | None, reason: str) -> None:
        if rel is not None and rel not in seen:
            seen[rel] = FollowedFile(pkg, rel, reason)

    for kind, value, where in uses:
        if kind == "class" and value in ("TrainingArguments", "Trainer", "Seq2SeqTrainingArguments") and result.trainer is None:
            result.trainer = where
        if kind == "class":
            mt = classes.get(value)
            if mt is not None:
                add(modeling_file(pkg, mt), f"{value} at {where}")
        elif kind == "model_type":
            rel = modeling_file(pkg, value)
            if rel is None:
                result.unresolved.append(f"model_type {value!r} at {where}: no installed modeling file")
            add(rel, f"model_type {value!r} at {where}")
        elif kind == "module":
            parts = value.split(".")
            if len(parts) >= 3 and re.fullmatch(r"\w+", parts[2]):
                rel = modeling_file(pkg, parts[2])
                add(rel, f"import {value} at {where}")
        elif kind == "unresolved":
            result.unresolved.append(f"{value} at {where}: not a folder with a config.json in the repo")
    result.files = sorted(seen.values(), key=lambda f: f.rel)
    return result


# -- the library's own NPU switches (transformers) -----------------------------------------------


def library_switches(pkg: InstalledPackage) -> list[dict[str, Any]]:
    """transformers' settings that reach torch_npu's fused kernels, found in the installed copy."""
    out: list[dict[str, Any]] = []

    def has(rel: str, needle: str) -> bool:
        try:
            return needle in (pkg.root / rel).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False

    label = f"{pkg.name} {pkg.version}"
    if has("integrations/npu_flash_attention.py", "npu_fusion_attention"):
        out.append({"package": label, "name": "attn_implementation", "value": "flash_attention_2", "pattern": "attention",
                    "where": f"{pkg.name}/integrations/npu_flash_attention.py",
                    "what": 'from_pretrained/from_config(..., attn_implementation="flash_attention_2") runs torch_npu.npu_fusion_attention on an NPU'})
    if has("training_args.py", "adamw_torch_npu_fused"):
        out.append({"package": label, "name": "optim", "value": "adamw_torch_npu_fused", "pattern": "fused_optimizer",
                    "where": f"{pkg.name}/training_args.py",
                    "what": 'TrainingArguments(optim="adamw_torch_npu_fused") uses torch_npu.optim.NpuFusedAdamW'})
    if has("modeling_utils.py", "experts_implementation"):
        out.append({"package": label, "name": "experts_implementation", "value": "eager", "pattern": "moe_experts",
                    "where": f"{pkg.name}/modeling_utils.py",
                    "what": 'the default experts_implementation is "grouped_mm"; "eager" runs the per-expert loop a rewrite of it fuses'})
    return out


def _defaults(pkg: InstalledPackage) -> dict[str, str]:
    """The library's default attention / experts implementation, read from modeling_utils.py."""
    try:
        text = (pkg.root / "modeling_utils.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, str] = {}
    m = re.search(r"applicable_attention\s*=\s*\"(\w+)\"\s+if requested_attention is None", text)
    if m:
        found["attention"] = m.group(1)
    m = re.search(r"applicable_experts\s*=\s*\"(\w+)\"\s+if requested_experts is None", text)
    if m:
        found["experts"] = m.group(1)
    return found


def bypass_reason(cand: dict[str, Any], pkg: InstalledPackage, defaults: dict[str, str] | None = None) -> str | None:
    """Why the library's default path never runs this candidate's code, and which setting does."""
    defaults = _defaults(pkg) if defaults is None else defaults
    pattern, qualname = cand.get("pattern"), str(cand.get("qualname", ""))
    attn = defaults.get("attention")
    if pattern == "attention" and attn and attn != "eager" and "eager" in qualname:
        return (f'{pkg.name} {pkg.version} defaults to attn_implementation="{attn}": this eager attention runs only with '
                f'attn_implementation="eager"; prefer the library\'s own NPU path, attn_implementation="flash_attention_2" '
                "(torch_npu.npu_fusion_attention on an NPU)")
    experts = defaults.get("experts")
    if pattern == "moe_experts" and experts and experts != "eager" and qualname.split(".")[0].endswith("Experts"):
        return (f'{pkg.name} {pkg.version} defaults to experts_implementation="{experts}": this per-expert loop runs only with '
                'experts_implementation="eager" (from_pretrained/from_config(..., experts_implementation="eager"))')
    return None


# -- merging into scan.json ------------------------------------------------------------------------


def merge(scan: dict[str, Any], followed: FollowedFile, part: dict[str, Any]) -> None:
    """Add one followed file's scan (``part``, scanned with the file's own folder as root) to
    ``scan``: ids continue, paths become ``<site-relative path>`` and candidates name their package."""
    prefix = followed.rel.rsplit("/", 1)[0] + "/"
    pkg = followed.package
    n = max((c["id"] for c in scan["candidates"]), default=0)
    for c in part.get("candidates", []):
        n += 1
        c["id"] = n
        c["file"] = prefix + c["file"]
        head, sep, nth = c["key"].rpartition("#")
        c["key"] = f"{c['pattern']}@{c['file']}:{c['qualname']}" + (f"#{nth}" if sep and nth.isdigit() else "")  # "#2": a second site in one function
        c["package"] = {"name": pkg.name, "version": pkg.version, "site": str(pkg.site), "path": c["file"]}
        c.setdefault("notes", []).append(f"in installed {pkg.name} {pkg.version} (followed: {followed.reason}); `npufuse apply` patches it in "
                                         "npufuse_patches.py in this repo, never in site-packages: add `import npufuse_patches; npufuse_patches.apply()` "
                                         "to the training script")
        scan["candidates"].append(c)
    for m in part.get("near_misses", []):
        m["file"] = prefix + m["file"]
        scan["near_misses"].append(m)
    for f in part.get("files_failed", []):
        f["file"] = prefix + f["file"]
        scan["files_failed"].append(f)
    scan["files_scanned"] = scan.get("files_scanned", 0) + part.get("files_scanned", 0)
    scan["lines_scanned"] = scan.get("lines_scanned", 0) + part.get("lines_scanned", 0)


def extend_scan(scan: dict[str, Any], found: FollowResult, *, only: list[str] | None, max_file_bytes: int, switch_mode: str,
                overrides: dict[str, Any], optimizer_zero_grad_in_place: bool = False) -> None:
    """Scan each followed file (read-only, like the repo) and merge it into ``scan``; note the
    library's own NPU switches and rank candidates its default path bypasses last.
    ``optimizer_zero_grad_in_place``: the repo scan's ``--optimizer-zero-grad-in-place`` (ScanOptions),
    so a followed file's optimizers are judged under the same option as the repo's."""
    from npufuse.scan import engine

    packages: dict[str, InstalledPackage] = {}
    for f in found.files:
        inputs = engine.gather_inputs(f.path, only=only, max_file_bytes=max_file_bytes, switch_mode=switch_mode, overrides=overrides,
                                      optimizer_zero_grad_in_place=optimizer_zero_grad_in_place)
        part = engine.run_scan(inputs, jobs=1).to_json()
        merge(scan, f, part)
        packages[f.package.name] = f.package
    scan["followed"] = [{"package": {"name": f.package.name, "version": f.package.version}, "file": f.rel, "reason": f.reason} for f in found.files]
    if found.unresolved:
        scan["followed_unresolved"] = list(found.unresolved)
    switches: list[dict[str, Any]] = []
    bypassed: list[int] = []
    for pkg in packages.values():
        switches += library_switches(pkg)
        defaults = _defaults(pkg)
        for c in scan["candidates"]:
            if (c.get("package") or {}).get("name") != pkg.name:
                continue
            reason = bypass_reason(c, pkg, defaults)
            if reason:
                c["bypassed_by_default"] = reason
                c.setdefault("notes", []).append(reason)
                bypassed.append(c["id"])
    # the repo trains through transformers' Trainer: its optimizer has the library's own switch
    if found.trainer is not None and found.package is not None:
        switches += [s for s in library_switches(found.package) if s["name"] == "optim" and s not in switches]
        for c in scan["candidates"]:
            if c.get("pattern") == "fused_optimizer" and not c.get("package"):
                c.setdefault("notes", []).append(f'the repo uses Trainer ({found.trainer}): prefer TrainingArguments(optim="adamw_torch_npu_fused") '
                                                 "(transformers' own torch_npu fused AdamW) to rewriting this construction")
    if switches:
        scan["library_switches"] = switches
    order = engine.suggested_order(scan["candidates"])
    scan["suggested_order"] = [i for i in order if i not in bypassed] + [i for i in order if i in bypassed]
