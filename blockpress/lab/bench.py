"""The benchmark harness behind `blockpress bench`: generation speed of blockpress vs transformers vs our own AR
decode, one run.

Builds a model from a preset (`tiny`, `small`, `real-26b`), a config.json (`--config`) or a
checkpoint (`--model`), with random weights made directly on the target device (meta device, then
a seeded fill per tensor name: no CPU copy, and the transformers twin gets identical weights from
the same fill). Times, for each batch size and mode (16 fixed steps without early stopping, and
adaptive): tokens/s with and without the prompt encoding, ms per denoising step and per commit
(encoder pass), time to first commit, peak memory, and the fraction of the memory-bandwidth floor
(lab/roofline.py) reached. Then the transformers 5.23 reference (same config, weights and
settings) and the AR decode (the causal encoder as an LM, greedy, KV cache). Prints a table and
ends with ONE JSON line; every ratio comes from this one process.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from ..loading import DTYPES  # noqa: F401  (every name --dtype takes: bf16 and bfloat16 alike; re-exported)
from .presets import PRESETS, preset_config  # noqa: F401  (the harness's presets, re-exported)


# ------------------------------------------------------------------------------------ timing

class _Timer:
    """Times the calls made inside it (device events on CUDA, so no extra synchronisation)."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == "cuda", []

    def call(self, fn, *args, **kwargs):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
        else:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            end = time.perf_counter()
        self.marks.append((start, end))
        return out

    def take_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            ms = [s.elapsed_time(e) for s, e in self.marks]
        else:
            ms = [(e - s) * 1e3 for s, e in self.marks]
        self.marks = []
        return ms


