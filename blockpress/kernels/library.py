"""The float experts kernels as one torch custom op, so a compiled block traces them as a single graph node.

Shape legend: N tokens, H hidden, E experts, K top-k, Im expert intermediate size.

Why an op: `torch.compile` traces what a function does to build its graph. The experts kernels cannot be traced:
the references read routing counts on the host, `torch._grouped_mm` has no fp32 meta kernel, and the checked Triton
kernel compares itself with its reference on its first call (a host sync). As a custom op (`torch.library.custom_op`)
a kernel is one opaque call in the graph: its fake implementation gives the output's shape and dtype to the
tracer, and the real one runs the kernel eagerly, first-use check included, when the compiled graph runs. So a
compiled decoder block is one graph with no breaks (tests/test_compiled.py counts them).

`experts_op(x, w, idx, gate_up, down, kernel, tiles, moe_sum)` runs `FLOAT_EXPERTS[kernel]` (tiles and moe_sum for
the Triton kernels, `TILED`): the same function, the same numbers. `kernels.select` sets it as each float `Experts`
module's kernel when the blocks are compiled (eager blocks call the kernels directly: an op call costs ~20 us on a
CPU). The quantised experts and the 8-bit linears have their own ops beside their modules (quant.py, linear_q.py),
and routing its own (route.py).
"""

from __future__ import annotations

import functools

import torch

from ..model.moe import experts_dense, experts_loop
from .moe_grouped import as_tiles, experts_grouped, experts_triton, experts_triton_checked

FLOAT_EXPERTS = {"loop": experts_loop, "dense": experts_dense, "grouped": experts_grouped, "triton": experts_triton,
                 "triton_checked": experts_triton_checked}
TILED = ("triton", "triton_checked")  # the float experts kernels that take tiles and a K sum


def float_experts(kernel: str, tiles=None, moe_sum: str = "kernel"):
    """The function `Experts.kernel` holds for the named kernel: tiles and K sum bound where it takes them."""
    fn = FLOAT_EXPERTS[kernel]
    return functools.partial(fn, tiles=as_tiles(tiles), moe_sum=moe_sum) if kernel in TILED else fn


@torch.library.custom_op("blockpress::experts", mutates_args=())
def experts_op(x_NH: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EFH: torch.Tensor,
               down_EHI: torch.Tensor, kernel: str, tiles: str, moe_sum: str) -> torch.Tensor:
    """`FLOAT_EXPERTS[kernel]` (tiles: a `Tiles` spec string) -> [N, H] in x's dtype."""
    return float_experts(kernel, tiles, moe_sum)(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI)


@experts_op.register_fake
def _(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, kernel, tiles, moe_sum):
    return x_NH.new_empty(x_NH.shape)  # the kernels return contiguous [N, H]


def float_experts_op(kernel: str, tiles=None, moe_sum: str = "kernel"):
    """`float_experts(kernel, ...)` through the op: what a compiled block's `Experts` call."""
    return functools.partial(experts_op, kernel=kernel, tiles=as_tiles(tiles).spec(), moe_sum=moe_sum)


def kernel_of(fn) -> str | None:
    """The `FLOAT_EXPERTS` name of an `Experts.kernel` (plain, partial or through the op); None if another."""
    if getattr(fn, "func", None) is experts_op:
        return fn.keywords["kernel"]
    fn = getattr(fn, "func", fn)
    return next((k for k, v in FLOAT_EXPERTS.items() if v is fn), None)
