"""Roofline arithmetic: the fewest bytes a denoising step, a commit and an AR token must move.

Shape legend: B batch, C canvas length, V vocab, H hidden, T encoded tokens, W sliding window.

Counted from the module's actual tensors (so fp8 / int4 experts, their scales and the model dtype
are all reflected), each read once:
- experts: every expert of every layer that receives a token (`hit` = fraction hit; a 256-token
  canvas with top-8 of 128 hits all of them: P(miss) = (120/128)^256 ~ 7e-8);
- attention, dense MLP ("shared expert"), router, norms: always;
- embedding table: twice per denoising step (tied LM head, and the self-conditioning soft embedding
  softmax(z) @ E); an encoder pass reads only B*S rows of it;
- self-conditioning MLP: per step;
- KV cache: the visible keys/values (full layers: T, sliding layers: min(T, W-1));
- logits: the fp32 [B, C, V] written once and read once by the sampler (the floor; the exact
  sampler makes several passes).
An AR token reads the non-expert weights, K of E experts per layer, the LM head and the cache.
`step_flops` gives the other number of the roofline: at batch 1 the step is bandwidth-bound for
every precision on Hopper, but int4 (and any precision at batch >= 2-4) nears the compute floor.
"""

from __future__ import annotations

import time

import torch


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_groups(module) -> dict[str, int]:
    """Bytes per group of weights, from the module's parameters and buffers."""
    g = {"experts": 0, "attention": 0, "dense_mlp": 0, "router": 0, "norms": 0}
    for layer in module.layers:
        g["experts"] += _nbytes(list(layer.experts.parameters()) + list(layer.experts.buffers()))
        attn = list(layer.self_attn.named_parameters()) + list(layer.self_attn.named_buffers())  # int8 linears: buffers
        g["attention"] += _nbytes(p for n, p in attn if not n.endswith("norm.weight"))
        g["dense_mlp"] += _nbytes(list(layer.mlp.parameters()) + list(layer.mlp.buffers()))
        g["router"] += _nbytes(layer.router.parameters())
        g["norms"] += _nbytes(p for n, p in layer.named_parameters() if "norm" in n)
    g["embedding"] = _nbytes(list(module.embed_tokens.parameters()) + list(module.embed_tokens.buffers()))  # int8
    g["self_conditioning"] = _nbytes(module.self_conditioning.parameters())
    return g


def kv_bytes(module, batch: int, cached: int) -> int:
    t, total = module.text, 0
    for i in range(t.num_hidden_layers):
        visible = cached if t.is_full(i) else min(cached, module.window - 1)
        total += 2 * batch * t.layer_kv_heads(i) * visible * t.layer_head_dim(i)
    return total * module.dtype.itemsize


def native_expert_bytes(module) -> int:
    """Expert bytes if the experts were stored in the model dtype (the transformers twin's)."""
    t = module.text
    return t.num_hidden_layers * t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size * module.dtype.itemsize


def step_bytes(module, batch: int, canvas: int, cached: int, hit: float = 1.0, native: bool = False) -> dict[str, int]:
    """Bytes one denoising step must move, by component, plus "total" (native: bf16/fp32 experts)."""
    g = weight_groups(module)
    if native:
        g["experts"] = native_expert_bytes(module)
    k = None if native else getattr(module, "sc_topk", None)  # top-k soft embedding: k rows per position, not E
    t = module.text
    soft = g["embedding"] if k is None else min(g["embedding"], batch * canvas * k * t.hidden_size *
                                                 module.dtype.itemsize)
    b = {
        "experts": int(g["experts"] * hit),
        "attention+dense+router+norms": g["attention"] + g["dense_mlp"] + g["router"] + g["norms"],
        "embedding (LM head + soft embedding)": g["embedding"] + soft,
        "self_conditioning": g["self_conditioning"],
        "kv_cache": kv_bytes(module, batch, cached),
        "logits (fp32 write + read)": 2 * batch * canvas * module.text.vocab_size * 4,
    }
    b["total"] = sum(b.values())
    return b


def encode_bytes(module, batch: int, tokens: int, cached: int, hit: float = 1.0) -> int:
    """An encoder pass of `tokens` new tokens after `cached` ones (prefill or commit)."""
    g = weight_groups(module)
    rows = batch * tokens * module.text.hidden_size * module.dtype.itemsize
    w = int(g["experts"] * hit) + g["attention"] + g["dense_mlp"] + g["router"] + g["norms"]
    return w + rows + kv_bytes(module, batch, cached + tokens)


