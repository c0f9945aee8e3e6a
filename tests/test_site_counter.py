"""The independent site counter reads each counted op's declaration (its ``CountedSite``): the
transformers convention finds a site of every counted kind, recorded under the kind at the module
path the declaration says, and nothing in the counter or the report names a kind."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from npu_fusion.lowering import FUSED_OPS
from npu_fusion.measure.sites import COUNTED_SITES, KINDS, PROBES, SiteCounter
from npu_fusion.plugin.options import forward_ops
from npu_fusion.report.subjects import conventional_counter


def test_every_op_of_a_kind_counted_on_its_own_declares_how_its_sites_are_seen():
    on_their_own = {kind for kind, probe in PROBES.items() if not probe.same_sites_as}
    assert set(COUNTED_SITES) == on_their_own
    for kind, site in COUNTED_SITES.items():
        # the report's counter can find it: by class name, function name, or (SwiGLU: a Phi-3 MLP
        # and a Llama MLP are both "...MLP", only the first a site) the gated module's source
        assert site.class_suffix or site.function_prefix or site.gate_activation, kind


@pytest.mark.parametrize("model_type, sites", [("phi3", 2), ("mixtral", 2), ("llama", 0), ("jetmoe", 2),
                                               ("granitemoehybrid", 4), ("deepseek_v4", 0)])
def test_conventional_counter_counts_the_swiglu_products_of_gate_activations(model_type, sites):
    """The report's counter of transformers models counts a SwiGLU site per call of a SiLU that
    computes SwiGLU's value, whatever the projection is called: Phi-3's MLP, Mixtral's experts,
    JetMoE's ``input_linear`` experts, GraniteMoE-Hybrid's shared MLP beside its experts; none in
    Llama's MLP (separate gate and up) nor DeepSeek-V4's (its halves clamped before the product:
    not SwiGLU's value); 2 layers. The zoo's own counter counts the same."""
    pytest.importorskip("transformers")
    from npu_fusion_testing import zoo

    (entry,) = zoo.discover([model_type], layers=2)
    model = zoo.build(entry)
    ids = torch.randint(0, entry.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with conventional_counter(model) as counter:
        zoo.param_grads(model, ids)
    swiglu = next(kind for kind, site in COUNTED_SITES.items() if site.gate_activation)
    assert counter.counts[KINDS[swiglu]] == sites
    with zoo.count_sites(model, entry) as counts:
        zoo.param_grads(model, ids)
    assert counts[swiglu] == sites


class GatedMlp(torch.nn.Module):
    """A gate activation applied to ``halves(projection)``, multiplied as ``product`` says."""

    def __init__(self, product, halves=lambda h: h.chunk(2, dim=-1)):
        super().__init__()
        self.proj, self.act, self.product, self.halves = torch.nn.Linear(4, 8), torch.nn.SiLU(), product, halves

    def forward(self, x):
        gate, up = self.halves(self.proj(x))
        return self.product(self.act, gate, up)


GATED = {  # name: (the module, whether each call is a SwiGLU site)
    "chunk": (GatedMlp(lambda act, g, u: act(g) * u), True),
    "up_first": (GatedMlp(lambda act, g, u: u * act(g)), True),
    "slices": (GatedMlp(lambda act, g, u: act(g) * u, lambda h: (h[..., :4], h[..., 4:])), True),
    "clamped_gate": (GatedMlp(lambda act, g, u: act(g.clamp(max=1.0)) * u), False),
    "clamped_up": (GatedMlp(lambda act, g, u: act(g) * u.clamp(-1.0, 1.0)), False),
    "swapped": (GatedMlp(lambda act, g, u: act(u) * g), False),
    "scaled_up": (GatedMlp(lambda act, g, u: act(g) * (2 * u)), False),
    "not_halves": (GatedMlp(lambda act, g, u: act(g) * u, lambda h: (h[..., :3], h[..., 5:])), False),
    "two_projections": (GatedMlp(lambda act, g, u: act(g) * u, lambda h: (h[..., :4], h[..., :4] * 1)), False),
}


@pytest.mark.parametrize("name", GATED)
def test_a_gate_activation_is_a_site_where_it_computes_swiglus_value(name):
    """By value, not by names: the SiLU of the first half of one tensor times its second half is a
    site (at the path of the module that holds the SiLU); a clamp, a scale, swapped or unequal
    halves, or an up that is no half of the gate's tensor is none."""
    model, fuses = GATED[name]
    wrapped = torch.nn.Sequential(model)
    with SiteCounter(wrapped, gated={"swiglu": (model.act,)}) as counter:
        wrapped(torch.randn(3, 4)).sum().backward()
    assert counter.sites_of("swiglu") == ([("0", 1)] if fuses else [])


@pytest.mark.parametrize("op", FUSED_OPS, ids=lambda op: op.name)
def test_every_op_has_a_short_label(op):
    """The HTML map's boxes and the coverage tables' columns: a forward op's label differs from its
    backward's (both count the same sites)."""
    assert op.short_label and op.short_label != op.name
    backward = {PROBES[kind].same_sites_as for kind, name in KINDS.items() if name == op.name} - {None}
    for kind in backward:
        assert op.short_label != next(o for o in FUSED_OPS if o.option == kind).short_label
    assert (op.name in forward_ops()) == bool(backward)


def _namespace(monkeypatch, site):
    """A module of the user's code: a class named by the convention (its own weight, so that its
    output requires grad) and a function named by it, both of the convention's kind ``site``."""
    namespace = types.ModuleType("user_model_of_the_site_counter_test")
    monkeypatch.setitem(sys.modules, namespace.__name__, namespace)

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    Inner.__name__ = Inner.__qualname__ = "User" + (site.class_suffix or "Block")
    Inner.__module__ = namespace.__name__

    def function(x, y):
        return x * 2.0, y * 3.0  # q and k: two sites in one call

    function.__name__ = (site.function_prefix or "helper") + "_user"
    setattr(namespace, function.__name__, function)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            h = self.inner(x)
            if site.function_prefix:  # looked up at the call: the counter wraps the namespace's attribute
                q, k = getattr(namespace, function.__name__)(h * self.weight, h)
                h = q + k
            return h

    Outer.__module__ = namespace.__name__
    setattr(namespace, "Outer", Outer)
    return Outer


@pytest.mark.parametrize("kind", sorted(COUNTED_SITES))
def test_the_conventional_counter_finds_each_kind_where_its_declaration_says(monkeypatch, kind):
    site = COUNTED_SITES[kind]
    model = _namespace(monkeypatch, site)()
    with conventional_counter(model) as counter:
        model(torch.randn(2, 4)).sum().backward()
    expected = []
    if site.class_suffix:  # one call of the module: its own path, or its caller's (the root's, "")
        expected.append(("" if site.path_of_caller else "inner", 1))
    if site.function_prefix:  # two tensors returned, both receiving a gradient, at the caller's path
        expected.append(("", 2))
    merged = {}
    for path, n in expected:
        merged[path] = merged.get(path, 0) + n
    assert counter.sites_of(kind) == sorted(merged.items())
    assert counter.total(kind) == sum(merged.values())
    assert all(k == kind for k, _ in counter.counted), counter.counted  # no other kind sees them


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown site kind"):
        SiteCounter(torch.nn.Linear(2, 2), modules={"no_such_kind": (torch.nn.Linear,)})


@pytest.mark.parametrize("kind", sorted(COUNTED_SITES))
def test_a_hooked_module_of_each_kind_is_recorded_at_the_path_its_declaration_says(kind):
    """A module named by the caller (a framework's class): its path, or, for a kind whose modules
    are often one instance shared by every layer (RoPE), the path of the module that called it."""
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with SiteCounter(model, modules={kind: (torch.nn.Linear,)}) as counter:
        model(torch.randn(2, 4)).sum().backward()
    assert counter.sites_of(kind) == [("0" if COUNTED_SITES[kind].path_of_caller else "0.0", 1)]
