"""The test harness of npu-fusion: shared by the tests, the benchmarks and the scripts, kept in the
repository and out of the wheel (``setup.cfg`` packages ``npu_fusion`` only). It is imported from
the repository root: the tests through pytest's ``pythonpath = .`` (``setup.cfg``), the benchmarks
and scripts by putting the root on ``sys.path`` themselves, anything else with ``PYTHONPATH=.`` or
``python -m`` from the root.

It builds on what the package ships for measuring (:mod:`npu_fusion.measure`: the recording
backend, run counts, the gradient criterion, the site counter) and on the report
(:mod:`npu_fusion.report`); nothing in ``npu_fusion`` imports it.

- :mod:`.capture`: the recording backend with the tests' defaults (``strict``), and what the pass
  tests check with it (:func:`.capture.compile_and_compare`, :func:`.capture.decomposed_leftovers`);
- :mod:`.reference`: the fused ops' forwards (docs/fused-ops.md) written plainly, differentiated in float64;
- :mod:`.programs`: random RoPE/RMSNorm programs for the property tests (needs hypothesis);
- :mod:`.frameworks`: tiny random models of torchtitan, torchtune and Megatron-core, measured
  with the site counter; :mod:`.report` adds them to ``npu-fusion report`` as ``--framework``
  (``python -m npu_fusion_testing report --framework torchtune:gemma2``);
- :mod:`.zoo`: the sweep over the causal LMs of the installed transformers (its own site count);
- :mod:`.whole_rms_norm`: CPU kernels for ``aten._fused_rms_norm`` and its backward, so that the
  CPU routes ``F.rms_norm`` to the whole ops as a device with its own kernel does;
- :mod:`.in_place`: a caller's in-place update between forward and backward;
- :mod:`.cpu_workarounds`: what those libraries need to run on a CPU-only machine at all;
- :mod:`.torchair`: torchair's real Python sources from the torch_npu wheel (downloaded once) with
  CANN stubbed, and the NPU contract check.
"""
