"""Attention pass s25: the interchangeable-implementations evidence (a function or method read as a
value, not only called) found by a pruned walk over the statements whose lines name it."""

from __future__ import annotations

from npufuse.patterns.attention import _value_references, _written_uncalled
from npufuse.scan.dataflow import ModuleInfo

_CODE = '''\
import torch


def attend(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


def register(fn):
    return fn


class Layer:
    @register(attend)
    def forward(self, q, k, v):
        impl = self._eager if q.shape[0] > 1 else self._other
        return attend(q, k, v) + impl(q, k, v) + self._called(q, k, v)

    def _eager(self, q, k, v):
        return q

    def _other(self, q, k, v):
        return q

    def _called(self, q, k, v):
        return q
'''


def test_value_reads_are_found_in_decorators_and_nested_statements() -> None:
    module = ModuleInfo.from_source("m.py", _CODE)
    # `attend` is read as a value in a decorator (and called elsewhere): found
    assert _written_uncalled(module, "attend", False)
    assert "attend" in _value_references(module, "attend")[0]
    # `self._eager` is read as a value inside a method body: found as a method
    assert _written_uncalled(module, "_eager", True)
    assert "_eager" in _value_references(module, "_eager")[1]


def test_a_name_only_called_is_not_a_value_read() -> None:
    module = ModuleInfo.from_source("m.py", _CODE)
    assert not _written_uncalled(module, "_called", True)
    names, methods = _value_references(module, "_called")
    assert "_called" not in methods and "_called" not in names
