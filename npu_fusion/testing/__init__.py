"""The test harness of npu-fusion, shared by the tests, the benchmarks and ``npu-fusion report``.

- :mod:`.capture`: a torch.compile backend that runs the real pass on each backward graph and
  keeps the graph before and after it;
- :mod:`.grads`: the gradient criterion (a compiled gradient may be at most ``factor`` times
  further from float64 than the eager one, plus a per-dtype floor);
- :mod:`.sites`: an independent site counter (hooks on a library's norm and RoPE modules, or a
  wrapper around its apply-RoPE function) and the accounting of every counted site: fused, a
  recorded miss, run outside every compiled graph, or unexplained;
- :mod:`.frameworks`: tiny random models of torchtitan, torchtune and Megatron-core, measured
  with the above;
- :mod:`.cpu_workarounds`: what those libraries need to run on a CPU-only machine at all.

Nothing here is imported by the pass, the fused ops or the backend.
"""
