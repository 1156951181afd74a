"""Data-parallel training under torchrun: process-group setup, DDP wrapping, small collectives.

`setup()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); with
WORLD_SIZE unset or 1 it does nothing and returns (0, 1). Backend: nccl when CUDA is available, gloo on
CPU. Equality with one process comes from the data layout (trainer.py): every rank computes the mean
loss over its equal share of the global batch with the noise of the global example indices, and DDP
averages gradients, which equals the gradient of the global per-example mean.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as tdist


def setup() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        tdist.init_process_group(backend)
    return tdist.get_rank(), tdist.get_world_size()


def wrap(module: torch.nn.Module):
    """DDP around the whole objective (one forward per step: encoder, pass 1, pass 2 inside), so DDP's
    reducer sees exactly one forward and one backward per step. Unrouted experts get no gradient on
    some steps, hence find_unused_parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .objective import ObjectiveModule

    dev = [torch.cuda.current_device()] if next(module.parameters()).is_cuda else None
    return DDP(ObjectiveModule(module), device_ids=dev, find_unused_parameters=True)


def all_reduce_mean(x: float) -> float:
    if not (tdist.is_available() and tdist.is_initialized()):
        return x
    t = torch.tensor([float(x)], dtype=torch.float64)
    tdist.all_reduce(t)
    return float(t) / tdist.get_world_size()


def cleanup() -> None:
    """Leave the process group together: a barrier first, so that no rank tears gloo down while another still
    talks to it (that race aborted a worker now and then: "terminate called without an active exception")."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
