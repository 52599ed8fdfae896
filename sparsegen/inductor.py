"""Inductor lowerings of the forward ops: a compiled graph calls our Python launcher directly.

Called through the dispatcher (`torch.ops.sparsegen.bsr_dds.default(...)`), a forward op
costs its launch plus a boxed call into Python, a fresh output and a size check of it: on
the H100 machine's host about 2.4x a dense linear's call inside the same graph. Lowered
here, the graph allocates the output with its own buffers (reused across the graph) and
calls `extern_kernels.sparsegen_*(..., out=buf)`: the launcher and nothing else.

Each layout registers its forward ops' launchers (registry.Lowering, in its compiled.py);
this module lowers whatever is registered and names no op itself.

This reaches into Inductor's IR (`ExternKernelOut`), which is not a public API. Anything
missing there leaves the ops as they were (the dispatcher path), with one warning.
"""
from __future__ import annotations

import itertools
import warnings

import torch

from .jit import epilogues, registry
from .launch import library


def register() -> None:
    """Register the lowerings (library.on_first_trace calls this once per process)."""
    try:
        _register()
    except Exception as error:  # an Inductor without these internals: the ops still work, slower
        warnings.warn(f"sparsegen: compiled graphs call the ops through the dispatcher ({error!r})",
                      RuntimeWarning, stacklevel=2)


def _register() -> None:
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings, register_lowering

    def lowering(spec: registry.Lowering):
        """op(*its declared arguments: registry.ProductArgs) -> one [..., width] tensor
        (calls.fake_product's shape), written by the layout's launcher."""
        names = _launchers(spec)

        @register_lowering(getattr(torch.ops.sparsegen, spec.op).default, type_promotion_kind=None)
        def lower(*args):
            inlined = None if spec.inline is None else spec.inline(args, lowerings, GraphContext())
            if inlined is not None:
                return inlined
            tensors = len(spec.args.tensors)
            inputs, constants = args[:tensors], args[tensors:]
            present = [ir.ExternKernel.realize_input(t) for t in inputs if t is not None]
            x = present[0]
            out_features, epilogue = spec.args.out_features_and_epilogue(args)
            size = [*x.get_size()[:-1], epilogues.output_features(epilogue, out_features)]
            kernel = names[tuple(at for at, t in enumerate(inputs) if t is None)]
            return _extern_out(kernel, present, constants, spec.output_dtype(x.get_dtype(), args), size)
        return lower

    for spec in registry.lowerings():
        lowering(spec)
        for name, launcher in spec.more_launchers:
            _set_launcher(name, launcher)


def _launchers(spec: registry.Lowering) -> dict[tuple[int, ...], str]:
    """{positions of the optional tensors a graph passes as None: the launcher's name in
    extern_kernels}, every combination set now: a graph from Inductor's cache calls them
    without lowering anything."""
    from torch._inductor.select_algorithm import extern_kernels
    optional = [spec.args.tensors.index(name) for name in spec.args.optional]
    names = {}
    for count in range(len(optional) + 1):
        for missing in itertools.combinations(optional, count):
            name = f"{spec.op}" + "".join(f"_no_{spec.args.tensors[at]}" for at in missing)
            names[missing] = _set_launcher(name, _with_none_at(spec.launcher, missing))
    return names


def _set_launcher(name: str, launcher) -> str:
    """extern_kernels.sparsegen_<name> = launcher (the first one set stays: graphs hold the
    name); the name as generated code calls it."""
    from torch._inductor.select_algorithm import extern_kernels
    full = f"sparsegen_{name}"
    if not hasattr(extern_kernels, full):
        setattr(extern_kernels, full, launcher)
    return _kernel_name(name)


def _kernel_name(name: str) -> str:
    """How generated code calls the launcher set as `name` (_set_launcher)."""
    return f"extern_kernels.sparsegen_{name}"


