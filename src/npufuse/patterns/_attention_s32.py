"""Repository facts the attention detector asks about members of a class (s32).

Whether anything can read ``obj.<member>`` of one class: TTS blocks (VITS, Glow-TTS, Matcha) write
``x, self.attn = self.attention(q, k, v)`` and never read ``self.attn`` again, so the returned
probabilities are dead even though they are kept on the module. The answer is a proof over every file of
the repository, never a guess from names: each load of the attribute (and each string literal equal to
it, a ``getattr`` / hook key) is either ``self.<member>`` inside a class that is neither the class nor
one of its ancestors or descendants (by the names in ``class X(Base)`` headers across the repository),
or it is a possible read.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from npufuse.scan.dataflow import fast_walk

_CLASS_HEADER = re.compile(r"^[ \t]*class[ \t]+(\w+)[ \t]*\(([^)]*)\)", re.MULTILINE)
_NOTEBOOK_SKIP = {".git", "__pycache__", ".venv", "venv", "node_modules", "site-packages", ".ipynb_checkpoints"}


def _bases_by_class(texts: Iterable[str]) -> dict[str, set[str]]:
    """Class name -> the names of its bases (last dotted part), over ``class X(...)`` headers of the texts."""
    found: dict[str, set[str]] = {}
    for text in texts:
        for name, bases in _CLASS_HEADER.findall(text):
            found.setdefault(name, set()).update(b.strip().split(".")[-1] for b in bases.split(",") if b.strip())
    return found


def _related(bases: dict[str, set[str]], cls: str) -> set[str]:
    """``cls``, its ancestors and its descendants, by class names (a name defined twice counts both ways)."""
    up: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        for b in bases.get(c, ()):
            if b not in up:
                up.add(b)
                todo.append(b)
    down: set[str] = set()
    grew = True
    while grew:
        grew = False
        for c, bs in bases.items():
            if c not in down and (cls in bs or bs & down):
                down.add(c)
                grew = True
    return up | down | {cls}


def _possible_reads(tree: ast.AST, member: str, related: Callable[[], set[str]]) -> Optional[int]:
    """The line of the first node of ``tree`` that may read ``<obj>.<member>`` of a class in ``related()`` (the
    class, its ancestors and descendants; computed only when a ``self.<member>`` load needs it), else None."""
    def visit(node: ast.AST, cls: Optional[str], self_name: Optional[str]) -> Optional[int]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found = visit(child, child.name, None)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = child.args
                params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                if isinstance(node, ast.ClassDef) and not isinstance(child, ast.Lambda):
                    static = any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in child.decorator_list)
                    inner = params[0] if params and not static else None  # a method: its first parameter is the instance
                else:
                    inner = self_name if self_name not in params else None  # a closure sees the method's instance
                found = visit(child, cls, inner)
            else:
                found = None
                if isinstance(child, ast.Attribute) and child.attr == member and (
                        isinstance(child.ctx, ast.Load) or isinstance(node, ast.AugAssign) and node.target is child):
                    own = isinstance(child.value, ast.Name) and self_name is not None and child.value.id == self_name
                    if not own or cls in related():
                        return child.lineno
                elif isinstance(child, ast.Constant) and child.value == member and not isinstance(node, ast.Expr):
                    return child.lineno  # getattr(m, "attn"), a hook or dict key naming the member
                if found is None:
                    found = visit(child, cls, self_name)
            if found is not None:
                return found
        return None

    return visit(tree, None, None)


def _notebook_mentions(root: Path, member: str) -> bool:
    """Does a notebook of the repository write ``.member`` (a plot of stored attention maps)?"""
    pattern = re.compile(r"\." + re.escape(member) + r"\b")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NOTEBOOK_SKIP and not d.startswith(".")]
        for f in filenames:
            if f.endswith(".ipynb"):
                try:
                    path = Path(dirpath) / f
                    if path.stat().st_size <= 20_000_000 and pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                        return True
                except OSError:
                    return True
    return False


def member_may_be_read(module: Any, class_name: str, member: str, this_file: bool = True) -> Optional[str]:
    """Where ``<instance of class_name>.<member>`` may be read in the repository of ``module`` ("file:line"),
    or None when no file can read it (see the module docstring). ``this_file=False``: the caller has
    accounted for every mention in the module itself; only the other files are read."""
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    word = re.compile(r"\b" + re.escape(member) + r"\b")
    others: list[tuple[str, str]] = []
    if root is not None:
        repo_facts._depends(root, module.path)  # the answer reads the other files of the repository
        for rel in repo_facts._repo_py_files(root):
            if rel == module.path:
                continue
            text = repo_facts._repo_text(root, rel)
            if text is None:
                return rel  # unreadable: it may read the member
            others.append((rel, text))
    memo: list[set[str]] = []

    def related() -> set[str]:
        if not memo:
            memo.append(_related(_bases_by_class([module.source] + [text for _rel, text in others]), class_name))
        return memo[0]

    line = _possible_reads(module.tree, member, related) if this_file else None
    if line is not None:
        return f"{module.path}:{line}"
    for rel, text in others:
        if not word.search(text):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            return rel
        line = _possible_reads(tree, member, related)
        if line is not None:
            return f"{rel}:{line}"
    if root is not None and _notebook_mentions(root, member):
        return "a notebook of the repository"
    return None


_IDENTIFIER_PATH = re.compile(r"^[\w.]+$")


def code_mentions(module: Any, word: str) -> int:
    """How many times the code of ``module`` names ``word``: names, attributes, definitions, parameters, keyword
    arguments, imports, and string literals that are identifier paths (``__all__ = ["attention"]``,
    ``"layers.0.attention"``). Prose is no mention: comments, docstrings, and messages such as
    ``"only available for self-attention."`` (the regex count it replaces took those for uses)."""
    memo = module.__dict__.setdefault("_npufuse_s32_mentions", {})
    if word in memo:
        return memo[word]
    pattern = re.compile(r"\b" + re.escape(word) + r"\b")
    count = 0
    for node in fast_walk(module.tree):
        if isinstance(node, ast.Name):
            count += node.id == word
        elif isinstance(node, ast.Attribute):
            count += node.attr == word
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            count += node.name == word
        elif isinstance(node, ast.arg):
            count += node.arg == word
        elif isinstance(node, ast.keyword):
            count += node.arg == word
        elif isinstance(node, ast.alias):
            count += len(pattern.findall(node.name)) + (node.asname == word)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            count += node.names.count(word)
        elif isinstance(node, ast.ImportFrom) and node.module:
            count += len(pattern.findall(node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _IDENTIFIER_PATH.match(node.value):
            count += len(pattern.findall(node.value))
    memo[word] = count
    return count
