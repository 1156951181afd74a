"""Seeded random weights made directly on the target device (benchmarks, quality guard, tests).

Job: `build_model(config, device, dtype, precision)` builds a DiffusionGemmaModel on the meta
device, allocates it on `device` (`to_empty`) and fills every tensor from a generator seeded by its
parameter name, so nothing is ever materialised on the CPU first (the 26B model is 50 GB in bf16).
`build_reference` builds the transformers twin and fills it through the checkpoint name map with
the same function, giving identical weights without holding both models at once.

Invariants:
- the value of a tensor depends only on (seed, name, shape, dtype, device); experts are filled 16
  at a time with one generator per chunk, so fp8 / int4 experts can be quantised chunk by chunk as
  they are made and equal, bit for bit, the quantised float twin (tested);
- norms and router scales are drawn around 1 (not all ones), layer scalars are 1, matrices are
  normal(0, std); the rotary tables and embedding scales are computed, never drawn.
"""

from __future__ import annotations

import zlib

import torch

from ..config import ModelConfig
from ..errors import InputError
from ..model.diffusion_gemma import DiffusionGemmaModel
from ..model.weights import checkpoint_to_module_name
from ..kernels.quant import QuantizedExperts, quantize_fp8, quantize_int4

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16)
EXPERT_CHUNK = 16  # experts are filled (and quantised) 16 at a time: bounded temporaries on the device


def _generator(device, seed: int, name: str, chunk: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}/{chunk}".encode()))


@torch.no_grad()
def fill_(name: str, t: torch.Tensor, seed: int, std: float) -> None:
    """Deterministic random value of the tensor called `name` (our parameter names), on its device."""
    if name.endswith("layer_scalar"):
        t.fill_(1.0)
    elif t.dim() == 3:  # experts: chunked so quantised twins can be filled chunk by chunk
        for e0 in range(0, t.shape[0], EXPERT_CHUNK):
            t[e0:e0 + EXPERT_CHUNK].normal_(0.0, std, generator=_generator(t.device, seed, name, e0))
    elif t.dim() == 2:
        t.normal_(0.0, std, generator=_generator(t.device, seed, name))
    else:  # norms and router scales around 1
        t.normal_(1.0, 0.1, generator=_generator(t.device, seed, name))


def build_model(config: dict, device, dtype, precision: str = "native", seed: int = 0, std: float = 0.02,
                group_size: int = 64):
    """Random-weight DiffusionGemmaModel built on meta and filled on `device` (experts optionally fp8/int4)."""
    cfg = ModelConfig.from_dict(config)
    t = cfg.text
    with torch.device("meta"):
        module = DiffusionGemmaModel(cfg).to(dtype)
        if precision != "native":
            for layer in module.layers:
                layer.experts = QuantizedExperts(t.num_experts, t.hidden_size, t.moe_intermediate_size, precision,
                                                 group_size, dtype=dtype)
    module.to_empty(device=device)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if ".experts." not in name and not name.split(".")[-1].startswith("inv_freq"):
            fill_(name, p, seed, std)
    for i, layer in enumerate(module.layers):
        if precision == "native":
            fill_(f"layers.{i}.experts.gate_up_proj", layer.experts.gate_up_proj, seed, std)
            fill_(f"layers.{i}.experts.down_proj", layer.experts.down_proj, seed, std)
            continue
        for which, shape in (("gate_up", (2 * t.moe_intermediate_size, t.hidden_size)),
                             ("down", (t.hidden_size, t.moe_intermediate_size))):
            q, s = getattr(layer.experts, f"{which}_q"), getattr(layer.experts, f"{which}_scale")
            for e0 in range(0, t.num_experts, EXPERT_CHUNK):  # the same values fill_ gives the float twin
                w = torch.empty(min(EXPERT_CHUNK, t.num_experts - e0), *shape, dtype=dtype, device=device)
                w.normal_(0.0, std, generator=_generator(device, seed, f"layers.{i}.experts.{which}_proj", e0))
                qw, sw = quantize_fp8(w) if precision == "fp8" else quantize_int4(w, group_size, dtype)
                q[e0:e0 + len(w)], s[e0:e0 + len(w)] = qw, sw
    module.materialize_buffers(device)
    return module.eval()


def build_reference(config: dict, device, dtype, seed: int = 0, std: float = 0.02):
    """The transformers twin: same config, identical weights through the same per-name fill."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    cfg = ModelConfig.from_dict(config)
    hf_cfg = DiffusionGemmaConfig(text_config=cfg.text.to_dict(), vision_config=dict(TINY_VISION),
                                  canvas_length=cfg.canvas_length)
    with torch.device(device):
        hf = DiffusionGemmaForBlockDiffusion._from_config(hf_cfg, dtype=dtype)
    with torch.device("meta"):  # only our tensors: the name map would also match HF's computed buffers
        known = {n for n, _ in DiffusionGemmaModel(cfg).named_parameters()}
    known |= {f"layers.{i}.{b}" for i in range(cfg.text.num_hidden_layers)
              for b in ("layer_scalar", "encoder_layer_scalar")}
    tensors = list(hf.named_parameters(remove_duplicate=False)) + list(hf.named_buffers(remove_duplicate=False))
    with torch.no_grad():  # HF's own non-persistent buffers (embed scale, rotary tables) stay as computed
        for name, t in tensors:
            ours = checkpoint_to_module_name(name)
            if ours in known:
                fill_(ours, t, seed, std)
    hf.generation_config.eos_token_id = None  # no early end: every run generates all new tokens
    hf.generation_config.pad_token_id = None
    return hf.eval()


def _vision_key(name: str) -> bool:
    """A weight of the vision side (tower or its projection into the text embeddings), unused by text generation."""
    return any(part in name.split(".") for part in ("vision_tower", "embed_vision"))


def load_reference(folder, device, dtype):
    """transformers' model from a checkpoint folder (a trained model's twin), with no early end."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    # text-only checkpoints (ours, the shipped models) have no vision tower: transformers initialises it and prints
    # a table of its missing weights, which generation never reads. Any other missing weight is an error here: a
    # reference with random weights would make the token agreement meaningless.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    missing = sorted(k for k in map(str, info["missing_keys"] | info["mismatched_keys"]) if not _vision_key(k))
    if missing:
        raise InputError(f"transformers' reference left {len(missing)} weights of {folder} uninitialised (e.g. "
                         f"{missing[0]}); compare against a complete checkpoint, or pass --no-reference")
    hf = hf.to(device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = None
    return hf.eval()
