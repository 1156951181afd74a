"""Peak GPU memory of one training step, accounted on the meta device (no GPU, no weights in memory).

Predicted, not measured. The model is built on the meta device (`--preset real-26b`: the 26B-A4B text stack) in the
precision asked for (quantised experts / 8-bit linears are the real `QuantizedExperts` / `QuantizedLinear` modules,
LoRA the real `train.lora.add_lora`), and one training step is *run* the way `Trainer.train_step` runs it, under
`lab.memory.LiveBytes` (every tensor allocated and freed as the code does):

    loss = objective.compute_loss(module, batch, cfg)   # encoder pass + AR loss, decoder pass 1 (no grad), pass 2
    opt.zero_grad(set_to_none=True); loss.backward()
    clip_grad_norm_(params, 1.0); opt.step()             # torch AdamW, the Trainer's two parameter groups

twice (the first step creates the AdamW state; the second is the steady state the table reports). What is traced
(real autograd on meta tensors): the attention, projections, LoRA hooks, norms, router, logits, both losses,
gradient checkpointing's recomputation, the quantised experts' `DequantMatmul` / the 8-bit linears' backward,
gradient accumulation, the clip and the AdamW step (`foreach=True`, what torch picks on CUDA; on the meta device
it would otherwise take the per-tensor loop). What is assumed rather than traced:

- routing: every expert gets the same number of assignments (A = tokens * top_k split evenly). The expert loop is
  the code's own (`QuantizedExperts._forward_torch`, the training path of quantised experts; for float experts the
  reference `moe.experts_loop`), only its host-side counts are made up (meta tensors have no values). What the
  backward keeps summed over experts does not depend on the routing; the per-expert transients do, a little;
- host syncs on meta tensors (`bool(valid.all())`, `float(loss)`, the stats' boolean masks) read as true / 1 / all
  positions (`_MetaScalars`), which is what a batch without padding gives;
- attention: `attention_sdpa_gqa` (what a GPU run selects) around a stand-in for the fused CUDA kernel
  (`lab.memory.attention_meta_training`): it keeps q, k, v, the mask, the output and the log-sum-exp rows for the
  backward, as the flash / memory-efficient kernels do, and no score matrix; `--attention math` traces torch's SDPA
  as the meta device dispatches it instead (its math fallback keeps the [S, L] probabilities of every layer);
- FSDP2 (`--procs N`, full SFT only, `blockpress train --fsdp`): the shards are computed, the rest traced.
  Parameters, gradients and AdamW state are sharded 1/N; during forward and backward one unit's parameters are
  gathered (the largest of: one decoder layer, the embedding) plus one unit's unsharded gradient before its
  reduce-scatter; activations are per rank, traced with the backward FSDP2 runs (`objective.TwoBackwards`: the
  decoder's, then the encoder's) and each gradient dropped once accumulated (as a reduce-scatter frees it). No
  prefetch of a second unit, no CPU offload. With one backward instead, autograd would hold every layer's
  decoder-pass gradient until the encoder's backward reached it (about one unsharded copy of all the gradients);
  `one_backward_peak_bytes` is that peak, for comparison.

Left out: the caching allocator's rounding and fragmentation, the CUDA context, NCCL buffers, the data loader.
Precision, as `blockpress train` holds the model on a GPU: a LoRA run's frozen base in bf16 (quantised where asked),
its adapters in fp32 (so their gradients and AdamW moments are fp32, traced); full fine-tuning in fp32 parameters,
gradients and AdamW moments (16 bytes a parameter; under FSDP2 computed, sharded 1/N, with the layers gathered
in bf16 and the gradients reduce-scattered in fp32). The trace runs the model in bf16, the compute dtype under
autocast. A single-process full fine-tuning trace (`--lora 0 --procs 1`) therefore reports bf16 weights and state,
half of what the trainer would hold. Note that `Trainer.train_step` calls `zero_grad` *after* the forward pass: the
previous step's gradients are alive during the next forward, which the trace includes.

    python benchmarks/train_memory.py --precision int4 --lora 16 --checkpointing
    python benchmarks/train_memory.py --precision native --lora 16 --checkpointing
    python benchmarks/train_memory.py --precision native --lora 0 --checkpointing --procs 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import torch

from blockpress.config import ModelConfig
from blockpress.lab.memory import LiveBytes
from blockpress.lab.presets import preset_config
from blockpress.model import moe
from blockpress.model.diffusion_gemma import DiffusionGemmaModel
from blockpress.train import objective as obj

GB = 1e9


class _MetaScalars(LiveBytes):
    """LiveBytes, where a host read of a meta tensor (`bool`, `float`, `.item()`) gives true / 1 instead of failing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _uniform_counts(A: int, E: int) -> torch.Tensor:
    c = torch.full((E,), A // E, dtype=torch.int64)
    c[: A % E] += 1
    return c


def _route_uniform(idx_NK: torch.Tensor, n_experts: int):
    """`route_by_expert` with host counts split evenly (meta tensors carry no routing)."""
    order = torch.argsort(idx_NK.reshape(-1), stable=True)
    return order, _uniform_counts(idx_NK.numel(), n_experts), None


def _experts_loop_uniform(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI):
    """`moe.experts_loop` with evenly split counts."""
    counts = _uniform_counts(idx_NK.numel(), gate_up_EFH.shape[0]).tolist()
    return moe.experts_loop(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, counts=counts)


def build(preset: str, precision: str, linears: str, lora_rank: int, dtype=torch.bfloat16, device="meta"):
    """The model as `blockpress train` would hold it: quantised experts / linears, adapters attached (base
    frozen) or every parameter trainable. -> (module, weight bytes without adapters)."""
    from blockpress.kernels.linear_q import quantize_linears_
    from blockpress.kernels.quant import QuantizedExperts

    config, _, _ = preset_config(preset) if isinstance(preset, str) else (preset, None, None)
    with torch.device(device):
        m = DiffusionGemmaModel(ModelConfig.from_dict(config)).to(dtype)
    m.materialize_buffers(device)
    if device != "meta":
        m.reset_parameters()
    if precision != "native":
        for layer in m.layers:
            E, F2, H = layer.experts.gate_up_proj.shape
            layer.experts = QuantizedExperts(E, H, F2 // 2, precision, 64, dtype=dtype, device=device)
            layer.experts.backend = "torch"
    if linears != "native":
        quantize_linears_(m, linears, backend="torch")
    weights = _bytes(m.parameters()) + _bytes(b for n, b in m.named_buffers() if not n.startswith("inv_freq"))
    if lora_rank:
        from blockpress.train.lora import LoraSpec, add_lora

        add_lora(m, LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank))  # fp32 adapters, as the trainer's
    return m, weights


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def meta_batch(B: int, P: int, C: int, canvases: int, V: int, device="meta") -> obj.TrainBatch:
    """A batch of B rows of a P-token prompt and a `canvases`-canvas response, the last canvas selected (the longest
    decoder context); no padding; the AR loss on the response (the default scope: from position P). Only shapes
    and dtypes matter on the meta device."""
    S, T = P + canvases * C, P + (canvases - 1) * C
    z = functools.partial(torch.zeros, device=device)
    valid = torch.ones(B, S, dtype=torch.bool, device=device)
    return obj.TrainBatch(z(B, S, dtype=torch.long), valid, valid.clone(), T, z(B, C, dtype=torch.long),
                          z(B, C, dtype=torch.long), z(B, C, dtype=torch.bool), z(B), z(B, dtype=torch.bool), ar_from=P)


def make_optimizer(m, foreach: bool | None = True):
    """The Trainer's AdamW (its parameter groups, lr, betas, eps)."""
    params = [p for p in m.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.99), eps=1e-8, foreach=foreach), params


