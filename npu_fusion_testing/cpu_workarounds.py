"""What torchtitan and Megatron-core need to run a tiny model on a CPU-only machine at all.

None of this is part of npu-fusion's method, and nothing in the pass, the fused ops or the backend
imports it: it exists only so that the framework tests (``tests/test_frameworks.py``), the coverage
benchmark and ``npu-fusion report --framework`` can build those libraries' own model code without a
GPU. Each workaround says which library code assumes CUDA. torchtune needs none.
"""
from __future__ import annotations

import contextlib
import os
import socket


def cpu_workarounds_torchtitan(model_config):
    """torchtitan's debug flavors use FlexAttention, which has no CPU backward: each layer gets
    scaled-dot-product attention instead (the attention is not what the pass fuses). Edits and
    returns the model config; nothing global is patched."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config


class _NullRngTracker:
    """Stands for Megatron's CUDA RNG tracker: ``fork()`` changes no RNG state (dropout is 0)."""

    def fork(self, name=None):
        return contextlib.nullcontext()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _single_process_group():
    """Megatron's modules read their tensor/pipeline groups: a 1-process gloo group, torn down on
    exit unless one existed already."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def cpu_workarounds_megatron():
    """Megatron-core 0.16 on a CPU, for building and running a model inside the ``with``:

    - ``torch.cuda.current_device()`` returns ``"cpu"``: ``RotaryEmbedding`` moves its ``inv_freq``
      to the current CUDA device on every forward;
    - ``tensor_parallel.get_cuda_rng_tracker()`` returns a tracker whose ``fork()`` does nothing:
      ``DotProductAttention`` forks the CUDA RNG around its attention dropout;
    - a single-process gloo group and model parallel sizes 1 (its layers ask for their groups).

    (Its default causal mask is made on CUDA too: the framework builders pass an explicit one, an
    input rather than a patch.) Every patch is undone on exit."""
    import torch
    from megatron.core import tensor_parallel

    saved = (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _NullRngTracker()
    try:
        with _single_process_group():
            yield
    finally:
        torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker = saved


#: the workarounds each library's builders and runs need, by library (context manager factories)
CPU_WORKAROUNDS = {"megatron": cpu_workarounds_megatron}
