"""Deepen a trained checkpoint without changing what it computes, so that a larger model starts from a smaller one.

`grow_depth(src, out, times)` writes a checkpoint with `times` x the layers: the original stack, then
`times - 1` copies of it on top (so the sliding / full layer pattern repeats). Every added layer starts as the
layer it copies, except that its two residual-branch output norms (`post_attention_layernorm` and
`post_feedforward_layernorm`, the last op before each branch is added to the residual) have zero weights and its
residual scale (`layer_scalar`) is 1: each branch adds exactly zero, the block is the identity and the grown
model's outputs equal the original's. Training
then moves those norm weights off zero, and the copied weights below them start to learn (Adam's step size does
not depend on how small their first gradients are). This is progressive stacking (copy the trained layers,
continue training) made function-preserving, which is far cheaper than training the deeper model from scratch.

Files other than config.json and model.safetensors (tokenizer, chat template, generation config) are copied as
they are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ..config import ModelConfig
from ..errors import InputError
from ..model.weights import FOLDER_FILES

# the last op of each residual branch: zero weights make the branch add nothing
BRANCH_OUTPUT_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
_LAYER_KEY = re.compile(r"^(.*\.layers\.)(\d+)\.(.+)$")
_COPIED = FOLDER_FILES + ("generation_config.json",)


def grow_depth(src: str | Path, out: str | Path, times: int = 2) -> dict:
    """Write `out`: `src` with its layer stack repeated `times` times, the copies starting as identity blocks.
    Returns the new config dict."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    if times < 2:
        raise InputError(f"grow times must be >= 2, got {times}")
    for name in ("config.json", "model.safetensors"):
        if not (src / name).is_file():
            raise InputError(f"{src} has no {name}; pass a checkpoint folder (config.json + model.safetensors)")
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} is not empty; pass a new folder for the grown checkpoint")
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    n = int(text["num_hidden_layers"])
    state = load_file(src / "model.safetensors")

    grown = {}
    for key, value in state.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            grown[key] = value
            continue
        prefix, i, rest = m.group(1), int(m.group(2)), m.group(3)
        for r in range(times):
            copy = value.clone()
            if r and rest in BRANCH_OUTPUT_NORMS:
                copy = torch.zeros_like(value)
            elif r and rest == "layer_scalar":
                copy = torch.ones_like(value)
            grown[f"{prefix}{i + r * n}.{rest}"] = copy

    # the source's layer types as it resolves them (a config may leave them to the default rule, which would place
    # the full layers differently in a deeper stack), repeated
    text["layer_types"] = list(ModelConfig.from_dict(config).text.layer_types) * times
    text["num_hidden_layers"] = n * times
    if text.get("per_layer_config"):
        text["per_layer_config"] = {str(int(k) + r * n): v for r in range(times)
                                    for k, v in text["per_layer_config"].items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(grown, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return config
