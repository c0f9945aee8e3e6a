"""The test harness of npu-fusion, shared by the tests, the benchmarks, the scripts and
``npu-fusion report``; the tests import it as a package (no ``sys.path`` edits).

- :mod:`.capture`: a torch.compile backend that runs the real pass on each backward graph and
  keeps the graph before and after it (or, with ``fuse=False``, the graph the pass would get);
  :func:`.capture.compile_and_compare` and :func:`.capture.decomposed_leftovers`;
- :mod:`.grads`: the gradient criterion, with its one tolerance table (a compiled gradient may be
  at most ``factor`` times further from float64 than the eager one, plus a per-dtype floor), and
  the eager, compiled and float64 gradients it compares;
- :mod:`.reference`: the fused ops' SPEC forwards written plainly, differentiated in float64;
- :mod:`.programs`: random RoPE/RMSNorm programs for the property tests (needs hypothesis);
- :mod:`.sites`: an independent site counter (hooks on a library's norm and RoPE modules, or a
  wrapper around its apply-RoPE function) and the accounting of every counted site: fused, a
  recorded miss, run outside every compiled graph, or unexplained;
- :mod:`.frameworks`: tiny random models of torchtitan, torchtune and Megatron-core, measured
  with the above;
- :mod:`.zoo`: the sweep over the causal LMs of the installed transformers;
- :mod:`.whole_rms_norm`: CPU kernels for ``aten._fused_rms_norm`` and its backward, so that the
  CPU routes ``F.rms_norm`` to the whole ops as a device with its own kernel does;
- :mod:`.cpu_workarounds`: what those libraries need to run on a CPU-only machine at all;
- :mod:`.torchair`: torchair's real Python sources with CANN stubbed, and the NPU contract check.

Nothing here is imported by the pass, the fused ops or the backend.
"""
