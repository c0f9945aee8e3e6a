"""Random forward programs around RoPE and RMSNorm, exact or slightly wrong, for the
property tests (tests/test_properties.py).

A program is Python source defining ``f(*inputs)`` plus its inputs' shapes and dtypes. It
is drawn in two steps: a form (:class:`RopeForm`, :class:`NormForm`: mode, spelling,
layout, dtypes, sizes), then perturbations (a flipped sign, a wrong split point, a root of
a square, an extra output, a 0-dim factor, ...), at most one per place in the program.
A failure shrinks toward the first entry of every choice and toward no perturbation, and
the program text printed on failure runs as it is (``exec`` it with ``torch`` in scope).

Casts are spelled ``.to(torch.float32)`` (never ``.float()``), so that the float64
reference runs the same text with every float dtype read as float64 (:func:`wide_torch`).

:func:`precision_programs` draws exact RoPE and RMSNorm that differ only in where they round
(:class:`PrecisionForm`: autocast regions, mixed dtypes, round trips to bf16/fp16/fp8).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from typing import Dict, List, Tuple

import torch
from hypothesis import strategies as st

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
DTYPE_NAME = {F32: "float32", F16: "float16", BF16: "bfloat16", FP8: "float8_e4m3fn"}
DTYPE_NAME_TORCH = {dtype: f"torch.{name}" for dtype, name in DTYPE_NAME.items()}
EPS = "1e-6"


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    dims: str                # one letter per axis: B N S T H (drawn sizes), D (head dim), W R (table widths), 1
    shape: Tuple[int, ...]
    dtype: torch.dtype = F32
    grad: bool = False
    scale: float = 1.0       # of the standard normal values

    def __str__(self):
        flags = (", requires_grad" if self.grad else "") + (f", scale {self.scale:g}" if self.scale != 1 else "")
        return f"{self.name}: {DTYPE_NAME[self.dtype]}{list(self.shape)}{flags}"


@dataclasses.dataclass
class Program:
    family: str                      # "rope" or "rms_norm"
    form: str                        # e.g. "mode 0 BNSD/11SD D=16", "llama (pow_mean, rsqrt) over [16] of [2, 3, 16]"
    perturbations: Tuple[str, ...]   # how it differs from the plain form (some are benign)
    inputs: List[Input]
    source: str
    #: axes that may be marked dynamic: letters of Input.dims
    dynamic_axes: str = "BST"
    #: {input: dtype} of an explicit rounding of that input's gradient after the sites (RoPE of
    #: ``rnd(x)``): a fused op exact to the program's precision may flip a value across that
    #: rounding's boundary, an ulp of it, which a matmul after it spreads over the gradient
    grad_rounding: Dict[str, torch.dtype] = dataclasses.field(default_factory=dict)

    def build(self, wide: bool = False, keep_narrowing: bool = False):
        """The program's ``f``; with ``wide``, every float dtype the text names is float64
        (with ``keep_narrowing``, float32 only: its casts to a narrower type still round)."""
        namespace = {"torch": wide_torch(keep_narrowing) if wide else torch, "__name__": "program"}
        exec(compile(self.source, "<program>", "exec"), namespace)
        return namespace["f"]

    def tensors(self, seed: int = 0) -> List[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [(torch.randn(i.shape, generator=gen) * i.scale).to(i.dtype).requires_grad_(i.grad)
                for i in self.inputs]

    def dynamic_dims(self) -> Dict[int, List[int]]:
        """{input index: axes to mark dynamic} (sizes 1 stay static: Dynamo specializes them)."""
        out = {}
        for index, i in enumerate(self.inputs):
            axes = [a for a, (letter, size) in enumerate(zip(i.dims, i.shape))
                    if letter in self.dynamic_axes and size > 1]
            if axes:
                out[index] = axes
        return out

    def __repr__(self):  # hypothesis prints it as the argument; the note has the full text
        return f"<{self.family} {self.form}; {', '.join(self.perturbations) or 'no perturbation'}>"

    def _repr_pretty_(self, printer, cycle):  # hypothesis's printer spells dataclasses out otherwise
        printer.text(repr(self))

    def __str__(self):
        head = f"{self.family} {self.form}; perturbations: {', '.join(self.perturbations) or 'none'}"
        inputs = "\n".join(f"#   {i}" for i in self.inputs)
        return f"# {head}\n# inputs:\n{inputs}\n{self.source}"


def wide_torch(keep_narrowing: bool = False):
    """``torch`` with float32/float16/bfloat16/float8_e4m3fn read as float64 and autocast
    regions doing nothing: the program's own math, exactly. With ``keep_narrowing``, float32
    only: the program's math with its explicit roundings (``.to(torch.bfloat16)``) kept."""
    wide = types.ModuleType("torch")
    wide.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    wide.float32 = torch.float64
    if not keep_narrowing:
        wide.float16 = wide.bfloat16 = wide.float8_e4m3fn = torch.float64
    wide.autocast = lambda *args, **kwargs: contextlib.nullcontext()
    return wide


def indent(lines, by=4):
    return [" " * by + line for line in lines]


def function_source(name, args, body) -> List[str]:
    return [f"def {name}({', '.join(args)}):"] + indent(body)


# -- shared strategies ----------------------------------------------------------------

SIZES = st.sampled_from([2, 3, 4])
DTYPES = st.sampled_from([F32, BF16, F16])


@st.composite
def second_dtype(draw, dtype):
    """Usually ``dtype``; sometimes float32, or the other half type (fp16 with bf16)."""
    choice = draw(st.sampled_from(["same", "same", "float32", "other half"]))
    return {"same": dtype, "float32": F32, "other half": {F32: BF16, BF16: F16, F16: BF16}[dtype]}[choice]


@st.composite
def some_of(draw, slots, counts=(0, 1, 1, 1, 2)):
    """Perturbations: a few distinct slots (a name, or a list of alternatives for the same
    place in the program, of which one is drawn), in a canonical order. How many is drawn
    from ``counts``, whose first entry (none) is where shrinking goes."""
    slots = [slot if isinstance(slot, list) else [slot] for slot in slots]
    n = min(draw(st.sampled_from(counts)), len(slots))
    chosen = sorted(draw(st.permutations(range(len(slots))))[:n])
    return tuple(draw(st.sampled_from(slots[i])) for i in chosen)


WRAPPER_COUNTS = (0, 0, 1, 2)
SCALINGS = ["scale", "zero_dim", "zero_dim_input"]


def scaled(y: str, p) -> str:
    """Constant scalings of an output: a Python float, a 0-dim tensor made in the program,
    a 0-dim input requiring grad."""
    if "scale" in p:
        y = f"{y} * 0.125"
    if "zero_dim" in p:
        y = f"{y} * torch.full((), 0.5)"
    if "zero_dim_input" in p:
        y = f"{y} * s"
    return y


# -- RoPE -------------------------------------------------------------------------

