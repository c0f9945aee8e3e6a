"""Random forward programs around one RMSNorm or RoPE, exact or one step away, for the property
tests of the forward rules (``rms_norm_forward``, ``rope_forward``: tests/test_forward_properties.py).

Drawn like :mod:`.programs` (a form, then perturbations, shrinking toward the first entry of every
choice and toward none), but each perturbation says what a forward rule may do with it:

- ``BREAKING`` ones make the site no RMSNorm or RoPE at all (a mean over the wrong axis, eps
  outside the root, the rotation of another tensor, a partner lane one off, a nonlinear term, a
  rounding to bf16 inside a site that computes in float32): the forward must stay unfused;
- the others keep a formula the fused op can still express with other operands (a sign flipped
  onto a table, tables whose halves differ, a linear extra term, a negative eps): fusing them is
  allowed, but only with the right operands, which the output and gradient checks see.

:attr:`ForwardProgram.sites` is how many applications of the norm or rotation the program makes
(each one a forward site that must end fused or as a recorded miss when no perturbation breaks it).
The programs' text runs as printed (``exec`` it with ``torch`` in scope), and its casts are spelled
``.to(torch.float32)`` so that the float64 references of :class:`.programs.Program` apply.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

from hypothesis import strategies as st

from .programs import BF16, DTYPE_NAME, DTYPES, F32, SIZES, Input, Program, function_source, some_of

NORM_OP, ROPE_OP = "rms_norm", "rotary_position_embedding"


@dataclasses.dataclass
class ForwardProgram(Program):
    op: str = NORM_OP
    #: applications of the norm or rotation (forward sites when nothing breaks them)
    sites: int = 1
    #: the drawn perturbations that make every site no op's formula
    breaking: Tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        """Every site is still the op's formula as the program reads it: nothing drawn, or only
        wrappers around the sites (:data:`SITE_KEEPING`), so each must end fused or recorded."""
        return not set(self.perturbations) - SITE_KEEPING


#: wrappers that leave each site as it is: the program returns an intermediate of it or a view of
#: its output, updates its input or output in place, or reads its input through a transpose
SITE_KEEPING = {"returns_stat", "returns_rotated", "in_place_output", "in_place_input", "strided_input",
                "returned_view"}


# -- RMSNorm ------------------------------------------------------------------------------

#: where the norm rounds: "hf" statistics in float32, the normalized value cast back to x's dtype,
#: then the weight (rounds before the weight multiply); "weight_in_fp32" the weight multiplied in
#: float32, then the cast back (rounds after it); "plain" no cast; "functional" F.rms_norm
NORM_CASTS = ["hf", "weight_in_fp32", "plain", "functional"]
#: the weight: gamma, none, or Gemma's (1 + w)
WEIGHTS = ["gamma", "none", "one_plus"]
EPSILONS = ["1e-6", "1e-5", "1e-12", "0.1"]
#: the norm's input: a leaf taking gradient, the sum of a residual stream and a sublayer's output
#: (the sum returned too), or a tensor without gradient (the norm's forward alone is the site: the
#: program returns ``x * norm(h)``)
NORM_INPUTS = ["leaf", "residual", "frozen"]
#: around the norm: nothing, a sandwich (the norm of a sublayer of the norm: two sites), a post-norm
#: (``x + norm(tanh(x))``)
NORM_AROUND = ["none", "sandwich", "post"]
#: after the norm's output: returned as it is, through a projection, cast to float32
NORM_AFTER = ["none", "matmul", "cast_fp32"]

#: (an extra term after the normalized value, or its rounding to bf16 before the weight, leaves a
#: weightless norm followed by other math: a site as it is, so they do not break it)
NORM_BREAKING = {
    "eps_outside_root", "eps_on_x", "wrong_axis", "wrong_n", "abs_stat", "stat_of_flip", "numerator_flip",
    "numerator_extra", "rstd_squared", "quartic_root", "rounded_stat", "rounded_copy"}
NORM_PERTURBATIONS = [  # a list holds alternatives for one place in the norm (see some_of)
    ["wrong_axis", "wrong_n", "abs_stat", "stat_of_flip", "eps_on_x", "rounded_stat"],
    ["eps_outside_root", "quartic_root", "rstd_squared", "eps_negated"],
    ["numerator_flip", "numerator_extra", "extra_term", "rounded_normalized"]]


#: what the backward's generators draw around a site and the forward's lacked (issue 30): roundings
#: per lane (half the normalized value's lanes rounded to bf16 before the weight) and per copy (the
#: numerator reads a bf16 copy of what the statistic squares: no norm), the statistic returned, in-place
#: updates of the norm's input or output, a transposed (strided) input, a view of the output returned
NORM_WRAPPERS = [["lane_rounded", "rounded_copy"], "returns_stat", ["in_place_output", "in_place_input"],
                 ["strided_input", "returned_view"]]


@dataclasses.dataclass(frozen=True)
class NormForward:
    casts: str
    weight: str
    eps: str
    source: str         # a key of NORM_INPUTS
    around: str
    after: str
    shape: Tuple[int, int, int]
    dtype: object
    w_dtype: object
    w_grad: bool

    def computes_in_float32(self) -> bool:
        return self.dtype == F32 or self.casts in ("hf", "weight_in_fp32")

    def __str__(self):
        return (f"{self.casts} weight={self.weight} eps={self.eps} input={self.source} around={self.around} "
                f"after={self.after} x {DTYPE_NAME[self.dtype]}{list(self.shape)} w {DTYPE_NAME[self.w_dtype]}"
                + (" (trained)" if self.w_grad else ""))


@st.composite
def norm_forward_forms(draw) -> NormForward:
    dtype = draw(DTYPES)
    casts = draw(st.sampled_from(NORM_CASTS))
    weight = draw(st.sampled_from(WEIGHTS if casts != "functional" else ["gamma", "none"]))
    return NormForward(
        casts=casts, weight=weight, eps=draw(st.sampled_from(EPSILONS)), source=draw(st.sampled_from(NORM_INPUTS)),
        around=draw(st.sampled_from(NORM_AROUND)), after=draw(st.sampled_from(NORM_AFTER)),
        shape=(draw(SIZES), draw(SIZES), draw(st.sampled_from([8, 16]))), dtype=dtype,
        w_dtype=draw(st.sampled_from([dtype, dtype, F32])), w_grad=draw(st.booleans()))


def norm_statistic(form: NormForward, h: str, p) -> str:
    eps = f"-{form.eps}" if "eps_negated" in p else form.eps
    x2 = f"({h} + {eps}) * ({h} + {eps})" if "eps_on_x" in p else f"{h}.pow(2)"
    if "abs_stat" in p:
        x2 = f"{h}.abs()"
    if "stat_of_flip" in p:
        x2 = f"{h}.flip(0).pow(2)"
    if "wrong_axis" in p:
        return f"{x2}.mean(1, keepdim=True)"
    if "wrong_n" in p:
        return f"{x2}.sum(-1, keepdim=True) / {form.shape[-1] + 1}"
    ms = f"{x2}.mean(-1, keepdim=True)"
    return f"{ms}.to(torch.bfloat16).to(torch.float32)" if "rounded_stat" in p else ms


def norm_rstd(form: NormForward, p) -> str:
    eps = f"-{form.eps}" if "eps_negated" in p else form.eps
    if "eps_on_x" in p:
        return "torch.rsqrt(ms)"
    if "eps_outside_root" in p:
        return f"1.0 / (torch.sqrt(ms) + {eps})"
    if "quartic_root" in p:
        return f"torch.rsqrt(torch.sqrt(ms + {eps}))"
    r = f"torch.rsqrt(ms + {eps})"
    return f"{r} * {r}" if "rstd_squared" in p else r


def norm_body(form: NormForward, p) -> List[str]:
    if form.casts == "functional":
        weight = ", w" if form.weight == "gamma" else ""
        return [f"return torch.nn.functional.rms_norm(x, [{form.shape[-1]}]{weight}, eps={form.eps})"]
    upcast = form.casts != "plain"
    lines = ["h = x.to(torch.float32)"] if upcast else ["h = x"]
    lines += [f"ms = {norm_statistic(form, 'h', p)}", f"r = {norm_rstd(form, p)}",
              {"numerator_flip": "n = h.flip(-1) * r", "numerator_extra": "n = (h + 0.1 * h * h) * r"}.get(
                  next((name for name in p if name.startswith("numerator")), ""), "n = h * r")]
    if "rounded_copy" in p:  # the numerator reads a bf16 copy of what the statistic squares
        lines[-1] = lines[-1].replace("n = h", "n = h.to(torch.bfloat16).to(torch.float32)", 1)
    if "extra_term" in p:
        lines.append("n = n + 0.1 * h")
    if "rounded_normalized" in p:
        lines.append("n = n.to(torch.bfloat16).to(torch.float32)")
    if "lane_rounded" in p:  # half of the lanes rounded to bf16, the other half exact
        half = form.shape[-1] // 2
        lines.append(f"n = torch.cat((n[..., :{half}], n[..., {half}:].to(torch.bfloat16).to(torch.float32)), -1)")
    w = {"gamma": "w", "none": None, "one_plus": "(1.0 + w.to(torch.float32))"}[form.weight]
    if form.casts == "hf":
        y = "n.to(x.dtype)" if w is None else f"{w} * n.to(x.dtype)"
        if form.weight == "one_plus":
            y = "(n * (1.0 + w.to(torch.float32))).to(x.dtype)"  # Gemma: the weight in float32, one cast
    elif form.casts == "weight_in_fp32":
        y = "n.to(x.dtype)" if w is None else f"(n * {w}.to(torch.float32)).to(x.dtype)"
    else:
        y = "n" if w is None else f"n * {w}"
    return lines + [f"return {y}, r" if "returns_stat" in p else f"return {y}"]


def norm_forward_program(form: NormForward, p) -> ForwardProgram:
    b, s, d = form.shape
    weighted = form.weight != "none"
    inputs = [Input("x", "SBD", (s, b, d), form.dtype, form.source != "frozen") if "strided_input" in p
              else Input("x", "BSD", form.shape, form.dtype, form.source != "frozen")]
    if form.source == "residual":
        inputs.append(Input("a", "BSD", form.shape, form.dtype, True))
    if form.source == "frozen":
        inputs.append(Input("g", "BSD", form.shape, form.dtype, True))
    if weighted:
        inputs.append(Input("w", "D", (d,), form.w_dtype, form.w_grad))
    if form.after == "matmul":
        inputs.append(Input("wp", "DD", (d, d), form.dtype, True))
    args = "x, w" if weighted else "x"
    norm = lambda t: f"norm({t}, w)" if weighted else f"norm({t})"  # noqa: E731
    lines, outs = ["x = x.transpose(0, 1)"] if "strided_input" in p else [], []
    if "in_place_input" in p:
        lines += ["x = x * 1.0", "x.mul_(1.5)"]
    if form.source == "residual":  # the residual stream: its sum is the norm's input and an output
        lines.append("x = x + a")
        outs.append("x")
    y = norm("x")
    if "returns_stat" in p:  # the statistic returned too (around is "none": one norm)
        lines.append(f"y, r = {y}")
        outs.append("r")
        y = "y"
    if form.around == "sandwich":
        y = norm(f"torch.tanh({y})")
    elif form.around == "post":
        y = f"x + {norm('torch.tanh(x)')}"
    lines.append(f"y = {y}")
    if "in_place_output" in p:
        lines.append("y.mul_(0.5)")
    if "returned_view" in p:
        outs.append("y.transpose(0, 1)")
    y = {"none": "y", "matmul": "y @ wp.to(y.dtype)", "cast_fp32": "y.to(torch.float32)"}[form.after]
    if form.source == "frozen":
        y = f"g * {y}"
    outs.insert(0, y)
    helpers = function_source("norm", args.split(", "), norm_body(form, p))
    source = helpers + function_source("f", [i.name for i in inputs], lines + [f"return {', '.join(outs)}"])
    breaking = tuple(name for name in p if name in NORM_BREAKING)
    return ForwardProgram("rms_norm_forward", str(form), p, inputs, "\n".join(source) + "\n",
                          op=NORM_OP, sites=2 if form.around == "sandwich" else 1, breaking=breaking)


def norm_wrapper_slots(form: NormForward, p) -> list:
    """The :data:`NORM_WRAPPERS` that make sense for the form and the drawn perturbations."""
    slots = []
    for slot in NORM_WRAPPERS:
        slot = [name for name in (slot if isinstance(slot, list) else [slot]) if not (
            (name in ("lane_rounded", "rounded_copy", "returns_stat") and form.casts == "functional")
            or (name in ("lane_rounded", "rounded_copy") and (not form.computes_in_float32() or form.dtype == BF16
                                                              or {"rounded_normalized", "rounded_stat"} & set(p)))
            or (name == "returns_stat" and form.around != "none")
            # an output without gradient (the statistic or a view of a frozen input's norm) has no backward
            or (name in ("returns_stat", "returned_view") and form.source == "frozen"))]
        if slot:
            slots.append(slot)
    return slots


@st.composite
def norm_forward_programs(draw, near_misses: bool = True, wrappers: bool = False) -> ForwardProgram:
    """A norm forward program; with ``wrappers``, :data:`NORM_WRAPPERS` drawn around it too."""
    form = draw(norm_forward_forms())
    slots = NORM_PERTURBATIONS if form.casts != "functional" and near_misses else []
    p = draw(some_of(slots, counts=(0, 1, 1)))
    if wrappers:
        p = p + draw(some_of(norm_wrapper_slots(form, p), counts=(1, 1, 2, 3)))
    if not form.computes_in_float32() and ({"rounded_stat", "rounded_normalized"} & set(p)):
        p = ()  # a rounding to bf16 in a half-precision norm is no clear near miss
    if form.dtype == BF16 and "rounded_normalized" in p and form.casts == "hf":
        p = ()  # rounds to bf16 just before the program's own cast to bf16: the same value
    return norm_forward_program(form, p)


# -- RoPE -----------------------------------------------------------------------------------

#: q's axes, the tables' axes drawn with them; "BSND_T": q is [B, S, N, D] transposed to BNSD
#: before the rotation (HF), tables [S, D]
ROPE_LAYOUTS = {"BNSD": ["SD", "11SD", "B1SD"], "BSND": ["S1D", "1S1D", "BS1D"], "BSND_T": ["SD", "1SD"]}
#: how the tables are spelled: full-width inputs, half-width inputs rebuilt as HF (``cat((f, f))``)
#: or GPT-J (``repeat_interleave``), or the half-table formula on half-width inputs
TABLE_SPELLINGS = ["full", "rebuilt", "half_tables"]
#: where the rotation rounds: "none" in x's dtype; "upcast" q in float32, cast back (HF's
#: apply_rotary_pos_emb under float32 tables); "tables_to_x" tables cast to x's dtype first
ROPE_CASTS = ["none", "upcast", "tables_to_x"]

#: (a term added after the rotation, linear or not, leaves the rotation a site as it is)
ROPE_BREAKING = {"wrong_split", "wrong_partner", "rot_of_flip", "rot_of_rolled", "rot_axis", "abs_x",
                 "term_inside", "rounded_term"}
ROPE_PERTURBATIONS = [
    ["wrong_split", "wrong_partner", "rot_axis", "no_negation", "both_negated"],
    ["rot_of_flip", "rot_of_rolled", "abs_x"],
    ["term_inside", "nonlinear_term", "linear_term", "term_sign", "rounded_term"],
    ["halves_differ", "tables_swapped"]]


#: what the backward's generators draw around a rotation and the forward's lacked (issue 30): roundings
#: per lane (``x * cos`` with the table rounded to bf16 on its second half only, an exact near miss
#: of a float32 rotation that a forward fused once with the exact table) and per copy (the x * cos
#: term reads a bf16 copy of cos), the rotated half returned, in-place updates of the rotation's
#: input or output, a transposed view of the output returned
ROPE_WRAPPERS = [["lane_rounded_table", "rounded_table_copy"], "returns_rotated",
                 ["in_place_output", "in_place_input"], "returned_view"]


@dataclasses.dataclass(frozen=True)
class RopeForward:
    mode: int            # 0 half, 1 interleave
    layout: str
    table_layout: str
    tables: str          # a key of TABLE_SPELLINGS
    casts: str
    head_dim: int
    width: int           # rotary dim (partial rotary when < head_dim)
    sizes: Tuple[int, int, int]  # B, N, S
    dtype: object
    table_dtype: object
    with_k: bool
    q_grad: bool         # False: q takes no gradient (the rotation's forward alone, times g)
    after: str           # "none" or "times": an elementwise use of each output

    def __str__(self):
        return (f"mode {self.mode} {self.layout}/{self.table_layout} tables={self.tables} casts={self.casts} "
                f"D={self.head_dim}" + (f" rotary_dim={self.width}" if self.width < self.head_dim else "")
                + f" q {DTYPE_NAME[self.dtype]} tables {DTYPE_NAME[self.table_dtype]}"
                + (" with k" if self.with_k else "") + ("" if self.q_grad else " (q frozen)")
                + ("" if self.after == "none" else f", then {self.after}"))


@st.composite
def rope_forward_forms(draw) -> RopeForward:
    tables = draw(st.sampled_from(TABLE_SPELLINGS))
    mode = 0 if tables == "half_tables" else draw(st.sampled_from([0, 1]))
    layout = draw(st.sampled_from(list(ROPE_LAYOUTS)))
    head_dim = draw(st.sampled_from([8, 16]))
    dtype = draw(DTYPES)
    return RopeForward(
        mode=mode, layout=layout, table_layout=draw(st.sampled_from(ROPE_LAYOUTS[layout])), tables=tables,
        casts=draw(st.sampled_from(ROPE_CASTS)), head_dim=head_dim,
        width=draw(st.sampled_from([head_dim, head_dim // 2])),
        sizes=(draw(SIZES), draw(st.sampled_from([1, 2])), draw(SIZES)), dtype=dtype,
        table_dtype=draw(st.sampled_from([dtype, dtype, F32])), with_k=draw(st.booleans()),
        q_grad=draw(st.sampled_from([True, True, False])), after=draw(st.sampled_from(["none", "none", "times"])))


def rope_rotation(form: RopeForward, p) -> List[str]:
    """``def rot(x)``: the mode's rotation of the last axis, or a near miss of it."""
    h = form.width // 2
    if "rot_axis" in p:  # halves of the axis before the last
        return function_source("rot", ["x"], ["m = x.shape[-2] // 2", "x1, x2 = x[..., :m, :], x[..., m:, :]",
                                              "return torch.cat((-x2, x1), dim=-2)"])
    a, b = {"no_negation": ("x2", "x1"), "both_negated": ("-x2", "-x1")}.get(
        next((n for n in p if n in ("no_negation", "both_negated")), ""), ("-x2", "x1"))
    if form.mode == 0:
        split = h - 1 if "wrong_split" in p else h
        body = [f"x1, x2 = x[..., :{split}], x[..., {split}:]", f"r = torch.cat(({a}, {b}), dim=-1)"]
    else:
        body = ["x1, x2 = x[..., 0::2], x[..., 1::2]", f"r = torch.stack(({a}, {b}), dim=-1).flatten(-2)"]
    if "wrong_partner" in p:  # every lane paired with the lane one further on
        body.append("r = r.roll(1, -1)")
    return function_source("rot", ["x"], body + ["return r"])


