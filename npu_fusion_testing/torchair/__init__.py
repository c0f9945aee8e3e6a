"""torchair's real Python sources on a machine without CANN, for the torchair tests, the
``--torchair`` overhead benchmark and the NPU contract check.

- :mod:`.harness`: unpacks torchair from the torch_npu wheel and imports it (:func:`.harness.load_torchair`);
  reads what the wheel says about the ops npu-fusion uses (:func:`.harness.contract_sources`);
- :mod:`.cann_stub`: a pure-Python stand-in for torchair's CANN-facing extension modules;
- :mod:`.ge_graph_view`: the GE graphs torchair built, parsed (:class:`.ge_graph_view.GeCapture`);
- :mod:`.npu_contracts`: npu-fusion's eager kernels and GE nodes checked against a torch_npu release;
- :mod:`.llama_block`: a Llama-style block trained one step through torchair;
- :mod:`.saved_tensors`: which backward GE input is which forward GE output, by edges.

Nothing here is imported by the pass, the fused ops or the backend.
"""
