"""Profile stage: Ascend PyTorch Profiler output -> same-module op sequences -> fused API candidates.

Entry points (plain data in, plain data out):

* :func:`npufuse.profile.analysis.analyze` — paths -> profile result dict (what
  ``npufuse profile --format json`` prints).
* :func:`npufuse.profile.join.join_with_scan` — (profile result, scan.json candidates) ->
  (ranked candidates, unexplained sequences); :func:`npufuse.profile.join.render_section_1_2`
  renders the latter as report section 1.2.

Module layout: ``readers`` (column-tolerant file loading), ``trace`` (kernel -> host op -> call
stack / module), ``kb`` + ``knowledge_base.yaml`` (patterns), ``mining`` (matching, n-grams, gaps),
``roofline`` (value assessment), ``analysis`` (orchestration), ``render``, ``join``, ``command``.
"""
