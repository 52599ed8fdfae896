"""Run by tests/test_distributed.py under torchrun on 2 GPUs: BlockSparseLinear under
DistributedDataParallel and FSDP2 gives the gradients of one process on the whole batch."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import sparsegen


def model():
    torch.manual_seed(0)  # same layout and initial values on every rank
    kw = dict(device="cuda", dtype=torch.bfloat16)
    return torch.nn.Sequential(sparsegen.linear(256, 512, block=(64, 64), density=0.5, **kw), torch.nn.GELU(),
                               sparsegen.linear(512, 128, block=(32, 32), density=0.25, **kw))


def grads(net, x, y):
    torch.nn.functional.mse_loss(net(x).float(), y.float()).backward()
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in net.parameters()]


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64 * world, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(64 * world, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = grads(model(), x, y)
    mine = slice(64 * rank, 64 * (rank + 1))
    ddp = grads(DistributedDataParallel(model(), device_ids=[rank]), x[mine], y[mine])
    from torch.distributed.fsdp import fully_shard

    sharded = model()
    for layer in sharded:
        if isinstance(layer, sparsegen.BlockSparseLinear):
            fully_shard(layer)
    fully_shard(sharded)
    fsdp = grads(sharded, x[mine], y[mine])
    errors = [relative_error(g, w) for got in (ddp, fsdp) for g, w in zip(got, want)]
    print(f"rank {rank}: worst relative gradient error {max(errors):.2e}", flush=True)
    dist.destroy_process_group()
    return 0 if max(errors) < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
