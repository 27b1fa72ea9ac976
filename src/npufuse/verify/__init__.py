"""Stage 2 verification: prove each applied replacement, operator first, then end to end.

* :mod:`npufuse.verify.opcheck` — ``npufuse verify op ID``: the user's rewritten function with the
  fused branch on and off on the same inputs, forward and backward, against a float64 golden run
  (fp32 on an NPU) of the original (inputs from :mod:`npufuse.verify.inputs`).
* :mod:`npufuse.verify.e2e` — ``npufuse verify e2e ID --cmd ...``: baseline vs fused run of the
  user's own launch command (:mod:`npufuse.verify.runner`, :mod:`npufuse.verify.logparse`),
  loss first, then step time (:mod:`npufuse.verify.stats`); per-step JSONL
  (:mod:`npufuse.verify.jsonl`).
* :mod:`npufuse.verify.probe` — what runs *inside* a child process (sitecustomize bootstrap):
  the emulator when there is no real torch_npu, per-site call counters proving the fused branch
  ran, peak memory, and the argument capture of ``verify op --capture``.
* :mod:`npufuse.verify.candidate` — one candidate's facts from scan.json + state.json.

Nothing here is imported by the rewritten user code: proof is injected from outside.
"""
