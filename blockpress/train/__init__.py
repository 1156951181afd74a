"""Training and fine-tuning with the DiffusionGemma objective.

- `objective`: uniform-state corruption, batch layout (one sampled canvas per example, cropped
  encoder cache so the decoder never sees its clean canvas), diffusion + encoder AR loss, self-conditioning.
- `data`: chat JSONL (model chat template, final assistant turn supervised), plain text, sudoku generator.
- `trainer`: AdamW + warmup/cosine, clipping, eval, atomic HF-layout checkpoints (the optimizer state by parameter
  name, re-split on resume), exact `--resume`.
- `lora`: LoRA adapters in PEFT's format; `apply_adapter(model, dir, merge=False)` for inference.
- `distributed`: torchrun, DDP or FSDP2 (`--fsdp`: parameters, gradients and optimizer state sharded; the
  backward in two parts, `objective.TwoBackwards`); gloo on CPU. `ar`: the autoregressive baseline (greedy decoding).
- `sizes`: named small configs for training from scratch.
"""
