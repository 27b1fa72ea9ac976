"""s48 review48: a class name the file defines more than once is resolved by no name.

``ModuleInfo.classes`` maps a name to the FIRST top-level definition (through ``if`` / ``try`` blocks), and the
readers find a method's class as ``module.classes.get(scope.class_name)``: with two definitions of one name
(``if flag: class Norm .. else: class Norm ..``, a stale class left above the live one, a class nested in a function
or class under a module-level class's name) the methods of one were read with the other's ``__init__`` -- an eps
read as the other class's tiny literal fused ``x / (rms + self.eps)`` with ``self.eps = 0.5`` (a wrong result). Which
definition a name means is not known by name, so such a name is taken out of ``classes``: every reader then finds no
class (their refusal or run-time reading), as for a class of another file."""

from __future__ import annotations

from typing import Any


def drop_ambiguous(module: Any) -> None:
    seen: set[str] = set()
    twice: set[str] = set()
    for node in module.all_classes:
        (twice if node.name in seen else seen).add(node.name)
    for name in twice:
        module.classes.pop(name, None)
