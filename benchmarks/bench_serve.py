"""Serving benchmark: the server's worker under closed-loop load, in process (no HTTP, no tokenizer).

For each concurrency c, c requests are kept in flight (a finished one is replaced at once) until `--requests`
have finished, after an untimed warm-up of c requests (on a GPU also `serve`'s own warm-up, which captures the
CUDA graphs of every batch size up to c; its seconds are reported). Every request has a
random P-token prompt and generates N tokens (no end-of-text stop) with fixed or adaptive steps. Reports, per
level: aggregate generated tok/s, each request's own tok/s, time to first commit from submission (p50 / p95),
rows per batched step, wall ms per batched step, and the CUDA graph captures in the timed part (0: the server
only replays). A table, then one JSON line.

    python benchmarks/bench_serve.py --preset small --concurrency 1,2,4                   # CPU
    python benchmarks/bench_serve.py --preset real-26b --precision int4 --linears int8 --cuda-graphs \\
        --concurrency 1,2,4,8 --prompt-tokens 1024 --new-tokens 1024 --steps 16         # GPU
    python benchmarks/bench_serve.py --model blockpress/assets/kjv --concurrency 1,4     # a checkpoint
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time

import torch

from blockpress.cli.bench import _tiles
from blockpress.lab.bench import DTYPES, _free, _gen_config, _peak_bytes, _reset_peak, _sync, check_build_memory, \
    hardware, print_json
from blockpress.lab.presets import PRESETS, preset_config
from blockpress.cli.run import _float_in, _nonneg_int, _positive_int, _positive_int_list
from blockpress.options import LINEAR_FORMATS


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def closed_loop(worker, make_job, concurrency: int, requests: int) -> dict:
    """Keep `concurrency` requests in flight until `requests` have finished; per-request timings and the level's
    totals. make_job(i) -> the i-th Job. A request that fails raises (a benchmark of errors is no benchmark). The
    worker must have been made with `metrics=` (rows per step come from them)."""
    if worker.metrics is None:
        raise ValueError("closed_loop needs a Worker made with metrics=Metrics()")
    from blockpress.server.worker import RowCommit, RowDone, RowError

    finished: queue.Queue = queue.Queue()

    def follow(h, rec):
        while True:
            e = h.get()
            if isinstance(e, RowCommit):
                rec["first"] = rec["first"] or time.perf_counter()
                rec["tokens"] += len(e.tokens)
            elif isinstance(e, (RowDone, RowError)):
                rec["done"], rec["error"] = time.perf_counter(), getattr(e, "message", None)
                rec["passes"] = getattr(e, "forward_passes", 0)
                finished.put(rec)
                return

    m = worker.metrics
    steps0, rows0 = m.batch_rows.count, m.batch_rows.total
    t0, recs, submitted = time.perf_counter(), [], 0

    def submit():
        nonlocal submitted
        rec = {"submitted": time.perf_counter(), "first": None, "tokens": 0}
        h = worker.submit(make_job(submitted))
        submitted += 1
        threading.Thread(target=follow, args=(h, rec), daemon=True).start()

    for _ in range(min(concurrency, requests)):
        submit()
    while len(recs) < requests:
        rec = finished.get(timeout=3600)
        if rec["error"]:
            raise RuntimeError(f"a request failed: {rec['error']}")
        recs.append(rec)
        if submitted < requests:
            submit()
    wall = max(r["done"] for r in recs) - t0
    steps, rows = m.batch_rows.count - steps0, m.batch_rows.total - rows0
    tokens = sum(r["tokens"] for r in recs)
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "request_tok_s_p50": _pct([r["tokens"] / (r["done"] - r["submitted"])
                                                                for r in recs], 0.5),
            "first_commit_ms_p50": 1e3 * _pct([r["first"] - r["submitted"] for r in recs], 0.5),
            "first_commit_ms_p95": 1e3 * _pct([r["first"] - r["submitted"] for r in recs], 0.95),
            "batched_steps": steps, "rows_per_step": rows / steps if steps else None,
            "ms_per_batched_step": 1e3 * wall / steps if steps else None,
            "row_passes_per_request": statistics.mean(r["passes"] for r in recs)}


def next_turn(lm, cfg, prompt_tokens: int, turn_tokens: int, budget: int, seed: int = 0, repeats: int = 3) -> dict:
    """A conversation's next turn: a P-token prompt runs to its end, then the same prompt + T new tokens is submitted
    (what a chat client sends); the time from that submission to its first commit, with the prefix cache of
    `budget` bytes (0: none), the median of `repeats` conversations."""
    from blockpress.server.worker import Job, RowCommit, RowDone, RowError, Worker

    V = lm.module.text.vocab_size
    w = Worker(lm, max_batch=1, queue_size=2, prefix_cache=budget)
    if lm.device.type == "cuda":
        w.warm_up()
    w.start()
    times = []
    try:
        for r in range(repeats):
            g = torch.Generator().manual_seed(seed + 7919 * (r + 1))
            first = torch.randint(5, V, (prompt_tokens,), generator=g).tolist()
            second = first + torch.randint(5, V, (turn_tokens,), generator=g).tolist()
            for ids in (first, second):
                t0 = time.perf_counter()
                h, t_first = w.submit(Job(ids, cfg, seed=seed)), None
                while True:
                    e = h.get(timeout=3600)
                    if isinstance(e, RowCommit) and t_first is None:
                        t_first = time.perf_counter() - t0
                    if isinstance(e, RowError):
                        raise RuntimeError(f"a request failed: {e.message}")
                    if isinstance(e, RowDone):
                        break
            times.append(t_first)
    finally:
        w.stop()
    pc = w.runner.prefixes
    return {"prefix_cache_bytes": budget, "first_commit_ms": 1e3 * statistics.median(times),
            "hits": pc.hits if pc else 0, "tokens_reused": pc.tokens_reused if pc else 0}


def build(args):
    """The model for --model (loaded, quantised while loading) or the preset (random weights on the device), with
    the default fast kernels configured."""
    from blockpress.lab.random_weights import build_model
    from blockpress.lm import BlockDiffusionLM
    from blockpress.loading import load, parse_device
    from blockpress.options import Options

    device = parse_device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    options = dict(precision=args.precision, linears=args.linears, moe_tiles=args.moe_tiles,
                   sampler=args.sampler, fuse_commit=args.fuse_commit, cuda_graphs=bool(args.cuda_graphs),
                   merge_projections=args.merge_projections, attention_kernel=args.attention_kernel)
    if args.model:
        return load(args.model, device=str(device), dtype=dtype, progress=sys.stderr.isatty(), tokenizer=False,
                    **options)
    config, _, _ = preset_config(args.preset)
    check_build_memory(config, device, dtype, args.precision)  # InputError naming what fits, before allocating
    module = build_model(config, device, dtype, args.precision, args.seed)
    return BlockDiffusionLM(module, module.config, {}, options=Options(**options))


def run(args, lm=None) -> dict:
    from blockpress.errors import InputError
    from blockpress.loading import parse_device
    from blockpress.server.metrics import Metrics
    from blockpress.server.worker import Job, Worker

    on = lm.device if lm is not None else parse_device(args.device)
    if args.cuda_graphs and on.type != "cuda":  # before a build that can take minutes
        raise InputError("--cuda-graphs needs a CUDA device; drop the flag on CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = lm if lm is not None else build(args)
    module = lm.module
    device, C, V = module.device, module.config.canvas_length, module.text.vocab_size
    _, prompt, new = preset_config(args.preset) if not args.model else (None, 128, 128)
    args.prompt_tokens, args.new_tokens = args.prompt_tokens or prompt, args.new_tokens or new
    cfg = _gen_config(args.mode, args)
    graphs = lm.passes if lm.options.cuda_graphs else None
    result = {"bench": "serve", "hardware": hardware(device), "device": str(device), "torch": torch.__version__,
              "model": args.model, "preset": None if args.model else args.preset,
              "dtype": str(module.dtype).replace("torch.", ""), "precision": args.precision, "linears": args.linears,
              "cuda_graphs": graphs is not None, "fuse_commit": lm.options.fused(lm.device), "sampler": lm.options.sampler,
              "merge_projections": lm.options.merges(), "attention_kernel": lm.options.attention_kernel_on(lm.device),
              "mode": args.mode, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "steps": args.steps, "canvas_length": C,
              "moe_tiles": module.layers[0].experts.tiles.spec() if hasattr(module.layers[0].experts, "tiles")
              else lm.options.moe_tiles, "build_seconds": time.perf_counter() - t0, "levels": []}
    _free(device)
    for c in (int(c) for c in str(args.concurrency).split(",")):
        metrics = Metrics()
        s = Worker(lm, max_batch=max(c, 1), queue_size=max(c, 1) * 2, metrics=metrics,
                   prefix_cache=int(args.prefix_cache_gb * 2**30))
        if device.type == "cuda":  # as `serve` does before it listens: compiles, checks, every batch size's graphs
            warm_s = s.warm_up()
        s.start()

        def make_job(i, c=c):
            ids = torch.randint(5, V, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1000 * c + i))
            return Job(ids.tolist(), cfg, seed=args.seed + i)

        try:
            if args.warmup:
                closed_loop(s, make_job, c, c * args.warmup)
            _sync(device)
            _reset_peak(device)
            captures = graphs.captures if graphs is not None else 0
            level = closed_loop(s, make_job, c, args.requests or 2 * c)
            if device.type == "cuda":
                level["warm_up_seconds"] = warm_s
            _sync(device)
            level["peak_mem_bytes"] = _peak_bytes(device)
            if graphs is not None:
                level["graph_captures_timed"] = graphs.captures - captures
        finally:
            s.stop()
        result["levels"].append(level)
        print(f"  concurrency {c}: {level['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    if args.next_turn:
        budget = int(args.prefix_cache_gb * 2**30)
        result["next_turn"] = {"turn_tokens": args.next_turn, "runs": [
            next_turn(lm, cfg, args.prompt_tokens, args.next_turn, b, args.seed) for b in (0, budget)]}
    return result


def print_table(result: dict) -> None:
    title = (f"bench_serve: {result['model'] or result['preset']} on {result['hardware']}, {result['dtype']}/"
             f"{result['precision']}, P={result['prompt_tokens']} N={result['new_tokens']} steps={result['steps']} "
             f"({result['mode']}), graphs {'on' if result['cuda_graphs'] else 'off'}, fused commit "
             f"{'on' if result['fuse_commit'] else 'off'}, sampler {result['sampler']}")
    cols = [("concurrency", "c", "{}"), ("tok_s", "tok/s", "{:.1f}"), ("request_tok_s_p50", "req tok/s p50", "{:.1f}"),
            ("first_commit_ms_p50", "1st commit p50 ms", "{:.0f}"), ("first_commit_ms_p95", "p95 ms", "{:.0f}"),
            ("rows_per_step", "rows/step", "{:.2f}"), ("ms_per_batched_step", "ms/step", "{:.2f}"),
            ("graph_captures_timed", "captures", "{}")]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for _, head, _ in cols:
            t.add_column(head, justify="right")
        for lv in result["levels"]:
            t.add_row(*("-" if lv.get(k) is None else f.format(lv[k]) for k, _, f in cols))
        Console(stderr=True).print(t)
        if "next_turn" in result:
            nt = result["next_turn"]
            t = Table(title=f"next turn of a {result['prompt_tokens']}-token conversation (+{nt['turn_tokens']} "
                            "tokens): submission to first commit")
            for head in ("prefix cache", "1st commit ms", "tokens reused"):
                t.add_column(head, justify="right")
            for r in nt["runs"]:
                t.add_row(f"{r['prefix_cache_bytes'] / 2**30:g} GiB" if r["prefix_cache_bytes"] else "off",
                          f"{r['first_commit_ms']:.0f}", str(r["tokens_reused"]))
            Console(stderr=True).print(t)
    except ImportError:
        print(title, file=sys.stderr)
        for lv in result["levels"]:
            print("  " + "  ".join(f"{h}={'-' if lv.get(k) is None else f.format(lv[k])}" for k, h, f in cols),
                  file=sys.stderr)


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (default small)")
    p.add_argument("--model", help="a checkpoint folder (real weights) instead of random ones")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--precision", choices=["native", "fp8", "int4"], default="native", help="expert weights")
    p.add_argument("--linears", choices=LINEAR_FORMATS, default="native",
                   help="attention and dense-MLP projections")
    p.add_argument("--cuda-graphs", action="store_true", help="the server's CUDA graphs (serve --cuda-graphs)")
    p.add_argument("--fuse-commit", action=argparse.BooleanOptionalAction, default=None,
                   help="serve --fuse-commit (default: on a CUDA GPU)")
    p.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="serve --merge-projections (default: on)")
    p.add_argument("--attention-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="serve --attention-kernel (default: on a Hopper GPU)")
    p.add_argument("--sampler", choices=["exact", "fast"], default="exact", help="serve --sampler")
    p.add_argument("--moe-tiles", type=_tiles, metavar="SPEC", help="Triton expert kernels' tiles (as bench's)")
    p.add_argument("--mode", choices=["fixed", "adaptive"], default="fixed",
                   help="fixed steps (no early stop) or adaptive stopping")
    p.add_argument("--concurrency", type=_positive_int_list, default="1,2,4",
                   help="requests in flight, comma-separated levels (default 1,2,4)")
    p.add_argument("--requests", type=_positive_int, help="timed requests per level (default: 2 x concurrency)")
    p.add_argument("--warmup", type=_nonneg_int, default=1, help="untimed rounds of c requests per level")
    p.add_argument("--prompt-tokens", type=_positive_int, help="prompt length P (default per preset)")
    p.add_argument("--new-tokens", type=_positive_int, help="new tokens N (default per preset)")
    p.add_argument("--steps", type=_positive_int, default=16, help="denoising steps per canvas (max, if adaptive)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--next-turn", type=_positive_int, metavar="T",
                   help="also time a conversation's next turn: the P-token prompt, then it + T new tokens, from "
                        "submission to first commit, without and with the prefix cache")
    p.add_argument("--prefix-cache-gb", type=_float_in(0, strict=False), default=1.0, metavar="GB",
                   help="the worker's prefix cache (serve --prefix-cache-gb; default 1, 0: none)")
    p.add_argument("--out", help="also write the JSON line to this file")


def main(argv=None) -> int:
    from blockpress.errors import InputError

    p = argparse.ArgumentParser(prog="bench_serve", description=__doc__.splitlines()[0])
    add_parser(p)
    args = p.parse_args(argv)
    try:
        result = run(args)
    except InputError as e:
        print(f"bench_serve: error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    print_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
