"""Pre-quantised FP8 checkpoints: 8-bit float weights with a scale per output channel, loaded as they are stored.

The format is compressed-tensors' `float-quantized` with `strategy: channel` (llm-compressor's FP8 recipes; vLLM's
FP8-dynamic checkpoints, e.g. RedHatAI's DiffusionGemma copy: 27 GB to download instead of 52), and what `save`
writes for a model with fp8 experts and projections. Its experts are split per expert, its projections hold an fp8
weight and a scale each:

    model.decoder.layers.L.experts.E.gate_proj.weight   F8_E4M3 [Im, H] -> layers.L.experts.gate_up_q[E, :Im]
    model.decoder.layers.L.experts.E.up_proj.weight     F8_E4M3 [Im, H] -> layers.L.experts.gate_up_q[E, Im:]
    model.decoder.layers.L.experts.E.down_proj.weight   F8_E4M3 [H, Im] -> layers.L.experts.down_q[E]
    model.decoder.layers.L.self_attn.q_proj.weight      F8_E4M3 [O, I]  -> layers.L.self_attn.q_proj.weight_q
    (mlp.gate_proj / up_proj / down_proj and the other attention projections alike)
    <each of them>.weight_scale                         BF16 / F32 [O, 1] -> the matching fp32 scale rows

which is blockpress's own fp8 format (kernels/quant.py, kernels/linear_q.py: w = q * scale per output row), so
nothing is converted: the fp8 bytes are copied into the fp8 modules and the scales widened to fp32 (exact). The
router, embeddings, norms and self-conditioning are float in such checkpoints and load as usual.

The checkpoint's recipe also quantises activations to fp8 per token at run time (w8a8). blockpress runs the stored
weights against the model-dtype activations by default (the same weights without the activations' rounding);
`experts="scaled_mm"` runs the experts w8a8 as vLLM does (Hopper / Ada).

Other schemes (NVFP4, int4 pack-quantized / GPTQ / AWQ, block- or group-wise fp8, fp8 KV caches, static activation
scales) are refused before any tensor is read, with the supported one named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import CheckpointError, InputError

EXPERT_KEY = re.compile(r"^model\.decoder\.layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale)$")
LINEAR_KEY = re.compile(r"^model\.decoder\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|weight_scale)$")
SUPPORTED = ("compressed-tensors float-quantized: 8-bit float weights with a scale per output channel "
             "(llm-compressor's FP8 and FP8-dynamic recipes)")
FIX = ("load the model's bf16 checkpoint instead and quantise it at load with precision='fp8' or 'int4' "
       "(--precision)")
PREQUANTIZED_FIX = f"blockpress reads float weights, and pre-quantised ones only as {SUPPORTED}; {FIX}"
SUFFIX = {"q": "weight", "scale": "weight_scale"}  # a fp8 module's buffer (gate_up_q, weight_scale, ...) -> key suffix


def expert_key(i: int, e: int, proj: str, what: str) -> str:
    """The checkpoint key of expert e's `proj` ("gate" / "up" / "down") weight ("q") or scale ("scale"), layer i."""
    return f"model.decoder.layers.{i}.experts.{e}.{proj}_proj.{SUFFIX[what]}"


def linear_key(i: int, part: str, name: str, what: str) -> str:
    """The checkpoint key of projection `part.name` ("self_attn.q_proj", ...)'s weight ("q") or scale ("scale")."""
    return f"model.decoder.layers.{i}.{part}.{name}.{SUFFIX[what]}"


def expert_rows(proj: str, im: int) -> tuple[str, slice]:
    """(buffer, rows) an expert's `proj` occupies: gate and up stacked in gate_up (gate first), down alone."""
    return {"gate": ("gate_up", slice(0, im)), "up": ("gate_up", slice(im, 2 * im)),
            "down": ("down", slice(None))}[proj]


