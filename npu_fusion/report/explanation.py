"""What the pass does to the user's own model and training step (:func:`npu_fusion.explain`).

``npu_fusion.explain(model_or_fn, *example_inputs, loss=..., **options)``: what the pass does to
the user's own model and training step, the way ``torch._dynamo.explain`` tells about graph breaks.

It runs one step three times without touching the user's code: in float64 on a deep copy (the
reference), eagerly (the baseline, while an independent counter counts the RoPE and RMSNorm sites),
and compiled with the pass (the counter active again: it then sees only the sites that ran outside
every compiled graph). The result is the command line's report for that step
(:func:`npu_fusion.report.analysis.analyse`): sites fused per op and per mode, misses with reasons,
backward ops before and after, modelled traffic, saved activations, the gradient check, and where
each counted site ended.

The independent counter, unless ``counter=`` names one, counts what the transformers convention
each counted op declares (:class:`~npu_fusion.lowering.CountedSite`) finds in the modules that
define the model's classes (or the function): calls of module classes named ``*RMSNorm``, tensors
returned by functions named ``apply_rotary_pos_emb*``. A site it cannot see shows as ``expected``
lower than ``found``; pass ``counter=`` (a :class:`~npu_fusion.measure.sites.SiteCounter` factory,
its classes and functions by kind: ``modules={"rms_norm": (MyNorm,)}``) to name them.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, Optional

import torch

from ..measure.sites import SiteCounter
from ..plugin.options import FusionOptions, forward_options
from .analysis import analyse
from .subjects import FunctionModule, Subject, conventional_counter
from .text import finite, format_text


@dataclasses.dataclass
class Explanation:
    """A report of one training step: ``str()`` is the text report, :meth:`to_json` the JSON
    of ``npu-fusion report --json``, :attr:`report` the same as plain data."""
    report: Dict[str, Any]

    def __str__(self) -> str:
        return format_text(self.report)

    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-safe data (a non-finite float becomes a string)."""
        return finite(self.report)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_html(self) -> str:
        """The report as one self-contained page (``npu-fusion report --html``)."""
        from .html import render

        return render(self.report)

    def fused(self, op: str) -> int:
        return self.report["ops"][op]["fused"] if op in self.report["ops"] else 0

    @property
    def passed(self) -> bool:
        """The gradients meet the float64 criterion and the pass hit no internal error."""
        return self.report["gradients"]["passed"] and not self.report["pass_errors"]


def explain(model_or_fn: Callable, *example_inputs, loss: Optional[Callable[[Any], torch.Tensor]] = None,
            counter: Optional[Callable[[torch.nn.Module], SiteCounter]] = None, name: Optional[str] = None,
            compiled_autograd: bool = False, train: bool = True, **options) -> Explanation:
    """Compile ``model_or_fn`` with the pass, run one forward and backward on ``example_inputs``
    and report it (see the module docstring).

    ``train=False`` reports an inference step instead: one forward under ``torch.no_grad()`` (an
    inference graph, the forward rules), its outputs (every floating tensor of ``model_or_fn``'s
    output) checked by the float64 criterion where a training step checks gradients; ``loss`` is
    not used.

    ``loss(output)`` makes the step's scalar (default: the output itself when it is a scalar, its
    ``.loss`` when it has one, else the sum of the mean squares of its floating tensors). A module's
    parameter gradients are checked; for a plain function, the inputs that require grad (all floating
    inputs when none does) play the parameters. ``options`` are the pass's
    (:class:`~npu_fusion.plugin.options.FusionOptions`: ``target``, ``partitioner``, ``rope``, ...).
    Runs ``torch._dynamo.reset()`` before compiling; dropout makes eager and compiled differ, so
    pass a module in ``eval()`` mode or without dropout."""
    fusion_options = FusionOptions.from_mapping(options)
    if not train and compiled_autograd:
        raise ValueError("explain: compiled_autograd compiles a backward; an inference step (train=False) has none")
    subject, batch = _subject(model_or_fn, example_inputs, loss or default_loss, counter, name)
    settings = {"model": subject.name, "source": "explain", "inputs": [_describe(a) for a in example_inputs],
                "layers": None, "dtype": _dtype_name(subject.model), "batch": None, "seq": None,
                "dynamic": False, "target": fusion_options.target, "partitioner": fusion_options.partitioner,
                "compiler": "npu_fusion", "checkpointing": "none", "compiled_autograd": compiled_autograd, "seed": None,
                "forward": all(getattr(fusion_options, option) for option in forward_options()), "train": train}
    return Explanation(analyse(subject, batch, fusion_options, settings))


def default_loss(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    leaves = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError("explain: the output has no floating tensor that requires grad; pass loss=")
    return sum(t.to(torch.promote_types(t.dtype, torch.float32)).pow(2).mean() for t in leaves)


def _tensors(value) -> list:
    """The tensors in an output: a tensor, or nested tuples, lists and dicts (a ModelOutput) of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _subject(model_or_fn, inputs, loss, counter, name) -> tuple:
    """The report's :class:`~.subjects.Subject` and the step's inputs."""
    if isinstance(model_or_fn, torch.nn.Module):
        model, batch = model_or_fn, tuple(inputs)
        label = name or f"{type(model).__name__} (explain)"
    else:
        model = FunctionModule(model_or_fn, inputs)
        batch = tuple(a for i, a in enumerate(inputs) if i not in model.positions)
        label = name or f"{getattr(model_or_fn, '__qualname__', repr(model_or_fn))} (explain)"
    return Subject(name=label, model=model, loss=lambda m, b: loss(m(*b)), vocab_size=0,
                   counter=counter or conventional_counter, counts_outside=True,
                   widen=_widened, outputs=lambda m, b: m(*b)), batch


def _widened(batch):
    """The float64 reference's inputs: floating tensors widened, everything else as it is."""
    return tuple(a.detach().double().requires_grad_(a.requires_grad)
                 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in batch)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__


def _dtype_name(model: torch.nn.Module) -> str:
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    return "/".join(dtypes) or "-"
