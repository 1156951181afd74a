"""Quality guard for low-precision weights: fp8 / int4 experts, int8 linears (and bf16 for scale) vs fp32.

For each format the same model is copied, its experts quantised (fp8, int4; fp8-a8: fp8 weights and fp8
activations, experts="w8a8"), or its attention and
dense-MLP projections (int8-linears), or its dense MLP alone in int4 (int4-mlp), or one of each
(int4+int8-linears, int4+int4-mlp); embeddings, router and
self-conditioning stay fp32. Each is compared with the fp32 model on
  (a) the experts alone: relative error ||y_q - y|| / ||y|| of every layer's MoE output on the
      reference pass's own inputs and routing (the local quantisation error, nothing amplified);
  (b) one decoder step over the same cache and canvas: mean / max KL(p_fp32 || p_q) per position,
      top-1 (argmax) agreement;
  (c) a whole seeded generation (fixed steps, exact sampler): fraction of new tokens equal to the
      fp32 run's. Sampling amplifies any difference (one flipped draw changes the trajectory).
"bf16" (the whole model in bf16, the shipped precision) is the yardstick: on random weights the
router's near-uniform top-k flips under any rounding, so (b) and (c) measure routing chaos as much
as the format; hence the KL gate is relative to bf16's KL (`--kl-vs-bf16 fp8=..,int4=..`), except that
a mean KL under `--kl-floor` (default 1e-3 nats) always passes: on a trained model bf16's KL can be
~1e-5, and 10x that is still imperceptible. The expert- and linear-error gates are absolute (`--max-err`). A trained model (`--model blockpress/assets/sudoku`,
any checkpoint folder) gives the numbers that matter. Prints a table, ends with one JSON line,
exits 1 if a format fails a gate.

    python benchmarks/quality_guard.py --preset tiny
    python benchmarks/quality_guard.py --model blockpress/assets/sudoku --prompt-tokens 96
    python benchmarks/quality_guard.py --model google/diffusiongemma-26B-A4B-it --device cuda --ref-dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys

import torch

from blockpress.cli.run import _group_size
from blockpress.lab.presets import preset_config
from blockpress.cli.run import _positive_int
from blockpress.config import GenerationConfig
from blockpress.engine.generate import generate
from blockpress.kernels.linear_q import QUANTIZED_LINEARS, QuantizedEmbedding, QuantizedLinear
from blockpress.kernels.quant import W8A8_FORMAT, QuantizedExperts, QuantizedMLP, compare_logits, expert_format
from blockpress.lab.random_weights import build_model

# attention and dense-MLP projections in 8 bits (kernels/linear_q.py): weight-only int8 / fp8, or fp8 weights and
# fp8 activations ("-a8": the scaled_mm backend, w8a8, which runs on a CPU too)
LINEAR_PARTS = {"int8-linears": ("int8", "torch"), "fp8-linears": ("fp8", "torch"),
                "fp8-linears-a8": ("fp8", "w8a8"), "int4-mlp": None}  # int4-mlp: the dense MLP alone, in int4
MLP4 = "int4-mlp"  # (kernels/quant.py QuantizedMLP: one int4 expert every token takes)
A8 = W8A8_FORMAT  # fp8 experts with fp8 activations (experts="w8a8"; on a CPU its torch reference, experts_w8a8_torch)
EXPERT_FORMATS = ("fp8", "int4", A8)
LINEARS = "int8-linears"
# relative error of the experts' output (of each projection's output, for the linears)
ERR_BUDGET = {"bf16": 0.01, "fp8": 0.08, "int4": 0.25, A8: 0.10, "int8-linears": 0.02, "fp8-linears": 0.08,
              "fp8-linears-a8": 0.10, MLP4: 0.25}
# mean KL may be at most this multiple of bf16's (combined formats: the experts format's budget). fp8-linears was
# 4.0 while the bf16 yardstick also rounded the rotary frequencies to bf16 (load keeps them fp32): a yardstick ~1.3x
# too wide on the tiny preset (benchmarks/results/2026-11-28-cpu-rope-dtype.md)
EMB = "int8-embeddings"  # the embedding table (also the LM head) in int8 with a scale per token
KL_VS_BF16 = {"fp8": 2.0, "int4": 8.0, A8: 4.0,
              "int8-linears": 2.0, "fp8-linears": 5.0, "fp8-linears-a8": 8.0, MLP4: 8.0,
              EMB: 2.0}


def load_model(args):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.ref_dtype]
    if args.model:
        from blockpress import load

        return load(args.model, device=args.device, dtype=dtype, progress=False, tokenizer=False).module
    config, _, _ = preset_config(args.preset)
    return build_model(config, torch.device(args.device), dtype, seed=args.seed, std=args.init_std)


def _parts(fmt: str) -> tuple[str | None, str | None]:
    """'int4+int8-linears' -> ('int4', 'int8-linears'); 'fp8-linears' -> (None, 'fp8-linears'); 'fp8' -> ('fp8', None)."""
    parts = [x for x in fmt.split("+") if x != EMB] if fmt != EMB else []
    experts = [x for x in parts if x in EXPERT_FORMATS]
    linears = [x for x in parts if x in LINEAR_PARTS]
    if len(experts) + len(linears) != len(parts) or len(experts) > 1 or len(linears) > 1:
        raise SystemExit(f"unknown format {fmt!r}: use bf16, an experts format ({', '.join(EXPERT_FORMATS)}), "
                         f"a linears format "
                         f"({', '.join(LINEAR_PARTS)}), {EMB}, or one of each joined by + (e.g. int4+{LINEARS})")
    return (experts or [None])[0], (linears or [None])[0]


def _budget(table: dict, fmt: str):
    """A format's budget: its own, else the experts part's (combined formats)."""
    if fmt in table or fmt == "bf16":
        return table.get(fmt)
    experts, linears = _parts(fmt)
    return table.get(experts) if experts else table.get(linears) if linears else table.get(EMB)


@contextlib.contextmanager
def variant(ref, fmt: str, group_size: int):
    """The reference with `fmt` weights. fp8/int4 experts and 8-bit linears: swapped in place (and restored),
    so a 26B reference needs one extra copy of what is quantised only; bf16: a bf16 copy of the whole model."""
    if fmt == "bf16":  # the whole model in bf16: the yardstick fp8/int4 errors are read against
        yield copy.deepcopy(ref).to(torch.bfloat16)
        return
    experts, linears = _parts(fmt)
    table = ref.embed_tokens
    saved = [layer.experts for layer in ref.layers]
    saved_mlp = [layer.mlp for layer in ref.layers]
    saved_lin = [(getattr(layer, part), name, getattr(getattr(layer, part), name, None))
                 for layer in ref.layers for part, names in QUANTIZED_LINEARS.items() for name in names]
    try:
        for layer, old in zip(ref.layers, saved) if experts else ():
            E, two_im, H = old.gate_up_proj.shape
            weights, a8 = expert_format(experts)
            q = QuantizedExperts(E, H, two_im // 2, weights, group_size, dtype=old.gate_up_proj.dtype,
                                 device=old.gate_up_proj.device)
            layer.experts = q.load_float_(old.gate_up_proj, old.down_proj)
            q.backend = "w8a8" if a8 else q.backend
        for layer, old in zip(ref.layers, saved_mlp) if linears == MLP4 else ():
            layer.mlp = QuantizedMLP.from_mlp(old, group_size)
            layer.mlp.experts.backend = "torch"
        for parent, name, lin in saved_lin if linears and linears != MLP4 else ():
            if lin is not None:  # full-attention layers have no v_proj
                setattr(parent, name, QuantizedLinear.from_linear(lin, *LINEAR_PARTS[linears]))
        if EMB in fmt.split("+"):
            ref.embed_tokens = QuantizedEmbedding.from_embedding(table)
            ref.embed_tokens.backend = "torch"
        yield ref
    finally:
        ref.embed_tokens = table
        for layer, old, mlp in zip(ref.layers, saved, saved_mlp):
            layer.experts, layer.mlp = old, mlp
        for parent, name, lin in saved_lin:
            if lin is not None:
                setattr(parent, name, lin)


def projection_names(module) -> list[str]:
    """The attention and dense-MLP projections the linears formats quantise (full layers have no v_proj)."""
    return [f"layers.{i}.{part}.{name}" for i, layer in enumerate(module.layers)
            for part, names in QUANTIZED_LINEARS.items() for name in names
            if getattr(getattr(layer, part), name, None) is not None]


@torch.no_grad()
def capture_first_calls(module, ids, canvas, names: list[str]) -> dict:
    """name -> (inputs, output) of each named submodule's first call in `one_step_logits` (the prompt's
    encoder pass): the inputs a quantised twin is then measured on."""
    seen = {}
    hooks = [module.get_submodule(n).register_forward_hook(
        lambda mod, inp, out, n=n: None if n in seen else seen.update({n: (inp, out)})) for n in names]
    try:
        one_step_logits(module, ids, canvas)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def rel_error(module, captured: dict) -> float:
    """Mean over the captured submodules of ||twin(inputs) - y_ref|| / ||y_ref|| (0 where nothing is quantised):
    the local quantisation error, nothing amplified."""
    errs = []
    for n, (inp, y) in captured.items():
        x, *rest = inp
        yq = module.get_submodule(n)(x.to(module.dtype), *rest).float()
        errs.append(float((yq - y.float()).norm() / y.float().norm()))
    return sum(errs) / len(errs)


@torch.no_grad()
def one_step_logits(module, ids, canvas):
    cache = module.new_cache(ids.shape[0], ids.shape[1])
    module.encode(ids, cache)
    return module.decode(canvas, cache).float()


@torch.no_grad()
def generation_tokens(module, ids, args):
    cfg = GenerationConfig.resolve(max_new_tokens=args.new_tokens, max_denoising_steps=args.steps,
                                   stability_threshold=None, confidence_threshold=None)
    torch.manual_seed(args.seed)
    return generate(module, ids, cfg, module.config.canvas_length).sequences[:, ids.shape[1]:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--model", help="checkpoint folder of a trained model (e.g. blockpress/assets/sudoku)")
    p.add_argument("--formats", default=f"bf16,fp8,int4,{','.join(LINEAR_PARTS)},fp8+{LINEARS},int4+{LINEARS},"
                                        f"int4+{MLP4},{EMB},int4+{EMB},{A8}")
    p.add_argument("--group-size", type=_group_size, default=64)
    p.add_argument("--init-std", type=float, default=0.05, help="random weights: larger = peakier logits")
    p.add_argument("--prompt-tokens", type=_positive_int, default=32)
    p.add_argument("--new-tokens", type=_positive_int, help="default: two canvases")
    p.add_argument("--steps", type=_positive_int, default=8)
    p.add_argument("--batch", type=_positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-err", default="", help="expert error budgets, e.g. fp8=0.08,int4=0.25")
    p.add_argument("--kl-vs-bf16", default="", help="KL budgets relative to bf16, e.g. fp8=2,int4=8")
    p.add_argument("--kl-floor", type=float, default=1e-3,
                   help="a mean KL (nats) at or under this passes whatever bf16's is")
    p.add_argument("--threads", type=_positive_int, default=1)
    p.add_argument("--device", default="cpu", help="cuda for the released checkpoint (reference in bf16)")
    p.add_argument("--ref-dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:  # a typo is named before the model loads
        if f != "bf16":
            _parts(f)
    ref = load_model(args)
    V, C = ref.text.vocab_size, ref.config.canvas_length
    args.new_tokens = args.new_tokens or 2 * C
    err_budget = dict(ERR_BUDGET, **_pairs(args.max_err))
    kl_budget = dict(KL_VS_BF16, **_pairs(args.kl_vs_bf16))
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(5, V, (args.batch, args.prompt_tokens), generator=g).to(args.device)
    canvas = torch.randint(0, V, (args.batch, C), generator=g).to(args.device)
    ref_logits, ref_tokens = one_step_logits(ref, ids, canvas), generation_tokens(ref, ids, args)
    captured = capture_first_calls(ref, ids, canvas, [f"layers.{i}.experts" for i in range(len(ref.layers))])
    captured_linears = capture_first_calls(ref, ids, canvas, projection_names(ref))
    captured_mlps = capture_first_calls(ref, ids, canvas, [f"layers.{i}.mlp" for i in range(len(ref.layers))])
    if "bf16" in formats:  # the yardstick first
        formats = ["bf16"] + [f for f in formats if f != "bf16"]
    rows, bf16_kl = [], None
    for fmt in formats:
        if fmt == "bf16" and ref.dtype == torch.bfloat16:
            continue  # the reference itself
        with variant(ref, fmt, args.group_size) as m:
            mlp4 = fmt != "bf16" and _parts(fmt)[1] == MLP4  # its error: each whole MLP's output
            r = {"format": fmt, "experts_rel_err": rel_error(m, captured),
                 "linears_rel_err": rel_error(m, captured_mlps if mlp4 else captured_linears),
                 **compare_logits(ref_logits, one_step_logits(m, ids, canvas))}
            r["token_agreement_generate"] = float((generation_tokens(m, ids, args) == ref_tokens).float().mean())
        bf16_kl = r["mean_kl"] if fmt == "bf16" else bf16_kl
        r["kl_vs_bf16"] = r["mean_kl"] / bf16_kl if bf16_kl else None
        experts_fmt, linears_fmt = (fmt, None) if fmt == "bf16" else _parts(fmt)
        kl_max = _budget(kl_budget, fmt)
        r["pass"] = (r["experts_rel_err"] <= err_budget.get(experts_fmt, float("inf"))
                     and r["linears_rel_err"] <= err_budget.get(linears_fmt, float("inf"))
                     and (r["kl_vs_bf16"] is None or kl_max is None or r["kl_vs_bf16"] <= kl_max
                          or r["mean_kl"] <= args.kl_floor))
        rows.append(r)
    print(f"quality guard: {'model ' + args.model if args.model else 'random ' + args.preset} "
          f"(std {args.init_std}), {args.ref_dtype} reference on {args.device}, "
          f"B={args.batch} P={args.prompt_tokens} C={C}")
    print(f"{'format':>17} {'experts err':>12} {'linears err':>12} {'mean KL':>10} {'x bf16':>7} {'max KL':>10} {'top-1':>7} "
          f"{'gen tokens =':>13} {'pass':>5}")
    for r in rows:
        vs = f"{r['kl_vs_bf16']:7.2f}" if r["kl_vs_bf16"] is not None else f"{'-':>7}"
        print(f"{r['format']:>17} {r['experts_rel_err']:12.2%} {r['linears_rel_err']:12.2%} {r['mean_kl']:10.2e} {vs} {r['max_kl']:10.2e} "
              f"{r['top1_agreement']:7.1%} {r['token_agreement_generate']:13.1%} {str(r['pass']):>5}")
    print(json.dumps({"bench": "quality_guard", "model": args.model, "preset": None if args.model else args.preset,
                      "init_std": None if args.model else args.init_std, "group_size": args.group_size,
                      "results": rows}))
    return 0 if all(r["pass"] for r in rows) else 1


def _pairs(text: str) -> dict:
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


if __name__ == "__main__":
    sys.exit(main())