def rope_formula(form: RopeForward, p) -> List[str]:
    """``def rope(x, cos, sin)`` on the rotary width."""
    xs = "x.abs()" if "abs_x" in p else "x"
    seq = -3 if form.layout == "BSND" else -2
    rx = "rot(x.flip(0))" if "rot_of_flip" in p else (f"rot(x.roll(1, {seq}))" if "rot_of_rolled" in p else "rot(x)")
    c, s = ("sin", "cos") if "tables_swapped" in p else ("cos", "sin")
    if form.tables == "half_tables":  # x1 * cos - x2 * sin, x2 * cos + x1 * sin on half-width tables
        h = form.width // 2
        c2, s2 = (f"{c}.flip({table_seq_axis(form)})", s) if "halves_differ" in p else (c, s)
        x1 = "x1.abs()" if "abs_x" in p else "x1"
        x2 = "(x2 + 0.1 * x1 * x1)" if "term_inside" in p else "x2"
        first = f"{x1} * {c} {'+' if 'term_sign' in p else '-'} {x2} * {s}"
        if "nonlinear_term" in p:
            first += " + 0.1 * x1 * x1"
        if "linear_term" in p:
            first += f" + x1 * {s}"
        if "rounded_term" in p:
            first = f"({first}).to(torch.bfloat16).to(x.dtype)"
        return function_source("rope", ["x", "cos", "sin"], [
            f"x1, x2 = x[..., :{h}], x[..., {h}:]", f"return torch.cat(({first}, x2 * {c2} + x1 * {s2}), dim=-1)"])
    first = f"{xs} * {c}"
    if "lane_rounded_table" in p:  # the table exact on the first half of the lanes, rounded on the second
        h = form.width // 2
        first = f"torch.cat(({xs}[..., :{h}] * {c}[..., :{h}], {xs}[..., {h}:] * {c}.to(torch.bfloat16).to({c}.dtype)" \
                f"[..., {h}:]), -1)"
    if "rounded_table_copy" in p:
        first = f"{xs} * {c}.to(torch.bfloat16).to({c}.dtype)"
    if "rounded_term" in p:
        first = f"({first}).to(torch.bfloat16).to(x.dtype)"
    if "term_inside" in p:  # a nonlinear term inside the rotated one: no node is the rotation
        rx = f"({rx} + 0.1 * x * x)"
    y = f"{first} {'-' if 'term_sign' in p else '+'} {rx} * {s}"
    if "nonlinear_term" in p:
        y += " + 0.1 * x * x"
    if "linear_term" in p:
        y += f" + x * {s}"
    return rope_rotation(form, p) + function_source("rope", ["x", "cos", "sin"], [f"return {y}"])


