"""`blockpress run [MODEL] [PROMPT]`: generate once, watching the canvas crystallise.

MODEL is a folder or a Hub id (default: the Sudoku model shipped in blockpress/assets/sudoku).
PROMPT is text ('-' or a pipe: read stdin). For a Sudoku model (its `blockpress_task.json` or
config.json says task "sudoku") the prompt is a puzzle (81 cells; a built-in example when
omitted), drawn as a grid, and the answer grid marks wrong or blank cells.

Output: the live canvas (on a terminal, unless --no-live), the final text, then one stats line:
tokens/s, tokens per forward (returned tokens / decoder passes), steps per canvas, time to first
commit. `--json` prints one JSON object instead. The returned text stops at the first stop id
(the checkpoint's eos ids, else `<eos>` and `<turn|>`) and at --max-new-tokens tokens.

This module also holds the flags and helpers shared by `chat` and `serve` (model loading,
sampling flags -> engine keyword arguments, stop ids). No heavy imports at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import MAX_SEED, MIN_SEED, reply_tokens
from ..options import DTYPE_NAMES, EMBEDDING_FORMATS, LINEAR_FORMATS, STORAGE_FIELDS

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "sudoku"
EXAMPLE_SUDOKU = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


# ----------------------------------------------------------------------------- flag types
def _parse_number(s: str, cast, what: str, allow_none: bool):
    """cast(s), or None for "none" when allowed; else argparse's "expected <what>, got ..." error."""
    if allow_none and s.lower() == "none":
        return None
    try:
        return cast(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None


def _int_flag(what: str, lo: int, hi: int | None = None, allow_none: bool = False):
    """An argparse type: an integer in [lo, hi] (or "none" when allowed), else "expected <what>, got ..."."""
    def parse(s: str):
        v = _parse_number(s, int, what, allow_none)
        if v is None:
            return None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    return parse


_positive_int = _int_flag("a positive integer", 1)
_nonneg_int = _int_flag("an integer >= 0", 0)
_int_or_none = _int_flag("an integer >= 0 or none", 0, allow_none=True)


_seed = _int_flag(f"a seed in {MIN_SEED}..{MAX_SEED}", MIN_SEED, MAX_SEED)


def _output_file(s: str) -> str:
    """An argparse type: a file the command writes when it ends, checked before it starts (a typo must not cost a
    long run's results): not a folder, in a folder that exists and is writable."""
    p = Path(s)
    parent = p.parent
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{s} is a folder; give a file path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {parent} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{s} cannot be written (permissions); give another path")
    return s


def _int_in(lo: int, hi: int):
    return _int_flag(f"an integer in {lo}..{hi}", lo, hi)


MAX_STEPS = 1024  # denoising steps per canvas: the CLI's bound and the server's default limit (--max-steps-limit)
_steps = _int_in(1, MAX_STEPS)


def _tokens_or_limit(s: str) -> int:
    """serve --max-new-tokens: a positive integer, or -1 for the server's limit (--max-tokens-limit)."""
    v = _int_flag("a positive integer or -1 (the limit)", -1)(s)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a positive integer or -1 (the limit), got 0")
    return v


def _positive_int_list(s: str) -> str:
    """A comma-separated list of positive integers ("1,2,4,8"), checked and returned as given."""
    for part in s.split(","):
        _positive_int(part.strip())
    return s


def _float_in(lo: float, strict: bool, allow_none: bool = False):
    def parse(s: str):
        v = _parse_number(s, float, "a number or none" if allow_none else "a number", allow_none)
        if v is None:
            return None
        if v != v or v in (float("inf"), float("-inf")) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {lo:g}, got {s}")
        return v
    return parse


# ----------------------------------------------------------------------------- shared flags
COMPILE_HELP = ("torch.compile each decoder block (norms, residual adds and RoPE fused into fewer kernels; the experts "
                "and 8-bit projections stay as they are): the same function up to rounding; the first pass of each "
                "shape compiles, for seconds to a minute")


def _group_size(v: str) -> int:
    from ..kernels.quant import check_group_size

    try:
        return check_group_size(int(v))
    except ValueError:  # not an integer, or InputError (a ValueError): not a power of two >= 16
        raise argparse.ArgumentTypeError(f"expected a power of two >= 16 (e.g. 32, 64, 128), got {v!r}") from None


def add_storage_args(p: argparse.ArgumentParser) -> None:
    """--precision, --group-size, --linears, --embeddings: how the weights are stored, fixed at load (options.py)."""
    p.add_argument("--precision", choices=["native", "fp8", "int4"], default="native",
                   help="expert weights: native (as stored), or fp8 / int4 quantised layer by layer while loading (a "
                        "model too big for the GPU in bf16 loads straight into 4 bits); the rest as --linears and "
                        "--embeddings say. A pre-quantised checkpoint loads as stored")
    p.add_argument("--group-size", type=_group_size, default=64,
                   help="int4: input columns per scale, a power of two >= 16 (default 64)")
    p.add_argument("--linears", choices=LINEAR_FORMATS, default="native",
                   help="attention and dense-MLP projections: native (--dtype), or int8 / fp8 (8 bits with a scale per "
                        "row, quantised while loading; int8 is the more accurate; with --precision int4 the 26B-A4B "
                        "weights take ~15.3 GB, not ~17); int4-mlp: the dense MLP alone in int4 on the experts' int4 "
                        "kernels (~16.2 GB with --precision int4)")
    p.add_argument("--embeddings", choices=EMBEDDING_FORMATS, default="native",
                   help="the embedding table, also the LM head: native (--dtype), or int8 with a scale per token "
                        "(0.74 GB less on the 26B-A4B model)")


def add_fp8_activations_arg(p: argparse.ArgumentParser) -> None:
    """--fp8-activations: the w8a8 backend (`experts_option`)."""
    p.add_argument("--fp8-activations", action="store_true",
                   help="with fp8 weights (--precision fp8 and / or --linears fp8, or an FP8 checkpoint): quantise "
                        "the activations of the fp8 experts and projections to fp8 too, a scale per token (w8a8, as "
                        "vLLM runs FP8 checkpoints), so the tensor cores take the fp8 weights as stored; slightly "
                        "different numbers (within bf16's error on the shipped models); a CPU runs its torch "
                        "reference")


def experts_option(args) -> dict[str, Any]:
    """--reference-kernels / --fp8-activations -> the `experts` option of `blockpress.load`."""
    reference, a8 = getattr(args, "reference_kernels", False), getattr(args, "fp8_activations", False)
    if reference and a8:
        from ..errors import InputError

        raise InputError("--fp8-activations and --reference-kernels: the references run the activations in --dtype; "
                         "pass one of them")
    return {"experts": "loop" if reference else "w8a8" if a8 else "auto"}


def storage_options(args) -> dict[str, Any]:
    """The storage flags (add_storage_args) -> `blockpress.load` options."""
    return {name: getattr(args, name) for name in STORAGE_FIELDS if hasattr(args, name)}


def add_model_args(p: argparse.ArgumentParser, cuda_graphs: bool = True,
                   default: str = f"the shipped Sudoku model, {DEFAULT_MODEL}") -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="checkpoint folder, Hub id, or a shipped model's name: sudoku, kjv, assistant "
                        f"(default: {default})")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: $BLOCKPRESS_DEVICE, else cuda when available)")
    p.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                   help="weights dtype (default: float32 on CPU, the checkpoint's dtype on GPU)")
    add_storage_args(p)
    p.add_argument("--adapter", metavar="DIR",
                   help="LoRA adapter folder (PEFT format: adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--merge-adapter", action="store_true",
                   help="fold the adapter into the weights once at load (faster steps; default: kept separate)")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (default: one per core left free by other processes, measured while "
                        "the model loads; OMP_NUM_THREADS also sets it)")
    p.add_argument("--reference-kernels", action="store_true",
                   help="run the plain PyTorch references (experts one by one, attention with expanded KV heads) "
                        "instead of the fast kernels: the same function up to rounding, for checking a fast path")
    add_fp8_activations_arg(p)
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    add_speed_args(p)
    if cuda_graphs:
        p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="replay every denoising step and commit from a CUDA graph captured on first use (takes "
                            "the ~1,800 kernel launches of each 26B pass off the host's path; default: on a CUDA GPU "
                            "whose kernels can be captured; --no-cuda-graphs launches each pass from Python)")


