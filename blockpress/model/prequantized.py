"""Pre-quantised checkpoints: compressed-tensors weights loaded as they are stored, and the layout `save` writes.

Two of compressed-tensors' formats hold exactly blockpress's own low-precision weights (kernels/quant.py,
kernels/linear_q.py), so nothing is converted either way: the stored integers or fp8 bytes are copied into the
quantised modules and the scales into theirs.

    fp8, `float-quantized` by output channel (llm-compressor's FP8 / FP8-dynamic recipes; vLLM's FP8-dynamic
    checkpoints, e.g. RedHatAI's DiffusionGemma copy, 27 GB instead of 52):
        X.weight         F8_E4M3 [O, I]          w = weight * weight_scale, one scale per output row
        X.weight_scale   BF16 / F32 [O, 1]
    int4 / int8, `pack-quantized`, symmetric, weight-only (llm-compressor's W4A16 / W8A16):
        X.weight_packed  I32 [O, I * b / 32]     b-bit values + 2^(b-1), packed from each word's low bits up
        X.weight_scale   float [O, I / G]        w = value * scale of its group of G columns (by channel: G = I)
        X.weight_shape   I64 [2]                 [O, I]
      On a little-endian machine the words' bytes are, for 4 bits, blockpress's int4 bytes (column 2j in the low
      nibble, stored + 8) and, for 8 bits, its int8 values + 128.

X is a projection of layer L: one expert's (model.decoder.layers.L.experts.E.{gate,up,down}_proj; gate and up are
the two halves of the expert's gate_up rows), the attention's (self_attn.{q,k,v,o}_proj) or the dense MLP's
(mlp.{gate,up,down}_proj). What loads into what:

    experts     fp8 -> QuantizedExperts fp8         int4 -> QuantizedExperts int4        (precision)
    projections fp8 -> QuantizedLinear fp8          int8 (by channel) -> QuantizedLinear int8   (linears)
    dense MLP   int4, all three -> QuantizedMLP (linears="int4-mlp": the MLP through the int4 expert kernels)
    attention   int4 -> float weights in the activation dtype, dequantised once at load (no int4 projection kernel:
                the values W4A16 computes with, at the bytes of the float projections)

Anything else (8-bit int experts, int8 by group, a model mixing projection formats) is refused naming the tensor, as
are other schemes (NVFP4, asymmetric or activation-ordered int, block- or tensor-wise fp8, int activations, fp8 KV
caches, static activation scales), those before any tensor is read.

int4 groups: blockpress's modules take one group size (kernels/quant.py `group_for`); a checkpoint's groups may
differ per tensor (each divides its columns). The modules use the largest power of two dividing all of them, and a
coarser stored group has its scale repeated over the finer groups it spans: the same weights, exactly. Scales are
held in the activation dtype, as blockpress's own int4 holds them (bf16 checkpoints load them as stored).

The fp8 recipe also quantises activations to fp8 per token at run time (w8a8). blockpress runs the stored weights
against the model-dtype activations by default (the same weights without the activations' rounding);
`experts="w8a8"` (`--fp8-activations`) runs the fp8 experts and projections w8a8 as vLLM does, in blockpress's Triton
kernels (`experts="scaled_mm"`: torch's grouped fp8 GEMM for the experts, Hopper / Ada). `recipe_fp8_activations` says whether a
checkpoint's recipe asks for it (the load's stderr line then names the flag).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import CheckpointError, InputError

PARTS = ("weight", "weight_packed", "weight_scale", "weight_shape")  # what a quantised projection stores
EXPERT_KEY = re.compile(rf"^model\.decoder\.layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj\.({'|'.join(PARTS)})$")
LINEAR_KEY = re.compile(rf"^model\.decoder\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.({'|'.join(PARTS)})$")
SUPPORTED = ("compressed-tensors float-quantized (8-bit float weights, a scale per output channel: llm-compressor's "
             "FP8 recipes) or pack-quantized (symmetric 4-bit int weights by group, 8-bit by channel, weight-only: "
             "its W4A16 / W8A16)")
FIX = ("load the model's bf16 checkpoint instead and quantise it at load with precision='fp8' or 'int4' "
       "(--precision)")
PREQUANTIZED_FIX = f"blockpress reads float weights, and pre-quantised ones only as {SUPPORTED}; {FIX}"
KINDS = ("fp8", "int4", "int8")


def expert_key(i: int, e: int, proj: str, part: str) -> str:
    """The checkpoint key of expert e's `proj` ("gate" / "up" / "down") `part` ("weight_scale", ...), layer i."""
    return f"model.decoder.layers.{i}.experts.{e}.{proj}_proj.{part}"