def _extern_out(kernel: str, present: list, constants: tuple, dtype: torch.dtype, size: list):
    """`kernel(*present, *constants, out=buffer)` into a new contiguous buffer of `size` on the
    first input's device (present: realized inputs)."""
    from torch._inductor import ir
    layout = ir.FixedLayout(present[0].get_device(), dtype, size)
    return ir.TensorBox.create(ir.ExternKernelOut(layout, present, constant_args=constants,
                                                  python_kernel_name=kernel))


def _with_none_at(launch, missing: tuple[int, ...]):
    """The launcher as a graph without those tensors calls it: None put back in their places."""
    if not missing:
        return launch
    if len(missing) == 1:
        at, = missing  # (read once: this runs per compiled call)

        def launcher(*args, out):
            launch(*args[:at], None, *args[at:], out=out)
        return launcher

    def launcher(*args, out):
        args = list(args)
        for at in missing:
            args.insert(at, None)
        launch(*args, out=out)
    return launcher


class GraphContext:
    """What an inline lowering (registry.Lowering.inline) may ask of the graph being lowered:
    whether Inductor computes an input itself, the other calls of the same op on the same X,
    results decided for calls not lowered yet, and extern calls of the layout's launchers."""

    def __init__(self):
        from torch._inductor.virtualized import V
        self._graph, self.node = V.graph, V.graph.current_node
        # (per graph lowered: a graph lowered again starts afresh)
        self._decided = self._graph.__dict__.setdefault("_sparsegen_decided", {})

    @staticmethod
    def computed_in_graph(x) -> bool:
        """Whether Inductor generates x's loops itself (a pointwise or reduction, realized or not),
        so that what reads x may join that kernel; False for an extern kernel's output or an input."""
        from torch._inductor import ir
        node = x
        while isinstance(node, (ir.MutableBox, ir.BaseView)):
            node = node.data
        return isinstance(node, (ir.ComputedBuffer, ir.Loops))

    def decided(self):
        """What an earlier call's lowering decided this call is (decide), or None."""
        return self._decided.get(self.node)

    def decide(self, node, value) -> None:
        """node's lowering returns `value`; None: node is lowered on its own, in no later call's group."""
        self._decided[node] = value

    def siblings(self) -> list:
        """[(node, its arguments but X, lowered)] of the calls of this op on this call's X (the
        same tensor, or the same reshape of it) not lowered yet, this call first. X itself is
        left None: a later call's reshape of it is not lowered yet either."""
        source, found = _source(self.node.args[0]), [(self.node, None)]
        for user in _reshaped_users(source[0]):
            if user is self.node or user.target != self.node.target or user in self._decided:
                continue
            if _source(user.args[0]) == source:
                try:
                    found.append((user, (None, *torch.fx.node.map_arg(user.args[1:], self._graph.env.__getitem__))))
                except KeyError:  # an argument computed later
                    continue
        return found

    def extern(self, name: str, inputs: list, constants: tuple, dtype: torch.dtype, size: list):
        """The result of `extern_kernels.sparsegen_<name>(*inputs, *constants, out=buffer)` (a
        Lowering's more_launchers), into a new contiguous buffer of `size` on X's device."""
        from torch._inductor import ir
        present = [ir.ExternKernel.realize_input(t) for t in inputs]
        return _extern_out(_kernel_name(name), present, constants, dtype, size)


_RESHAPES = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")


def _source(node) -> tuple:
    """(the tensor node reads, its shape): through one reshape, so that layers each reshaping
    one input to rows find each other."""
    value = node.meta.get("val") if hasattr(node, "meta") else None
    shape = tuple(value.shape) if value is not None else None
    if getattr(node, "op", None) == "call_function" and str(node.target) in _RESHAPES:
        return node.args[0], shape
    return node, shape


def _reshaped_users(node) -> list:
    """node's users and its reshapes' users, in graph order as far as FX keeps it."""
    found = []
    for user in node.users:
        found.append(user)
        if user.op == "call_function" and str(user.target) in _RESHAPES:
            found.extend(user.users)
    return found


library.on_first_trace(register)