def add_speed_args(p: argparse.ArgumentParser) -> None:
    """The speed options of `blockpress.load` / `configure` that every command running a model takes
    (`model_options` reads them)."""
    p.add_argument("--fuse-commit", action=argparse.BooleanOptionalAction, default=None,
                   help="encode each committed canvas in the same pass as the next canvas's first denoising step "
                        "(serve: when nobody waits to join; one read of the weights for both; same tokens up to fp32 "
                        "rounding; default: on a CUDA GPU, off on a CPU; --no-fuse-commit: a pass of its own per "
                        "commit)")
    p.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="run each layer's q/k/v and gate/up projections as one GEMM each (default: on; the same "
                        "numbers on a CPU; -0.4 ms a step on an H100; --no-merge-projections: one GEMM per projection)")
    p.add_argument("--attention-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="the replayed passes' attention in one Triton kernel that reads the cache in place (CUDA "
                        "only; default: on a Hopper GPU, where it was timed; --no-attention-kernel: a mask over the "
                        "cache through SDPA)")
    p.add_argument("--sampler", choices=["exact", "fast"], default="exact",
                   help="exact: the reference's sampler arithmetic and random draws (default); fast: one fused pass "
                        "over each row's logits (Gumbel-max: the same distribution, another random stream; seeded, "
                        "reproducible)")


