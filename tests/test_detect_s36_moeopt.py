"""s36 moeopt36: reads of a name inside an inner scope are not reads of the enclosing scope's variable.

A comprehension has its own scope in Python 3 (its targets are its variables; only its first iterable is
evaluated in the enclosing scope), and a lambda's or nested def's parameters are its own. ``Scope.uses_after``
(the live-out check every detector asks before replacing a span) counted such reads, so an expert loop's
``expert`` looked live after the loop when an ``else:`` arm ran ``[expert(xs) for expert in self.experts]``
(Language-Group's DLG-MoE ``MoEBlock``). The same shadowing follows loops over experts in DynMoE, MMoE/CGC
(multitask-learning-pytorch), ktransformers, Megatron-LM, lmdeploy, xtuner, lerobot and exllamav2."""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo


def _scope(src: str, qualname: str):
    module = ModuleInfo.from_source("m.py", src)
    return next(s for s in module.scopes if s.qualname == qualname)


_SRC = '''
def f(xs, experts, k):
    for expert in experts:
        y = expert(xs)
    a = [expert(xs) for expert in experts]
    b = {i: e for i, e in enumerate(experts)}
    c = (lambda expert: expert(xs))(experts[0])
    def g(expert, k=k):
        return expert(xs)
    return a, b, c, g
'''


def test_comprehension_and_parameter_reads_are_not_reads_after_the_loop():
    scope = _scope(_SRC, "f")
    loop_end = 4
    assert not scope.uses_after("expert", loop_end)
    assert not scope.uses_after("e", loop_end)
    assert scope.uses_after("experts", loop_end)  # a comprehension's first iterable is the function's
    assert scope.uses_after("k", loop_end)  # a default is evaluated in the function's scope
    assert scope.uses_after("xs", loop_end)  # a free name of the lambda / def is the function's


def test_first_iterable_and_own_parameters_still_count():
    src = _SRC.replace("a = [expert(xs) for expert in experts]", "a = [p for p in expert.parameters()]")
    assert _scope(src, "f").uses_after("expert", 4)
    # the scope's own parameters are its variables, read after line 4
    assert _scope(_SRC, "f").uses_after("xs", 4)
    inner = _scope(_SRC, "f.g")
    assert inner.uses_after("expert", 8)


def test_later_generator_targets_shadow_earlier_iterables():
    src = "def f(rows, e):\n    for e in rows:\n        pass\n    return [x for x in rows for e in x if e]\n"
    assert not _scope(src, "f").uses_after("e", 3)
    assert ast.parse(src)
