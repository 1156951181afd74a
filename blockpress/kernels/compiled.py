"""Opt-in `torch.compile` of a decoder block's own arithmetic (inference).

Why: on an H200 (benchmarks/results/2026-11-25-h200.md) a batch-1 denoising step of the 26B-A4B model spent ~12 of
its ~24 ms of kernel time outside the experts: ~330 norm kernels, ~400 small elementwise kernels (residual adds,
scalings, RoPE's roll, copies) and ~200 projections a step, each a few microseconds however few bytes it moves.
CUDA graphs remove the launch gaps, not the kernels. Inductor fuses a block's norms, residual adds, RoPE and
activation into a handful of kernels.

What is compiled: `Block.forward` in the fixed-shape passes (model/keys.py `Fixed`: the denoising steps and commits
of the engine's fixed-shape passes, what CUDA graphs capture), one compiled function for every layer: parameters
and the layer's K/V buffers are graph inputs, so one graph serves each kind of layer, sliding and full, and the
attention and cache writes are traced in (written in place: no cache-sized copy in the generated code). The span
passes (a prompt's prefill) stay eager: their host-position attention breaks each block into pieces, every prompt
length compiles again, and compiling them bought nothing on an H100 (68 ms compiled against 71 eager for a 1,024-token
prefill; benchmarks/results/2026-11-26-h100-compiled.md). The experts, the routing
kernel and the 8-bit projections are torch custom ops (kernels/library.py, route.py, quant.py, linear_q.py): each
is one opaque call in the graph, so a fixed-shape pass traces one graph per block with no break
(tests/test_compiled.py counts them). Their kernels run as in eager mode, first-use checks included, inside the op
(a host sync the tracer never sees; the first call is a CUDA graph's warm-up run). The first pass of each shape
compiles (seconds to a minute); CUDA graphs capture after their warm-up runs, so they replay the compiled kernels.

Each compiled block is handed its input norm and computes the next block's (the last: the final norm) in its last
kernel (model/diffusion_gemma.py `_layers`): a block graph starts with its q/k/v projection, 13 launches at the 26B
widths (benchmarks/block_kernels.py reads them from the Triton code inductor generates).

The same function as eager up to fp32 reassociation (tests/test_compiled.py compares logits at 1e-5).
"""

from __future__ import annotations

import functools

import torch

RECOMPILE_LIMIT = 64  # per code object: (sliding, full) x (encode, decode, fused commit) x batch sizes x chunk lengths


@functools.lru_cache(maxsize=1)
def compiled_block():
    """`Block.forward` under torch.compile: `ops.block(layer, x, attend, scalar)` (made once per process)."""
    import torch._dynamo

    from ..model.diffusion_gemma import Block

    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; raise whichever this torch has
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    return torch.compile(Block.forward)
