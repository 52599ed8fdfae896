"""Fused epilogues: what a forward kernel does to X W^T + b before it writes Y.

An activation applied to every output, or a gated product (swiglu: silu(gate) * up, as
Llama's MLP; geglu: gelu(gate) * up; geglu_tanh: the tanh GELU's, as Gemma's; reglu:
relu(gate) * up) over one weight that holds the gate and up projections
interleaved in groups of GATE_GROUP rows - the rows that meet in one thread's registers in
every kernel's store (templates/sg_epilogue.cuh) - so Y has half the weight's rows.
`reference` is the PyTorch definition the kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import expect

ACTIVATIONS = {"none": lambda y: y, "relu": F.relu, "gelu": F.gelu,
               "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "silu": F.silu}
# gated epilogue -> the activation of its gate: every activation has one
GATED = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}
EPILOGUES = tuple(ACTIVATIONS) + tuple(GATED)
FUSED = EPILOGUES[1:]  # every epilogue but none: sparsegen.patch fuses each (precompiled, shipped)
GATE_GROUP = 8
_DEVICE_ACTIVATIONS = {"none": "Identity", "relu": "Relu", "gelu": "Gelu", "gelu_tanh": "GeluTanh", "silu": "Silu"}


def check(epilogue) -> str:
    expect(epilogue in EPILOGUES, f"epilogue one of {EPILOGUES}", repr(epilogue))
    return epilogue


def is_gated(epilogue: str) -> bool:
    return epilogue in GATED


def activation(epilogue: str) -> str:
    """The activation the epilogue applies (to the gate, for a gated one)."""
    return GATED.get(epilogue, epilogue)


def output_features(epilogue: str, weight_rows: int) -> int:
    """Y's width for a weight of `weight_rows` rows: half of them for a gated epilogue."""
    return weight_rows // 2 if is_gated(epilogue) else weight_rows


def reference(y: torch.Tensor, epilogue: str) -> torch.Tensor:
    """The epilogue applied to Y = X W^T + b, rounded once into y's dtype as the kernels do
    (PyTorch's activations compute 16-bit inputs in float32 already; the gated product is
    taken there too)."""
    if epilogue == "none":
        return y
    act = ACTIVATIONS[activation(epilogue)]
    if not is_gated(epilogue):
        return act(y)
    wide = y if y.dtype == torch.float64 else y.float()
    gate, up = split_rows(wide.movedim(-1, 0))
    return (act(gate) * up).movedim(0, -1).to(y.dtype)


def differentiable(y: torch.Tensor, epilogue: str, kernels=None) -> torch.Tensor:
    """The epilogue on a product autograd records (training): what an unfused PyTorch MLP
    computes, in y's dtype. A gated one runs on views of y's interleaved column groups (no
    float copy, no transposed copy: reference() would make both, and its backward as many
    again over the product, which cost a Llama step more than the sparse products saved) -
    or, given `kernels` (forward(y, act), gradient(dh, y, act): the GPU's gated_product,
    which the layers pass where it runs), in one pass each way, rounding once."""
    if not is_gated(epilogue):
        return ACTIVATIONS[epilogue](y)
    _check_gated_width(y)
    if kernels is not None:
        return _GatedKernels.apply(y, activation(epilogue), kernels)
    return _GatedProduct.apply(y, activation(epilogue))


def _check_gated_width(y: torch.Tensor) -> None:
    expect(y.shape[-1] % (2 * GATE_GROUP) == 0, f"a multiple of {2 * GATE_GROUP} columns for a gated epilogue",
           y.shape[-1])