def table_seq_axis(form: RopeForward) -> int:
    """The tables' sequence axis, counted from the end (a flip over it: another position's values)."""
    return form.table_layout.index("S") - len(form.table_layout)


def rope_table_shape(form: RopeForward) -> Tuple[str, Tuple[int, ...]]:
    b, n, s = form.sizes
    width = form.width // 2 if form.tables != "full" else form.width
    sizes = {"B": b, "S": s, "1": 1, "D": width}
    return form.table_layout, tuple(sizes[letter] for letter in form.table_layout)


def rope_forward_program(form: RopeForward, p) -> ForwardProgram:
    b, n, s = form.sizes
    q_dims, q_shape = ("BNSD", (b, n, s, form.head_dim)) if form.layout == "BNSD" else \
        ("BSND", (b, s, n, form.head_dim))
    t_dims, t_shape = rope_table_shape(form)
    inputs = [Input("q", q_dims, q_shape, form.dtype, form.q_grad)]
    if form.with_k:
        inputs.append(Input("k", q_dims, q_shape, form.dtype, True))
    inputs += [Input("cos", t_dims, t_shape, form.table_dtype), Input("sin", t_dims, t_shape, form.table_dtype)]
    if not form.q_grad:
        inputs.append(Input("g", q_dims, q_shape, form.dtype, True))
    lines = ["q = q * 1.0", "q.mul_(1.5)"] if "in_place_input" in p else []
    if form.tables == "rebuilt":
        rebuild = "torch.cat(({t}, {t}), dim=-1)" if form.mode == 0 else "{t}.repeat_interleave(2, dim=-1)"
        if "halves_differ" in p:  # the second half of sin from another position
            flip = f".flip({table_seq_axis(form)})"
            rebuild = f"torch.cat(({{t}}, {{t}}{flip}), dim=-1)" if form.mode == 0 else \
                f"torch.stack(({{t}}, {{t}}{flip}), dim=-1).flatten(-2)"
        lines += [f"{t} = {rebuild.format(t=t)}" for t in ("cos", "sin")]
    elif "halves_differ" in p and form.tables == "full":
        w = form.width // 2
        lines.append(f"sin = torch.cat((sin[..., :{w}], cos[..., {w}:]), dim=-1)")
    if form.casts == "tables_to_x":
        lines += ["cos, sin = cos.to(q.dtype), sin.to(q.dtype)"]
    elif form.casts == "upcast":
        lines += ["cos, sin = cos.to(torch.float32), sin.to(torch.float32)"]
    outs = []
    for name in ("q", "k") if form.with_k else ("q",):
        x = f"{name}.transpose(1, 2)" if form.layout == "BSND_T" else name
        if form.casts == "upcast":
            x = f"{x}.to(torch.float32)"
        if form.width < form.head_dim:
            y = f"torch.cat((rope({x}[..., :{form.width}], cos, sin), {x}[..., {form.width}:]), dim=-1)"
        else:
            y = f"rope({x}, cos, sin)"
        if form.casts == "upcast":
            y = f"({y}).to({name}.dtype)"
        if form.after == "times":
            y = f"({y}) * 2.0"
        if name == "q" and not form.q_grad:
            y = f"g.transpose(1, 2) * {y}" if form.layout == "BSND_T" else f"g * {y}"
        lines.append(f"{name}_out = {y}")
        if "in_place_output" in p:
            lines.append(f"{name}_out.mul_(0.5)")
        outs.append(f"{name}_out")
        if name == "q" and "returns_rotated" in p:  # the rotated half of the site's x returned too
            outs.append(f"rot({x}[..., :{form.width}])")
    if "returned_view" in p:
        outs.append("q_out.transpose(1, 2)")
    source = rope_formula(form, p) + function_source("f", [i.name for i in inputs], lines + [
        f"return {', '.join(outs)}"])
    breaking = tuple(name for name in p if name in ROPE_BREAKING)
    return ForwardProgram("rope_forward", str(form), p, inputs, "\n".join(source) + "\n", dynamic_axes="BS",
                          op=ROPE_OP, sites=1 + form.with_k, breaking=breaking)


