"""`blockpress bench`: generation speed of blockpress vs transformers vs its own AR decode, one run (the harness is
blockpress/lab/bench.py; benchmarks/README.md says what it measures). Prints a table and ends with ONE JSON line."""

from __future__ import annotations

import argparse

from ..lab.presets import PRESETS
from ..options import DTYPE_NAMES
from .run import COMPILE_HELP, _int_in, add_speed_args, add_storage_args, _nonneg_int, _positive_int, _positive_int_list, _seed, _output_file

MODES = ("fixed", "adaptive")


def _spec_type(parse):
    """argparse type of a tile spec: the string, checked by `parse` (its ValueError becomes argparse's message)."""
    def check(spec: str) -> str:
        try:
            parse(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return spec
    return check


def _tiles(spec: str) -> str:
    """argparse type of --moe-tiles."""
    from ..kernels.moe_grouped import parse_tiles

    return _spec_type(parse_tiles)(spec)


def _linear_tiles(spec: str) -> str:
    """argparse type of --linear-tiles."""
    from ..kernels.linear_q import parse_linear_tiles

    return _spec_type(parse_linear_tiles)(spec)


def _attention_tiles(spec: str) -> str:
    """argparse type of --attention-tiles."""
    from ..kernels.attention_fixed import parse_attention_tiles

    return _spec_type(parse_attention_tiles)(spec)


def _modes(spec: str) -> str:
    """argparse type of --modes: a comma-separated subset of fixed, adaptive."""
    modes = [m for m in spec.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected fixed and/or adaptive (comma-separated), got {spec!r}")
    return spec


def _positive_float(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = float("nan")
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v!r}")
    return x


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (default tiny)")
    p.add_argument("--config", help="a config.json (diffusion_gemma) instead of a preset")
    p.add_argument("--model", help="a checkpoint folder (real weights) instead of random ones")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="model dtype (default bf16 on GPU, fp32 on CPU)")
    add_storage_args(p)
    p.add_argument("--experts", default="auto",
                   help="experts backend: auto, loop (or torch: the reference), dense, grouped, triton, "
                        "triton_checked, scaled_mm (fp8 experts with fp8 activations in torch's grouped GEMM) or "
                        "w8a8 (every fp8 weight, experts and --linears fp8, with fp8 activations in the Triton "
                        "kernels)")
    p.add_argument("--attention", default="auto", help="attention backend: auto, eager, sdpa, sdpa_gqa")
    add_speed_args(p)
    p.add_argument("--attention-split", type=_int_in(1, 16), default=None, metavar="K",
                   help="the attention kernel's key tiles of each row block in K runs, merged by a second kernel (more "
                        "programs at batch 1; default: as the attention tiles say, else 1)")
    p.add_argument("--attention-tiles", type=_attention_tiles, default=None, metavar="SPEC",
                   help="the attention kernel's tiles per kind of layer, e.g. 'sliding:bm=32,split=2;full:dv=128' (bm, "
                        "bn, dv, warps, stages, split; a part without 'kind:' sets both kinds; default: what "
                        "blockpress tune kept for this card, else the built-in tiles)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="replay denoising steps, commits (also fused ones) and AR steps from CUDA graphs (default "
                        "off: the bench times what its flags ask; run, chat, infill and serve replay graphs by default "
                        "on a GPU)")
    p.add_argument("--moe-tiles", type=_tiles, metavar="SPEC",
                   help="Triton expert kernels' tiles, e.g. bm=32,bn=128,bk=64,warps=8,stages=4 (default: what "
                        "blockpress tune kept for this card, else bm=auto,bn=128,bk=64, and for fp8 on Hopper "
                        "bm=auto,bn=64,bk=128,swap=1); swap=1: the weight tile as the MMA's first operand (Hopper's "
                        "wgmma reads it from registers)")
    p.add_argument("--linear-tiles", type=_linear_tiles, metavar="SPEC",
                   help="the Triton 8-bit linear kernel's tiles with --linears int8/fp8, e.g. bm=auto,bn=32,split=4 "
                        "(benchmarks/bench_linears.py's best_int8_spec; default: bm=auto,bn=64,bk=64); swap=1: the "
                        "weight tile as the MMA's first operand, a canvas's rows in one block (untimed)")
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--moe-sum", choices=["kernel", "atomic"], default="kernel",
                   help="how the Triton experts sum a token's K expert outputs: kernel (a third kernel, deterministic; "
                        "default) or atomic (fp32 atomic adds in the down kernel: no [A, H] buffer, run-to-run "
                        "last-bit differences)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one canvas's denoising steps (first batch size, not captured: the timed "
                        "runs' passes, the fixed-shape ones with --cuda-graphs or --compile): kernels per step, time "
                        "per step by kernel class, top kernels, experts' achieved GB/s (JSON key 'profile')")
    p.add_argument("--compact-rows", action="store_true",
                   help="adaptive mode, batch > 1: run each decoder pass on the rows still denoising only (the "
                        "sampler still draws for every row: the same random stream); not with --cuda-graphs")
    p.add_argument("--prefill-chunk", type=_nonneg_int, default=None, metavar="N",
                   help="encode a long prompt N tokens at a time (default: the model's, 2048; 0: in one pass)")
    p.add_argument("--sc-topk", type=_positive_int, default=None, metavar="K",
                   help="self-conditioning over the top-K tokens only (approximate; default: exact, all V)")
    p.add_argument("--prompt-tokens", type=_positive_int, help="prompt length P (default per preset)")
    p.add_argument("--prompt", help="with --model: this text (the model's tokenizer) as the prompt of every row, "
                                    "instead of P random ids")
    p.add_argument("--new-tokens", type=_positive_int, help="new tokens N (default per preset)")
    p.add_argument("--steps", type=_positive_int, default=16, help="denoising steps per canvas (max, in adaptive mode)")
    p.add_argument("--batch", type=_positive_int_list, default="1", help="comma-separated batch sizes, e.g. 1,2,4,8")
    p.add_argument("--modes", type=_modes, default="fixed,adaptive", help="fixed (no early stop) and/or adaptive")
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip transformers")
    p.add_argument("--reference-batch", type=_positive_int_list, default="1",
                   help="batch sizes for the transformers runs")
    p.add_argument("--no-ar", dest="ar", action="store_false", help="skip the autoregressive baseline")
    p.add_argument("--ar-batch", type=_positive_int_list, default="1", help="batch sizes for the AR baseline")
    p.add_argument("--ar-tokens", type=_positive_int, help="tokens for the AR baseline (default: --new-tokens)")
    p.add_argument("--warmup", type=_nonneg_int, default=1)
    p.add_argument("--repeats", type=_positive_int, default=1, help="timed runs per setting (median reported)")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (1 is steadier on a shared machine)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--init-std", type=float, default=0.02, help="std of the random weights")
    p.add_argument("--bandwidth-gbs", type=_positive_float,
                   help="memory bandwidth for the floor (default: measured copy)")
    p.add_argument("--peak-tflops", type=_positive_float,
                   help="dense bf16 peak for the roofline floors that count math too (default: known GPUs, e.g. "
                        "H100 SXM 989; none on a CPU: bytes-only floors)")
    p.add_argument("--out", type=_output_file, help="also write the JSON result to this file")


def main(args) -> int:
    from ..lab.bench import print_json, print_table, run

    result = run(args)
    title = (f"blockpress bench: {result['preset'] or result['model'] or result['config_file']} on "
             f"{result['hardware']}, {result['dtype']}/{result['precision']}, P={result['prompt_tokens']} "
             f"N={result['new_tokens']} steps={result['steps']} (floor at {result['bandwidth_gbs']:.0f} GB/s)")
    print_table(result["runs"], title)
    print_json(result, args.out)
    return 0




def main_argv(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_generate", description=__doc__.splitlines()[0])
    add_parser(parser)
    return main(parser.parse_args(argv))