def fp8_channel_scheme(qc) -> str | None:
    """None when a quantization_config is the one pre-quantised scheme blockpress loads (see the module docstring),
    else why not, in a few words."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return "only compressed-tensors checkpoints are read"
    if qc.get("kv_cache_scheme"):
        return "it quantises the KV cache"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return "it has no config_groups"
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            return f"config group {name} has no weights scheme"
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (8, "float", "channel"):
            return (f"config group {name} stores {w.get('num_bits')}-bit {w.get('type')} weights by "
                    f"{w.get('strategy')}")
        if w.get("symmetric") is False or w.get("dynamic") or w.get("group_size") or w.get("block_structure"):
            return f"config group {name}'s weights are asymmetric, dynamic or grouped"
        a = g.get("input_activations")
        if a is not None and not (isinstance(a, dict) and a.get("dynamic") is True
                                  and (a.get("num_bits"), a.get("type")) == (8, "float")):
            return f"config group {name} has static or non-fp8 activation scales"
        if g.get("output_activations"):
            return f"config group {name} quantises outputs"
    return None


@dataclass
class Layout:
    """Which of a model's weights a pre-quantised checkpoint stores in fp8, read from the safetensors headers, and
    where each of its tensors goes (`target`)."""

    experts: set[int] = field(default_factory=set)  # layers whose experts are fp8
    linears: set[tuple[int, str, str]] = field(default_factory=set)  # (layer, "self_attn" | "mlp", projection)
    wanted: set[str] = field(default_factory=set)  # every checkpoint key the fp8 modules need

    @classmethod
    def from_headers(cls, dtypes: dict[str, str]) -> "Layout":
        """dtypes: checkpoint key -> safetensors dtype name, over every file."""
        lay = cls()
        for key, stored in dtypes.items():
            if not stored.startswith("F8"):
                continue
            if stored != "F8_E4M3":
                raise CheckpointError(f"tensor {key} is stored as {stored}; blockpress reads fp8 weights as F8_E4M3 "
                                      f"only; {FIX}")
            m, n = EXPERT_KEY.match(key), LINEAR_KEY.match(key)
            if m and m.group(4) == "weight":
                lay.experts.add(int(m.group(1)))
            elif n and n.group(4) == "weight":
                lay.linears.add((int(n.group(1)), n.group(2), n.group(3)))
            else:
                raise CheckpointError(f"tensor {key} is an fp8 tensor blockpress does not map (it reads fp8 expert "
                                      f"and projection weights); {FIX}")
        return lay

    def describe(self) -> str:
        """What is fp8, in words: "the experts of 30 layer(s) and 200 projection(s)"."""
        parts = [f"the experts of {len(self.experts)} layer(s)"] if self.experts else []
        parts += [f"{len(self.linears)} projection(s)"] if self.linears else []
        return " and ".join(parts)

    def __bool__(self) -> bool:
        return bool(self.experts or self.linears)

    def prepare(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Swap the fp8 parts of `module` (built on the meta device) for empty fp8 modules, and list the
        checkpoint keys they need. dtype: the activation dtype."""
        from ..kernels.linear_q import QuantizedLinear
        from ..kernels.quant import QuantizedExperts

        deepest = max([*self.experts, *(i for i, _, _ in self.linears)])
        if deepest >= len(module.layers):
            raise CheckpointError(f"the checkpoint holds fp8 weights of layer {deepest}, but config.json describes "
                                  f"{len(module.layers)} layers; the config and weights do not belong together")
        for i in sorted(self.experts):
            old = module.layers[i].experts
            E, two_im, H = old.gate_up_proj.shape
            module.layers[i].experts = QuantizedExperts(E, H, two_im // 2, "fp8", dtype=dtype, device="meta")
            self.wanted |= {expert_key(i, e, p, w) for e in range(E) for p in ("gate", "up", "down") for w in SUFFIX}
        for i, part, name in sorted(self.linears):
            parent = getattr(module.layers[i], part)
            lin = getattr(parent, name, None)
            if not isinstance(lin, nn.Linear):
                raise CheckpointError(f"model.decoder.layers.{i}.{part}.{name}.weight is in the checkpoint but not "
                                      "in the model config.json describes; the config and weights do not belong "
                                      "together")
            setattr(parent, name, QuantizedLinear(lin.in_features, lin.out_features, "fp8", device="meta"))
            self.wanted |= {linear_key(i, part, name, w) for w in SUFFIX}

    def target(self, key: str, module: nn.Module):
        """(buffer name, index) a checkpoint key of the fp8 modules fills, or None for any other key."""
        if key not in self.wanted:
            return None
        what = "q" if key.endswith(".weight") else "scale"
        m = EXPERT_KEY.match(key)
        if m:
            i, e = int(m.group(1)), int(m.group(2))
            which, rows = expert_rows(m.group(3), module.layers[i].experts.inter)
            return f"layers.{i}.experts.{which}_{what}", (e, rows)
        n = LINEAR_KEY.match(key)
        return f"layers.{n.group(1)}.{n.group(2)}.{n.group(3)}.weight_{what}", ()

    def missing(self, seen: set[str]) -> list[str]:
        return sorted(self.wanted - seen)


EXPERT_BUFFER = re.compile(r"^layers\.(\d+)\.experts\.(gate_up|down)_(q|scale)$")
LINEAR_BUFFER = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight_(q|scale)$")


def checkpoint_entries(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The checkpoint tensors of an fp8 module's buffer `name` (the module's naming) in the layout above: the inverse
    of `Layout.target` (`save` writes what `load` reads). None for any other tensor."""
    m = EXPERT_BUFFER.match(name)
    if m:
        i, which, what = int(m.group(1)), m.group(2), m.group(3)
        projs = ("down",) if which == "down" else ("gate", "up")
        rows = {p: expert_rows(p, t.shape[1] // 2)[1] for p in projs}
        return {expert_key(i, e, p, what): (t[e, rows[p]] if what == "q" else t[e, rows[p]][:, None]).contiguous()
                for e in range(t.shape[0]) for p in projs}
    n = LINEAR_BUFFER.match(name)
    if n:
        i, part, proj, what = int(n.group(1)), n.group(2), n.group(3), n.group(4)
        return {linear_key(i, part, proj, what): (t if what == "q" else t[:, None]).contiguous()}
    return None


def quantization_config() -> dict:
    """The quantization_config `save` writes beside fp8 weights: compressed-tensors' fp8 by output channel, weight-only
    (what blockpress computes by default), the float parts ignored."""
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*router\\.proj$", "re:.*self_conditioning.*", "re:.*vision.*"]}


def resolve_options(layout: Layout, opts) -> dict:
    """The storage options a pre-quantised checkpoint fixes: its fp8 parts load as fp8 ("native" means as stored);
    asking for another format for them is an InputError that names the way to get it."""
    out = {}
    for part, held, option in (("expert", layout.experts, "precision"), ("projection", layout.linears, "linears")):
        if not held:
            continue
        asked = getattr(opts, option)
        if asked not in ("native", "fp8"):
            raise InputError(f"this checkpoint stores its {part} weights in fp8, and {option}={asked!r} needs float "
                             f"ones: load it with {option} 'native' or 'fp8' (--{option}), or load the model's bf16 "
                             f"checkpoint with {option}={asked!r}")
        out[option] = "fp8"
    return out


def finite_probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim fp32 tensor that is NaN where `t` holds a NaN or Inf, for load's one-sync finite check: the sum of a
    float tensor, and for fp8 (e4m3fn: no Inf; NaN is every bit of exponent and mantissa set) a test of the bytes,
    not a conversion to fp32 (10x the copy on a CPU)."""
    if t.dtype != torch.float8_e4m3fn or t.numel() == 0:
        return t.sum(dtype=torch.float32)
    nan = (t.view(torch.uint8) & 0x7F).amax() == 0x7F  # (one reduction: 8x faster than eq().any() on a CPU)
    return torch.where(nan, float("nan"), 0.0).to(torch.float32)


def loaded_tensor(t: torch.Tensor, key: str, like: torch.Tensor, fname: str) -> torch.Tensor:
    """A checkpoint tensor reshaped to its target (a scale [O, 1] to [O]) in the target's dtype (fp8 bytes as they
    are; scales widened to fp32), or CheckpointError naming it."""
    if key.endswith("_scale"):
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"tensor {key} in {fname} is stored as {t.dtype}, expected a float scale; {FIX}")
        t = t.reshape(-1) if t.dim() == 2 and t.shape[-1] == 1 else t
    elif t.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"tensor {key} in {fname} is stored as {t.dtype}, expected F8_E4M3 beside its "
                              f"weight_scale; {FIX}")
    if tuple(t.shape) != tuple(like.shape):
        raise CheckpointError(f"tensor {key} in {fname} has shape {list(t.shape)}, expected {list(like.shape)} from "
                              "config.json; the config and weights do not belong together")
    return t.to(like.dtype)
