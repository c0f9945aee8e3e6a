"""What ``npu-fusion report`` and :func:`npu_fusion.explain` measure.

What ``npu-fusion report`` and :func:`npu_fusion.explain` measure, shipped with the package
(the test harness, ``npu_fusion_testing`` in the repository, builds on it but stays out of the
wheel):

- :mod:`.recording`: the one recording backend (the ``npu_fusion`` backend's AOTAutograd with the
  real pass, keeping each backward graph before and after the pass and the pass's results; its
  Inductor variant), op counts and each node's module path;
- :mod:`.runs`: how many times each graph through the pass ran (a graph Dynamo reuses for several
  layers runs its sites once per layer);
- :mod:`.grads`: the gradient criterion with its one tolerance table (a compiled gradient may be at
  most ``factor`` times further from float64 than the eager one, plus a per-dtype floor) and the
  per-parameter comparison the report prints;
- :mod:`.sites`: the independent site counter (hooks on a library's norm and RoPE modules, or a
  wrapper around its apply-RoPE function) and the accounting of every counted site: fused, a
  recorded miss, run outside every compiled graph, or unexplained;
- :mod:`.timing`: the pass's share of a compile (its own CPU time over the compiled step's), what
  the report prints and the benchmarks measure.

Layering: this package imports ``plugin/`` and below; the report (``npu_fusion.report``) imports
it; nothing in the pass imports it.
"""
