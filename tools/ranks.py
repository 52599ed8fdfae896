"""This process's place in a torchrun job, for the distributed tools and tests."""
import torch
import torch.distributed as dist


def joined() -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device) once the process group is up: NCCL and a GPU
    per rank where there are GPUs, gloo on the CPU elsewhere."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return rank, dist.get_world_size(), device
