"""Peak GPU memory of a generation, accounted on the meta device (no GPU, no weights in memory).

The issue's int4 target is a peak of 18 GB on the bench workload (batch 1, 1024-token prompt, 1024 new
tokens): the weights alone are ~17 GB there, so what a pass allocates on top decides it. This script
builds the model on the meta device, runs each pass of a generation under `lab.memory.LiveBytes`
(every tensor allocated and freed as the engine's code does; the Triton experts and a fused attention
kernel replaced by stand-ins that allocate what they allocate on a GPU) and prints, per pass, the most
bytes alive at once on top of the weights and the cache, then the predicted peak:

- eager: weights + cache + the held self-conditioning logits + the largest pass (the caching allocator
  reuses freed blocks from pass to pass); a step is the decoder pass and then the sampler on its logits;
- with CUDA graphs (`--cuda-graphs`): weights + the graphs' cache (one canvas longer: the fixed-shape passes
  write a canvas's K/V past the cache's length) + the graphs' two shared buffers (the self-conditioning logits every
  pass reads, which the sampler writes in place, and the fp32 logits every pass writes, which also hold that pass's
  self-conditioning probabilities until it writes them) + the captured passes' memory pool (the largest of the
  fixed-shape passes' intermediates, measured the same way: `GraphedPasses` captures all into one pool) + the
  larger of the eager prefill and the sampler, which run in the general pool; the sampler reads the shared logits
  buffer (`GraphedPasses(copy_outputs=False)`, what the bench and `--cuda-graphs` use; a copy would add one
  [B, C, V] fp32 tensor).
Both samplers: "exact" (the reference's draws) and "fast" (the fused Triton sampler's allocations).

It leaves out the caching allocator's rounding and fragmentation and the CUDA context (not in
`max_memory_allocated`); `blockpress bench` on a GPU reports the measured `peak_mem_bytes`.

    python benchmarks/peak_memory.py --preset real-26b --precision int4
    python benchmarks/peak_memory.py --preset real-26b --precision int4 --group-size 128 --prefill-chunk 512
    python benchmarks/peak_memory.py --preset tiny --precision native --batch 2
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from blockpress.cli.bench import _positive_float
from blockpress.cli.run import _group_size
from blockpress.lab.presets import preset_config
from blockpress.cli.run import _nonneg_int, _positive_int
from blockpress.options import EMBEDDING_FORMATS, LINEAR_FORMATS
from blockpress.config import GenerationConfig, ModelConfig
from blockpress.engine import step as engine_step
from blockpress.model.cache import rounded_capacity
from blockpress.engine.step import sampler_cap, single_step
from blockpress.lab.memory import LiveBytes, fused_sample_meta, meta_backends
from blockpress.loading import estimated_weight_bytes
from blockpress.model.diffusion_gemma import DiffusionGemmaModel

GB = 1e9


def measure(fn) -> tuple[int, list]:
    with LiveBytes() as lb:
        out = fn()
        del out
    return lb.peak, lb.top(4)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--precision", default="int4", choices=["native", "fp8", "int4"])
    p.add_argument("--linears", default="native", choices=LINEAR_FORMATS,
                   help="attention / dense-MLP projections (8 bits: only the weights change; the Triton kernel "
                        "allocates what F.linear does, its output)")
    p.add_argument("--embeddings", default="native", choices=EMBEDDING_FORMATS,
                   help="the embedding table / LM head: int8 (the LM head and the soft embedding are the int8 "
                        "kernel, which allocates its output only)")
    p.add_argument("--group-size", type=_group_size, default=64,
                   help="int4 scale group along the input dim (64: 4.25 bits a weight; 128: 4.125 where the input "
                        "dim allows, which the 26B model's down projections (704 inputs) do not)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--prompt-tokens", type=_positive_int, default=None)
    p.add_argument("--new-tokens", type=_positive_int, default=None)
    p.add_argument("--prefill-chunk", type=_nonneg_int, default=None,
                   help="tokens a long prompt is encoded at a time (default: the model's, 2048; 0: the whole prompt)")
    p.add_argument("--no-ring", action="store_true",
                   help="the sliding layers keep every position (the default keeps a ring of the last window + 2048)")
    p.add_argument("--budget-gb", type=_positive_float, default=18.0,
                   help="the target to compare with (issue 4: int4 18 GB)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    config, prompt, new = preset_config(args.preset)
    P, N, B = args.prompt_tokens or prompt, args.new_tokens or new, args.batch
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        m = DiffusionGemmaModel(ModelConfig.from_dict(config)).to(dtype)
    m.materialize_buffers("meta")
    if args.prefill_chunk is not None:
        m.prefill_chunk = args.prefill_chunk or None
    m.ring_cache = not args.no_ring
    weights = estimated_weight_bytes(m, dtype, args.precision, args.group_size, linears=args.linears,
                                     embeddings=args.embeddings)
    meta_backends(m)
    if args.embeddings == "int8":
        from blockpress.kernels.linear_q import QuantizedEmbedding

        table = QuantizedEmbedding(m.text.vocab_size, m.text.hidden_size, dtype, device="meta")
        vocab = range(m.text.vocab_size)
        # on a GPU both products are the int8 kernel, which allocates its output only
        table.head = lambda h, rows=slice(None): h.new_empty(*h.shape[:-1], len(vocab[rows]))
        table.soft = lambda probs: probs.new_empty(*probs.shape[:-1], m.text.hidden_size)
        m.embed_tokens = table
    C, V = m.config.canvas_length, m.text.vocab_size
    capacity = P + math.ceil(N / C) * C  # generate's cache: the commits and one canvas of room (its scratch K/V)
    cache = m.new_cache(B, capacity)
    kv = cache.nbytes() + cache.valid.numel()
    dev = torch.device("meta")
    canvas = torch.zeros(B, C, dtype=torch.long, device=dev)
    sc = torch.zeros(B, C, V, dtype=dtype, device=dev)  # the previous step's logits, held between steps
    cfg = GenerationConfig.resolve({}, max_denoising_steps=16, t_min=0.4, t_max=0.8, stability_threshold=None,
                                   confidence_threshold=None)
    T = capacity - C  # the last canvas: the longest cache

    # what a decoder pass hands the sampler: fp32 logits (exact), the LM head's product in the model dtype (fast: it
    # applies the soft cap itself, `lm_logits(capped=False)`)
    out_dtype = {"exact": torch.float32, "fast": dtype}

    def raw_logits(s="exact"):  # made outside the measurement: with graphs it is the replay's output copy
        with torch.utils._python_dispatch._disable_current_modes():
            return torch.zeros(B, C, V, dtype=out_dtype[s], device=dev)

    def at(length):
        cache.length = length
        return cache

    # under CUDA graphs the cache comes from the graphs' pool, its capacity rounded up to a power of two (the engine's
    # Runner._room; the bench's 1,024 + 1,024 positions are one already)
    gcache = m.new_cache(B, rounded_capacity(capacity, m.text.max_position_embeddings))
    kv_graphs = gcache.nbytes() + gcache.valid.numel()
    on = torch.ones(B, dtype=torch.bool, device=dev)
    # GraphedPasses' shared buffers: the logits (or product) every captured pass writes (made outside the
    # measurement) and the self-conditioning logits (`sc`) it reads
    shared_out = {s: torch.zeros(B, C, V, dtype=out_dtype[s], device=dev) for s in out_dtype}

    def pos(n):  # a device position, as the graphs' input buffers hold it
        with torch.utils._python_dispatch._disable_current_modes():
            return torch.tensor(n, device=dev)

    passes = {
        "prefill": lambda: m.encode(torch.zeros(B, P, dtype=torch.long, device=dev), at(0), output=False),
        "commit": lambda: m.encode(canvas, at(T - C), output=False),
        "graphs: commit": lambda: m.encode(canvas, gcache, output=False, start=pos(T - C)),
    }
    for s in ("exact", "fast"):  # the fast sampler's passes write the LM head's product, not the capped logits
        capped = sampler_cap(m, s == "fast")[0]
        passes.update({
            f"decode ({s})": lambda c=capped: m.decode(canvas, at(T), sc, capped=c),
            f"sampler ({s}, logits given)": lambda s=s: single_step(m, canvas, sc, cfg, at(T), n=16, fast=s == "fast",
                                                                    raw=raw_logits(s)),
            f"fused commit + first step ({s})": lambda c=capped: m.encode_decode(canvas, canvas, at(T - C), None, sc,
                                                                                 capped=c),
            f"graphs: decode ({s})": lambda c=capped, s=s: m.decode(canvas, gcache, sc, on, start=pos(T),
                                                                    out=shared_out[s], capped=c),
            f"graphs: fused commit + first step ({s})": lambda c=capped, s=s: m.encode_decode(
                canvas, canvas, gcache, None, sc, on, start=pos(T - C), out=shared_out[s], capped=c),
            # the engine under graphs: the sampler writes the next pass's self-conditioning logits into its input
            f"graphs: sampler ({s})": lambda s=s: single_step(m, canvas, sc, cfg, at(T), n=16, fast=s == "fast",
                                                              raw=raw_logits(s), sc_out=sc),
        })
    rows = {}
    real_fused_sample = engine_step.fused_sample
    engine_step.fused_sample = fused_sample_meta  # the Triton kernel's allocations
    try:
        for name, fn in passes.items():
            peak, top = measure(fn)
            rows[name] = {"peak_bytes": peak, "largest": [(b, op) for b, op in top]}
    finally:
        engine_step.fused_sample = real_fused_sample
    held = sc.numel() * sc.element_size()  # the self-conditioning logits kept from the previous step
    base = weights + kv + held
    predicted = {}
    for s in ("exact", "fast"):
        logits = B * C * V * out_dtype[s].itemsize
        # a step: the decoder pass (its logits are its last allocation), then the sampler on those logits
        step = max(rows[f"decode ({s})"]["peak_bytes"], logits + rows[f"sampler ({s}, logits given)"]["peak_bytes"])
        passes_eager = [rows[k]["peak_bytes"] for k in ("prefill", "commit", f"fused commit + first step ({s})")]
        # CUDA graphs: the captured passes share one memory pool (GraphedPasses) and two buffers (self-conditioning
        # logits in, logits out), the prefill and the sampler run eagerly in the general pool, one after the other
        pool = max(rows[k]["peak_bytes"] for k in (f"graphs: decode ({s})", "graphs: commit",
                                                    f"graphs: fused commit + first step ({s})"))
        sampler = rows[f"graphs: sampler ({s})"]["peak_bytes"]
        predicted[s] = {"eager": base + max(step, *passes_eager),
                        "cuda_graphs": weights + kv_graphs + held + logits + pool + max(rows["prefill"]["peak_bytes"],
                                                                                         sampler)}
    print(f"{args.preset}, {args.dtype}, experts {args.precision}"
          f"{f' (group {args.group_size})' if args.precision == 'int4' else ''}, linears {args.linears}, "
          f"embeddings {args.embeddings}, B={B}, P={P}, N={N} (cache {capacity} positions)")
    ring = f"a ring of {cache.ring} positions in the sliding layers" if cache.ring else "every position in every layer"
    print(f"  weights {weights / GB:.3f} GB, KV cache {kv / GB:.3f} GB ({ring}), self-conditioning logits held "
          f"{held / GB:.3f} GB")
    print(f"  {'pass':42s} {'peak on top (GB)':>16s}   largest allocations (MB, op)")
    for name, r in rows.items():
        big = ", ".join(f"{b / 1e6:.0f} {op}" for b, op in r["largest"])
        print(f"  {name:42s} {r['peak_bytes'] / GB:16.3f}   {big}")
    print(f"  predicted peak (GB; budget {args.budget_gb:.1f}):   eager   CUDA graphs")
    for s_, v in predicted.items():
        print(f"    {s_ + ' sampler':28s} {v['eager'] / GB:7.2f} {v['cuda_graphs'] / GB:13.2f}")
    result = {"bench": "peak_memory", "preset": args.preset, "precision": args.precision,
              "group_size": args.group_size, "linears": args.linears, "embeddings": args.embeddings,
              "dtype": args.dtype, "ring": cache.ring,
              "batch": B, "prompt_tokens": P, "new_tokens": N, "weights_bytes": weights, "kv_bytes": kv,
              "held_bytes": held, "passes": {k: v["peak_bytes"] for k, v in rows.items()},
              "predicted_peak_bytes": predicted,
              "budget_bytes": args.budget_gb * GB}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
