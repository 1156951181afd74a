"""Opt-in `torch.compile` of each decoder block's own arithmetic (inference).

Why: on an H200 (benchmarks/results/2026-11-25-h200.md) a batch-1 denoising step of the 26B-A4B model spent
~12 of its ~24 ms of kernel time outside the experts: ~330 norm kernels, ~400 small elementwise kernels (residual
adds, scalings, RoPE's roll, copies) and ~200 projections a step, each a few microseconds however few bytes it
moves. CUDA graphs remove the launch gaps, not the kernels. Inductor fuses a block's norms, residual adds, RoPE
and activation into a handful of kernels.

What is compiled: `Block.forward` of every layer, with the attention closure it is given (SDPA and the cache
writes are traced). The experts and the 8-bit projections are left out (`torch.compiler.disable`): their Triton
kernels check themselves on first use (a host sync), and `torch._grouped_mm` has no fp32 meta kernel. One compiled graph serves every layer of
a kind (sliding / full), since parameters are graph inputs. The first pass of each shape compiles (seconds to a
minute); CUDA graphs (`kernels.graphs`) capture after their warm-up runs, so they replay the compiled kernels.

`compile_blocks_(module, False)` puts the eager forwards back. Same function as eager up to fp32 reassociation (the
test compares logits at 1e-5 on a tiny model; the shipped KJV model gives the same tokens). On this repository's
2-core CPU the KJV model's step went from 5.92 to 5.32 ms (fp32, 1 thread, fused sampler; README, Speed). Not yet
timed on a GPU (benchmarks/gpu_session.sh next).
"""

from __future__ import annotations

import torch

RECOMPILE_LIMIT = 64  # per code object: (sliding, full) x (encode, decode, fused commit) x batch sizes x chunk lengths


def blocks_compiled(module) -> bool:
    return any("forward" in vars(layer) and hasattr(vars(layer)["forward"], "_torchdynamo_orig_callable")
               for layer in module.layers)


def _eager_parts(layer) -> list:
    """The modules of a block that stay outside the compiled graph: its experts and its 8-bit projections."""
    from .linear_q import QuantizedLinear

    return [layer.experts] + [m for m in layer.modules() if isinstance(m, QuantizedLinear)]


def compile_blocks_(module, enabled: bool = True) -> bool:
    """Wrap (or unwrap) each decoder block's forward in torch.compile; returns whether they are compiled now."""
    if not enabled:
        for layer in module.layers:
            if "forward" in vars(layer):
                del layer.forward
            for part in _eager_parts(layer):
                if getattr(vars(part).get("forward"), "_blockpress_uncompiled", False):
                    del part.forward
        return False
    if blocks_compiled(module):
        return True
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; raise whichever this torch has
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    for layer in module.layers:
        for part in _eager_parts(layer):
            eager = torch.compiler.disable(part.forward)
            eager._blockpress_uncompiled = True
            part.forward = eager
        layer.forward = torch.compile(layer.forward)
    return True
