"""Training steps timed and their peak memory measured, beside the meta-device prediction of train_memory.py.

    python benchmarks/train_step.py --precision int4 --linears int8 --lora 16          # the 26B, one GPU (QLoRA)
    python benchmarks/train_step.py --precision native --lora 16                        # LoRA over bf16 (80 GB)
    python benchmarks/train_step.py --preset tiny --device cpu --lora 4 --steps 2       # any machine

The preset's model is built with seeded random weights directly on the device (`lab.random_weights.build_model`:
quantised experts are made quantised, never as a float copy); `--linears` quantises the projections as
`blockpress run --linears` does; `--lora R` attaches fp32 adapters over the frozen base, as `blockpress train` does
(`--lora 0`: every weight trains, in fp32). The model is held in the dtype `blockpress train` holds it in (its
`base_dtype`), and gradient checkpointing is on (the default for QLoRA; `--no-checkpointing` turns it off).
Then `Trainer.train_step` runs on batches of random rows: a `--prompt-tokens` prompt and a response that fills
one canvas. Printed: seconds and tokens/s per step, the peak memory the device allocated (CUDA:
`torch.cuda.max_memory_allocated()`, weights included; elsewhere not measured), train_memory.py's prediction for
the same setup (`--no-predict` skips it: it traces the step on the meta device, minutes for the 26B), and a JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch

GB = 1e9


def _train_memory():
    spec = importlib.util.spec_from_file_location("train_memory", Path(__file__).with_name("train_memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(preset: str, precision: str, linears: str, lora: int, device: str, seed: int = 0):
    """-> (BlockDiffusionLM, LoraSpec or None): the model as `blockpress train` would hold it."""
    from blockpress.cli.train import base_dtype
    from blockpress.kernels import use
    from blockpress.kernels.linear_q import quantize_linears_
    from blockpress.lab.presets import preset_config
    from blockpress.lab.random_weights import build_model
    from blockpress.lm import BlockDiffusionLM
    from blockpress.config import ModelConfig

    config, _, _ = preset_config(preset)
    dtype = getattr(torch, base_dtype(Namespace(device=device), lora > 0))
    module = build_model(config, device, dtype, precision, seed=seed)
    if linears != "native":
        quantize_linears_(module, linears, backend="torch")
    lm = BlockDiffusionLM(module, ModelConfig.from_dict(config), {})
    use(lm.module, experts="dense")  # what `blockpress train` runs autograd through (quantised experts: torch)
    spec = None
    if lora:
        from blockpress.train.lora import LoraSpec, add_lora

        spec = LoraSpec(rank=lora, alpha=2.0 * lora)
        add_lora(lm.module, spec, seed=seed)
    else:
        for p in lm.module.parameters():
            p.requires_grad_(True)
    return lm, spec


def run(preset="real-26b", precision="int4", linears="native", lora=16, prompt_tokens=1024, batch=1, steps=3,
        checkpointing=True, device=None, predict=True) -> dict:
    from blockpress.train.data import ListSource
    from blockpress.train.trainer import TrainConfig, Trainer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm, spec = build(preset, precision, linears, lora, device)
    C, V = lm.canvas_length, lm.config.text.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(5, V, (prompt_tokens,), generator=g).tolist(),
             torch.randint(5, V, (C - 1,), generator=g).tolist()) for _ in range(max(4, batch))]  # + EOS: one canvas
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(out_dir=out, steps=steps, batch_size=batch, eval_every=0, save_every=0, progress=False,
                          grad_checkpointing=checkpointing)
        tr = Trainer(lm, ListSource(rows, batch_size=batch), cfg, lora=spec)
        cuda = lm.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        stats = []
        for _ in range(steps):
            t0 = time.perf_counter()
            s = tr.train_step()
            if cuda:
                torch.cuda.synchronize()
            s["seconds"] = time.perf_counter() - t0
            stats.append(s)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    out = {"bench": "train_step", "preset": preset, "precision": precision, "linears": linears, "lora_rank": lora,
           "prompt_tokens": prompt_tokens, "canvas": C, "batch": batch, "checkpointing": checkpointing,
           "device": str(lm.device), "steps": [{k: s[k] for k in ("loss", "seconds", "tokens_per_s")} for s in stats],
           "measured_peak_bytes": peak, "predicted_peak_bytes": None}
    if predict:
        p = _train_memory().predict(preset=preset, precision=precision, linears=linears, lora=lora,
                                    prompt_tokens=prompt_tokens, batch=batch, checkpointing=checkpointing)
        out["predicted_peak_bytes"] = p["predicted_peak_bytes"]
    return out


def main(argv=None) -> dict:
    tm = _train_memory()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tm.setup_arguments(p)  # the same setup flags as the prediction's
    p.add_argument("--steps", type=int, default=3, help="steps timed (the first includes AdamW's state)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--predict", action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args(argv)
    tm.check_setup(p, a)
    r = run(a.preset, a.precision, a.linears, a.lora, a.prompt_tokens, a.batch, a.steps, a.checkpointing, a.device,
            a.predict)
    print(f"{r['preset']}, experts {r['precision']}, linears {r['linears']}, LoRA rank {r['lora_rank']}, batch "
          f"{r['batch']}, prompt {r['prompt_tokens']} + canvas {r['canvas']}, on {r['device']}")
    for i, s in enumerate(r["steps"]):
        print(f"  step {i + 1}: loss {s['loss']:.4f}  {s['seconds']:.3f} s  {s['tokens_per_s']:.0f} tok/s")
    fmt = lambda b: "not measured" if b is None else f"{b / GB:.2f} GB"  # noqa: E731
    print(f"  peak memory: measured {fmt(r['measured_peak_bytes'])}, predicted {fmt(r['predicted_peak_bytes'])}")
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
