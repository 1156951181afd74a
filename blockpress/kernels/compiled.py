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

torch.compile keeps what it compiled on disk and reuses it in later processes. Its key holds the traced graph, in which
a custom op's arguments left at their defaults do not appear, while the code it generated passes every argument by
name: after a blockpress upgrade that changed an op's arguments (the attention op's `split` became `tiles`), the
cached code called the op with an argument it no longer has and `--compile` failed. `compiled_block` therefore adds
`ops_cache_tag()`, a hash of the blockpress ops' schemas, to torch.compile's cache key (`torch.compiler.config.
cache_key_tag`): an upgrade that changes an op compiles again, one that does not keeps the cache.
"""

from __future__ import annotations

import functools

import torch

RECOMPILE_LIMIT = 64  # per code object: (sliding, full) x (encode, decode, fused commit) x batch sizes x chunk lengths


def ops_cache_tag(namespace: str = "blockpress") -> str:
    """'<namespace>-ops-<hash>': a hash of the schemas of the custom ops registered under `namespace` (every overload,
    sorted), for torch.compile's cache key (module docstring)."""
    import hashlib

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith(namespace + "::")]
    schemas = sorted(str(s) for n in names for s in torch._C._jit_get_schemas_for_operator(n))
    return f"{namespace}-ops-" + hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:16]


def tag_compile_cache(tag: str) -> None:
    """Add `tag` to torch.compile's cache key (`torch.compiler.config.cache_key_tag`, beside a tag of the caller's)."""
    old = torch.compiler.config.cache_key_tag
    if tag not in old.split("+"):
        torch.compiler.config.cache_key_tag = f"{old}+{tag}" if old else tag


@functools.lru_cache(maxsize=1)
def compiled_block():
    """`Block.forward` under torch.compile: `ops.block(layer, x, attend, scalar)` (made once per process, after the
    custom ops are registered: kernels.select imports them)."""
    import torch._dynamo

    from ..model.diffusion_gemma import Block

    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; raise whichever this torch has
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    tag_compile_cache(ops_cache_tag())
    return torch.compile(Block.forward)