def _gate_and_up(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a gated product's gate and up columns, [..., N/G, G] each (G = GATE_GROUP)."""
    pairs = y.view(*y.shape[:-1], y.shape[-1] // (2 * GATE_GROUP), 2, GATE_GROUP)
    return pairs.select(-2, 0), pairs.select(-2, 1)


# d act(g) / dg times a gradient: aten's activation backwards (their .grad_input overload
# writes into a given tensor, here a view of dY's gate columns).
_BACKWARD = {"silu": torch.ops.aten.silu_backward, "gelu": torch.ops.aten.gelu_backward}


class _TanhGeluBackward:
    """gelu_backward with approximate='tanh', called as the _BACKWARD entries are."""

    @staticmethod
    def __call__(grad, gate):
        return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh")

    @staticmethod
    def grad_input(grad, gate, grad_input):
        return torch.ops.aten.gelu_backward.grad_input(grad, gate, approximate="tanh", grad_input=grad_input)


class _ReluBackward:
    """relu's gradient (threshold_backward at 0), called as the _BACKWARD entries are."""

    @staticmethod
    def __call__(grad, gate):
        return torch.ops.aten.threshold_backward(grad, gate, 0)

    @staticmethod
    def grad_input(grad, gate, grad_input):
        return torch.ops.aten.threshold_backward.grad_input(grad, gate, 0, grad_input=grad_input)


_BACKWARD.update(gelu_tanh=_TanhGeluBackward(), relu=_ReluBackward())


class _GatedProduct(torch.autograd.Function):
    """act(gate) * up of a gated product [..., 2N] -> [..., N], and its gradient written
    straight into the product's gate and up columns (torch.compile traces both). act(gate)
    is kept for the backward, as an unfused MLP keeps it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, act: str) -> torch.Tensor:
        gate, up = _gate_and_up(y)
        activated = ACTIVATIONS[act](gate)
        ctx.save_for_backward(y, activated)
        ctx.act = act
        return (activated * up).view(*y.shape[:-1], y.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        y, activated = ctx.saved_tensors
        gate, up = _gate_and_up(y)
        dh, backward = dh.reshape(gate.shape), _BACKWARD[ctx.act]
        if torch.compiler.is_compiling():  # functional: Inductor fuses it into one kernel (writes
            # into views would stay aten calls of their own there)
            return torch.stack((backward(dh * up, gate), dh * activated), dim=-2).view(y.shape), None
        dy = torch.empty_like(y, memory_format=torch.contiguous_format)
        d_gate, d_up = _gate_and_up(dy)
        torch.mul(dh, activated, out=d_up)
        backward.grad_input(dh * up, gate, grad_input=d_gate)
        return dy, None


class _GatedKernels(torch.autograd.Function):
    """act(gate) * up and its gradient on the kernels `differentiable` was given: one pass
    each, and only y kept for the backward (the kernel takes act(gate) again from the gate)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, act: str, kernels) -> torch.Tensor:
        ctx.save_for_backward(y)
        ctx.act, ctx.gradient = act, kernels[1]
        return kernels[0](y, act)

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the kernel's gradient has none of its own: a
    def backward(ctx, dh: torch.Tensor):          # second backward raises instead of reading zeros)
        (y,) = ctx.saved_tensors
        return ctx.gradient(dh.to(y.dtype), y, ctx.act), None, None


# The activations in place, as PyTorch computes them out of place (the same kernels).
_IN_PLACE = {"relu": torch.relu_, "gelu": lambda y: torch.ops.aten.gelu_(y),
             "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
             "silu": lambda y: F.silu(y, inplace=True)}


def apply_in_place(y: torch.Tensor, epilogue: str) -> torch.Tensor:
    """y (a product of its own, no autograd) with a non-gated epilogue applied in place: one
    pass over Y, where reference() writes a new tensor (and the dense path copied that)."""
    expect(not is_gated(epilogue), "an epilogue that keeps the product's width", repr(epilogue))
    return _IN_PLACE[epilogue](y) if epilogue != "none" else y


def gated_into(y: torch.Tensor, product: torch.Tensor, epilogue: str) -> torch.Tensor:
    """y [M, N] = act(gate) * up of a gated epilogue's product [M, 2N] (its columns in
    interleave_rows' groups), in two passes: the activation in place on the gate columns,
    then the product into y. Each rounds to the dtype, as an unfused PyTorch MLP does (the
    kernels and reference() round once): a difference of an ulp."""
    expect(is_gated(epilogue), "a gated epilogue", repr(epilogue))
    m, wide = product.shape
    groups = product.view(m, wide // (2 * GATE_GROUP), 2, GATE_GROUP)
    gate, up = groups[:, :, 0], groups[:, :, 1]
    _IN_PLACE[activation(epilogue)](gate)
    return torch.mul(gate, up, out=y.view(m, wide // (2 * GATE_GROUP), GATE_GROUP))


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """One weight (or bias) for a gated epilogue: gate's and up's rows in alternating groups
    of GATE_GROUP, [N, ...] each -> [2N, ...]."""
    expect(gate.shape == up.shape and gate.shape[0] % GATE_GROUP == 0,
           f"gate and up of one shape with a multiple of {GATE_GROUP} rows", f"{tuple(gate.shape)} and {tuple(up.shape)}")
    groups = gate.shape[0] // GATE_GROUP
    pair = torch.stack([gate.reshape(groups, GATE_GROUP, *gate.shape[1:]),
                        up.reshape(groups, GATE_GROUP, *up.shape[1:])], dim=1)
    return pair.reshape(2 * gate.shape[0], *gate.shape[1:])


def interleaved_linear(gate_weight: torch.Tensor, up_weight: torch.Tensor, gate_bias, up_bias) -> "torch.nn.Linear":
    """One nn.Linear of a gated pair's weights (and biases), rows as interleave_rows lays them out."""
    fused = torch.nn.Linear(gate_weight.shape[1], 2 * gate_weight.shape[0], bias=gate_bias is not None, device="meta")
    fused.weight = torch.nn.Parameter(interleave_rows(gate_weight.detach(), up_weight.detach()))
    if gate_bias is not None:
        fused.bias = torch.nn.Parameter(interleave_rows(gate_bias.detach(), up_bias.detach()))
    return fused


def split_rows(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of an interleaved weight or bias: the inverse of interleave_rows."""
    expect(fused.shape[0] % (2 * GATE_GROUP) == 0, f"a multiple of {2 * GATE_GROUP} rows for a gated epilogue",
           fused.shape[0])
    pairs = fused.reshape(fused.shape[0] // (2 * GATE_GROUP), 2, GATE_GROUP, *fused.shape[1:])
    half = fused.shape[0] // 2
    return pairs[:, 0].reshape(half, *fused.shape[1:]), pairs[:, 1].reshape(half, *fused.shape[1:])


def device_struct(epilogue: str) -> str:
    """The C++ type a template instantiates its kernel with (sg_epilogue.cuh)."""
    gated = "true" if is_gated(epilogue) else "false"
    return f"sg::Epilogue<sg::{_DEVICE_ACTIVATIONS[activation(epilogue)]}, {gated}>"


def name_token(epilogue: str) -> str:
    """The epilogue as it appears in a kernel's name: letters only (gelu_tanh -> gelutanh)."""
    return epilogue.replace("_", "")


def from_name_token(token: str) -> str | None:
    return next((e for e in EPILOGUES if name_token(e) == token), None)


class DenseEpilogue(torch.nn.Module):
    """A dense nn.Linear followed by an epilogue: what a sparse layer with a fused epilogue
    computes, made dense (dense_copy, to_linear)."""

    def __init__(self, linear: torch.nn.Linear, epilogue: str):
        super().__init__()
        self.linear, self.epilogue = linear, check(epilogue)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference(self.linear(x), self.epilogue)

    def extra_repr(self) -> str:
        return f"epilogue={self.epilogue!r}"


class Fusable:
    """What the sparse linear layers share about epilogues: one fused into the forward kernel
    at inference; a training step computes the same in PyTorch after the kernel (autograd
    needs the product before the activation, which the fused kernel never writes)."""

    epilogue = "none"

    def fuse(self, epilogue: str):
        """Apply `epilogue` in the forward kernel from now on. A gated one expects the weight's
        rows as interleave_rows lays out gate and up, and halves the output's width."""
        check(epilogue)
        expect(not is_gated(epilogue) or self.out_features % (2 * GATE_GROUP) == 0,
               f"out_features a multiple of {2 * GATE_GROUP} (interleaved gate and up rows) for {epilogue!r}",
               self.out_features)
        self.epilogue = epilogue
        return self

    @property
    def output_features(self) -> int:
        """The output's width: out_features, or half of it with a gated epilogue."""
        return output_features(self.epilogue, self.out_features)

    def _dense_twin(self, linear: torch.nn.Linear) -> torch.nn.Module:
        return linear if self.epilogue == "none" else DenseEpilogue(linear, self.epilogue)

    def _epilogue_repr(self) -> str:
        return "" if self.epilogue == "none" else f", epilogue={self.epilogue!r}"