@contextlib.contextmanager
def _meta_patches(m, attention: str = "fused"):
    """Uniform routing for the expert loops; nonzero() of meta masks as all-true; attention as the fused GPU kernel
    keeps it for backward ("fused") or as the meta device's SDPA dispatch traces it ("math")."""
    import dataclasses

    import torch.fx.experimental._config as fx_config

    from blockpress.kernels import quant
    from blockpress.kernels.attention import attention_sdpa_gqa
    from blockpress.lab.memory import attention_meta_training

    old_ops = m.ops
    m.ops = dataclasses.replace(m.ops, attention=attention_meta_training if attention == "fused" else attention_sdpa_gqa)
    old_route, old_nz = quant.route_by_expert, fx_config.meta_nonzero_assume_all_nonzero
    quant.route_by_expert = _route_uniform
    fx_config.meta_nonzero_assume_all_nonzero = True
    olds = []
    for layer in m.layers:
        if isinstance(layer.experts, moe.Experts):
            olds.append((layer.experts, layer.experts.kernel))
            layer.experts.kernel = _experts_loop_uniform
    try:
        yield
    finally:
        quant.route_by_expert = old_route
        fx_config.meta_nonzero_assume_all_nonzero = old_nz
        for ex, k in olds:
            ex.kernel = k
        m.ops = old_ops


