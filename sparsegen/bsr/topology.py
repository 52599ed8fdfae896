"""Topology updates during training: drop the weakest blocks of a BlockSparseLinear and
grow as many new ones, by gradient magnitude (RigL) or at random (SET).

    updater = sparsegen.topology.TopologyUpdater(model, optimizer, mode="rigl", interval=100,
                                                 fraction=0.1)
    for batch in data:
        loss(model(batch)).backward(); optimizer.step(); optimizer.zero_grad()
        updater.step()

The number of blocks stays the same, so optimizers keep their tensors: surviving blocks keep
their values and optimizer state (moved to their new storage position), new blocks start
at zero with zero state.
"""
from __future__ import annotations

import torch

from ..errors import expect
from . import format as bsr
from .nn import BlockSparseLinear


def prune_and_regrow(layer: BlockSparseLinear, fraction: float, scores: torch.Tensor,
                     optimizer: torch.optim.Optimizer | None = None) -> int:
    """Drop round(fraction * nnz) stored blocks of smallest norm; grow as many absent blocks
    of highest `scores` ([out/bm, in/bk]). Returns how many blocks moved."""
    expect(0.0 <= fraction <= 1.0, "fraction in [0, 1]", fraction)
    mask = layer.layout.cpu()
    expect(tuple(scores.shape) == tuple(mask.shape), f"scores of shape {tuple(mask.shape)}",
           tuple(scores.shape))
    moved = min(round(fraction * int(mask.sum())), int((~mask).sum()))
    if moved == 0:
        return 0
    norms = layer.values.detach().float().flatten(1).norm(dim=1).cpu()
    flat = bsr.flat_index(mask)
    new_mask = mask.clone().flatten()
    new_mask[flat[norms.topk(moved, largest=False).indices]] = False
    candidates = scores.detach().float().cpu().flatten().masked_fill(mask.flatten(), float("-inf"))
    new_mask[candidates.topk(moved).indices] = True
    layer.set_layout(new_mask.view(mask.shape), optimizer)
    return moved


def block_norms(dense: torch.Tensor, block) -> torch.Tensor:
    """Frobenius norm of every block of a dense [out, in] tensor: [out/bm, in/bk]."""
    return bsr.blocks_of(dense.detach().float(), tuple(block)).pow(2).sum(dim=(2, 3)).sqrt()


class TopologyUpdater:
    """Every `interval` calls of step(), moves `fraction` of the blocks of every
    BlockSparseLinear in `model`. mode "rigl" grows where the dense gradient of the last
    backward is largest (captured only on the step before an update); "set" grows at random."""

    def __init__(self, model: torch.nn.Module, optimizer=None, mode: str = "rigl", interval: int = 100,
                 fraction: float = 0.1, generator: torch.Generator | None = None):
        expect(mode in ("rigl", "set"), "mode 'rigl' or 'set'", repr(mode))
        expect(interval >= 1, "interval >= 1", interval)
        self.layers = [m for m in model.modules() if isinstance(m, BlockSparseLinear)]
        expect(bool(self.layers), "a model with BlockSparseLinear layers", type(model).__name__)
        self.optimizer, self.mode, self.interval, self.fraction = optimizer, mode, interval, fraction
        self.generator, self.steps, self._scores = generator, 0, {}
        self._hooks = [layer.register_forward_hook(self._capture) for layer in self.layers] if mode == "rigl" else []

    def _due_next(self) -> bool:
        return (self.steps + 1) % self.interval == 0

    def _capture(self, layer, inputs, output):
        """On the forward before an update, keep X and take dY when it arrives."""
        if not (self._due_next() and torch.is_grad_enabled() and output.requires_grad):
            return
        x = inputs[0].detach()

        def on_grad(dy):
            dense = dy.reshape(-1, dy.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
            self._scores[layer] = block_norms(dense, layer.block)
        output.register_hook(on_grad)

    def step(self) -> int:
        """Call once per optimizer step; returns the blocks moved (0 between updates)."""
        self.steps += 1
        if self.steps % self.interval:
            return 0
        moved = sum(prune_and_regrow(layer, self.fraction, self._scores_for(layer), self.optimizer)
                    for layer in self.layers)
        self._scores.clear()
        return moved

    def _scores_for(self, layer: BlockSparseLinear) -> torch.Tensor:
        if self.mode == "set" or layer not in self._scores:
            return torch.rand(layer.layout.shape, generator=self.generator)
        return self._scores[layer]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