ROPE_LAYOUTS = {  # q/k axes: the cos/sin axes allowed with them (docs/supported-forms.md)
    "BNSD": ["SD", "11SD", "B1SD", "BNSD"],
    "BSND": ["1S1D", "BS1D"],
    "SBND": ["S11D"],
    "TND": ["T1D"],
}
#: how the program writes RoPE, and the width of its tables (W: rotary_dim, R: half of it);
#: "computed": cos/sin computed in the program from positions and inverse frequencies (HF's
#: rotary embedding inside the compiled region: no table is an input); "half_computed": the
#: half-table formula with ``freqs.cos()``/``freqs.sin()`` written at each use (the forward
#: computes each table twice and the partitioner saves copies); "tune": torchtune's
#: selects and stack on a [.., R, 2] cache of (cos, sin); "complex_plain": complex RoPE in
#: float32 with no casts (``reshape``); "megatron": Megatron-core's [S, B, H, D] with cos/sin
#: computed from ``freqs`` inside each call (two calls: two copies of each table)
ROPE_SPELLINGS = {"full": "W", "rebuilt": "R", "half": "R", "complex": "R", "function": "W", "computed": "R",
                  "half_computed": "R", "tune": "R2", "complex_plain": "R", "megatron": "R"}
USES_ROT = ("full", "rebuilt", "function", "computed")
COMPLEX = ("complex", "complex_plain")

# Perturbation slots (see some_of): a list holds alternatives for one place in the program.
ROTATION_PERTURBATIONS = {  # in the rotate helper, per mode
    0: ["rot_sign", ["rot_split", "rot_axis"]],
    1: ["rot_sign", "rot_parity"],
    2: ["rot_sign", "rot_order"],
    3: ["rot_sign", "deinterleave_parity"],
}
TERM_PERTURBATIONS = [  # in x * cos + rot(x) * sin
    ["abs_x", "sqrt_square_x", "pow_half_square_x"], "detach_x",
    ["swap_tables", "same_table", "rolled_sin", "missing_table"], ["term_sign", "coef"], "extra_term",
    "rounding_cast"]
HALF_TABLE_PERTURBATIONS = [  # in x1 * cos - x2 * sin, x2 * cos + x1 * sin
    ["abs_x", "sqrt_square_x"], "detach_x", ["swap_tables", "same_table"], ["term_sign", "coef"], "extra_term"]
COMPLEX_PERTURBATIONS = [["conj", "conj_x"], "extra_term", "swap_parts"]
#: half_computed: the second lane's tables are another table, or a multiple of the first's copy
COPY_PERTURBATIONS = [["copy_other", "copy_other_cos", "copy_scaled"]]
TUNE_PERTURBATIONS = [  # in stack([x0 * c - x1 * s, x1 * c + x0 * s], -1)
    ["no_negation", "both_negated", "unrotated_pair", "conj_x", "lanes_out_swapped"],
    ["cache_other", "cache_other_cos", "cache_scaled", "cache_scaled_sin"], "lanes_swapped",
    ["abs_x", "sqrt_square_x"], "detach_x", "coef"]
#: Megatron's rotate_half pair (-x2, x1) and its near misses, then x * cos + rot(x) * sin's
MEGATRON_PERTURBATIONS = [["rot_sign", "unrotated_pair", "pair_not_swapped"]] + TERM_PERTURBATIONS
#: an elementwise use of each RoPE output, so that dy is computed (not a tangent as it is)
ROPE_AFTER = {"none": "{}", "exp": "({}).exp()", "square": "({}).square()", "times": "({}) * o"}
FUNCTION_PERTURBATIONS = [  # in a hand-written backward
    ["bw_swap_tables", "bw_sqrt_square"], ["bw_sign", "bw_missing_rot"], "bw_extra"]
ROPE_WRAPPERS = [SCALINGS, "extra_output", "transpose_in", ["transpose_out", "flatten_out"], "table_reuse",
                 "rest_overlap", "qk_norm", ["twice", "swapped_too", "residual"], "projected"]
#: Qwen3's q/k norm before RoPE (so RoPE's dx is the norm's dy)
QK_NORM = function_source("qk_norm", ["x", "w"], [
    "h = x.to(torch.float32)", f"h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + {EPS})",
    "return w * h.to(x.dtype)"])


