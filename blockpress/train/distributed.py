"""Data-parallel training under torchrun: process-group setup, DDP or FSDP2 wrapping, small collectives.

`setup()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); with
WORLD_SIZE unset or 1 it does nothing and returns (0, 1). Backend: nccl when CUDA is available, gloo on
CPU. Equality with one process comes from the data layout (trainer.py): every rank computes the mean
loss over its equal share of the global batch with the noise of the global example indices, and the
wrapper averages gradients, which equals the gradient of the global per-example mean.

Two wrappers, chosen in `wrap`:
- DDP: every rank holds the whole model, its gradients and its optimizer state; gradients are all-reduced.
- FSDP2 (`fsdp=True`, PyTorch's `fully_shard`): parameters, gradients and optimizer state are split across the
  ranks, one shard group per decoder layer plus one for the rest (embedding, final norm, self-conditioning
  MLP). A layer is gathered whole just before it runs and freed after, in forward and again in backward; its
  gradient is reduce-scattered as soon as its backward is done. The encoder and the decoder run the same
  layers, so a layer is gathered once per pass; each pass's gradient is reduce-scattered into the same shard.
  Memory per rank is the model's bytes / N plus one gathered layer plus the activations.
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


def wrap(module: torch.nn.Module, fsdp: bool = False):
    """The whole objective as one module forward (encoder, pass 1, pass 2 inside), wrapped for data parallel.

    DDP: its reducer sees exactly one forward and one backward per step; unrouted experts get no gradient on
    some steps, hence find_unused_parameters.
    FSDP2: `fully_shard` on every decoder layer, then on the objective, whose forward gathers the parameters left
    outside the layers (the model's own methods, encode/decode, are called inside it). `module`'s parameters
    become sharded DTensors in place: build the optimizer after this."""
    from .objective import ObjectiveModule

    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # on GPUs (NCCL) the fp32 shards are gathered in bf16 (what autocast would compute in; half the all-gather)
        # and the gradients reduce-scattered in fp32. The module may still be in host memory (`blockpress train`
        # loads it there): fully_shard moves each layer to this process's GPU as it shards it.
        gpu = tdist.is_initialized() and tdist.get_backend() == "nccl"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu else \
            MixedPrecisionPolicy()
        for layer in module.layers:
            fully_shard(layer, mp_policy=mp)
        return fully_shard(ObjectiveModule(module), mp_policy=mp)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = [torch.cuda.current_device()] if next(module.parameters()).is_cuda else None
    return DDP(ObjectiveModule(module), device_ids=dev, find_unused_parameters=True)


def backward(wrapper, two) -> None:
    """The step's backward under FSDP2, as `objective.TwoBackwards`: the decoder's backward reduce-scatters each
    layer's gradient into its shard as it finishes it, then the encoder's adds its share. The root's parameters (the
    embedding, tied to the LM head, the final norm) stay gathered between the two (the AR loss's backward reads
    them), and the shards are finished only after the second."""
    wrapper.set_is_last_backward(False)
    wrapper.set_reshard_after_backward(False, recurse=False)
    two.decoder()
    wrapper.set_is_last_backward(True)
    wrapper.set_reshard_after_backward(True, recurse=False)
    two.encoder()


def is_sharded(wrapper) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(wrapper, FSDPModule)


def full_tensors(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of an FSDP2-sharded `module`, gathered whole onto rank 0's CPU, by name (the
    names of `module.named_parameters()`); other ranks get {}. A collective: every rank calls it.
    trainable_only: only the parameters that require a gradient (a LoRA run's adapters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(module, options=opts)


def all_ok(ok: bool) -> bool:
    """Whether every rank succeeded (one rank that failed makes it False everywhere); `ok` alone without a
    process group. Lets all ranks leave a failed checkpoint write together instead of waiting on a barrier."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
    return bool(t.item())


def reduce_stats(rows: list[dict], counts_key: str) -> dict:
    """One dict of statistics from each row of this rank (eval batches; a training step is one row) and every
    rank, in one collective: a ratio a row's `counts_key` dict gives a count for is pooled over the positions it
    counts (sum of ratio x count over sum of counts; a ratio with no position anywhere stays the rows' mean), any
    other number is the mean over rows and ranks, which is the global batch's for a per-rank mean loss."""
    counts = [row.get(counts_key, {}) for row in rows]
    keys = [k for k in rows[0] if k != counts_key]
    n = [sum(c.get(k, 0) for c in counts) for k in keys]
    mean = [sum(row[k] for row in rows) / len(rows) for k in keys]
    pooled = [sum(row[k] * c.get(k, 0) for row, c in zip(rows, counts)) for k in keys]
    if tdist.is_available() and tdist.is_initialized():
        t = torch.tensor([mean, pooled, n], dtype=torch.float64, device=_device())
        tdist.all_reduce(t)
        world = tdist.get_world_size()
        mean, pooled, n = (t[0] / world).tolist(), t[1].tolist(), t[2].tolist()
    elif len(rows) == 1:
        return {k: rows[0][k] for k in keys}  # nothing to pool: the row's own numbers, bit for bit
    return {k: (p / c if c > 0 else m) for k, m, p, c in zip(keys, mean, pooled, n)}


def _device() -> torch.device:
    """Where the backend's collectives take their tensors: NCCL only reduces CUDA tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


def cleanup() -> None:
    """Leave the process group together: a barrier first, so that no rank tears gloo down while another still
    talks to it (that race aborted a worker now and then: "terminate called without an active exception")."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