def trace_step(m, batch, checkpointing: bool, steps: int = 2, drop_grads: bool = False, split: bool = False,
               attention: str = "fused") -> dict:
    """Run `steps` training steps as Trainer.train_step does under LiveBytes; report the last one's phases (bytes on
    top of the weights and adapters). drop_grads (the FSDP2 estimate): each gradient is dropped as soon as it is
    accumulated (as a reduce-scatter frees the unsharded gradient; the sharded ones are added by `fsdp`), so the
    backward peak is activations and transients only; one step, no optimizer step. split: the backward as FSDP2
    runs it (`objective.TwoBackwards`), not loss.backward()."""
    m.train()
    m.gradient_checkpointing = checkpointing
    cfg = obj.ObjectiveConfig()
    phases = {}
    kept: dict[str, int] = {}

    def timed(name, fn):  # bytes still alive after `fn` returns, less before: what that part of the forward keeps
        def run(*a, **k):
            before = lb.live
            out = fn(*a, **k)
            kept[name] = kept.get(name, 0) + lb.live - before
            return out
        return run

    with _meta_patches(m, attention), _MetaScalars() as lb, torch.enable_grad():
        opt, params = make_optimizer(m)
        if drop_grads:
            steps = 1
            for p_ in params:
                p_.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
        for _ in range(steps):
            start = lb.live
            lb.peak = lb.live
            kept.clear()
            names = {"encoder_pass": "encoder pass (layers, K/V cache)", "ar_loss": "AR loss (its logits)",
                     "decoder_inputs": "decoder pass 1 (no grad; its SC logits)", "diffusion_loss": "diffusion loss"}
            saved_fns = {n: getattr(obj, n) for n in names}
            m.decode = timed("decode", m.decode)  # pass 1 (inside decoder_inputs) + pass 2
            for n, f in saved_fns.items():
                setattr(obj, n, timed(names[n], f))
            try:
                loss, _stats, *two = obj.compute_loss(m, batch, cfg, split=split)
            finally:
                for n, f in saved_fns.items():
                    setattr(obj, n, f)
                del m.decode
            # what decode kept, less pass 1's share (decoder_inputs calls it under no_grad): pass 2's layers + logits
            kept["decoder pass 2 (layers, logits)"] = kept.pop("decode") - max(0, kept[names["decoder_inputs"]])
            fwd_peak, saved = lb.peak, lb.live
            opt.zero_grad(set_to_none=True)
            after_zero = lb.live
            lb.peak = lb.live
            if split:
                two[0].decoder()
                two[0].encoder()
            else:
                loss.backward()
            del loss, two
            bwd_peak, after_bwd = lb.peak, lb.live
            lb.peak = lb.live
            if not drop_grads:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            opt_peak, end = lb.live, lb.live
            opt_peak = lb.peak
            phases = {"start": start, "forward_peak": fwd_peak, "saved_after_forward": saved - start,
                      "after_zero_grad": after_zero, "backward_peak": bwd_peak, "after_backward": after_bwd,
                      "optimizer_peak": opt_peak, "end": end}
        grads = _bytes(p.grad for p in params if p.grad is not None)
        state = _bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
        top = lb.top(5)
    phases.update(grads=grads, optimizer_state=state, trainable=_bytes(params),
                  peak=max(phases["forward_peak"], phases["backward_peak"], phases["optimizer_peak"]),
                  largest=top, kept=dict(kept))
    return phases


