"""Before/after token check for engine refactors: every way blockpress generates, on fixed seeds, dumped to JSON.

Run it on two checkouts and compare the files: a refactor that claims bit-identical tokens must give the same JSON
(the script prints the cases that differ when given `--against FILE`).

    python benchmarks/token_check.py --out /tmp/after.json --against benchmarks/results/2026-11-26-token-check-after.json

What it covers (CPU, fp32, 1 thread): tiny random models (the reference's draw order under torch's global RNG, one
private generator, per-row generators, row compaction on and off, the fused sampler, fused commits, fixed tokens,
left-padded batches, EOS with and without a pad id, multi-turn cache reuse, given decoder inputs and
self-conditioning logits, a sliding ring cache with chunked prefill, every draft of a stream, CUDA-graph plumbing
without capture), the server's scheduler (one request alone; a batch with joins, cancellations, drafts and mixed
settings; insert mode), and the shipped models (KJV text and infilling, Sudoku batches with candidates and repair;
structured output: schemas, a regex, a Lark grammar, JSON objects, strict tool calls, tools beside a schema).
Ends with one JSON line: the number of cases and, with --against, how many differ.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

import blockpress

C = 16
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, num_experts=8, top_k_experts=3, moe_intermediate_size=24,
            sliding_window=8, max_position_embeddings=4096, final_logit_softcapping=30.0)
ADAPTIVE = dict(stability_threshold=0, confidence_threshold=2.5)  # rows stop at different steps (std 0.3)
FIXED = dict(stability_threshold=None, confidence_threshold=None)


def tiny_model(seed=0, std=0.3):
    cfg = {"model_type": "diffusion_gemma", "text_config": {"model_type": "diffusion_gemma_text", **TINY},
           "canvas_length": C}
    return blockpress.from_config(cfg, seed=seed, init_std=std)


def prompts(n, lo=5, hi=30, seed=0):
    rnd = random.Random(seed)
    return [[rnd.randrange(5, 512) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def seq(result):
    return result.sequences.tolist()


def with_graphs(lm, fn):
    """fn() with the CUDA-graph plumbing on the CPU (no capture), through whichever API this checkout has."""
    if not hasattr(lm, "configure"):  # before the one-engine redesign
        from blockpress.kernels.graphs import GraphedPasses

        g = GraphedPasses(lm.module, capture=False, copy_outputs=False).install()
        try:
            return fn()
        finally:
            g.uninstall()
    lm.configure(cuda_graphs=True)
    try:
        return fn()
    finally:
        lm.configure(cuda_graphs=False)


def python_cases(out):
    lm = tiny_model()
    kw = dict(max_new_tokens=3 * C, max_denoising_steps=6, eos_token_id=None, pad_token_id=0)
    rows = prompts(3, seed=1)
    torch.manual_seed(5)
    out["global_rng_b1_fixed"] = seq(lm.generate([rows[0]], **kw, **FIXED))
    torch.manual_seed(5)
    out["global_rng_b3_adaptive"] = seq(lm.generate(rows, **kw, **ADAPTIVE))
    for sampler in ("exact", "fast"):
        for mode in ("one", "per_row"):
            for compact in (None, False, True):
                for fuse in (False, True):
                    g = torch.Generator().manual_seed(7) if mode == "one" else gens([7, 8, 9])
                    name = f"{sampler}_{mode}_compact{compact}_fuse{fuse}"
                    out[name] = seq(lm.generate(rows, generator=g, sampler=sampler, compact_rows=compact,
                                                fuse_commit=fuse, **kw, **ADAPTIVE))
    # EOS: common ids end rows at different canvases; with and without a pad id
    eos = dict(kw, max_new_tokens=4 * C, eos_token_id=list(range(17, 500, 40)))
    for pad in (0, None):
        for mode in ("one", "per_row"):
            g = torch.Generator().manual_seed(3) if mode == "one" else gens([3, 4, 5])
            out[f"eos_pad{pad}_{mode}"] = seq(lm.generate(rows, generator=g, **dict(eos, pad_token_id=pad),
                                                          **ADAPTIVE))
    # fixed tokens (infilling): held ids, free (-1) and free-but-discarded (-2)
    fixed = torch.tensor([[-1, 7, -1, 9] * 6, [5] * 3 + [-1] * 21, [-2] * 4 + [-1] * 20])
    for mode in ("one", "per_row"):
        g = torch.Generator().manual_seed(2) if mode == "one" else gens([2, 3, 4])
        out[f"fixed_tokens_{mode}"] = seq(lm.generate(rows, generator=g, fixed_tokens=fixed, **kw, **ADAPTIVE))
    # multi-turn: the returned cache, then only the new tokens
    g = torch.Generator().manual_seed(11)
    first = lm.generate([rows[0]], generator=g, **dict(kw, max_new_tokens=C), **FIXED)
    second = lm.generate([[5, 6, 7]], generator=g, cache=first.cache, **dict(kw, max_new_tokens=2 * C), **FIXED)
    out["multi_turn"] = [seq(first), seq(second)]
    # given decoder inputs and self-conditioning logits (what the reference's parity tests feed)
    g = torch.Generator().manual_seed(12)
    canvas = torch.randint(0, 512, (1, C), generator=torch.Generator().manual_seed(1))
    sc = torch.randn(1, C, 512, generator=torch.Generator().manual_seed(2))
    out["decoder_inputs_sc"] = seq(lm.generate([rows[1]], generator=g, decoder_input_ids=canvas,
                                               self_conditioning_logits=sc, **kw, **FIXED))
    # every draft of a stream
    drafts = []
    for ev in lm.stream(rows, generator=gens([1, 2, 3]), **kw, **ADAPTIVE):
        if isinstance(ev, blockpress.Draft):
            drafts.append([ev.canvas_index, ev.step, ev.tokens.tolist(), ev.accepted.tolist(), ev.done.tolist()])
        elif isinstance(ev, blockpress.Commit):
            drafts.append(["commit", ev.canvas_index, ev.tokens.tolist(), ev.finished.tolist(), ev.steps])
        else:
            drafts.append(["finished", seq(ev.result), ev.result.forward_passes.tolist(),
                           ev.result.steps_per_canvas])
    out["stream_events"] = drafts
    # a sliding ring cache: chunked prefill of a long prompt, several canvases
    lm.module.prefill_chunk = 8
    long = prompts(2, 40, 60, seed=4)
    out["ring_cache"] = seq(lm.generate(long, generator=gens([4, 5]), **dict(kw, max_new_tokens=4 * C), **FIXED))
    lm.module.prefill_chunk = 2048
    # CUDA-graph plumbing on the CPU (the fixed-shape passes, no capture)
    for mode in ("one", "per_row"):
        for fuse in (False, True):
            def run(mode=mode, fuse=fuse):
                g = torch.Generator().manual_seed(6) if mode == "one" else gens([6, 7, 8])
                return seq(lm.generate(rows, generator=g, fuse_commit=fuse, **kw, **ADAPTIVE))
            out[f"graphs_{mode}_fuse{fuse}"] = with_graphs(lm, run)


def server_cases(out):
    from blockpress.config import GenerationConfig

    lm = tiny_model(seed=3)
    try:
        from blockpress.server.scheduler import Job, RowCommit, RowDone, RowDraft, Scheduler
    except ImportError:  # after the one-engine redesign: the server's worker runs the engine's loop
        from blockpress.server.worker import Job, RowCommit, RowDone, RowDraft, Worker

        def Scheduler(module, C, **kw):  # noqa: N802
            return Worker(lm, **kw)

    def drive(s, plan):
        runs, k = [], 0
        step = getattr(s, "_canvas", None) or s.canvas
        busy = (lambda: s.busy) if hasattr(s, "busy") else (lambda: s.rows or s._waiting)
        while k <= max(plan) + 4 or busy():
            for job, cancel in plan.get(k, []):
                h = s.submit(job)
                if cancel is not None and cancel[0] == "step":
                    def put(e, h=h, put=h.put, n=cancel[1], seen=[0]):
                        put(e)
                        seen[0] += isinstance(e, RowDraft)
                        if seen[0] == n:
                            h.cancel()
                    h.put = put
                runs.append((h, cancel))
            for h, cancel in runs:
                if cancel == ("boundary", k):
                    h.cancel()
            with torch.no_grad():
                step()
            k += 1
        res = []
        for h, _ in runs:
            evs = h.drain()
            res.append([[e.canvas, e.step, e.tokens, e.accepted] if isinstance(e, RowDraft) else
                        [e.canvas, e.tokens, e.finished, e.steps] if isinstance(e, RowCommit) else
                        [e.prompt_tokens, e.steps_per_canvas, e.forward_passes] if isinstance(e, RowDone) else
                        [type(e).__name__] for e in evs])
        return res

    def plan_of(seed, fixed=False):
        rnd = random.Random(seed)
        plan = {}
        for i in range(6):
            kw = dict(max_denoising_steps=rnd.randint(2, 4), **FIXED) if rnd.random() < 0.5 else \
                dict(max_denoising_steps=rnd.randint(3, 6), stability_threshold=rnd.choice([0, 1]),
                     confidence_threshold=rnd.choice([2.0, 2.5, 3.0]))
            if rnd.random() < 0.5:
                kw.update(t_min=rnd.choice([0.2, 0.4]), t_max=rnd.choice([0.8, 1.0]))
            eos = rnd.choice([None, list(range(17, 500, 40))])
            cfg = GenerationConfig.resolve(max_new_tokens=C * rnd.randint(1, 4), eos_token_id=eos,
                                           pad_token_id=rnd.choice([0, None]) if eos else None,
                                           entropy_bound=rnd.choice([0.1, 1.0]), **kw)
            ft = None
            if fixed and rnd.random() < 0.5:
                ft = [rnd.choice([-1, -1, -2, rnd.randrange(5, 512)]) for _ in range(C * rnd.randint(1, 2))]
            job = Job([rnd.randrange(5, 512) for _ in range(rnd.randint(5, 30))], cfg, seed=100 * seed + i,
                      drafts=rnd.random() < 0.5, fixed_tokens=ft)
            cancel = rnd.choice([None, None, None, ("boundary", rnd.randint(1, 4)), ("step", rnd.randint(1, 6))])
            plan.setdefault(rnd.randint(0, 3), []).append((job, cancel))
        return plan

    for sampler in ("exact", "fast"):
        for fuse in (False, True):
            for compact in (True, False):
                for seed in (0, 1):
                    s = Scheduler(lm.module, C, max_batch=3, fuse_commit=fuse, compact_rows=compact, sampler=sampler)
                    out[f"server_{sampler}_fuse{fuse}_compact{compact}_{seed}"] = drive(s, plan_of(seed, fixed=True))
    for seed in (2, 3):
        out[f"server_graphs_{seed}"] = with_graphs(
            lm, lambda seed=seed: drive(Scheduler(lm.module, C, max_batch=3), plan_of(seed, fixed=True)))
    # a request served alone equals generate() with its seed
    cfg = GenerationConfig.resolve(max_new_tokens=2 * C, max_denoising_steps=5, eos_token_id=None, pad_token_id=0,
                                   **ADAPTIVE)
    out["server_alone"] = drive(Scheduler(lm.module, C, max_batch=1), {0: [(Job(prompts(1)[0], cfg, seed=9), None)]})


def shipped_cases(out):
    kjv = blockpress.load("kjv", device="cpu", progress=False)
    out["kjv_text"] = kjv.generate_text("And God said", seed=0, max_new_tokens=64)
    out["kjv_text_steps8"] = kjv.generate_text("In the beginning", seed=1, max_new_tokens=64, max_denoising_steps=8,
                                               stability_threshold=None, confidence_threshold=None)
    out["kjv_infill"] = kjv.infill("And God [MASK:3] the light, that it was good.", seed=0).text
    out["kjv_fast"] = kjv.generate_text("And the LORD spake", seed=2, max_new_tokens=64, sampler="fast")
    from blockpress.tasks import sudoku as sd

    puzzles = [p for p, _ in sd.test_set(50, 6)]
    out["sudoku_batch"] = sd.solve_batch(puzzles, generator=gens(range(len(puzzles))))
    out["sudoku_batch_one_gen"] = sd.solve_batch(puzzles, generator=torch.Generator().manual_seed(0))
    out["sudoku_samples_repair"] = sd.solve_batch(puzzles, samples=3, repair=2, generator=gens(range(len(puzzles))))
    structured_cases(out)


def structured_cases(out):
    """Structured output on the shipped models (the grammar engine's extra): a schema, a regex, a Lark grammar, JSON
    objects, strict and forced tool calls, tools beside a schema."""
    from blockpress.engine.constraint import structured_extra

    if not structured_extra():
        print("structured: llguidance is not installed; its cases are left out", file=sys.stderr)
        return
    kjv = blockpress.load("kjv", device="cpu", progress=False)
    chat = blockpress.load("assistant", device="cpu", progress=False)
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    time_tool = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    calc = {"type": "function", "function": {"name": "calculate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

    def reply(r):
        return [r.content, r.reasoning, [c.to_openai()["function"] for c in r.tool_calls], r.finish_reason]

    for s in range(3):
        out[f"kjv_schema_{s}"] = kjv.generate_text("And God said", seed=s, json_schema=person, max_new_tokens=48)
        out[f"kjv_regex_{s}"] = kjv.generate_text("And God said", seed=s, regex=r"[A-Z][a-z]+( [a-z]+){2,5}\.",
                                                  max_new_tokens=24)
        out[f"chat_schema_{s}"] = reply(chat.chat("Invent a person.", seed=s, json_schema=person, max_new_tokens=48))
        out[f"chat_json_object_{s}"] = reply(chat.chat("List two colours.", seed=s, json_object=True,
                                                       max_new_tokens=48))
        out[f"chat_tools_{s}"] = reply(chat.chat("What time is it in Oslo?", seed=s, tools=[time_tool, calc],
                                                 max_new_tokens=48))
        out[f"chat_tools_schema_{s}"] = reply(chat.chat("What time is it in Oslo?", seed=s, tools=[time_tool, calc],
                                                        json_schema={"type": "object", "properties": {
                                                            "hour": {"type": "integer"}}, "required": ["hour"]},
                                                        max_new_tokens=48))
    out["kjv_lark"] = kjv.generate_text("And God said", seed=0, max_new_tokens=16,
                                        grammar='start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]+/')


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--against", default=None, help="a JSON from another checkout: list the cases that differ")
    p.add_argument("--only", default=None, help="python | server | shipped")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, fn in (("python", python_cases), ("server", server_cases), ("shipped", shipped_cases)):
            if args.only in (None, name):
                fn(out)
                print(f"{name}: {len(out)} cases so far, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f)
    summary = {"cases": len(out), "seconds": round(time.perf_counter() - t0, 1)}
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = sorted(k for k in out if k in before and out[k] != before[k])
        missing = sorted(set(before) - set(out)) if args.only is None else []
        for k in differ:
            print(f"DIFFERS: {k}")
        for k in missing:
            print(f"MISSING: {k}")
        summary.update(differ=len(differ), missing=len(missing), compared=sum(k in before for k in out))
    print(json.dumps(summary))
    return 1 if summary.get("differ") or summary.get("missing") else 0


if __name__ == "__main__":
    sys.exit(main())