def add_sampling_args(p: argparse.ArgumentParser, seed: bool = True, server: bool = False,
                      max_new_tokens: bool = True) -> None:
    """The sampling flags; max_new_tokens=False hides --max-new-tokens from --help (infill sets it from the
    template: given, it is refused with the reason)."""
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, then the reference)")
    if not max_new_tokens:
        g.add_argument("--max-new-tokens", type=_positive_int, help=argparse.SUPPRESS)
    elif server:
        g.add_argument("--max-new-tokens", type=_tokens_or_limit, metavar="N",
                       help="max_tokens of a request that gives none (-1: --max-tokens-limit; default: the "
                            "checkpoint's for chat, 16 for completions as OpenAI)")
    else:
        g.add_argument("--max-new-tokens", type=_positive_int, help="tokens to generate (rounded up to whole canvases)")
    steps = g.add_mutually_exclusive_group()
    steps.add_argument("--steps", type=_steps, metavar="N",
                       help="speed/quality dial: exactly N denoising steps per canvas (early stopping off; at most "
                            f"{MAX_STEPS})")
    steps.add_argument("--max-denoising-steps", type=_steps, help=f"step budget per canvas (at most {MAX_STEPS})")
    add_sampler_args(g)
    g.add_argument("--stability-threshold", type=_int_or_none, default=argparse.SUPPRESS,
                   help="steps the argmax must stay unchanged to stop early (none: never stop early)")
    g.add_argument("--confidence-threshold", type=_float_in(0, strict=True, allow_none=True),
                   default=argparse.SUPPRESS,
                   help="mean entropy below which a stable canvas stops (none: never stop early)")
    if seed:
        g.add_argument("--seed", type=_seed, help="random seed (same seed, same text)")


def add_sampler_args(g) -> None:
    """The sampler's own settings (each step's acceptance and temperature): what `sampler_kwargs` reads."""
    g.add_argument("--entropy-bound", type=_float_in(0, strict=True), help="entropy budget of accepted tokens per step")
    # these accept "none"; SUPPRESS tells "not given" (attribute absent) from "given as none"
    g.add_argument("--t-min", type=_float_in(0, strict=False, allow_none=True), default=argparse.SUPPRESS,
                   help="final temperature (none, with --t-max none: no temperature schedule)")
    g.add_argument("--t-max", type=_float_in(0, strict=False, allow_none=True), default=argparse.SUPPRESS,
                   help="initial temperature (none, with --t-min none: no temperature schedule)")


def sampler_kwargs(args) -> dict[str, Any]:
    """The flags of `add_sampler_args` given on the command line -> engine keyword arguments."""
    kw: dict[str, Any] = {}
    if getattr(args, "entropy_bound", None) is not None:
        kw["entropy_bound"] = args.entropy_bound
    for name in ("t_min", "t_max"):
        if hasattr(args, name):
            kw[name] = getattr(args, name)
    return kw