def fsdp(m, trace: dict, weights: int, N: int, one_backward: dict | None = None) -> dict:
    """Per-rank bytes of full SFT under FSDP2 (the shards computed, the step traced; see the module docstring).
    one_backward: the trace with loss.backward() instead of the two backwards FSDP2 runs (for comparison)."""
    unit = max([_bytes(layer.parameters()) for layer in m.layers] + [_bytes(m.embed_tokens.parameters())])  # bf16
    params = trace["trainable"] // 2  # the trace's parameters are bf16
    sharded = 16 * params / N  # fp32 params + grads + two AdamW moments
    gathered = 4 * unit  # one unit gathered in bf16, its unsharded bf16 gradient and that gradient's fp32 copy
    # traced with every gradient dropped once accumulated (trace_step(drop_grads=True)): activations and transients
    act = max(trace["forward_peak"], trace["backward_peak"]) - trace["start"]
    optimizer_transient = 4 * params / N  # foreach AdamW: one fp32 sqrt(exp_avg_sq) copy of the (sharded) state
    # in one backward autograd would hold the decoder pass's weight gradients in its input buffers until the
    # encoder's backward reached the same (shared) layer: about one unsharded copy of the gradients
    out = {"procs": N, "unit_bytes": unit, "sharded_bytes": sharded, "gathered_bytes": gathered,
           "activation_bytes": act, "optimizer_transient_bytes": optimizer_transient,
           "peak": sharded + gathered + max(act, optimizer_transient)}
    if one_backward is not None:
        act_one = max(one_backward["forward_peak"], one_backward["backward_peak"]) - one_backward["start"]
        out["one_backward_peak_bytes"] = sharded + gathered + max(act_one, optimizer_transient)
    return out


def setup_arguments(p: argparse.ArgumentParser) -> None:
    """The training setup's flags (model, precision, adapters, workload), shared with benchmarks/train_step.py."""
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--precision", default="int4", choices=["native", "fp8", "int4"])
    p.add_argument("--linears", default="native", choices=["native", "int8", "fp8"])
    p.add_argument("--lora", type=int, default=16, metavar="RANK", help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="examples per process")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)


def check_setup(p: argparse.ArgumentParser, args) -> None:
    if args.lora == 0 and (args.precision != "native" or args.linears != "native"):
        p.error("full fine-tuning of quantised weights is not supported (blockpress train refuses it): add --lora")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    setup_arguments(p)
    p.add_argument("--canvas", type=int, default=None, help="canvas length (default: the preset's, 256 on the 26B)")
    p.add_argument("--canvases", type=int, default=1, help="response canvases (the last one is denoised)")
    p.add_argument("--procs", type=int, default=1, help="full SFT under FSDP2 over this many processes (computed)")
    p.add_argument("--budget-gb", type=float, default=None, help="the target to compare with (per process)")
    p.add_argument("--attention", default="fused", choices=["fused", "math"],
                   help="fused: what the GPU's flash / memory-efficient kernel keeps for backward (default); math: "
                        "torch's SDPA as the meta device traces it (keeps every layer's [S, L] probabilities)")
    args = p.parse_args(argv)
    if args.procs > 1 and args.lora:
        p.error("--procs models full SFT under FSDP2: use it with --lora 0")
    check_setup(p, args)
    return report(**{k: v for k, v in vars(args).items()})