def rope_slots(form: RopeForward):
    slots = []
    for slot in ROPE_PERTURBATIONS:
        slot = [name for name in slot if not (
            (name == "rounded_term" and not (form.dtype == F32 or form.casts == "upcast"))
            or (name in ("wrong_split", "rot_axis") and (form.tables == "half_tables" or form.mode == 1))
            or (name == "rot_of_flip" and form.sizes[0] == 1)
            or (name in ("wrong_partner", "no_negation", "both_negated", "rot_of_rolled", "rot_of_flip")
                and form.tables == "half_tables")
            or (name == "rot_axis" and form.layout == "BSND" and form.sizes[1] == 1))]
        if slot:
            slots.append(slot)
    return slots


def rope_wrapper_slots(form: RopeForward, p) -> list:
    """The :data:`ROPE_WRAPPERS` that make sense for the form and the drawn perturbations."""
    slots = []
    rounded = {"rounded_term", "term_inside", "abs_x", "tables_swapped"} & set(p)
    for slot in ROPE_WRAPPERS:
        slot = [name for name in (slot if isinstance(slot, list) else [slot]) if not (
            (name in ("lane_rounded_table", "rounded_table_copy")
             and (form.tables == "half_tables" or rounded or not (form.dtype == F32 or form.casts == "upcast")))
            or (name == "returns_rotated" and (form.tables == "half_tables" or "rot_axis" in p or not form.q_grad)))]
        if slot:
            slots.append(slot)
    return slots


@st.composite
def rope_forward_programs(draw, near_misses: bool = True, wrappers: bool = False) -> ForwardProgram:
    """A RoPE forward program; with ``wrappers``, :data:`ROPE_WRAPPERS` drawn around it too."""
    form = draw(rope_forward_forms())
    p = draw(some_of(rope_slots(form), counts=(0, 1, 1))) if near_misses else ()
    if wrappers:
        p = p + draw(some_of(rope_wrapper_slots(form, p), counts=(1, 1, 2, 3)))
    return rope_forward_program(form, p)


__all__ = ["ForwardProgram", "NORM_OP", "ROPE_OP", "norm_forward_programs", "rope_forward_programs"]