def ar_token_bytes(module, batch: int, cached: int) -> int:
    """One autoregressive token (batch rows of one token each): K/E of the experts per row, at most all."""
    t = module.text
    g = weight_groups(module)
    hit = min(1.0, 1 - (1 - t.top_k_experts / t.num_experts) ** batch)
    return (int(g["experts"] * hit) + g["attention"] + g["dense_mlp"] + g["router"] + g["norms"]
            + g["embedding"] + kv_bytes(module, batch, cached) + batch * t.vocab_size * 4)


def step_flops(module, batch: int, canvas: int, cached: int) -> int:
    """Floating-point operations of one denoising step (2 per multiply-add): per canvas token the
    projections, dense MLP, router, top-k experts, LM head and soft embedding (V x H each),
    self-conditioning MLP, and attention over the visible keys (q k^T and p v)."""
    t = module.text
    H, I, Im, V = t.hidden_size, t.intermediate_size, t.moe_intermediate_size, t.vocab_size
    macs = 2 * V * H + 3 * H * I  # LM head, soft embedding, self-conditioning MLP
    for i in range(t.num_hidden_layers):
        nh, kv, D = t.num_attention_heads, t.layer_kv_heads(i), t.layer_head_dim(i)
        proj = H * nh * D * 2 + H * kv * D * (1 if t.is_full(i) else 2)  # q, o; k (+ v on sliding layers)
        visible = (cached if t.is_full(i) else min(cached, module.window - 1)) + canvas
        macs += proj + 2 * nh * D * visible + 3 * H * I + H * t.num_experts + t.top_k_experts * 3 * H * Im
    return 2 * batch * canvas * macs


# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
                    "A100": 312.0, "L40S": 362.0, "RTX 4090": 165.0, "RTX 5090": 209.0}


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a named GPU, or None when it is not in the table."""
    for key, tflops in PEAK_BF16_TFLOPS.items():  # longer keys first where they share a prefix ("H100 PCIe")
        if key in device_name:
            return tflops * 1e12
    return None


def pass_parts(module, batch: int, tokens: int, cached: int, hit: float = 1.0,
               decoder: bool = True) -> dict[str, tuple[int, int]]:
    """One pass by kernel group: name -> (bytes it must move, FLOPs it must do). decoder=True: a denoising step
    over a `tokens`-long canvas after `cached` tokens (its bytes add up to `step_bytes`); False: an encoder pass
    of `tokens` new tokens (prefill or commit; its bytes add up to `encode_bytes`)."""
    t = module.text
    H, I, Im, V, E, K = (t.hidden_size, t.intermediate_size, t.moe_intermediate_size, t.vocab_size,
                         t.num_experts, t.top_k_experts)
    g = weight_groups(module)
    rows = batch * tokens
    proj = attn = 0
    for i in range(t.num_hidden_layers):
        nh, kv, D = t.num_attention_heads, t.layer_kv_heads(i), t.layer_head_dim(i)
        proj += H * nh * D * 2 + H * kv * D * (1 if t.is_full(i) else 2) + 3 * H * I
        # keys a row sees (an encoder row sees fewer, causally: an upper bound there)
        attn += 2 * nh * D * ((cached if t.is_full(i) else min(cached, module.window - 1)) + tokens)
    L = t.num_hidden_layers
    parts = {
        "experts": (int(g["experts"] * hit), 2 * rows * L * K * 3 * H * Im),
        "projections + dense MLP": (g["attention"] + g["dense_mlp"], 2 * rows * proj),
        "router + norms": (g["router"] + g["norms"], 2 * rows * L * H * E),
        "attention (KV cache)": (kv_bytes(module, batch, cached if decoder else cached + tokens), 2 * rows * attn),
    }
    if not decoder:
        parts["embedding rows"] = (rows * H * module.dtype.itemsize, 0)
        return parts
    b = step_bytes(module, batch, tokens, cached, hit)
    k = getattr(module, "sc_topk", None)
    parts["LM head + soft embedding"] = (b["embedding (LM head + soft embedding)"], 2 * rows * H * (V + (k or V)))
    parts["self-conditioning MLP"] = (g["self_conditioning"], 2 * rows * 3 * H * I)
    parts["logits"] = (b["logits (fp32 write + read)"], 0)
    return parts


WEIGHT_PARTS = ("experts", "projections + dense MLP", "router + norms")


def floor_seconds(parts: dict[str, tuple[int, int]], bandwidth_bps: float, peak_flops: float | None) -> float:
    """Sum over kernel groups of max(bytes / bandwidth, FLOPs / peak): each group waits for the slower of its
    memory traffic and its math (peak_flops None: bytes only). At batch 1 the experts are far below the ridge
    point (16 FLOPs per bf16 weight byte) while the projections, the LM head and the soft embedding over 256
    rows sit at it (256 FLOPs per bf16 byte, 512 per int8 byte; an H100's ridge is ~295); from batch 2 those
    are compute-bound."""
    return sum(max(nb / bandwidth_bps, fl / peak_flops if peak_flops else 0.0) for nb, fl in parts.values())


# the profile's kernel classes (lab/profile.py CLASSES) -> the pass parts (`pass_parts`) whose floors they carry:
# every part is one class's, so the classes' floors add up to the step's (`floor_seconds`); "norm" and "other" carry
# none (their weights are in "router + norms", counted with the router's GEMM: the activations they pass are not
# counted by the roofline)
CLASS_PARTS = {"experts": ("experts",),
               "dense GEMM": ("projections + dense MLP", "LM head + soft embedding", "self-conditioning MLP",
                              "router + norms"),
               "attention": ("attention (KV cache)",),
               "sampler": ("logits",)}


def class_floors_ms(parts: dict[str, tuple[int, int]], bandwidth_bps: float, peak_flops: float | None) -> dict:
    """The floor of each kernel class of a step profile, in ms: the `floor_seconds` of the pass parts it carries
    (`CLASS_PARTS`). ValueError for a part no class carries (the mapping fell behind `pass_parts`)."""
    left = set(parts) - {p for ps in CLASS_PARTS.values() for p in ps}
    if left:
        raise ValueError(f"pass parts with no kernel class: {sorted(left)}")
    return {cls: floor_seconds({p: parts[p] for p in ps if p in parts}, bandwidth_bps, peak_flops) * 1e3
            for cls, ps in CLASS_PARTS.items()}


def expected_hit_fraction(n_experts: int, top_k: int, tokens: int) -> float:
    """Fraction of experts receiving >= 1 of `tokens` uniformly routed tokens (top-k, no repeats)."""
    return 1.0 - (1.0 - top_k / n_experts) ** tokens


def generation_floor_seconds(module, batch, prompt, new_tokens, canvas, steps, bandwidth_bps, hit=1.0,
                             fuse_commit: bool = False, peak_flops: float | None = None) -> float:
    """A whole fixed-step generation (prefill, commits, steps): bytes over the bandwidth, or with `peak_flops`
    the per-kernel-group roofline (`floor_seconds`) of each pass. fuse_commit: each commit runs inside the next
    canvas's first step, which reads the weights once for both (engine `fuse_commit=True`)."""
    n_canvases = -(-new_tokens // canvas)
    total = floor_seconds(pass_parts(module, batch, prompt, 0, hit, decoder=False), bandwidth_bps, peak_flops)
    for c in range(n_canvases):
        cached = prompt + c * canvas
        step, plain_steps = pass_parts(module, batch, canvas, cached, hit), steps
        if c and fuse_commit:  # one pass: the step's parts plus the commit's work, its weights not read again
            merged = dict(step)
            for name, (nb, fl) in pass_parts(module, batch, canvas, cached - canvas, hit, decoder=False).items():
                ob, of = merged.get(name, (0, 0))
                merged[name] = (ob + (0 if name in WEIGHT_PARTS else nb), of + fl)
            total += floor_seconds(merged, bandwidth_bps, peak_flops)
            plain_steps -= 1
        elif c:
            total += floor_seconds(pass_parts(module, batch, canvas, cached - canvas, hit, decoder=False),
                                   bandwidth_bps, peak_flops)
        total += plain_steps * floor_seconds(step, bandwidth_bps, peak_flops)
    return total


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Device-memory copy bandwidth in bytes/s (bytes read + bytes written), median of `repeats`."""
    if nbytes is None:
        nbytes = 2 << 30 if device.type == "cuda" else 256 << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()  # never time on zeros
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # first copy warms up
    return 2 * nbytes / times[len(times) // 2]