def linear_key(i: int, module: str, name: str, part: str) -> str:
    """The checkpoint key of projection `module.name` ("self_attn.q_proj", ...)'s `part`, layer i."""
    return f"model.decoder.layers.{i}.{module}.{name}.{part}"


def expert_rows(proj: str, im: int) -> tuple[str, slice]:
    """(buffer, rows) an expert's `proj` occupies: gate and up stacked in gate_up (gate first), down alone."""
    return {"gate": ("gate_up", slice(0, im)), "up": ("gate_up", slice(im, 2 * im)),
            "down": ("down", slice(None))}[proj]


def weight_part(kind: str) -> str:
    """The key suffix a `kind`'s weight is stored under."""
    return "weight" if kind == "fp8" else "weight_packed"


def parts_of(kind: str) -> tuple[str, ...]:
    return (weight_part(kind), "weight_scale") + (() if kind == "fp8" else ("weight_shape",))


# ------------------------------------------------------------------------------------ the scheme (config.json)

def scheme_problem(qc) -> str | None:
    """None when every config group of a quantization_config is a scheme blockpress loads (see the module docstring),
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
        kind = (w.get("num_bits"), w.get("type"), w.get("strategy"))
        if kind not in ((8, "float", "channel"), (4, "int", "group"), (4, "int", "channel"), (8, "int", "channel")):
            return f"config group {name} stores {kind[0]}-bit {kind[1]} weights by {kind[2]}"
        if w.get("symmetric") is False or w.get("dynamic") or w.get("block_structure"):
            return f"config group {name}'s weights are asymmetric, dynamic or by block"
        if kind[2] == "channel" and w.get("group_size"):
            return f"config group {name}'s weights by channel name a group size"
        if w.get("actorder") == "group":
            return f"config group {name}'s int groups are activation-ordered (a g_idx per column)"
        a = g.get("input_activations")
        if a is not None and not (kind[1] == "float" and isinstance(a, dict) and a.get("dynamic") is True
                                  and (a.get("num_bits"), a.get("type")) == (8, "float")):
            return f"config group {name} quantises activations other than to fp8 per token at run time"
        if g.get("output_activations"):
            return f"config group {name} quantises outputs"
    return None


def recipe_fp8_activations(qc) -> bool:
    """Does a (readable) quantization_config quantise activations to fp8 per token at run time (FP8-dynamic)?"""
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    return isinstance(groups, dict) and any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
                                            for g in groups.values())


# ------------------------------------------------------------------------------------ loading

@dataclass
class Layout:
    """Which of a model's weights a pre-quantised checkpoint stores quantised, in which kind, read from the
    safetensors headers against the model config.json describes (`read`); `prepare` swaps the quantised modules in,
    `target` says where each stored tensor goes."""

    experts: dict[int, str] = field(default_factory=dict)  # layer -> "fp8" | "int4"
    linears: dict[tuple[int, str, str], str] = field(default_factory=dict)  # (layer, module, proj) -> "fp8" | "int8"
    mlps: set[int] = field(default_factory=set)  # layers whose dense MLP is int4 (QuantizedMLP)
    widened: set[tuple[int, str, str]] = field(default_factory=set)  # int4 attention projections: float once loaded
    group_size: int | None = None  # int4: the group blockpress's modules use
    wanted: set[str] = field(default_factory=set)  # every checkpoint key the quantised modules need
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # weight_shape key -> the [O, I] it must hold

    @classmethod
    def read(cls, headers: dict[str, tuple[str, list[int]]], module: nn.Module) -> "Layout":
        """headers: checkpoint key -> (safetensors dtype, shape), over every file (weights.read_headers); module:
        the model config.json describes, on the meta device."""
        lay, groups, kinds = cls(), {}, {}
        for key, (stored, shape) in headers.items():
            fp8, packed = stored.startswith("F8"), key.endswith(".weight_packed")
            if not (fp8 or packed):
                continue
            if fp8 and stored != "F8_E4M3":
                raise CheckpointError(f"tensor {key} is stored as {stored}; blockpress reads fp8 weights as F8_E4M3 "
                                      f"only; {FIX}")
            m = EXPERT_KEY.match(key) or LINEAR_KEY.match(key)
            if m is None or m.group(4) not in ("weight", "weight_packed"):
                raise CheckpointError(f"tensor {key} is {'an fp8' if fp8 else 'a packed int'} tensor blockpress "
                                      f"does not map (it reads quantised expert and projection weights); {FIX}")
            if packed and stored != "I32":
                raise CheckpointError(f"tensor {key} is stored as {stored}, expected I32 (packed int weights); "
                                      "the file is damaged: re-download it")
            i = int(m.group(1))
            if i >= len(module.layers):
                raise CheckpointError(f"the checkpoint holds quantised weights of layer {i}, but config.json "
                                      f"describes {len(module.layers)} layers; the config and weights do not belong "
                                      "together")
            prefix = key.rsplit(".", 1)[0]
            cols = _in_features(module, m)
            kind = "fp8" if fp8 else _packed_kind(key, shape, cols)
            kinds[prefix] = kind
            if kind == "int4":
                groups[prefix] = _stored_group(headers, prefix, cols)
            elif kind == "int8":
                scale = headers.get(prefix + ".weight_scale", (None, [None, 1]))[1]
                if len(scale) == 2 and scale[1] != 1:
                    raise CheckpointError(f"tensor {prefix}.weight_scale has shape {list(scale)}: 8-bit int weights "
                                          "by group; blockpress holds 8-bit projections with one scale per output "
                                          f"row (by channel); {FIX}")
            if not fp8:
                lay.shapes[prefix + ".weight_shape"] = (_out_features(module, m), cols)
        lay._place(kinds, module)
        if groups:
            lay.group_size = _common_group(groups)
        return lay

    def _place(self, kinds: dict[str, str], module: nn.Module) -> None:
        """Sort each quantised tensor's kind onto its module: a layer's experts, a projection, a whole dense MLP."""
        for prefix, kind in kinds.items():
            m = EXPERT_KEY.match(prefix + ".weight") or LINEAR_KEY.match(prefix + ".weight")
            i = int(m.group(1))
            if m.re is EXPERT_KEY:
                if kind == "int8":
                    raise CheckpointError(f"tensor {prefix}.weight_packed holds 8-bit int expert weights; blockpress "
                                          f"holds experts in fp8 or int4; {FIX}")
                if self.experts.setdefault(i, kind) != kind:
                    raise CheckpointError(f"layer {i}'s experts are stored in both {self.experts[i]} and {kind}; "
                                          "blockpress holds one format per layer's experts; " + FIX)
            elif kind == "int4" and m.group(2) == "mlp":
                self.mlps.add(i)
            elif kind == "int4":
                self.widened.add((i, m.group(2), m.group(3)))
            else:
                self.linears[(i, m.group(2), m.group(3))] = kind
        for i in sorted(self.mlps):
            names = [n for n in ("gate_proj", "up_proj", "down_proj") if kinds.get(f"model.decoder.layers.{i}.mlp.{n}")
                     != "int4"]
            if names:
                raise CheckpointError(f"layer {i}'s dense MLP stores some projections in int4 but not {names[0]}; "
                                      "blockpress holds a dense MLP in int4 whole (linears='int4-mlp'); " + FIX)
        for part, held, option in (("experts", set(self.experts.values()), "precision"),
                                   ("projections", set(self.linears.values()) | ({"int4"} if self.mlps else set()),
                                    "linears")):
            if len(held) > 1:
                raise CheckpointError(f"the checkpoint's {part} mix {' and '.join(sorted(held))}; blockpress holds one "
                                      f"format for a model's {part} ({option}=...); " + FIX)

    def describe(self) -> str:
        """What is quantised, in words: "the experts of 30 layer(s) in int4 and 210 projection(s) in int8"."""
        parts = []
        for kind in KINDS:
            ex = sum(k == kind for k in self.experts.values())
            pr = sum(k == kind for k in self.linears.values()) + (3 * len(self.mlps) if kind == "int4" else 0)
            what = [f"the experts of {ex} layer(s)"] * bool(ex) + [f"{pr} projection(s)"] * bool(pr)
            if what:
                parts.append(f"{' and '.join(what)} in {kind}")
        if self.widened:
            parts.append(f"{len(self.widened)} int4 attention projection(s) dequantised to float (blockpress has no "
                         "int4 projection kernel)")
        return "; ".join(parts)

    def __bool__(self) -> bool:
        return bool(self.experts or self.linears or self.mlps or self.widened)

    def prepare(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Swap the quantised parts of `module` (built on the meta device) for empty quantised modules, and list the
        checkpoint keys they need. dtype: the activation dtype."""
        from ..kernels.linear_q import QuantizedLinear
        from ..kernels.quant import QuantizedExperts, QuantizedMLP

        gs = self.group_size or 64
        for i, kind in sorted(self.experts.items()):
            E, two_im, H = module.layers[i].experts.gate_up_proj.shape
            module.layers[i].experts = QuantizedExperts(E, H, two_im // 2, kind, gs, dtype=dtype, device="meta")
            self.wanted |= {expert_key(i, e, p, part) for e in range(E) for p in ("gate", "up", "down")
                            for part in parts_of(kind)}
        for i in sorted(self.mlps):
            mlp = module.layers[i].mlp
            module.layers[i].mlp = QuantizedMLP(mlp.gate_proj.in_features, mlp.gate_proj.out_features, gs,
                                                dtype=dtype, device="meta")
            self.wanted |= {linear_key(i, "mlp", n, part) for n in ("gate_proj", "up_proj", "down_proj")
                            for part in parts_of("int4")}
        for (i, part, name), kind in sorted(self.linears.items()):
            parent = getattr(module.layers[i], part)
            lin = getattr(parent, name)
            setattr(parent, name, QuantizedLinear(lin.in_features, lin.out_features, kind, device="meta"))
            self.wanted |= {linear_key(i, part, name, p) for p in parts_of(kind)}
        for i, part, name in sorted(self.widened):
            parent = getattr(module.layers[i], part)
            lin = getattr(parent, name)
            setattr(parent, name, PackedInt4(lin.in_features, lin.out_features, gs, dtype))
            self.wanted |= {linear_key(i, part, name, p) for p in parts_of("int4")}

    def finish(self, module: nn.Module) -> None:
        """After the tensors are in: each int4 attention projection becomes a float `nn.Linear` of its dequantised
        weight (activation dtype), one at a time."""
        from ..kernels.quant import dequantize_int4

        for i, part, name in sorted(self.widened):
            parent = getattr(module.layers[i], part)
            packed = getattr(parent, name)
            lin = nn.Linear(packed.in_features, packed.out_features, bias=False, device="meta")
            lin.weight = nn.Parameter(dequantize_int4(packed.weight_q, packed.weight_scale, packed.dtype))
            setattr(parent, name, lin)

    def target(self, key: str, module: nn.Module):
        """(buffer name, index) a checkpoint key of the quantised modules fills; (None, None) for a packed weight's
        recorded [O, I] (checked by `check_shape`, not stored); None for any other key."""
        if key not in self.wanted:
            return None
        if key in self.shapes:
            return None, None
        what = "scale" if key.endswith("_scale") else "q"
        m = EXPERT_KEY.match(key)
        if m:
            i, e = int(m.group(1)), int(m.group(2))
            which, rows = expert_rows(m.group(3), module.layers[i].experts.inter)
            return f"layers.{i}.experts.{which}_{what}", (e, rows)
        n = LINEAR_KEY.match(key)
        i = int(n.group(1))
        if n.group(2) == "mlp" and i in self.mlps:
            which, rows = expert_rows(n.group(3).removesuffix("_proj"), module.layers[i].mlp.experts.inter)
            return f"layers.{i}.mlp.experts.{which}_{what}", (0, rows)
        return f"layers.{i}.{n.group(2)}.{n.group(3)}.weight_{what}", ()

    def check_shape(self, key: str, t: torch.Tensor, fname: str) -> None:
        """CheckpointError unless a packed weight's `weight_shape` holds the [O, I] config.json gives it."""
        want = self.shapes[key]
        if t.is_floating_point() or t.numel() != 2 or tuple(int(v) for v in t.reshape(-1)) != want:
            raise CheckpointError(f"tensor {key} in {fname} records the shape {t.reshape(-1).tolist()}, expected "
                                  f"{list(want)} from config.json; the config and weights do not belong together")

    def missing(self, seen: set[str]) -> list[str]:
        return sorted(self.wanted - seen)


class PackedInt4(nn.Module):
    """An int4 attention projection while it loads (blockpress's int4 bytes [O, I/2] and group scales [O, I/G], the
    buffers QuantizedLinear names); `Layout.finish` turns it into a float nn.Linear. Never run."""

    def __init__(self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        from ..kernels.quant import group_for

        if in_features % 2:
            raise CheckpointError(f"an int4 attention projection has {in_features} input columns; int4 packs two a "
                                  f"byte, so they must be even; {FIX}")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        g = group_for(in_features, group_size)
        self.register_buffer("weight_q", torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                     device="meta"))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // g, dtype=dtype, device="meta"))


def _in_features(module: nn.Module, m: re.Match) -> int:
    """The input columns of the projection a key names, from the model config.json describes."""
    layer = module.layers[int(m.group(1))]
    if m.re is EXPERT_KEY:
        E, two_im, H = layer.experts.gate_up_proj.shape
        return two_im // 2 if m.group(3) == "down" else H
    lin = getattr(getattr(layer, m.group(2)), m.group(3), None)
    if not isinstance(lin, nn.Linear):
        raise CheckpointError(f"{m.string} is in the checkpoint but {m.group(2)}.{m.group(3)} is not in the model "
                              "config.json describes; the config and weights do not belong together")
    return lin.in_features


def _out_features(module: nn.Module, m: re.Match) -> int:
    layer = module.layers[int(m.group(1))]
    if m.re is EXPERT_KEY:
        two_im, H = layer.experts.gate_up_proj.shape[1:]
        return H if m.group(3) == "down" else two_im // 2
    return getattr(getattr(layer, m.group(2)), m.group(3)).out_features


def _packed_kind(key: str, shape: list[int], cols: int) -> str:
    """"int4" or "int8", from a packed weight's int32 words per row and the columns they hold."""
    words = shape[-1] if shape else 0
    for kind, bits in (("int4", 4), ("int8", 8)):
        if words == math.ceil(cols * bits / 32):
            return kind
    raise CheckpointError(f"tensor {key} has shape {list(shape)}: {words} int32 words a row do not pack {cols} "
                          "columns (config.json) in 4 or 8 bits; the config and weights do not belong together")


def _stored_group(headers: dict, prefix: str, cols: int) -> int:
    """The columns per scale of an int4 weight (its group; the whole row by channel), from its scale's shape."""
    key = prefix + ".weight_scale"
    if key not in headers:
        return cols  # missing: reported by name once the tensors are read
    shape = headers[key][1]
    groups = shape[-1] if len(shape) == 2 else 0
    if not groups or cols % groups:
        raise CheckpointError(f"tensor {key} has shape {list(shape)}: its groups do not divide the weight's {cols} "
                              "columns (config.json); the config and weights do not belong together")
    return cols // groups


def _common_group(groups: dict[str, int]) -> int:
    """The group size the int4 modules use: the largest power of two dividing every stored group (each stored scale
    then covers whole groups of it)."""
    from ..kernels.quant import check_group_size

    g = math.gcd(*groups.values())
    g &= -g  # its largest power-of-two factor
    try:
        return check_group_size(g)
    except InputError:
        first = min(groups, key=lambda k: groups[k] & -groups[k])
        raise CheckpointError(f"tensor {first}.weight_scale scales groups of {groups[first]} columns; blockpress's "
                              f"int4 needs groups that are multiples of 16; {FIX}") from None


def resolve_options(layout: Layout, opts) -> dict:
    """The storage options a pre-quantised checkpoint fixes: its quantised parts load as stored ("native" means as
    stored); asking for another format for them is an InputError that names the way to get it."""
    out = {}
    linears = set(layout.linears.values()) | ({"int4-mlp"} if layout.mlps else set())
    for part, held, option in (("expert", set(layout.experts.values()), "precision"),
                               ("projection", linears, "linears")):
        if not held:
            continue
        (kind,) = held  # (one format each: Layout.read)
        asked = getattr(opts, option)
        if asked not in ("native", kind):
            raise InputError(f"this checkpoint stores its {part} weights in {kind}, and {option}={asked!r} needs "
                             f"float ones: load it with {option} 'native' or {kind!r} (--{option}), or load the "
                             f"model's bf16 checkpoint with {option}={asked!r}")
        out[option] = kind
    if layout.group_size is not None:
        out["group_size"] = layout.group_size
    return out


def finite_probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim fp32 tensor that is NaN where `t` holds a NaN or Inf, for load's one-sync finite check: 0 times a float
    tensor's extremes (a NaN or an Inf among them makes it NaN; a sum would also overflow on large finite values),
    0 for integers, and for fp8 (e4m3fn: no Inf; NaN is every bit of exponent and mantissa set) a test of the bytes,
    not a conversion to fp32 (10x the copy on a CPU)."""
    if not t.is_floating_point() or t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if t.dtype != torch.float8_e4m3fn:
        return torch.stack(torch.aminmax(t)).float().mul(0).sum()
    nan = (t.view(torch.uint8) & 0x7F).amax() == 0x7F  # (one reduction: 8x faster than eq().any() on a CPU)
    return torch.where(nan, float("nan"), 0.0).to(torch.float32)


def loaded_tensor(t: torch.Tensor, key: str, like: torch.Tensor, fname: str) -> torch.Tensor:
    """A checkpoint tensor in its target's form and dtype, or CheckpointError naming it: fp8 bytes as they are;
    packed int32 words as the bytes they hold (int4: the nibble pairs; int8: less 128); a scale [O, 1] as [O], an int4
    scale repeated over the finer groups of its target; scales in the target's dtype."""
    if key.endswith("_scale"):
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"tensor {key} in {fname} is stored as {t.dtype}, expected a float scale; {FIX}")
        if t.dim() == 2 and like.dim() == 1 and t.shape[-1] == 1:
            t = t.reshape(-1)
        elif t.dim() == 2 and like.dim() == 2 and 0 < t.shape[-1] < like.shape[-1] \
                and like.shape[-1] % t.shape[-1] == 0:  # a coarser stored group: each scale over its finer groups
            t = t.repeat_interleave(like.shape[-1] // t.shape[-1], dim=-1)
    elif key.endswith("_packed"):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise CheckpointError(f"tensor {key} in {fname} is stored as {t.dtype} {list(t.shape)}, expected int32 "
                                  "words [O, W]; the file is damaged: re-download it")
        t = t.contiguous().view(torch.uint8)[:, :like.shape[-1]]
        if like.dtype == torch.int8:
            t = (t.to(torch.int16) - 128).to(torch.int8)
    elif t.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"tensor {key} in {fname} is stored as {t.dtype}, expected F8_E4M3 beside its "
                              f"weight_scale; {FIX}")
    if tuple(t.shape) != tuple(like.shape):
        raise CheckpointError(f"tensor {key} in {fname} has shape {list(t.shape)}, expected {list(like.shape)} from "
                              "config.json; the config and weights do not belong together")
    return t.to(like.dtype)


