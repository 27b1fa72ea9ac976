"""s43 sweep43b: which other files of a repository can reach a class or function a file defines.

``probs_discarded_by_callers`` proves that every caller drops the attention probabilities a method returns; a
mention of the class's name in another repository file is a possible caller unless proven otherwise. A file that
defines its own top-level class (or function) of that name and imports nothing that could be the scanned file is
not one: its mentions are its own definition (``try_1 - Copy/models/patchtst.py`` next to
``try_1/models/patchtst.py``, a model zoo's per-model ``MultiHeadAttention``). An import of the scanned module (by
its file stem anywhere in the dotted path), a star import, or an import of the name itself keeps the file a
possible caller.
"""

from __future__ import annotations

import ast
from pathlib import PurePosixPath


def defines_its_own(tree: ast.Module, word: str, scanned_path: str) -> bool:
    """True when ``tree`` (another file of the repository) defines ``word`` at top level and no import in it could
    bring in the scanned file's ``word``."""
    if not any(isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == word for n in tree.body):
        return False
    stem = PurePosixPath(scanned_path.replace("\\", "/")).stem
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(stem in a.name.split(".") for a in node.names):
                return False
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if stem in parts or any(a.name in ("*", word, stem) for a in node.names):
                return False
    return True