class HookTimer(_Timer):
    """Times every forward of a module we do not drive (transformers' model inside its own generate) with a
    forward pre-hook and hook: nothing of the module is replaced. `remove()` takes the hooks off."""

    def __init__(self, module: torch.nn.Module, device: torch.device, end: torch.nn.Module | None = None):
        """end: the module whose forward ends a timed span (default `module`'s own)."""
        super().__init__(device)
        self.hooks = [module.register_forward_pre_hook(self._start), (end or module).register_forward_hook(self._end)]

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _start(self, module, args):
        self.start = self._now()

    def _end(self, module, args, out):
        self.marks.append((self.start, self._now()))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class TimedPasses:
    """The passes the engine runs (the module's, or their CUDA graphs) with every decode / encode / fused commit
    timed; everything else is the inner passes'. Handed to the engine as `passes`: nothing is replaced."""

    def __init__(self, inner, device: torch.device):
        self.inner = inner
        self.timers = {name: _Timer(device) for name in ("decode", "encode", "encode_decode")}

    def decode(self, *args, **kwargs):
        return self.timers["decode"].call(self.inner.decode, *args, **kwargs)

    def encode(self, *args, **kwargs):
        return self.timers["encode"].call(self.inner.encode, *args, **kwargs)

    def encode_decode(self, *args, **kwargs):
        return self.timers["encode_decode"].call(self.inner.encode_decode, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process high-water mark (Linux: KiB)


def _median(xs):
    return statistics.median(xs) if xs else None


def _gen_config(mode: str, args):
    from ..config import GenerationConfig

    adaptive = mode == "adaptive"
    return GenerationConfig.resolve(
        max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, entropy_bound=0.1, t_min=0.4, t_max=0.8,
        stability_threshold=1 if adaptive else None, confidence_threshold=0.005 if adaptive else None,
        eos_token_id=None, pad_token_id=None)


def _summary(engine, mode, batch, total_s, prefill_s, first_commit_s, steps_ms, commit_ms, steps_per_canvas,
             new_tokens, peak, fused_ms=None):
    gen = batch * new_tokens
    out = {"engine": engine, "mode": mode, "batch": batch, "tok_s": gen / total_s,
           "tok_s_excl_prompt": gen / max(total_s - prefill_s, 1e-9), "total_ms": total_s * 1e3,
           "prefill_ms": prefill_s * 1e3, "first_commit_ms": None if first_commit_s is None else first_commit_s * 1e3,
           "ms_per_step": _median(steps_ms), "ms_per_commit": _median(commit_ms),
           "steps_per_canvas": steps_per_canvas, "peak_mem_bytes": peak}
    if fused_ms:  # --fuse-commit: a commit and the next canvas's first step in one pass
        out["ms_per_fused_commit_step"] = _median(fused_ms)
    return out


def run_blockpress(module, ids, mode, args, label="blockpress", passes=None):
    """Warm-up run(s), then `repeats` timed runs (median). Returns (summary, sequences of the last run).
    passes: the passes to run (None: the module's own); CUDA graphs report their captures during the timed runs
    (0 when they replay only)."""
    from ..engine import generate as engine
    from ..options import Options

    device = module.device
    cfg = _gen_config(mode, args)
    C = module.config.canvas_length
    passes = passes if passes is not None else module
    timed = TimedPasses(passes, device)
    options = Options(sampler=args.sampler, fuse_commit=args.fuse_commit,
                      compact_rows=True if getattr(args, "compact_rows", False) else None)
    graphed = hasattr(passes, "captures")
    runs = []
    _reset_peak(device)
    for r in range(args.warmup + args.repeats):
        if r == args.warmup and graphed:
            captured = passes.captures
        torch.manual_seed(args.seed)
        res = engine.generate(module, ids, cfg, C, options=options, passes=timed)
        _sync(device)
        res.cache = None  # gone, so the next run's cache reuses its buffers (and CUDA graphs: GraphedPasses)
        ms = [timed.timers[name].take_ms() for name in ("decode", "encode", "encode_decode")]
        if r >= args.warmup:
            runs.append((res, *ms))
    res, dec, enc, fused = sorted(runs, key=lambda x: x[0].total_seconds)[len(runs) // 2]
    s = _summary(label, mode, ids.shape[0], res.total_seconds, res.prefill_seconds, res.first_commit_seconds,
                 dec, enc[1:], statistics.mean(res.steps_per_canvas), args.new_tokens, _peak_bytes(device), fused)
    if graphed:
        s["graph_captures_timed"] = passes.captures - captured
    return s, res.sequences.cpu()


def run_reference(hf, ids, mode, args):
    """transformers' generate with the same settings (global seed, no EOS, fixed or adaptive steps)."""
    from transformers import EntropyBoundSamplerConfig

    device = hf.device
    stab, conf = (1, 0.005) if mode == "adaptive" else (None, None)
    kw = dict(max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, t_min=0.4, t_max=0.8,
              sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), stability_threshold=stab,
              confidence_threshold=conf)
    # a step: the decoder pass through the LM head (transformers 5.23's generate calls the top module's forward
    # directly, past its hooks; the decoder and the head are called as modules)
    dec_t, enc_t = HookTimer(hf.model.decoder, device, end=hf.lm_head), HookTimer(hf.model.encoder, device)
    runs = []
    try:
        _reset_peak(device)
        for r in range(args.warmup + args.repeats):
            torch.manual_seed(args.seed)
            _sync(device)
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            _sync(device)
            total = time.perf_counter() - t0
            enc, dec = enc_t.take_ms(), dec_t.take_ms()
            if r >= args.warmup:
                runs.append((total, enc, dec, out))
    finally:
        dec_t.remove()
        enc_t.remove()
    total, enc, dec, out = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
    n_canvases = -(-args.new_tokens // hf.config.canvas_length)
    # prefill = first encoder call; first commit is not observable from outside generate
    s = _summary("transformers", mode, ids.shape[0], total, enc[0] / 1e3, None, dec, enc[1:],
                 len(dec) / n_canvases, args.new_tokens, _peak_bytes(device))
    return s, out.sequences.cpu()


@torch.no_grad()
def run_ar(module, ids, args, passes=None):
    """Greedy autoregressive decode with the causal encoder: prefill, then one token per pass (replayed from a
    CUDA graph with --cuda-graphs, like the diffusion steps, so that the ratio compares like with like)."""
    passes = passes if passes is not None else module
    graphs = passes if hasattr(passes, "captures") else None
    device = module.device
    B, P = ids.shape
    n = args.ar_tokens or args.new_tokens
    times = []
    _reset_peak(device)
    for r in range(args.warmup + args.repeats):
        if r == args.warmup and graphs is not None:
            captured = graphs.captures
        cache = passes.new_cache(B, P + n)
        _sync(device)
        t0 = time.perf_counter()
        h = passes.encode(ids, cache)
        tok = torch.argmax(module.lm_logits(h[:, -1:]), dim=-1)  # [B, 1]
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            h = passes.encode(tok, cache)
            tok = torch.argmax(module.lm_logits(h), dim=-1)
        _sync(device)
        t2 = time.perf_counter()
        if r >= args.warmup:
            times.append((t2 - t0, t1 - t0, t2 - t1))
        cache = None  # gone before the next run asks for one: it gets these buffers (and their graphs) back
    total, prefill, decode = sorted(times)[len(times) // 2]
    s = _summary("blockpress-ar", "greedy", B, total, prefill, prefill, [decode * 1e3 / max(n - 1, 1)], [],
                 None, n, _peak_bytes(device))
    s["tok_s"], s["tok_s_excl_prompt"] = B * n / total, B * max(n - 1, 1) / max(decode, 1e-9)
    if graphs is not None:
        s["graph_captures_timed"] = graphs.captures - captured
    return s


# ------------------------------------------------------------------------------------ report

def mean_cached(module, args) -> int:
    """The cache length a denoising step sees on average over the generation's canvases."""
    C = module.config.canvas_length
    return args.prompt_tokens + (-(-args.new_tokens // C) - 1) * C // 2


def mean_step_bytes(module, batch: int, args, hit: float, native: bool = False) -> int:
    """Bytes of one denoising step at the mean cache length over the generation's canvases."""
    from .roofline import step_bytes

    return step_bytes(module, batch, module.config.canvas_length, mean_cached(module, args), hit, native)["total"]


def add_roofline(s: dict, step_bytes: int, bandwidth: float) -> None:
    s["bytes_per_step"] = step_bytes
    s["step_floor_ms"] = step_bytes / bandwidth * 1e3
    if s.get("ms_per_step"):
        s["achieved_gbs"] = step_bytes / (s["ms_per_step"] / 1e3) / 1e9
        s["floor_fraction"] = s["step_floor_ms"] / s["ms_per_step"]


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} torch threads)"


def print_table(rows: list[dict], title: str) -> None:
    cols = [("engine", "engine", "{}"), ("mode", "mode", "{}"), ("batch", "B", "{}"), ("tok_s", "tok/s", "{:.1f}"),
            ("tok_s_excl_prompt", "tok/s excl. prompt", "{:.1f}"), ("ms_per_step", "ms/step", "{:.2f}"),
            ("ms_per_commit", "ms/commit", "{:.2f}"), ("prefill_ms", "prefill ms", "{:.1f}"),
            ("first_commit_ms", "1st commit ms", "{:.1f}"), ("steps_per_canvas", "steps/canvas", "{:.1f}"),
            ("floor_fraction", "step floor %", "{:.1%}"), ("floor_fraction_roofline", "roofline %", "{:.1%}"),
            ("peak_mem_bytes", "peak GB", "{:.2f}")]

    def cell(r, key, fmt):
        v = r.get(key)
        if v is None or (isinstance(v, float) and v != v):
            return "-"
        return fmt.format(v / 1e9 if key == "peak_mem_bytes" else v)

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(h for _, h, _ in cols))
        for r in rows:
            print(" | ".join(cell(r, k, f) for k, _, f in cols))
        return
    table = Table(title=title)
    for _, h, _ in cols:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*(cell(r, k, f) for k, _, f in cols))
    Console(width=200).print(table)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> dict:
    """The whole benchmark; returns the JSON-able result (also used by benchmarks/bench_cpu.py)."""
    from ..engine.graphs import passes_for
    from ..kernels import configure
    from .random_weights import build_model, build_reference, load_reference
    from .roofline import (class_floors_ms, expected_hit_fraction, floor_seconds, generation_floor_seconds,
                           measure_bandwidth, pass_parts, peak_bf16_flops)

    from ..errors import InputError

    from ..loading import parse_device

    device = parse_device(args.device)
    if args.prompt is not None and not args.model:
        raise InputError("--prompt needs --model (a checkpoint with a tokenizer); presets use random prompt ids")
    if args.profile and args.steps < 2:
        raise InputError("--profile leaves out a canvas's first step (it follows the prompt's encoding), so it "
                         "needs --steps 2 or more")
    if args.cuda_graphs and args.compact_rows:
        raise InputError("--compact-rows cannot run on CUDA graphs (each set of rows would be captured anew); "
                         "drop one of the two flags")
    if args.cuda_graphs and device.type != "cuda":
        raise InputError("--cuda-graphs needs a CUDA device; drop the flag on CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.config:
        from ..config import _read_json

        config, prompt, new = _read_json(Path(args.config), "--config"), 128, 128
    else:
        config, prompt, new = preset_config(args.preset)
    args.prompt_tokens = args.prompt_tokens or prompt
    args.new_tokens = args.new_tokens or new
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.model:
        from ..loading import load
        from ..options import STORAGE_FIELDS

        lm = load(args.model, device=str(device), dtype=dtype, progress=False, tokenizer=args.prompt is not None,
                  **{k: getattr(args, k) for k in STORAGE_FIELDS})
        for k in STORAGE_FIELDS:  # what loaded: a pre-quantised checkpoint's own
            setattr(args, k, getattr(lm.options, k))
        module, config = lm.module, lm.config.to_dict()
        args.model_folder = lm.path  # a shipped model's name or a run folder, resolved: what transformers loads
        if args.prompt is not None:
            if lm.tokenizer is None:
                raise InputError(f"--prompt needs the model's tokenizer.json; {args.model} has none")
            text_ids = lm.encode_chat(args.prompt, chat=False)
            args.prompt_tokens = len(text_ids)
    else:
        check_build_memory(config, device, dtype, args.precision, args.group_size)
        module = build_model(config, device, dtype, args.precision, args.seed, args.init_std, args.group_size)
    build_s = time.perf_counter() - t0
    try:  # the one place that picks the kernels (and quantises the storage asked for)
        choice = configure(module, experts=args.experts, attention=args.attention, precision=args.precision,
                           group_size=args.group_size, sc_topk=args.sc_topk, linears=args.linears,
                           compile=args.compile, moe_tiles=args.moe_tiles, moe_sum=args.moe_sum,
                           linear_tiles=args.linear_tiles, merge_projections=args.merge_projections,
                           attention_kernel=args.attention_kernel, attention_split=args.attention_split,
                           attention_tiles=args.attention_tiles, embeddings=args.embeddings)
    except ValueError as e:
        raise InputError(str(e)) from None
    if args.prefill_chunk is not None:  # 0: the whole prompt in one pass
        module.prefill_chunk = args.prefill_chunk or None
    choice["prefill_chunk"] = module.prefill_chunk
    text, C = module.text, module.config.canvas_length
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_bandwidth(device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    _free(device)
    passes = passes_for(module, None, args.cuda_graphs, args.compile, True)  # the module's, or its fixed-shape ones
    from ..options import Options

    fused = Options(fuse_commit=args.fuse_commit).fused(device)  # None (no flag): on a CUDA GPU
    result = {"bench": "generate", "hardware": hardware(device), "device": str(device), "torch": torch.__version__,
              "preset": None if (args.config or args.model) else args.preset, "config_file": args.config,
              "model": args.model, "dtype": str(dtype).replace("torch.", ""), "precision": args.precision,
              "linears": args.linears, "embeddings": args.embeddings, "backends": choice, "sampler": args.sampler,
              "cuda_graphs": bool(args.cuda_graphs), "fuse_commit": fused,
              "compact_rows": bool(args.compact_rows),
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "steps": args.steps,
              "canvas_length": C, "layers": text.num_hidden_layers, "hidden": text.hidden_size,
              "experts": text.num_experts, "top_k": text.top_k_experts, "vocab": text.vocab_size,
              "bandwidth_gbs": bandwidth / 1e9, "bandwidth_source": "given" if args.bandwidth_gbs else "measured copy",
              "peak_tflops": peak / 1e12 if peak else None,
              "build_seconds": build_s, "runs": []}
    batches = [int(b) for b in args.batch.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    seqs = {}

    def prompt_ids(B):
        if args.prompt is not None:
            return torch.tensor([text_ids] * B)
        return torch.randint(5, text.vocab_size, (B, args.prompt_tokens), generator=torch.Generator().manual_seed(B))

    for B in batches:
        ids = prompt_ids(B).to(device)
        hit = expected_hit_fraction(text.num_experts, text.top_k_experts, B * C)
        for mode in modes:
            s, seqs[(B, mode)] = run_blockpress(module, ids, mode, args, passes=passes)
            add_roofline(s, mean_step_bytes(module, B, args, hit), bandwidth)
            floor = generation_floor_seconds(module, B, args.prompt_tokens, args.new_tokens, C, args.steps,
                                             bandwidth, hit, fuse_commit=fused)
            s["gen_floor_tok_s"] = B * args.new_tokens / floor
            if peak:  # the same floors with each kernel group's math counted too (compute-bound from batch 2)
                parts = pass_parts(module, B, C, mean_cached(module, args), hit)
                s["step_floor_ms_roofline"] = floor_seconds(parts, bandwidth, peak) * 1e3
                if s.get("ms_per_step"):
                    s["floor_fraction_roofline"] = s["step_floor_ms_roofline"] / s["ms_per_step"]
                s["gen_floor_tok_s_roofline"] = B * args.new_tokens / generation_floor_seconds(
                    module, B, args.prompt_tokens, args.new_tokens, C, args.steps, bandwidth, hit,
                    fuse_commit=fused, peak_flops=peak)
            result["runs"].append(s)
            _save_partial(result, args.out)
        if args.ar and B in [int(b) for b in args.ar_batch.split(",")]:
            result["runs"].append(run_ar(module, ids, args, passes))
            _save_partial(result, args.out)
    passes = None  # its captures and buffers go
    if args.profile:  # eager kernels (a CUDA graph's replay hides them), first batch size, fixed steps
        from ..engine.graphs import passes_for
        from .profile import print_profile, profile_steps

        B = batches[0]
        fixed = args.cuda_graphs or args.compile  # the timed runs' fixed-shape passes, uncaptured: a graph's kernels
        result["profile"] = profile_steps(module, prompt_ids(B).to(device), _gen_config("fixed", args), C,
                                          sampler=args.sampler, passes=passes_for(module, None, False, fixed, True))
        result["profile"]["batch"] = B
        result["profile"]["passes"] = "fixed-shape, uncaptured" if fixed else "span (eager)"
        # each class's floor (the profiled steps follow the prompt: its tokens are cached), to read the gap against
        result["profile"]["floor_ms_by_class"] = class_floors_ms(
            pass_parts(module, B, C, args.prompt_tokens, hit), bandwidth, peak)
        print_profile(result["profile"], f"B={B}")
    ref_ok = args.reference and args.precision == "native" and args.linears == "native"
    if args.reference and not ref_ok:
        result["reference_skipped"] = "transformers runs only on native-precision weights here"
    elif ref_ok and importlib.util.find_spec("transformers") is None:  # a plain install: ours alone, said so
        ref_ok = False
        result["reference_skipped"] = ('transformers is not installed (pip install "blockpress[test]" to compare '
                                       'against it; --no-reference to skip it)')
        print(f"bench: {result['reference_skipped']}", file=sys.stderr)
    if ref_ok:
        ref_batches = [int(b) for b in args.reference_batch.split(",")]
        ref_bytes = {B: mean_step_bytes(module, B, args, 1.0, native=True) for B in ref_batches}
        del module  # the real model and its transformers twin do not fit on one GPU together
        _free(device)
        hf = load_reference(args.model_folder, device, dtype) if args.model else \
            build_reference(config, device, dtype, args.seed, args.init_std)
        result["transformers"] = __import__("transformers").__version__
        result["reference_experts_impl"] = getattr(hf.config, "_experts_implementation", None)
        for B in ref_batches:
            ids = prompt_ids(B)
            for mode in modes:
                s, ref_seq = run_reference(hf, ids.to(device), mode, args)
                add_roofline(s, ref_bytes[B], bandwidth)
                result["runs"].append(s)
                _save_partial(result, args.out)
                ours = seqs.get((B, mode))
                if ours is not None and ours.shape == ref_seq.shape:
                    new = slice(args.prompt_tokens, None)
                    result.setdefault("token_agreement_vs_transformers", {})[f"B{B}-{mode}"] = \
                        float((ours[:, new] == ref_seq[:, new]).float().mean())
        del hf
        _free(device)
    result["ratios"] = _ratios(result["runs"])
    return result



def check_build_memory(config: dict, device: torch.device, dtype: torch.dtype, precision: str = "native",
                       group_size: int = 64) -> None:
    """Refuse, before allocating anything, random weights that cannot fit on the device (the real 26B model in
    fp32 on a CPU is ~100 GB; in bf16 on a 24 GB card, 50 GB): `loading.check_memory`'s message names what would
    fit. --linears are quantised after the build, so the build's peak holds them in `dtype`."""
    from ..config import ModelConfig
    from ..loading import check_memory
    from ..model.diffusion_gemma import DiffusionGemmaModel

    with torch.device("meta"):
        meta = DiffusionGemmaModel(ModelConfig.from_dict(config))
    check_memory(meta, device, dtype, precision, group_size)


def _ratios(runs: list[dict]) -> dict:
    def find(engine, mode, B=1):
        return next((r for r in runs if r["engine"] == engine and r["mode"] == mode and r["batch"] == B), None)

    out = {}
    ours = find("blockpress", "fixed")
    for name, other in (("vs_transformers_fixed", find("transformers", "fixed")),
                        ("vs_ar", find("blockpress-ar", "greedy"))):
        if ours and other:
            out[name] = ours["tok_s"] / other["tok_s"]
    ad, ref_ad = find("blockpress", "adaptive"), find("transformers", "adaptive")
    if ad and ref_ad:
        out["vs_transformers_adaptive"] = ad["tok_s"] / ref_ad["tok_s"]
    return out


def _save_partial(result: dict, out: str | None) -> None:
    """Writes the runs done so far to `out` (marked partial), so that a run killed later (a timeout on a lent GPU,
    the transformers reference running long) keeps what it measured; the final print_json overwrites it."""
    if out:
        _write_json({**result, "partial": True}, out)


def _write_json(result: dict, out: str) -> str:
    line = json.dumps(result, default=str)
    with open(out, "w") as f:
        f.write(line + "\n")
    return line


def print_json(result: dict, out: str | None = None) -> None:
    """A benchmark's final JSON line, also written to `out` when given."""
    print(_write_json(result, out) if out else json.dumps(result, default=str))
