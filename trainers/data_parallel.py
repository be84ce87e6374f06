"""torchrun data parallelism for the trainers (ppo.py, impala.py): joining the process group,
summing gradients across ranks, and the end-of-run check that the ranks' parameters agree."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn


def init_distributed(args):
    """(rank, world size, device). Under torchrun (WORLD_SIZE > 1) each rank joins the process
    group: NCCL on CUDA, gloo on CPU; alone, the device is the single-process one."""
    cuda = torch.cuda.is_available() and args.cuda
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    if cuda:
        # NVLink multicast (NVLS, symmetric memory) stays off: not every machine supports it
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), world_size, device


def sum_gradients(module):
    """One all-reduce of all the gradients, concatenated (as CleanRL's ppo_atari_multigpu):
    each rank's loss is already weighted by its share of the union's minibatch."""
    grads = [p.grad for p in module.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def parameter_spread(module):
    """The largest difference of any parameter across the ranks (0: they agree exactly)."""
    params = nn.utils.parameters_to_vector(module.parameters()).detach()
    high, low = params.clone(), params.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).max().item()