def sampling_kwargs(args) -> dict[str, Any]:
    """Sampling flags given on the command line -> engine keyword arguments (reference names)."""
    kw: dict[str, Any] = sampler_kwargs(args)
    for name in ("max_new_tokens", "max_denoising_steps"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    for name in ("stability_threshold", "confidence_threshold"):
        if hasattr(args, name):
            kw[name] = getattr(args, name)
    if getattr(args, "steps", None) is not None:
        from ..config import steps_sampling

        kw.update(steps_sampling(args.steps, kw, lambda k: f"--{k.replace('_', '-')}", "--steps"))
    return kw


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    if not (DEFAULT_MODEL / "config.json").is_file():
        from ..errors import CheckpointError

        raise CheckpointError(f"no MODEL given and the shipped Sudoku model is not installed at {DEFAULT_MODEL}; "
                              "pass MODEL (a checkpoint folder or a Hub id like google/diffusiongemma-26B-A4B-it)")
    return str(DEFAULT_MODEL)


def refuse_task_model(lm, command: str) -> None:
    """`serve`, `chat` and `infill` speak text: a task model (Sudoku) reads a structured prompt that only
    its own entry points build, and would answer typed text with noise."""
    from ..tasks import task_info

    task = task_info(lm).get("task")
    if task == "sudoku":
        from ..errors import InputError

        raise InputError(f"{lm.path} is a Sudoku model: `blockpress {command}` speaks text, which it cannot read. "
                         "Use `blockpress run sudoku PUZZLE` (live grid), `blockpress eval sudoku`, or "
                         "`blockpress.tasks.sudoku.solve(puzzle)`")


def model_options(args) -> dict[str, Any]:
    """The model flags -> `blockpress.load` options (blockpress/options.py)."""
    opts = {**storage_options(args), **experts_option(args),
            "attention": "sdpa" if getattr(args, "reference_kernels", False) else "auto"}
    for name in ("sampler", "fuse_commit", "merge_projections", "attention_kernel"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts


def load_model(args):
    import blockpress

    if getattr(args, "merge_adapter", False) and not getattr(args, "adapter", None):
        from ..errors import InputError

        raise InputError("--merge-adapter needs --adapter DIR")
    watch = None
    if getattr(args, "threads", None):
        from .threads import set_threads

        set_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:  # measure the other processes' load while the model loads
        from .threads import CpuWatch

        watch = CpuWatch()
    graphs = getattr(args, "cuda_graphs", None)
    from ..errors import InputError
    from ..loading import parse_device

    for flag, on in (("--cuda-graphs", graphs), ("--attention-kernel", getattr(args, "attention_kernel", None))):
        if on and parse_device(args.device).type != "cuda":
            raise InputError(f"{flag} needs a CUDA GPU and the model would run on {parse_device(args.device)}; "
                             "drop the flag (or pass --device cuda on a machine with one)")
    opts = model_options(args)
    compile_ = getattr(args, "compile", False)
    from ..options import Options

    Options().replace(**opts, compile=compile_, cuda_graphs=graphs)  # every flag checked before the weights load
    lm = blockpress.load(resolve_model(args.model), device=args.device, dtype=args.dtype,
                         progress=sys.stderr.isatty(), **opts)
    if watch is not None and lm.device.type == "cpu":  # one thread per free core (cli/threads.py)
        from .threads import default_threads

        n = default_threads(watch.load())
        if n is not None:
            import torch

            torch.set_num_threads(n)
    if getattr(args, "adapter", None):
        from ..train.lora import apply_adapter

        apply_adapter(lm, args.adapter, merge=args.merge_adapter)
    if compile_ or graphs is not None:  # after the adapter: the graphs capture (and compile traces) the model as it
        lm.configure(compile=compile_, cuda_graphs=graphs)  # will run (by default they capture on first use, after it)
    return lm


def task_of(lm) -> str | None:
    """"sudoku" when the folder's blockpress_task.json (or config.json) says so."""
    from ..tasks import task_info

    return task_info(lm).get("task")


def stats_of(result, n_tokens: int) -> dict[str, Any]:
    passes = int(result.forward_passes[0])
    spc = list(result.steps_per_canvas)
    return {
        "tokens": n_tokens,
        "seconds": round(result.total_seconds, 4),
        "tokens_per_second": round(n_tokens / result.total_seconds, 2) if result.total_seconds > 0 else None,
        "tokens_per_forward": round(n_tokens / passes, 3) if passes else 0.0,
        "forward_passes": passes,
        "steps_per_canvas": spc,
        "mean_steps_per_canvas": round(sum(spc) / len(spc), 2) if spc else 0.0,
        "time_to_first_commit": round(result.first_commit_seconds, 4),
    }


def stats_line(s: dict[str, Any]) -> str:
    return (f"{s['tokens']} tokens in {s['seconds']:.2f}s · {s['tokens_per_second'] or 0:.1f} tokens/s · "
            f"{s['tokens_per_forward']:.2f} tokens/forward · {s['mean_steps_per_canvas']:.1f} steps/canvas "
            f"({len(s['steps_per_canvas'])} canvases) · first commit {1000 * s['time_to_first_commit']:.0f} ms"
            + (f" · {s['cpu_note']}" if s.get("cpu_note") else ""))


def cpu_stats(stats: dict[str, Any], watch, device) -> dict[str, Any]:
    """Add what the CPU did during the run (threads, cores, other processes' load) to `stats`; on a CPU shared
    with busy processes `cpu_note` says so (the stats line shows it)."""
    if watch is None or device.type != "cpu":
        return stats
    import torch

    from .threads import threads_note

    load, n = watch.load(min_seconds=0), torch.get_num_threads()
    if load is not None:
        stats["cpu"] = {"threads": n, "cores": load.cores, "others_busy": load.others}
        stats["cpu_note"] = threads_note(load, n) or None
    return stats


def read_prompt(prompt: str | None) -> str | None:
    """The prompt argument, or stdin ('-' or a pipe) without the newline `echo` and editors end it with, so
    `echo TEXT | blockpress run` is the same prompt (and the same text for a seed) as `blockpress run TEXT`."""
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
    return prompt


# ----------------------------------------------------------------------------- command
def add_parser(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("prompt", nargs="?", metavar="PROMPT",
                   help="text, or a Sudoku puzzle for a Sudoku model; '-' (or a pipe) reads stdin")
    add_sampling_args(p)
    p.add_argument("--thinking", action="store_true", help="let the model think first (reasoning shown dim)")
    p.add_argument("--raw", action="store_true", help="plain prompt without the chat template")
    p.add_argument("--no-live", action="store_true", help="do not draw the canvas while it denoises")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")
    p.add_argument("--repair", type=_int_or_none, default=0, metavar="R",
                   help="Sudoku: up to R rounds of editing the canvas in place, re-denoising the cells that break "
                        "a rule while the rest stays (default 0)")
    p.add_argument("--samples", type=_positive_int, default=None, metavar="K",
                   help="Sudoku: denoise K candidate answers side by side and keep the one that breaks no rule "
                        "(else the fewest cells); default: the model's own (blockpress_task.json, else 1)")


def main(args) -> int:
    from rich.console import Console

    from ..engine.generate import seeded

    if args.model == "-" and args.prompt is None:  # `run -`: the prompt from stdin, to the default model
        args.model, args.prompt = None, "-"
    lm = load_model(args)
    prompt = read_prompt(args.prompt)
    console = Console(highlight=False, soft_wrap=True)  # text is never hard-wrapped (a pipe or a file gets it whole)
    gen = seeded(args.seed, lm.device) if args.seed is not None else None
    live = not (args.no_live or args.json)
    if task_of(lm) == "sudoku":
        text_only = [f for f, on in (("--thinking", args.thinking), ("--raw", args.raw),
                                     ("--max-new-tokens", args.max_new_tokens is not None)) if on]
        if text_only:
            from ..errors import InputError

            raise InputError(f"{' and '.join(text_only)} {'applies' if len(text_only) == 1 else 'apply'} to text "
                             "models; a Sudoku model reads a puzzle")
        return _run_sudoku(lm, prompt, args, console, gen, live)
    if args.repair:
        from ..errors import InputError

        raise InputError("--repair re-denoises the cells of a Sudoku answer that break a rule; this model is not "
                         "a Sudoku model (for text, edit in place with `blockpress infill`)")
    if args.samples not in (None, 1):
        from ..errors import InputError

        raise InputError("--samples keeps the Sudoku candidate that breaks no rule; this model is not a Sudoku "
                         "model (drop --samples)")
    if lm.tokenizer is None:
        from ..errors import InputError

        raise InputError(f"{lm.path} has no tokenizer.json, so it cannot read a text prompt; add the tokenizer files "
                         "(or mark a Sudoku model with blockpress_task.json {\"task\": \"sudoku\"})")
    if prompt is None or not prompt.strip():
        from ..errors import InputError

        raise InputError("no PROMPT given; pass it as an argument, or '-' to read it from stdin")
    if args.thinking and (args.raw or not lm.tokenizer.is_chat):
        from ..errors import InputError

        raise InputError("--thinking turns on a chat model's thought channel, which a plain prompt does not have "
                         f"({'--raw' if args.raw else f'{lm.path} has no chat template'}); drop --thinking")
    kw = {**lm.text_defaults(), **sampling_kwargs(args)}
    cfg = lm.generation_config(**kw)  # validates: SamplingError -> one-line error, exit 2
    ids = lm.encode_chat(prompt, enable_thinking=args.thinking, chat=False if args.raw else None)
    from .threads import CpuWatch

    watch = CpuWatch()
    ban = None if args.raw else lm.chat_ban()  # a chat turn that offers no tool: no call (as lm.chat, the server)
    result = _generate(lm, ids, {**kw, "suppress_tokens": ban} if ban else kw, gen, _text_view(lm, console, live),
                       decode=True)
    tokens, reason = cfg.reply(result.new_tokens[0].tolist())
    from ..parsing import parse_reply

    parsed = parse_reply(lm.tokenizer, tokens, reason)
    stats = cpu_stats(stats_of(result, len(tokens)), watch, lm.device)
    if args.json:
        print(json.dumps({"text": parsed.content, "reasoning": parsed.reasoning,
                          "tool_calls": [c.to_openai() for c in parsed.tool_calls],
                          "finish_reason": parsed.finish_reason, "prompt_ids": ids, "token_ids": tokens,
                          "stats": stats}, ensure_ascii=False))
        return 0
    if parsed.reasoning:
        console.print(parsed.reasoning.strip(), style="dim italic", markup=False)
    console.print(parsed.content, markup=False)
    for c in parsed.tool_calls:
        console.print(f"[tool call] {c.name}({c.arguments_json})", style="magenta", markup=False)
    console.print(stats_line(stats), style="cyan", markup=False)
    return 0


def _text_view(lm, console, live):
    from .view import CanvasView, TextRenderer

    return CanvasView(TextRenderer(lm.tokenizer), console, live)


def _generate(lm, ids, kw, gen, view, decode: bool, rows: int = 1):
    """Stream one prompt (as `rows` batch rows, each from its own noise) through the canvas loop, feeding
    the view with row 0; returns the GenerationResult. With several rows (Sudoku candidates) the decoder runs on
    the rows still denoising only (`compact_rows`: the same random stream; not under CUDA graphs)."""
    import blockpress

    decoder = lm.tokenizer.stream_decoder(skip_special_tokens=True) if decode and lm.tokenizer else None
    compact = True if rows > 1 and lm.passes is lm.module else None
    with view:
        for ev in lm.stream([ids] * rows, generator=gen, drafts=view.live_on, compact_rows=compact, **kw):
            if isinstance(ev, blockpress.Draft):
                view.draft(ev.canvas_index, ev.step, ev.max_steps, ev.tokens[0].tolist(), ev.accepted[0].tolist())
            elif isinstance(ev, blockpress.Commit):
                view.commit(decoder.feed(ev.tokens[0].tolist()) if decoder else "")
            elif isinstance(ev, blockpress.Finished):
                return ev.result
    raise RuntimeError("generation ended without a result")  # unreachable


def _run_sudoku(lm, prompt, args, console, gen, live) -> int:
    import torch
    from rich.text import Text

    from ..tasks import sudoku as su
    from .view import CanvasView, SudokuRenderer

    puzzle = su.parse_grid(prompt if prompt and prompt.strip() else EXAMPLE_SUDOKU)
    kw = {"max_new_tokens": su.CANVAS_LEN, "eos_token_id": [su.EOS_ID], "pad_token_id": su.PAD_ID,
          **sampling_kwargs(args)}
    lm.generation_config(**kw)
    if not args.json:
        console.print("puzzle:", style="bold")
        console.print(su.format_grid(puzzle), markup=False)
    fmt = su.model_format(lm)
    if fmt == "inplace":  # the clues are held on the canvas; the model denoises the blanks
        ids, fixed, _ = su.encode_inplace(puzzle)
        kw["eos_token_id"] = None  # an <eos> drawn at a blank must not pad the clues after it
    else:
        ids = su.encode_prompt(puzzle)
        fixed = None
    if fixed is not None:
        kw["fixed_tokens"] = torch.tensor([fixed])
    renderer = SudokuRenderer(puzzle, lambda t: su.digit_of(t, fmt))
    view = CanvasView(renderer, console, live, title="answer", show_committed=False)
    result = _generate(lm, ids, kw, gen, view, decode=False)
    tokens = result.new_tokens[0].tolist()
    answer = su.read_answer(puzzle, tokens, fmt)
    stats = stats_of(result, len(reply_tokens(tokens, [su.EOS_ID], len(tokens))[0]))  # the first pass
    k = args.samples or su.default_samples(lm)
    broken = len(su.broken_cells(puzzle, answer, "cells"))
    stats["candidates"] = 1  # candidate answers drawn (up to --samples: more only when the first breaks a rule)
    if k > 1 and broken:  # candidates 2..K side by side; the one that breaks the fewest cells is kept
        if not args.json:
            console.print(f"candidate 1 breaks a rule at {broken} cells; denoising {k - 1} more side by side",
                          style="cyan")
        more = {**kw, "fixed_tokens": torch.tensor([fixed] * (k - 1))} if fixed is not None else kw
        view = CanvasView(renderer, console, live, title=f"candidates 2-{k} (candidate 2 shown)",
                          show_committed=False)
        extra = _generate(lm, ids, more, gen, view, decode=False, rows=k - 1)
        rows = [tokens] + [extra.new_tokens[j].tolist() for j in range(k - 1)]
        cands = [su.read_answer(puzzle, r, fmt) for r in rows]
        answer = su.pick_candidate(puzzle, cands)
        tokens = rows[cands.index(answer)]
        counts = [len(su.broken_cells(puzzle, c, "cells")) for c in cands]
        stats.update(candidates=k, candidates_breaking_no_rule=counts.count(0))
        if not args.json:
            console.print(f"{k} candidates: {counts.count(0)} break no rule; kept candidate "
                          f"{cands.index(answer) + 1} ({counts[cands.index(answer)]} cells break a rule)",
                          style="cyan")
    rounds = []
    for r in range(args.repair or 0):  # edit in place: the broken cells from noise, the rest held
        free = su.broken_cells(puzzle, answer)
        if not free:
            break
        rounds.append(len(free))
        if not args.json:
            console.print(f"repair {r + 1}: {len(free)} cells break a rule; denoising them again", style="cyan")
        fixed = torch.tensor([su.repair_canvas(puzzle, answer, free, fmt)])
        view = CanvasView(renderer, console, live, title=f"repair {r + 1}", show_committed=False)
        result = _generate(lm, ids, {**kw, "fixed_tokens": fixed}, gen, view, decode=False)
        tokens = result.new_tokens[0].tolist()
        answer = su.read_answer(puzzle, tokens, fmt)
    solution = su.solve_exact(puzzle)
    score = su.check(puzzle, answer, solution)
    if args.json:
        print(json.dumps({"puzzle": puzzle, "answer": answer, "solution": solution, **score, "format": fmt,
                          "repaired_cells": rounds, "token_ids": tokens, "stats": stats}))
        return 0
    cells = []
    for i in range(81):  # the clues bold, the model's right digits green
        d = answer[i]  # (81 digits: read_answer pads)
        if d == "0":
            cells.append(("·", "bold red reverse"))
        elif solution is not None and d != solution[i]:
            cells.append((d, "bold red reverse"))
        else:
            cells.append((d, "bold" if puzzle[i] != "0" else "green"))
    console.print("answer (red: wrong or blank):", style="bold")
    console.print(renderer.grid(cells))
    verdict = "solved" if score["solved"] else "not solved"
    console.print(Text(f"{verdict} · cell accuracy {100 * score['cell_accuracy']:.1f}% · "
                       f"clues kept {100 * score['clues_kept']:.1f}%", style="bold" if score["solved"] else "yellow"))
    console.print(stats_line(stats), style="cyan", markup=False)
    if rounds:
        console.print(f"repair: {len(rounds)} round(s) re-denoised {' + '.join(map(str, rounds))} cells",
                      style="cyan", markup=False)
    return 0