# ------------------------------------------------------------------------------------ saving

EXPERT_BUFFER = re.compile(r"^layers\.(\d+)\.(experts|mlp\.experts)\.(gate_up|down)_(q|scale)$")
LINEAR_BUFFER = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight_(q|scale)$")


def buffer_kind(q: torch.Tensor) -> str:
    """A quantised weight buffer's kind, from its dtype."""
    return {torch.float8_e4m3fn: "fp8", torch.uint8: "int4", torch.int8: "int8"}[q.dtype]


def _stored_weight(q: torch.Tensor, kind: str) -> torch.Tensor:
    """A quantised module's weight rows [O, ...] as the checkpoint stores them: fp8 bytes, or int32 words."""
    if kind == "fp8":
        return q.contiguous()
    b = (q.to(torch.int16) + 128).to(torch.uint8) if kind == "int8" else q
    pad = -b.shape[-1] % 4
    if pad:
        b = torch.cat([b, b.new_zeros(*b.shape[:-1], pad)], -1)
    return b.contiguous().view(torch.int32)


def checkpoint_entries(name: str, t: torch.Tensor, weight: torch.Tensor | None = None) -> dict | None:
    """The checkpoint tensors of a quantised module's buffer `name` (the module's naming) in the layout above: the
    inverse of `Layout.target` (`save` writes what `load` reads). weight: the matching weight buffer when `name` is a
    scale (its kind and columns). None for any other tensor."""
    m, n = EXPERT_BUFFER.match(name), LINEAR_BUFFER.match(name)
    if not (m or n):
        return None
    q = t if (m or n).groups()[-1] == "q" else weight
    kind = buffer_kind(q)
    cols = q.shape[-1] * (2 if kind == "int4" else 1)
    if m:
        i, inside, which, what = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        projs = ("down",) if which == "down" else ("gate", "up")
        rows = {p: expert_rows(p, t.shape[1] // 2)[1] for p in projs}
        key = (lambda e, p, part: expert_key(i, e, p, part)) if inside == "experts" else \
            (lambda e, p, part: linear_key(i, "mlp", f"{p}_proj", part))
        pieces = {(e, p): t[e, rows[p]] for e in range(t.shape[0]) for p in projs}
    else:
        i, module, proj, what = int(n.group(1)), n.group(2), n.group(3), n.group(4)
        key = lambda e, p, part: linear_key(i, module, proj, part)  # noqa: E731
        pieces = {(0, proj): t}
    out = {}
    for (e, p), piece in pieces.items():
        if what == "scale":
            out[key(e, p, "weight_scale")] = (piece[:, None] if piece.dim() == 1 else piece).contiguous()
            continue
        out[key(e, p, weight_part(kind))] = _stored_weight(piece, kind)
        if kind != "fp8":
            out[key(e, p, "weight_shape")] = torch.tensor([piece.shape[0], cols], dtype=torch.int64)
    return out


# the Linears kept float (llm-compressor's ignore list for this model: the router, self-conditioning, vision, LM head)
ALWAYS_FLOAT = ["lm_head", "re:.*router\\.proj$", "re:.*self_conditioning.*", "re:.*vision.*"]


def quantization_config(module: nn.Module) -> dict | None:
    """The quantization_config `save` writes beside a model's quantised weights (None when nothing is quantised),
    weight-only (what blockpress computes by default):
    - every projection of the layers (attention, dense MLP, experts) in one format: one config group targeting
      "Linear", the router, self-conditioning, LM head and vision tower ignored, as llm-compressor writes it for
      its FP8 / W4A16 recipes (and vLLM reads it);
    - otherwise a config group per format and group size, its targets regexes naming the projections that hold it
      by their names' ends (`re:.*\\.experts\\.\\d+\\.down_proj$`), narrowed to the layers that hold it where some
      layers hold the same projection in float."""
    from ..kernels.linear_q import QuantizedLinear
    from ..kernels.quant import QuantizedExperts, QuantizedMLP

    roles: dict[str, dict[int, tuple | None]] = {}  # name pattern -> layer -> (kind, group) or None (float)

    def note(pattern: str, i: int, what) -> None:
        roles.setdefault(pattern, {})[i] = what

    for i, layer in enumerate(module.layers):
        mlp4 = layer.mlp.experts if isinstance(layer.mlp, QuantizedMLP) else None
        for inside, ex in (("experts\\.\\d+", layer.experts), ("mlp", mlp4)):
            if isinstance(ex, QuantizedExperts):
                for pattern, group in ((f"{inside}\\.(gate|up)_proj", ex.groups[0]),
                                       (f"{inside}\\.down_proj", ex.groups[1])):
                    note(pattern, i, (ex.fmt, group if ex.fmt == "int4" else None))
            elif ex is layer.experts:  # float experts
                note(f"{inside}\\.(gate|up)_proj", i, None)
                note(f"{inside}\\.down_proj", i, None)
        for part in ("self_attn",) + (() if mlp4 is not None else ("mlp",)):
            for name, lin in getattr(layer, part).named_children():
                if isinstance(lin, QuantizedLinear):
                    note(f"{part}\\.{name}", i, (lin.fmt, None))
                elif isinstance(lin, nn.Linear):
                    note(f"{part}\\.{name}", i, None)
    held = {what for by in roles.values() for what in by.values() if what}
    if not held:
        return None
    if len(held) == 1 and all(what for by in roles.values() for what in by.values()):
        groups, ignore = {held.pop(): ["Linear"]}, ALWAYS_FLOAT
    else:
        groups, ignore = {}, ["lm_head"]
        for pattern, by in sorted(roles.items()):
            for what in sorted({w for w in by.values() if w}):
                layers = sorted(i for i, w in by.items() if w == what)
                where = "" if len(layers) == len(by) else "layers\\.(" + "|".join(map(str, layers)) + ")\\."
                groups.setdefault(what, []).append(f"re:.*\\.{where}{pattern}$")
    config_groups = {}
    for j, ((kind, group), targets) in enumerate(sorted(groups.items(), key=str)):
        bits, typ = (8, "float") if kind == "fp8" else (4 if kind == "int4" else 8, "int")
        weights = {"num_bits": bits, "type": typ, "strategy": "group" if kind == "int4" else "channel",
                   "symmetric": True, "dynamic": False, "group_size": group, "block_structure": None,
                   "actorder": None, "observer": "minmax"}
        config_groups[f"group_{j}"] = {"targets": sorted(targets), "weights": weights, "input_activations": None,
                                       "output_activations": None, "format": _format(kind)}
    formats = {g["format"] for g in config_groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "kv_cache_scheme": None, "config_groups": config_groups, "ignore": list(ignore)}


def _format(kind: str) -> str:
    return "float-quantized" if kind == "fp8" else "pack-quantized"