@dataclasses.dataclass(frozen=True)
class RopeForm:
    spelling: str          # a key of ROPE_SPELLINGS
    mode: int              # 0 half, 1 interleave, 2 quarter, 3 interleave-half
    layout: str            # q/k axes
    table_layout: str      # cos/sin axes
    head_dim: int
    width: int             # rotary_dim (partial rotary when < head_dim)
    sizes: Tuple[int, int, int, int]  # B, N, S, T
    dtype: torch.dtype
    table_dtype: torch.dtype
    table_grad: bool
    table_scale: float
    with_k: bool
    k_one_head: bool       # GQA-like k (not with per-head tables)
    upcast: bool           # HF: rotate in float32, cast back
    deinterleave: str      # mode 3: "slices" or "view"
    after: str = "none"    # a key of ROPE_AFTER

    @property
    def position_axis(self) -> str:
        return "T" if "T" in self.layout else "S"

    def size(self, letter: str) -> int:
        return {"B": self.sizes[0], "N": self.sizes[1], "S": self.sizes[2], "T": self.sizes[3], "D": self.head_dim,
                "W": self.width, "R": self.width // 2, "1": 1, "2": 2}[letter]

    def __str__(self):
        spelled = {"full": "", "rebuilt": " rebuilt tables", "half": " half-width tables",
                   "complex": " complex freqs", "function": " autograd.Function",
                   "computed": " computed tables", "half_computed": " half-width tables computed at each use",
                   "tune": " torchtune cache", "complex_plain": " complex freqs in float32",
                   "megatron": " Megatron freqs"}[self.spelling]
        tables = "" if self.spelling in ("computed", "half_computed") else f"/{self.table_layout}"
        after = "" if self.after == "none" else f", then {self.after}"
        return (f"mode {self.mode}{spelled}{' in float32' if self.upcast else ''} {self.layout}{tables}"
                f" D={self.head_dim}" + (f" rotary_dim={self.width}" if self.width < self.head_dim else "") + after)


@st.composite
def rope_forms(draw) -> RopeForm:
    spelling = draw(st.sampled_from(list(ROPE_SPELLINGS)))
    modes = {"half": [0], "half_computed": [0], "complex": [1], "complex_plain": [1], "tune": [1],
             "megatron": [0, 1], "function": [0, 1, 2]}.get(spelling, [0, 1, 2, 3])
    mode = draw(st.sampled_from(modes))
    layout = "SBND" if spelling == "megatron" else draw(st.sampled_from(list(ROPE_LAYOUTS)))
    head_dim = draw(st.sampled_from([8, 16]))
    width = draw(st.sampled_from([head_dim, head_dim // 2]))
    dtype = F32 if spelling == "complex_plain" else draw(DTYPES)  # view_as_complex of float32 only
    table_layout = draw(st.sampled_from(ROPE_LAYOUTS[layout]))
    # complex_plain is drawn with a use after it: the form the widening was for
    afters = (["none", "none"] if spelling != "complex_plain" else []) + ["exp", "square", "times"]
    after = draw(st.sampled_from(afters))
    return RopeForm(
        spelling=spelling, mode=mode, layout=layout, table_layout=table_layout, head_dim=head_dim,
        width=head_dim if mode == 2 and width % 4 else width,
        sizes=(draw(SIZES), draw(st.sampled_from([1, 2])), draw(SIZES), draw(SIZES)), dtype=dtype,
        # torch.polar needs float32; Megatron's freqs are float32 (cast to x's dtype in the call)
        table_dtype=F32 if spelling in COMPLEX + ("megatron",) else draw(second_dtype(dtype)),
        table_grad=spelling != "function" and draw(st.booleans()),
        table_scale=draw(st.sampled_from([1.0, 1.0, 1e-5, 3e4])),
        with_k=draw(st.sampled_from([False, True, True])),
        k_one_head="N" not in table_layout and draw(st.booleans()),
        upcast=spelling not in COMPLEX and draw(st.booleans()),
        deinterleave=draw(st.sampled_from(["slices", "view"])), after=after)


def rope_perturbation_slots(form: RopeForm):
    """(near-miss slots, wrapper slots) that make sense for the form."""
    core = {"full": TERM_PERTURBATIONS, "rebuilt": TERM_PERTURBATIONS, "computed": TERM_PERTURBATIONS,
            "half": HALF_TABLE_PERTURBATIONS, "half_computed": HALF_TABLE_PERTURBATIONS + COPY_PERTURBATIONS,
            "complex": COMPLEX_PERTURBATIONS, "complex_plain": COMPLEX_PERTURBATIONS, "tune": TUNE_PERTURBATIONS,
            "megatron": MEGATRON_PERTURBATIONS, "function": FUNCTION_PERTURBATIONS}[form.spelling]
    if form.spelling in USES_ROT:
        core = ROTATION_PERTURBATIONS[form.mode] + core
    wrappers = [w for w in ROPE_WRAPPERS if not (
        (w in ("transpose_in", ["transpose_out", "flatten_out"]) and len(form.layout) < 4)
        or (w == "rest_overlap" and form.width == form.head_dim))]
    return core, wrappers


@st.composite
def rope_programs(draw) -> Program:
    form = draw(rope_forms())
    core, wrappers = rope_perturbation_slots(form)
    return rope_program(form, draw(some_of(core)) + draw(some_of(wrappers, WRAPPER_COUNTS)))


def rotate_helper(mode: int, width: int, p) -> List[str]:
    """``def rot(x)``: the rotation of the mode (mode 3: of the de-interleaved x)."""
    a, b = ("x2", "-x1") if "rot_sign" in p else ("-x2", "x1")
    if mode in (0, 3):
        if "rot_axis" in p:  # along the axis before the last
            return function_source("rot", ["x"], ["h = x.shape[-2] // 2", "x1, x2 = x[..., :h, :], x[..., h:, :]",
                                                  f"return torch.cat(({a}, {b}), dim=-2)"])
        split = width // 2 - 1 if "rot_split" in p else width // 2
        return function_source("rot", ["x"], [
            f"x1, x2 = x[..., :{split}], x[..., {split}:]", f"return torch.cat(({a}, {b}), dim=-1)"])
    if mode == 1:
        odd, even = ("0::2", "1::2") if "rot_parity" in p else ("1::2", "0::2")
        a, b = (f"x[..., {odd}]", f"-x[..., {even}]") if "rot_sign" in p else (f"-x[..., {odd}]", f"x[..., {even}]")
        return function_source("rot", ["x"], [f"return torch.stack(({a}, {b}), dim=-1).flatten(-2)"])
    parts = "(-d, c, -b, a)" if "rot_order" in p else "(-b, a, -d, c)"
    if "rot_sign" in p:
        parts = parts.replace("-b, a", "b, -a").replace("-d, c, -b", "d, -c, -b")
    return function_source("rot", ["x"], ["a, b, c, d = x.chunk(4, dim=-1)", f"return torch.cat({parts}, dim=-1)"])


def deinterleave_helper(width: int, spelling: str, p) -> List[str]:
    """DeepSeek-V3's de-interleave: even positions, then odd ones."""
    if spelling == "view":
        flip = ".flip(-1)" if "deinterleave_parity" in p else ""
        return function_source("deinterleave", ["x"], [
            f"return x.unflatten(-1, ({width // 2}, 2)){flip}.transpose(-1, -2).flatten(-2)"])
    first, second = ("1::2", "0::2") if "deinterleave_parity" in p else ("0::2", "1::2")
    return function_source("deinterleave", ["x"], [f"return torch.cat((x[..., {first}], x[..., {second}]), dim=-1)"])


def rope_terms(p) -> str:
    """``x * cos + rot(x) * sin`` and its near misses."""
    xs = {"abs_x": "x.abs()", "sqrt_square_x": "torch.sqrt(x * x)", "pow_half_square_x": "(x * x) ** 0.5"}
    xs = next((spelled for name, spelled in xs.items() if name in p), "x")
    rx = "rot(x.detach())" if "detach_x" in p else "rot(x)"
    c, s = ("sin", "cos") if "swap_tables" in p else ("cos", "sin")
    if "same_table" in p:
        s = c
    if "rolled_sin" in p:  # sin read one position off
        s = f"torch.cat(({s}[..., 1:], {s}[..., :1]), dim=-1)"
    first = f"{xs} * {c}"
    if "rounding_cast" in p:  # a partial product rounded to bfloat16: a value change, not a form change
        first = f"({first}).to(torch.bfloat16).to(x.dtype)"
    second = rx if "missing_table" in p else f"{rx} * {s}"
    if "coef" in p:
        second = f"2.0 * {second}"
    return f"{first} {'-' if 'term_sign' in p else '+'} {second}" + (f" + x * {s}" if "extra_term" in p else "")


def half_table_terms(p, h: int, tables=("cos", "sin"), second=None) -> List[str]:
    """``x1 * cos - x2 * sin, x2 * cos + x1 * sin`` with half-width tables, and near misses.
    ``tables``: the (cos, sin) expressions of the first lane; ``second``: the second lane's,
    when each use spells its own (computed again: the partitioner saves copies)."""
    def arranged(c, s):
        c, s = (s, c) if "swap_tables" in p else (c, s)
        return c, c if "same_table" in p else s

    c, s = arranged(*tables)
    c2, s2 = arranged(*(second or tables))
    x1 = "x1.abs()" if "abs_x" in p else ("torch.sqrt(x1 * x1)" if "sqrt_square_x" in p else "x1")
    x2 = "x2.detach()" if "detach_x" in p else "x2"
    first = (f"{x1} * {c} {'+' if 'term_sign' in p else '-'} {'2.0 * ' if 'coef' in p else ''}{x2} * {s}"
             + (f" + x1 * {tables[1]}" if "extra_term" in p else ""))
    return [f"x1, x2 = x[..., :{h}], x[..., {h}:]", f"return torch.cat(({first}, x2 * {c2} + x1 * {s2}), dim=-1)"]


def half_computed_terms(form: RopeForm, p) -> List[str]:
    """The half-table formula with ``freqs.cos()``/``freqs.sin()`` spelled at each use; near
    misses: the second lane's copies are another table's (freqs one position off) or a
    multiple of the first's."""
    cast = f".to({DTYPE_NAME_TORCH[form.table_dtype]})"
    first = (f"freqs.cos(){cast}", f"freqs.sin(){cast}")
    second = first
    if "copy_other" in p:
        second = (f"freqs.roll(1, 0).cos(){cast}", f"freqs.roll(1, 0).sin(){cast}")
    if "copy_other_cos" in p:  # one of the four reads differs
        second = (f"freqs.roll(1, 0).cos(){cast}", first[1])
    if "copy_scaled" in p:
        second = (f"(2.0 * {first[0]})", first[1])
    return half_table_terms(p, form.width // 2, first, second)


def tune_terms(p) -> List[str]:
    """torchtune's selects and stack on a cache of (cos, sin) lanes, and near misses: the
    negation missing or doubled, the pair unrotated, x conjugated, the output lanes swapped,
    the second lane reading another cache or a multiple of it (copies that differ)."""
    c, s = ("1", "0") if "lanes_swapped" in p else ("0", "1")  # benign: RoPE with the tables swapped
    other = "other" if "cache_other" in p else ("(cache * 2.0)" if "cache_scaled" in p else "cache")
    # one of the four reads differs: the second lane's cos from the other cache, its sin doubled
    other_c = "other" if "cache_other_cos" in p else other
    other_s = "(cache * 2.0)" if "cache_scaled_sin" in p else other
    x0 = {"abs_x": "xs[..., 0].abs()", "sqrt_square_x": "torch.sqrt(xs[..., 0] * xs[..., 0])"}
    x0 = next((spelled for name, spelled in x0.items() if name in p), "xs[..., 0]")
    x1 = "xs[..., 1].detach()" if "detach_x" in p else "xs[..., 1]"
    a_pair, b_pair = ("xs[..., 0]", "xs[..., 1]") if "unrotated_pair" in p else ("xs[..., 1]", "xs[..., 0]")
    coef = "2.0 * " if "coef" in p else ""
    a = (f"{x0} * cache[..., {c}] {'+' if {'no_negation', 'conj_x'} & set(p) else '-'} "
         f"{coef}{a_pair} * cache[..., {s}]")
    if "conj_x" in p:  # conj(x) * (cos + i sin)
        b = f"{b_pair} * {other_s}[..., {s}] - {x1} * {other_c}[..., {c}]"
    else:
        b = f"{x1} * {other_c}[..., {c}] {'-' if 'both_negated' in p else '+'} {b_pair} * {other_s}[..., {s}]"
    lanes = f"{b}, {a}" if "lanes_out_swapped" in p else f"{a}, {b}"
    return ["xs = x.reshape(*x.shape[:-1], -1, 2)", f"return torch.stack([{lanes}], -1).flatten(-2)"]


def megatron_helpers(form: RopeForm, p) -> List[str]:
    """Megatron-core's rotate_half on [S, B, H, D] (chunks, or strided slices stacked for
    interleaved) and its RoPE computing cos/sin from freqs inside each call."""
    pair = {"rot_sign": "(x2, -x1)", "unrotated_pair": "(-x1, x2)", "pair_not_swapped": "(x1, -x2)"}
    pair = next((spelled for name, spelled in pair.items() if name in p), "(-x2, x1)")
    if form.mode == 0:
        rot = ["x1, x2 = torch.chunk(x, 2, dim=-1)", f"return torch.cat({pair}, dim=-1)"]
    else:
        rot = ["x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]", f"x_new = torch.stack({pair}, dim=-1)",
               "return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)"]
    return function_source("rot", ["x"], rot) + function_source("rope", ["x", "freqs"], [
        "cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)", f"return {rope_terms(p)}"])


def rope_function(p) -> List[str]:
    """An autograd.Function with RoPE's forward and a hand-written backward."""
    first, rotated = ("dy * sin", "rot(dy * cos)") if "bw_swap_tables" in p else ("dy * cos", "rot(dy * sin)")
    if "bw_sqrt_square" in p:
        first = first.replace("dy", "torch.sqrt(dy * dy)")
    if "bw_missing_rot" in p:
        rotated = "dy * sin"
    dx = f"{first} {'+' if 'bw_sign' in p else '-'} {rotated}" + (" + dy * sin" if "bw_extra" in p else "")
    return ["class Rope(torch.autograd.Function):",
            "    @staticmethod", "    def forward(ctx, x, cos, sin):",
            "        ctx.save_for_backward(cos, sin)", "        return x * cos + rot(x) * sin",
            "    @staticmethod", "    def backward(ctx, dy):",
            "        cos, sin = ctx.saved_tensors", f"        return {dx}, None, None"]


def rope_inputs(form: RopeForm, p) -> List[Input]:
    def make(name, dims, dtype, grad=False, scale=1.0):
        return Input(name, dims, tuple(form.size(letter) for letter in dims), dtype, grad, scale)

    q_dims = form.layout[:-1] + "D"
    q_in = q_dims[0] + q_dims[2] + q_dims[1] + q_dims[3] if "transpose_in" in p else q_dims
    inputs = [make("q", q_in, form.dtype, True)]
    if form.with_k:
        inputs.append(make("k", q_in.replace("N", "1") if form.k_one_head else q_in, form.dtype, True))
    table_grad = form.table_grad and not {"same_table", "missing_table"} & set(p)  # an unused sin has no grad
    t_dims = form.table_layout[:-1] + ROPE_SPELLINGS[form.spelling]
    if form.spelling in ("computed", "half_computed"):  # positions (of the S or T axis) and inverse frequencies
        inputs += [make("pos", form.position_axis, F32, False, 3.0), make("inv_freq", "R", F32, table_grad)]
    else:
        caches = ("cache", "cache2") if {"cache_other", "cache_other_cos"} & set(p) else ("cache",)
        names = {"complex": ("angles",), "complex_plain": ("angles",), "megatron": ("freqs",),
                 "tune": caches}.get(form.spelling, ("cos", "sin"))
        for name in names:
            inputs.append(make(name, t_dims, form.table_dtype, table_grad, form.table_scale))
    if "table_reuse" in p:
        inputs.append(make("v", q_dims, form.dtype, True))
    if "zero_dim_input" in p:
        inputs.append(make("s", "", F32, True))
    if "qk_norm" in p:
        inputs.append(make("wq", "D", form.dtype, True))
    if "projected" in p:
        inputs.append(make("wp", "DD", form.dtype, True))
    if form.after == "times":
        inputs.append(make("o", "D", form.dtype, True))
    return inputs


def rope_helpers(form: RopeForm, p) -> List[str]:
    """``rot``/``deinterleave`` as the form needs them, and ``rope(x, cos, sin)`` (``rope(x, freqs)``)."""
    helpers = list(QK_NORM) if "qk_norm" in p else []
    if form.spelling in USES_ROT:
        helpers += rotate_helper(form.mode, form.width, p)
        if form.mode == 3:
            helpers += deinterleave_helper(form.width, form.deinterleave, p)
    if form.spelling == "function":
        return helpers + rope_function(p) + function_source("rope", ["x", "cos", "sin"],
                                                            ["return Rope.apply(x, cos, sin)"])
    if form.spelling == "half":
        return helpers + function_source("rope", ["x", "cos", "sin"], half_table_terms(p, form.width // 2))
    if form.spelling == "half_computed":
        return helpers + function_source("rope", ["x", "freqs"], half_computed_terms(form, p))
    if form.spelling == "tune":
        two = {"cache_other", "cache_other_cos"} & set(p)
        return helpers + function_source("rope", ["x", "cache"] + (["other"] if two else []),
                                         tune_terms(p))
    if form.spelling == "megatron":
        return helpers + megatron_helpers(form, p)
    if form.spelling == "complex_plain":
        xc = "torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)" + (".flip(-1)" if "swap_parts" in p else "") + ")"
        freqs = "freqs.conj()" if "conj" in p else "freqs"
        return helpers + function_source("rope", ["x", "freqs"], [
            f"xc = {xc}" + (".conj()" if "conj_x" in p else ""),
            f"return torch.view_as_real(xc * {freqs}{' + xc' if 'extra_term' in p else ''}).flatten(-2)"])
    if form.spelling == "complex":
        pairs = "x.to(torch.float32).unflatten(-1, (-1, 2))" + (".flip(-1)" if "swap_parts" in p else "")
        freqs = "freqs.conj()" if "conj" in p else "freqs"
        return helpers + function_source("rope", ["x", "freqs"], [
            f"xc = torch.view_as_complex({pairs})" + (".conj()" if "conj_x" in p else ""),
            f"return torch.view_as_real(xc * {freqs}{' + xc' if 'extra_term' in p else ''}).flatten(-2).type_as(x)"])
    body = (["x = deinterleave(x)"] if form.mode == 3 else []) + [f"return {rope_terms(p)}"]
    return helpers + function_source("rope", ["x", "cos", "sin"], body)


def rope_body(form: RopeForm, p) -> List[str]:
    """The body of ``f``: tables prepared, RoPE of the rotary slice of q (and k), wrappers."""
    lines = []
    if "transpose_in" in p:
        lines += ["q = q.transpose(1, 2)"] + (["k = k.transpose(1, 2)"] if form.with_k else [])
    if "projected" in p:  # q (and k) computed in the program: their gradients flow on
        lines += ["q = q @ wp"] + (["k = k @ wp"] if form.with_k else [])
    if "qk_norm" in p:
        lines += ["q = qk_norm(q, wq)"] + (["k = qk_norm(k, wq)"] if form.with_k else [])
    table_lines, tables = rope_tables(form, p)
    outs = [rope_output(form, p, tables, x) for x in ["q", "k"][:1 + form.with_k]]
    return lines + table_lines + [f"return {', '.join(outs + rope_extra_outputs(form, p))}"]


def rope_tables(form: RopeForm, p) -> Tuple[List[str], List[str]]:
    """The lines that prepare the tables RoPE reads in this spelling, and the tables' names."""
    lines = []
    after_s = form.layout.index("D") - 1 - form.layout.index(form.position_axis)
    index = "[:" + ", None" * after_s + ", :]" if after_s else ""  # computed tables broadcast over the axes after S
    if form.spelling in COMPLEX:
        lines.append("freqs = torch.polar(torch.ones_like(angles), angles)")
        tables = ["freqs"]
    elif form.spelling == "tune":
        tables = ["cache", "cache2"] if {"cache_other", "cache_other_cos"} & set(p) else ["cache"]
    elif form.spelling == "megatron":  # emb = cat((freqs, freqs)), or interleaved: each frequency twice in a row
        lines.append("emb = " + ("torch.cat((freqs, freqs), dim=-1)" if form.mode == 0
                                 else "torch.stack((freqs, freqs), dim=-1).flatten(-2)"))
        tables = ["emb"]
    elif form.spelling == "half_computed":
        lines.append(f"freqs = (pos[:, None] * inv_freq[None, :]){index}")
        tables = ["freqs"]
    else:
        tables = ["cos", "sin"]
        rebuild = "{t}.repeat_interleave(2, dim=-1)" if form.mode == 1 else "torch.cat(({t}, {t}), dim=-1)"
        if form.spelling == "rebuilt":  # HF: emb = cat((freqs, freqs)); GPT-J: repeat_interleave
            lines += [f"{t} = {rebuild.format(t=t)}" for t in tables]
        if form.spelling == "computed":  # HF's rotary embedding, broadcast over the axes after S
            lines += ["freqs = pos[:, None] * inv_freq[None, :]", f"emb = {rebuild.format(t='freqs')}{index}",
                      f"cos, sin = emb.cos().to({DTYPE_NAME_TORCH[form.table_dtype]}), "
                      f"emb.sin().to({DTYPE_NAME_TORCH[form.table_dtype]})"]
    if form.upcast:  # new names: the originals stay in use (table_reuse)
        lines += [f"{t}32 = {t}.to(torch.float32)" for t in tables]
        tables = [f"{t}32" for t in tables]
    return lines, tables


def rope_output(form: RopeForm, p, tables: List[str], x: str) -> str:
    """The expression of ``x`` (q or k) rotated over its rotary width, with the wrappers drawn."""
    xin = f"{x}.to(torch.float32)" if form.upcast else x

    def rope(t):
        once = f"rope({t}, {', '.join(tables)})"
        if "twice" in p:  # the same rotation of its own output: one site's dx is the other's dy
            return f"rope({once}, {', '.join(tables)})"
        if "swapped_too" in p:  # a second RoPE of the same x (tables swapped): two dx summed
            return f"({once} + rope({t}, {', '.join(reversed(tables))}))"
        if "residual" in p:  # x's gradient is dx plus dy
            return f"({once} + {t})"
        return once

    y = rope(xin)
    if form.width < form.head_dim:
        w, d = form.width, form.head_dim
        rest = f"{x}[..., {w - 2}:{d - 2}]" if "rest_overlap" in p else f"{x}[..., {w}:]"
        y = f"torch.cat(({rope(f'{xin}[..., :{w}]')}, {rest}), dim=-1)"
    y = scaled(f"({y}).to({x}.dtype)" if form.upcast else y, p)
    y = ROPE_AFTER[form.after].format(y)
    if "transpose_out" in p:
        y = f"({y}).transpose(1, 2)"
    return f"({y}).flatten(-2)" if "flatten_out" in p else y


def rope_extra_outputs(form: RopeForm, p) -> List[str]:
    """Outputs beside the rotated q (and k) that reuse an intermediate or a table of the rotation."""
    outs = []
    if "extra_output" in p:  # an intermediate of the rotation used outside it
        whole = form.spelling in USES_ROT and form.width == form.head_dim
        outs.append("rot(q)" if whole else "q * 2.0")
    if "table_reuse" in p:  # a table used by something else too
        table = {"tune": "cache[..., 0]", "megatron": "emb", "half_computed": "freqs"}.get(form.spelling, "cos")
        cos_width = form.width // 2 if form.spelling in ("half", "half_computed", "tune") else form.width
        outs.append(f"(v[..., :{cos_width}] * {table})[..., :4]" if form.spelling not in COMPLEX else "v * 2.0")
    return outs


def rope_program(form: RopeForm, p) -> Program:
    inputs = rope_inputs(form, p)
    source = rope_helpers(form, p) + function_source("f", [i.name for i in inputs], rope_body(form, p))
    return Program("rope", str(form), p, inputs, "\n".join(source) + "\n")


# -- RMSNorm ------------------------------------------------------------------------

#: how the program writes RMSNorm: by hand (as HF LlamaRMSNorm, plainly in one dtype, as
#: Gemma, as T5), with F.rms_norm (what torch.nn.RMSNorm calls), or as an autograd.Function
NORM_SPELLINGS = ["llama", "plain", "gemma", "t5", "functional", "functional_no_weight", "function"]
BY_HAND = ("llama", "plain", "gemma", "t5")
STAT_SPELLINGS = ["pow_mean", "mul_mean", "square_sum"]
ROOT_SPELLINGS = ["rsqrt", "one_over_sqrt", "pow", "reciprocal"]

# Perturbation slots (see some_of): a list holds alternatives for one place in the program.
NORM_PERTURBATIONS = [
    ["abs_stat", "wrong_axis", "wrong_n"], "detach_stat", ["eps_outside", "no_root", "quartic_root"],
    ["sqrt_square", "pow_half_square", "square_of_root", "abs_num", "detach_num", "shifted_num"], "extra_term"]
NORM_FUNCTION_PERTURBATIONS = [  # in a hand-written backward
    ["bw_sqrt_square", "bw_pow_half_square", "bw_abs"], ["bw_sign", "bw_wrong_n", "bw_r_squared", "bw_missing_term"],
    "bw_dw_missing_r"]
NORM_WRAPPERS = [SCALINGS, "residual", ["two_norms", "stacked", "shared_weight"],
                 ["return_rstd", "return_normalized"], ["transpose_in", "transpose_out"], "cast_out", "projected"]


@dataclasses.dataclass(frozen=True)
class NormForm:
    spelling: str               # one of NORM_SPELLINGS
    x_shape: Tuple[int, ...]    # [B, S, D] or per head [B, S, H, Dh]
    axes: int                   # normalized trailing axes (gamma's rank)
    dtype: torch.dtype
    w_dtype: torch.dtype
    w_grad: bool
    x_scale: float
    stat: str                   # by hand: one of STAT_SPELLINGS
    root: str                   # by hand: one of ROOT_SPELLINGS

    @property
    def x_dims(self) -> str:
        return "BSD" if len(self.x_shape) == 3 else "BSHD"

    @property
    def n(self) -> int:
        return math.prod(self.x_shape[-self.axes:])

    @property
    def dims(self) -> str:
        return "-1" if self.axes == 1 else "(-2, -1)"

    def __str__(self):
        spelled = f" ({self.stat}, {self.root})" if self.spelling in BY_HAND else ""
        return f"{self.spelling}{spelled} over {list(self.x_shape[-self.axes:])} of {list(self.x_shape)}"


@st.composite
def norm_forms(draw) -> NormForm:
    spelling = draw(st.sampled_from(NORM_SPELLINGS))
    if draw(st.booleans()):
        x_shape = (draw(SIZES), draw(SIZES), draw(st.sampled_from([8, 16])))
    else:  # per-head norm (Qwen3's q/k norms), maybe over (heads, head_dim)
        x_shape = (draw(SIZES), draw(SIZES), draw(st.sampled_from([2, 3])), draw(st.sampled_from([4, 8])))
    axes = 2 if len(x_shape) == 4 and spelling != "function" and draw(st.booleans()) else 1
    dtype = draw(DTYPES)
    return NormForm(spelling=spelling, x_shape=x_shape, axes=axes, dtype=dtype, w_dtype=draw(second_dtype(dtype)),
                    w_grad=spelling == "function" or draw(st.booleans()),
                    x_scale=draw(st.sampled_from([1.0, 1.0, 1e-3, 1e2])),
                    stat=draw(st.sampled_from(STAT_SPELLINGS)), root=draw(st.sampled_from(ROOT_SPELLINGS)))


def norm_perturbation_slots(form: NormForm):
    """(near-miss slots, wrapper slots) that make sense for the form."""
    core = NORM_PERTURBATIONS if form.spelling in BY_HAND else (
        NORM_FUNCTION_PERTURBATIONS if form.spelling == "function" else [])
    wrappers = [w for w in NORM_WRAPPERS if not (
        (w == ["return_rstd", "return_normalized"] and form.spelling not in BY_HAND)
        or (w == ["two_norms", "stacked", "shared_weight"] and form.spelling == "functional_no_weight"))]
    return core, wrappers


@st.composite
def rms_norm_programs(draw) -> Program:
    form = draw(norm_forms())
    core, wrappers = norm_perturbation_slots(form)
    p = draw(some_of(core)) + draw(some_of(wrappers, WRAPPER_COUNTS))
    if "detach_stat" in p:  # a detached rstd has no gradient to give, and x needs some path
        p = tuple(name for name in p if name not in ("return_rstd", "detach_num"))
    return norm_program(form, p)


def norm_stat(form: NormForm, h: str, p) -> str:
    dims = form.dims
    if "abs_stat" in p:
        return f"{h}.abs().mean({dims}, keepdim=True)"
    if "wrong_axis" in p:
        return f"{h}.pow(2).mean(1, keepdim=True)"
    if "wrong_n" in p:
        return f"{h}.pow(2).sum({dims}, keepdim=True) / {form.n + 1}"
    return {"pow_mean": f"{h}.pow(2).mean({dims}, keepdim=True)",
            "mul_mean": f"({h} * {h}).mean({dims}, keepdim=True)",
            "square_sum": f"{h}.square().sum({dims}, keepdim=True) / {form.n}"}[form.stat]


def norm_root(form: NormForm, p) -> str:
    near = {"eps_outside": f"1.0 / (torch.sqrt(ms) + {EPS})", "no_root": f"1.0 / (ms + {EPS})",
            "quartic_root": f"torch.rsqrt(torch.sqrt(ms + {EPS}))"}
    exact = {"rsqrt": f"torch.rsqrt(ms + {EPS})", "one_over_sqrt": f"1.0 / torch.sqrt(ms + {EPS})",
             "pow": f"(ms + {EPS}) ** -0.5", "reciprocal": f"torch.sqrt(ms + {EPS}).reciprocal()"}
    return next((spelled for name, spelled in near.items() if name in p), exact[form.root])


def norm_numerator(h: str, p) -> str:
    near = {"sqrt_square": f"torch.sqrt({h} * {h})", "pow_half_square": f"({h} * {h}) ** 0.5",
            "square_of_root": f"({h} ** 0.5) ** 2", "abs_num": f"{h}.abs()", "detach_num": f"{h}.detach()",
            "shifted_num": f"({h} + 0.5)"}
    return next((spelled for name, spelled in near.items() if name in p), h)


def norm_by_hand(form: NormForm, p) -> List[str]:
    """The body of ``norm(x, w)`` written out; returns y (and r or n with return_*)."""
    if form.spelling == "t5":  # variance in float32, x itself normalized
        h, lines = "x", [f"ms = {norm_stat(form, 'x.to(torch.float32)', p)}"]
    elif form.spelling == "plain":
        h, lines = "x", [f"ms = {norm_stat(form, 'x', p)}"]
    else:
        h, lines = "h", ["h = x.to(torch.float32)", f"ms = {norm_stat(form, 'h', p)}"]
    if "detach_stat" in p:
        lines.append("ms = ms.detach()")
    lines += [f"r = {norm_root(form, p)}", f"n = {norm_numerator(h, p)} * r"]
    if "extra_term" in p:
        lines.append(f"n = n + 0.1 * {h}")
    lines.append({"llama": "y = w * n.to(x.dtype)", "plain": "y = n * w",
                  "gemma": "y = (n * (1.0 + w.to(torch.float32))).type_as(x)",
                  "t5": "y = w * n.to(w.dtype)"}[form.spelling])
    extra = {"return_rstd": ", r", "return_normalized": ", n"}
    return lines + ["return y" + "".join(e for name, e in extra.items() if name in p)]


def norm_function(form: NormForm, p) -> List[str]:
    """An autograd.Function with RMSNorm's forward and a hand-written backward."""
    near = {"bw_sqrt_square": "torch.sqrt(x * x)", "bw_pow_half_square": "(x * x) ** 0.5", "bw_abs": "x.abs()"}
    xs = next((spelled for name, spelled in near.items() if name in p), "x")
    n = form.n + 1 if "bw_wrong_n" in p else form.n
    r3 = "r ** 2" if "bw_r_squared" in p else "r ** 3"
    dx = "r * g" if "bw_missing_term" in p else (
        f"r * g {'+' if 'bw_sign' in p else '-'} {r3} * {xs} * (g * x).sum({form.dims}, keepdim=True) / {n}")
    lead = str(tuple(range(len(form.x_shape) - form.axes)))
    dw = f"(dy * x).sum({lead})" if "bw_dw_missing_r" in p else f"(dy * x * r).sum({lead})"
    return ["class Norm(torch.autograd.Function):",
            "    @staticmethod", "    def forward(ctx, x, w):",
            f"        r = torch.rsqrt(x.pow(2).mean({form.dims}, keepdim=True) + {EPS})",
            "        ctx.save_for_backward(x, w, r)", "        return x * r * w",
            "    @staticmethod", "    def backward(ctx, dy):",
            "        x, w, r = ctx.saved_tensors", "        g = dy * w", f"        return {dx}, {dw}"]


def norm_program(form: NormForm, p) -> Program:
    weighted = form.spelling != "functional_no_weight"
    w_dims, w_shape = form.x_dims[-form.axes:], form.x_shape[-form.axes:]
    inputs = [Input("x", form.x_dims, form.x_shape, form.dtype, True, form.x_scale)]
    if weighted:
        inputs.append(Input("w", w_dims, w_shape, form.w_dtype, form.w_grad))
    if {"two_norms", "stacked"} & set(p):
        inputs.append(Input("w2", w_dims, w_shape, form.w_dtype, True))
    if "shared_weight" in p:
        inputs.append(Input("x2", form.x_dims, form.x_shape, form.dtype, True, form.x_scale))
    if "projected" in p:
        d = form.x_shape[-1]
        inputs.append(Input("wp", "DD", (d, d), form.dtype, True))
    if "zero_dim_input" in p:
        inputs.append(Input("s", "", (), F32, True))

    args = ["x", "w"] if weighted else ["x"]
    helpers = []
    if form.spelling == "function":
        helpers += norm_function(form, p)
        body = ["return Norm.apply(x, w)"]
    elif form.spelling.startswith("functional"):
        weight = ", w" if weighted else ""
        body = [f"return torch.nn.functional.rms_norm(x, {list(w_shape)}{weight}, eps=1e-5)"]
    else:
        body = norm_by_hand(form, p)
    helpers += function_source("norm", args, body)

    extra = {"return_rstd", "return_normalized"} & set(p)
    lines = []
    if "transpose_in" in p:  # a strided x
        lines += ["x = x.transpose(0, 1)"] + (["x2 = x2.transpose(0, 1)"] if "shared_weight" in p else [])
    lines += [f"y, *extra = norm({', '.join(args)})"] if extra else []
    y = "y" if extra else f"norm({', '.join(args)})"
    if "two_norms" in p:  # two norms of one x: both dx summed into x's gradient
        y = f"{y} + norm(x, w2)" + ("[0]" if extra else "")
    if "stacked" in p:  # a norm of a norm (sandwich norms): the inner one's dy is the outer one's dx
        y = f"norm({y}, w2)" + ("[0]" if extra else "")
    if "shared_weight" in p:  # one weight, two norms: both dgamma summed
        y = f"{y} + norm(x2, w)" + ("[0]" if extra else "")
    if "residual" in p:
        y = f"x + {y}"
    y = scaled(y, p)
    if "transpose_out" in p:
        y = f"({y}).transpose(0, 1)"
    if "cast_out" in p:
        y = f"({y}).to(torch.float32)"
    if "projected" in p:  # the norm's output feeds a matmul, as in every model
        lines += [f"y = {y}"] if y != "y" else []
        y = "y @ wp.to(y.dtype)"
    lines.append(f"return {y}" + (", *extra" if extra else ""))
    source = helpers + function_source("f", [i.name for i in inputs], lines)
    return Program("rms_norm", str(form), p, inputs, "\n".join(source) + "\n")


# -- precision: autocast regions and mixed dtypes -------------------------------------
#
# Exact RoPE and RMSNorm whose only variation is where the program rounds: the forward in
# an autocast region (float32 inputs and master weights, some inputs already in the low
# dtype like an autocast linear's output), tables or weight stored in another dtype, and
# round trips ``rnd(t) = t.to(low).to(t.dtype)`` at different places. The float64 reference
# reads every rounding away, so the property test also holds each compiled gradient to
# eager's within two ulps of the program's final rounding (tests/test_properties.py).

AUTOCASTS = [None, BF16, F16]
LOW_DTYPES = [BF16, F16, FP8]
#: where a RoPE program rounds: the tables (their values stored in the low dtype), the rotated
#: half, the product x * cos, x itself (dx's path), the output (dy's path)
ROPE_ROUNDINGS = ["tables_round", "rot_round", "product_round", "x_round", "output_round"]
NORM_ROUNDINGS = ["weight_round", "normalized_round", "x_round", "output_round"]
#: the output's last cast: none, back to x's dtype (HF's upcast), or to a half type (autocast's
#: cast before attention)
OUT_CASTS = ["none", "back", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class PrecisionForm:
    family: str                 # "rope" or "rms_norm"
    x_dtype: torch.dtype        # q/k or x as stored (float32 when projected)
    other_dtype: torch.dtype    # cos/sin or the weight as stored
    autocast: object            # None, or the dtype of a torch.autocast("cpu") region around the forward
    projected: bool             # x = x @ wp in the region (an autocast linear's output), wp a float32 master weight
    upcast: bool                # the math in float32 (HF's x.to(torch.float32))
    low: torch.dtype            # what rnd() rounds to
    out_cast: str               # one of OUT_CASTS
    after: str                  # "none"; RoPE "scores": q @ k^T; RMSNorm "proj": y @ wo (in the region)
    other_grad: bool            # the tables or the weight require grad
    mode: int                   # RoPE: 0 (halves) or 1 (interleaved)
    table_layout: str           # RoPE: cos/sin axes
    rep: int                    # RoPE: k's heads repeated (GQA's repeat_kv) before the output cast
    spelling: str               # RMSNorm: "llama", "plain", "functional"
    sizes: Tuple[int, int, int, int]  # B, N (k's heads), S, D

    def __str__(self):
        region = f"autocast {DTYPE_NAME[self.autocast]}, " if self.autocast else ""
        what = (f"mode {self.mode} {self.table_layout} rep={self.rep}" if self.family == "rope"
                else self.spelling)
        return (f"{region}{what} {DTYPE_NAME[self.x_dtype]}/{DTYPE_NAME[self.other_dtype]}"
                f"{' projected' if self.projected else ''}{' in float32' if self.upcast else ''}"
                f", rnd to {DTYPE_NAME[self.low]}, out {self.out_cast}, then {self.after}")


@st.composite
def precision_forms(draw, family: str) -> PrecisionForm:
    autocast = draw(st.sampled_from(AUTOCASTS))
    projected = autocast is not None and draw(st.booleans())
    # in a region, only float32 and its dtype (CPU autocast's cat refuses the other half type)
    dtypes = st.sampled_from([F32, autocast]) if autocast else DTYPES
    x_dtype = F32 if projected else draw(dtypes)
    other_dtype = draw(dtypes) if autocast else draw(second_dtype(x_dtype))
    return PrecisionForm(
        family=family, x_dtype=x_dtype, other_dtype=other_dtype, autocast=autocast,
        projected=projected, upcast=draw(st.booleans()), low=draw(st.sampled_from(LOW_DTYPES)),
        out_cast=draw(st.sampled_from(OUT_CASTS)),
        after=draw(st.sampled_from(["none", "scores" if family == "rope" else "proj"])),
        other_grad=draw(st.booleans()), mode=draw(st.sampled_from([0, 1])),
        table_layout=draw(st.sampled_from(["SD", "11SD", "B1SD"])), rep=draw(st.sampled_from([1, 2])),
        spelling=draw(st.sampled_from(["llama", "plain", "functional"])),
        sizes=(draw(SIZES), draw(st.sampled_from([1, 2])), draw(SIZES), draw(st.sampled_from([8, 16]))))


@st.composite
def precision_programs(draw, family: str) -> Program:
    form = draw(precision_forms(family))
    roundings = ROPE_ROUNDINGS if family == "rope" else NORM_ROUNDINGS
    p = draw(some_of(roundings, counts=(0, 1, 1, 2, 2, 3)))
    return (rope_precision_program if family == "rope" else norm_precision_program)(form, p)


def region(form: PrecisionForm, lines: List[str]) -> List[str]:
    """``lines`` inside the form's autocast region (as they are without one)."""
    if form.autocast is None:
        return lines
    return [f'with torch.autocast("cpu", dtype={DTYPE_NAME_TORCH[form.autocast]}):'] + indent(lines)


def out_cast(form: PrecisionForm, y: str, x: str) -> str:
    return {"none": y, "back": f"{y}.to({x}.dtype)", "bfloat16": f"{y}.to(torch.bfloat16)",
            "float16": f"{y}.to(torch.float16)"}[form.out_cast]


def rnd_helper(low: torch.dtype) -> List[str]:
    return function_source("rnd", ["t"], [f"return t.to({DTYPE_NAME_TORCH[low]}).to(t.dtype)"])


def rope_precision_program(form: PrecisionForm, p) -> Program:
    b, n, s, d = form.sizes
    nq = n * form.rep
    inputs = [Input("q", "BNSD", (b, nq, s, d), form.x_dtype, True),
              Input("k", "BNSD", (b, n, s, d), form.x_dtype, True)]
    table_shape = {"SD": (s, d), "11SD": (1, 1, s, d), "B1SD": (b, 1, s, d)}[form.table_layout]
    inputs += [Input(t, form.table_layout, table_shape, form.other_dtype, form.other_grad) for t in ("cos", "sin")]
    if form.projected:
        inputs += [Input("wq", "DD", (d, d), F32, True), Input("wk", "DD", (d, d), F32, True)]
    rx = "rnd(rot(x))" if "rot_round" in p else "rot(x)"
    first = "rnd(x * cos)" if "product_round" in p else "x * cos"
    rope = ((["x = rnd(x)"] if "x_round" in p else []) + (["x = x.to(torch.float32)"] if form.upcast else [])
            + [f"return {first} + {rx} * sin"])
    body = ["q, k = q @ wq, k @ wk"] if form.projected else []
    if "tables_round" in p:
        body.append("cos, sin = rnd(cos), rnd(sin)")
    body += ["qo, ko = rope(q, cos, sin), rope(k, cos, sin)"]
    if form.rep > 1:  # repeat_kv of the rotated k, before the output cast
        body += ["b, n, s, d = ko.shape",
                 f"ko = ko[:, :, None].expand(b, n, {form.rep}, s, d).reshape(b, n * {form.rep}, s, d)"]
    if "output_round" in p:
        body.append("qo, ko = rnd(qo), rnd(ko)")
    body += [f"qo, ko = {out_cast(form, 'qo', 'q')}, {out_cast(form, 'ko', 'k')}"] if form.out_cast != "none" else []
    body.append("return qo @ ko.transpose(-1, -2)" if form.after == "scores" else "return qo, ko")
    source = (rnd_helper(form.low) + rotate_helper(form.mode, d, ())
              + function_source("rope", ["x", "cos", "sin"], rope)
              + function_source("f", [i.name for i in inputs], region(form, body)))
    rounded = ("q", "k", "wq", "wk") if "x_round" in p else ()
    return Program("rope", f"precision: {form}", p, inputs, "\n".join(source) + "\n", dynamic_axes="BS",
                   grad_rounding={name: form.low for name in rounded})


def norm_precision_program(form: PrecisionForm, p) -> Program:
    b, _, s, d = form.sizes
    # F.rms_norm takes one dtype and has no normalized value to round: else written out plainly
    functional = (form.x_dtype == form.other_dtype and not form.projected
                  and not {"x_round", "normalized_round"} & set(p))
    spelling = "plain" if form.spelling == "functional" and not functional else form.spelling
    inputs = [Input("x", "BSD", (b, s, d), form.x_dtype, True),
              Input("w", "D", (d,), form.other_dtype, form.other_grad)]
    if form.projected:
        inputs.append(Input("wp", "DD", (d, d), F32, True))
    if form.after == "proj":
        inputs.append(Input("wo", "DD", (d, d), F32, True))
    h = "x.to(torch.float32)" if form.upcast or spelling == "llama" else "x"
    stat = f"n = {h} * torch.rsqrt({h}.pow(2).mean(-1, keepdim=True) + {EPS})"
    norm = {"llama": [stat, "return w * n.to(x.dtype)"], "plain": [stat, "return n * w"],
            "functional": [f"return torch.nn.functional.rms_norm(x, [{d}], w, eps={EPS})"]}[spelling]
    if "normalized_round" in p:
        norm.insert(1, "n = rnd(n)")
    norm = (["x = rnd(x)"] if "x_round" in p else []) + norm
    body = (["x = x @ wp"] if form.projected else []) + (["w = rnd(w)"] if "weight_round" in p else [])
    body.append("y = norm(x, w)")
    if "output_round" in p:
        body.append("y = rnd(y)")
    body += [f"y = {out_cast(form, 'y', 'x')}"] if form.out_cast != "none" else []
    # the weight cast as autocast casts it: the float64 run that keeps the program's roundings has no region
    body.append("return y @ wo.to(y.dtype)" if form.after == "proj" else "return y")
    source = (rnd_helper(form.low) + function_source("norm", ["x", "w"], norm)
              + function_source("f", [i.name for i in inputs], region(form, body)))
    rounded = ("x", "wp") if "x_round" in p else ()
    return Program("rms_norm", f"precision: {dataclasses.replace(form, spelling=spelling)}", p, inputs,
                   "\n".join(source) + "\n", dynamic_axes="BS", grad_rounding={name: form.low for name in rounded})
