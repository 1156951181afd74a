"""The launches of a compiled decoder block as a GPU would run them, counted on a machine without one.

A denoising step's fixed cost is its kernels (issue 30: ~1,400 a step before compiled blocks, 779 on the H100 of
2026-11-27), and inductor decides how many a compiled block has. Its CPU code fuses differently (C++ loops, not
Triton kernels), so this script asks inductor for the Triton code it would write (its `cpu_backend = "triton"` takes
the GPU's scheduling and fusion path) and reads the launches back from the generated `call()`: inductor's Triton
kernels, the GEMMs (`extern_kernels.mm`) and blockpress's custom ops (attention, routing, experts; each one call
here, its own kernels inside). No generated kernel is compiled or run: each launch does nothing, and the pass runs
on to the next kind of layer with whatever its buffers hold. The block is configured as on a Hopper GPU (the attention kernel, the routing kernel and the
quantised experts as custom ops); the experts' count is cut to 8 (an opaque op: it changes no launch) and the
vocabulary to 512 (not in a block), so the 26B widths fit a CPU's memory.

    python benchmarks/block_kernels.py                       # the 26B-A4B widths, fp8 experts
    python benchmarks/block_kernels.py --preset tiny

Ends with one JSON line: per graph (a kind of layer) its launches in order.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before blockpress imports Triton: the generated code is for a compiler


def launches(code: str) -> list[str]:
    """The launches of a compiled graph's `call()`, in order: inductor's kernels, GEMMs, custom ops."""
    call = code[code.find("def call("):]
    found = re.findall(r"(triton_\w+)\.run\(|(extern_kernels\.\w+)\(|(torch\.ops\.blockpress\.\w+)\.default\(", call)
    return [next(x for x in t if x) for t in found]


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--precision", default="fp8", choices=["native", "fp8", "int4"])
    args = p.parse_args(argv)

    import torch._dynamo
    import torch._inductor.config as inductor
    from torch._inductor.graph import GraphLowering

    from blockpress import kernels
    from blockpress.kernels.route import route_op
    from blockpress.lab.aot import compile_only
    from blockpress.lab.presets import preset_config
    from blockpress.lab.random_weights import build_model

    from torch._inductor.async_compile import AsyncCompile

    class Unbuilt:  # a generated kernel not compiled: launching it does nothing (the block's outputs are not read)
        def run(self, *args, **kwargs):
            return None

    codes: list[str] = []
    inductor.cpu_backend = "triton"
    inductor.compile_threads = 1
    GraphLowering.save_output_code = staticmethod(codes.append)  # what run_and_get_code reads
    AsyncCompile.triton = lambda self, kernel_name, source_code, device_str="cuda": Unbuilt()
    cfg = copy.deepcopy(preset_config(args.preset)[0])
    cfg["text_config"].update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              num_experts=min(8, cfg["text_config"]["num_experts"]), vocab_size=512)
    cfg["text_config"]["top_k_experts"] = min(cfg["text_config"]["top_k_experts"], 4)
    m = build_model(cfg, torch.device("cpu"), torch.bfloat16, "native", 0, 0.02, 64)
    kernels.configure(m, experts="grouped", attention="sdpa_gqa", precision=args.precision, compile=True)
    kernels.use(m, attention_kernel="torch")  # the attention kernel's custom op (its torch body: nothing runs)
    for layer in m.layers:  # the routing kernel's custom op, as a GPU runs it
        layer.router.kernel = functools.partial(route_op, kernel="torch")
    g = torch.Generator().manual_seed(0)
    C = m.config.canvas_length
    ids = torch.randint(5, 500, (1, 21), generator=g)
    x = torch.randint(0, 500, (1, C), generator=g)
    cache = m.new_cache(1, 21 + 2 * C)
    with torch.no_grad():
        m.encode(ids, cache)
        torch._dynamo.reset()
        with compile_only(90):  # a stand-in CUDA driver: inductor asks Triton for a GPU target while writing code
            m.decode(x, cache, start=torch.tensor(cache.length))
    if not codes:
        raise SystemExit("block_kernels: inductor generated no code (this torch cannot write Triton for a CPU)")
    graphs = [launches(c) for c in codes]
    text = m.text
    print(f"block_kernels: {args.preset} widths (H {text.hidden_size}, {text.num_attention_heads} heads), "
          f"{args.precision} experts, a canvas of {C}: the launches of each compiled block graph")
    for i, ls in enumerate(graphs):
        kinds = {k: sum(1 for x in ls if x.startswith(k)) for k in ("triton_", "extern_kernels", "torch.ops")}
        print(f"graph {i}: {len(ls)} launches: {kinds['triton_']} inductor kernels, {kinds['extern_kernels']} GEMMs, "
              f"{kinds['torch.ops']} custom ops")
        for x in ls:
            print(f"    {x[:110]}")
    print(json.dumps({"bench": "block_kernels", "preset": args.preset, "precision": args.precision,
                      "torch": torch.__version__, "graphs": graphs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