def predict(preset="real-26b", precision="int4", linears="native", lora=16, canvas=None, prompt_tokens=1024,
            canvases=1, batch=1, checkpointing=True, procs=1, steps=2, attention="fused") -> dict:
    """steps: training steps traced (the last is reported; 1 leaves out the previous step's gradients alive during
    the forward, for quick checks)."""
    m, weights = build(preset, precision, linears, lora)
    if canvas:
        m.config.canvas_length = canvas
    C = canvas or m.config.canvas_length
    b = meta_batch(batch, prompt_tokens, C, canvases, m.text.vocab_size)
    tr = trace_step(m, b, checkpointing, steps=steps, drop_grads=procs > 1, split=procs > 1, attention=attention)
    if procs > 1:  # no optimizer step was traced: the full model's fp32 gradient and AdamW bytes, computed
        tr.update(grads=2 * tr["trainable"], optimizer_state=4 * tr["trainable"])
    lora_params = _bytes(p for n, p in m.named_parameters() if ".lora_" in n)
    total = weights + lora_params + tr["peak"]
    out = {"bench": "train_memory", "preset": preset, "precision": precision, "linears": linears, "lora_rank": lora,
           "canvas": C, "prompt_tokens": prompt_tokens, "canvases": canvases, "batch": batch,
           "checkpointing": checkpointing, "procs": procs, "attention": attention, "weights_bytes": weights, "lora_param_bytes": lora_params,
           "trainable_bytes": tr["trainable"], "grad_bytes": tr["grads"], "optimizer_state_bytes": tr["optimizer_state"],
           "saved_activation_bytes": tr["saved_after_forward"], "phases": {k: v for k, v in tr.items()
                                                                           if k != "largest"},
           "largest": tr["largest"], "predicted_peak_bytes": total}
    if procs > 1:
        one = trace_step(m, b, checkpointing, steps=steps, drop_grads=True, attention=attention)
        out["fsdp"] = fsdp(m, tr, weights, procs, one)
        out["predicted_peak_bytes"] = out["fsdp"]["peak"]
    return out


def report(budget_gb=None, **kw) -> dict:
    r = predict(**kw)
    g = lambda b: f"{b / GB:9.3f}"  # noqa: E731
    ph = r["phases"]
    print(f"{r['preset']}, experts {r['precision']}, linears {r['linears']}, LoRA rank {r['lora_rank']} "
          f"({'full fine-tuning' if not r['lora_rank'] else 'adapters, base frozen'}), batch {r['batch']}, prompt "
          f"{r['prompt_tokens']}, canvas {r['canvas']} x {r['canvases']}, checkpointing "
          f"{'on' if r['checkpointing'] else 'off'}; predicted on the meta device, not measured")
    print(f"  {'component':58s} {'GB':>9s}")
    rows = [("weights (frozen base or full model, bf16 / quantised)", r["weights_bytes"]),
            ("LoRA parameters (fp32)", r["lora_param_bytes"]),
            ("gradients (the trained parameters' dtype)", r["grad_bytes"]),
            ("AdamW state (exp_avg + exp_avg_sq, the trained parameters' dtype)", r["optimizer_state_bytes"]),
            ("activations saved for backward (live after the forward)", r["saved_activation_bytes"]),
            ("forward peak on top of weights (incl. previous step's grads)", ph["forward_peak"]),
            ("backward peak on top of weights", ph["backward_peak"]),
            ("clip + AdamW step peak on top of weights", ph["optimizer_peak"])]
    for name, b in rows:
        print(f"  {name:58s} {g(b)}")
    for name, b in ph["kept"].items():
        print(f"    kept after the forward by {name:34s} {g(b)}")
    big = ", ".join(f"{b / 1e6:.0f} MB {op}" for b, op in r["largest"])
    print(f"  largest single allocations: {big}")
    if "fsdp" in r:
        f = r["fsdp"]
        print(f"  FSDP2 over {f['procs']} processes (computed: fp32 state sharded 1/N, one unit gathered in bf16):")
        for name, key in (("sharded fp32 params + grads + AdamW state", "sharded_bytes"),
                          ("gathered unit + its bf16 and fp32 gradient", "gathered_bytes"),
                          ("activations and transients (per rank; the decoder's backward, then the encoder's)",
                           "activation_bytes")):
            print(f"    {name:56s} {g(f[key])}")
        print(f"    peak with one backward instead of two (every layer's decoder gradient held unsharded) "
              f"{f['one_backward_peak_bytes'] / GB:.2f} GB")
    print(f"  predicted peak per process: {r['predicted_peak_bytes'] / GB:.2f} GB"
          + (f" (budget {budget_gb:.1f} GB: {'fits' if r['predicted_peak_bytes'] <= budget_gb * GB else 'does NOT fit'})"
             if budget_gb else ""))
    r["budget_bytes"] = budget_gb * GB if budget_gb else None
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
