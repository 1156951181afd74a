"""LoRA adapters on the shared encoder/decoder stack, saved and loaded in PEFT's format.

Adapters live *inside* the adapted `nn.Linear` as two child linears `lora_A` [r, in] and `lora_B`
[out, r] plus a forward hook adding `scale * B(A(x))` (scale = alpha / r), so parameter names stay
the checkpoint names (`layers.N.self_attn.q_proj.weight`) and the adapter names are PEFT's
(`layers.N.self_attn.q_proj.lora_A.weight`). Targets: the attention projections and the dense MLP of
every layer (expert tensors and the router are not `nn.Linear`-adapted; the
self-conditioning MLP and the tied embedding stay frozen). QLoRA: on a model loaded with quantised experts
(`precision=`) and/or 8-bit projections (`linears=`, `QuantizedLinear`) the adapters train beside the frozen
quantised weights (the same hook; their backward passes dequantise on the fly) and save in the same format,
so they load on the unquantised base.

File format (`save_adapter`): `adapter_config.json` (peft_type LORA, r, lora_alpha, a regex
`target_modules` restricted to the text layers, base_model_name_or_path) and
`adapter_model.safetensors` with keys for transformers' `DiffusionGemmaForBlockDiffusion`:
`base_model.model.model.decoder.layers.N.<proj>.lora_{A,B}.weight` and the same tensors again under
`base_model.model.model.encoder.language_model.layers.N...`. transformers ties encoder and decoder
weights but PEFT gives each tree its own adapter; writing both makes PEFT's encoder and decoder passes
equal to ours (one shared stack, one adapter). `apply_adapter` reads the decoder keys; if a PEFT-trained
adapter has *different* encoder keys it warns and uses the decoder ones. Merging adds the delta once
to the shared weight (never once per tree: the "double merge" pitfall).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, InputError
from ..model.layers import merge_projections_
from ..model.weights import is_adapter_tensor

DEC = "base_model.model.model.decoder."
ENC = "base_model.model.model.encoder.language_model."
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(PROJ)
    base_model: str | None = None  # written as base_model_name_or_path: the model the adapter was trained on

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_modules(module: nn.Module, targets) -> dict[str, nn.Linear]:
    """Our names (`layers.N.self_attn.q_proj`) of the linears to adapt."""
    out = {}
    for i, layer in enumerate(module.layers):
        for t in targets:
            if t not in PROJ:
                raise ValueError(f"unknown LoRA target {t!r}; choose from {sorted(PROJ)}")
            lin = getattr(getattr(layer, PROJ[t]), t, None)
            if isinstance(lin, nn.Linear) or _quantized(lin):  # full-attention layers have no v_proj
                out[f"layers.{i}.{PROJ[t]}.{t}"] = lin
    return out


def _quantized(lin) -> bool:
    """An 8-bit projection (kernels/linear_q.py): its adapter runs beside the frozen weight (QLoRA), never merged."""
    return type(lin).__name__ == "QuantizedLinear"


def _hook(lin, inputs, output):
    """output + B(A(x)) * scale, in the activations' dtype: fp32 adapters over a bf16 base (training) are cast to bf16
    for the product (a [rank, in] copy) rather than the input to fp32 (an fp32 copy of every adapted projection's
    input kept for the backward: 1.5 GB on the 26B model at 1,280 tokens)."""
    x = inputs[0]
    a, b = lin.lora_A.weight, lin.lora_B.weight
    return output + (F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * lin.lora_scale).to(output.dtype)


def add_lora(module: nn.Module, spec: LoraSpec, freeze_base: bool = True, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> list[str]:
    """Attach zero-initialised adapters (PEFT init: A kaiming-uniform, B zeros) to train. Returns adapted names.
    dtype: the adapters' (fp32, whatever the base's: they are what trains; the hook computes in the activations'
    dtype).

    A is drawn from its own generator (`seed`, on the CPU, in the order of the adapted names), not torch's global
    one: the same adapters in every process of a run (FSDP2 shards each process's copy and broadcasts nothing) and
    in a run started again, whatever drew random numbers before."""
    g = torch.Generator().manual_seed(seed)
    merge_projections_(module, False)  # an adapter's hook adds to its own projection's output: one GEMM each
    if freeze_base:
        for p in module.parameters():
            p.requires_grad_(False)
    names = []
    for name, lin in target_modules(module, spec.targets).items():
        if hasattr(lin, "lora_A"):
            raise ValueError(f"{name} already has a LoRA adapter; merge or remove it first")
        # on the adapted weight's device (an 8-bit projection keeps its scales there)
        dev = lin.weight_scale.device if _quantized(lin) else lin.weight.device
        lin.lora_A = nn.Linear(lin.in_features, spec.rank, bias=False, device=dev, dtype=dtype)
        lin.lora_B = nn.Linear(spec.rank, lin.out_features, bias=False, device=dev, dtype=dtype)
        a = torch.empty(lin.lora_A.weight.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        with torch.no_grad():
            lin.lora_A.weight.copy_(a)
        nn.init.zeros_(lin.lora_B.weight)
        lin.lora_scale = spec.scale
        lin._lora_handle = lin.register_forward_hook(_hook)
        names.append(name)
    module.lora_spec = spec
    return names


def lora_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if is_adapter_tensor(n)}


def save_adapter(module: nn.Module, path: str | Path, spec: LoraSpec | None = None,
                 base_model: str | None = None, tensors: dict | None = None) -> Path:
    """Write a PEFT adapter folder (atomic): adapter_config.json + adapter_model.safetensors. tensors: the
    adapters' values by module name when the module holds only a shard of them (a sharded training run)."""
    from safetensors.torch import save_file

    from ..model.weights import write_atomic

    spec = spec or module.lora_spec
    sd = {}
    for n, p in lora_state(module).items():
        t = (tensors[n] if tensors is not None else p).detach().contiguous().cpu()
        sd[DEC + n] = t
        sd[ENC + n] = t.clone()
    layers = "|".join(sorted({PROJ[t] + r"\." + t for t in spec.targets}))
    config = {
        "peft_type": "LORA", "task_type": None, "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0,
        "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "target_modules": rf".*model\.(decoder|encoder\.language_model)\.layers\.\d+\.({layers})",
        "base_model_name_or_path": base_model or spec.base_model, "revision": None,
    }
    write_atomic(Path(path), {"adapter_config.json": json.dumps(config, indent=2),
                              "adapter_model.safetensors": lambda p: save_file(sd, str(p), metadata={"format": "pt"})})
    return Path(path)


def _targets(target_modules) -> set[str]:
    """The projection names of an adapter_config.json's target_modules (our regex, or PEFT's list of names)."""
    if isinstance(target_modules, str):
        return set(re.findall(r"(\w+_proj)", target_modules)) & set(PROJ)
    return {str(t).rsplit(".", 1)[-1] for t in target_modules or []} & set(PROJ)


def check_resume_adapters(spec: LoraSpec | None, ck: str | Path) -> None:
    """A run continues with the adapters it was started with, or with none if it trained every weight: compare
    --lora / --lora-alpha / --lora-targets with the checkpoint's adapter_config.json, one line naming the flag to
    change (a rank or target mismatch was a RuntimeError / AttributeError, another alpha trained silently on)."""
    ck = Path(ck)
    cfg_p = ck / "adapter_config.json"
    if not cfg_p.is_file():
        if spec is not None:
            raise InputError(f"the run being resumed fine-tunes every weight ({ck.name} has no adapter_config.json); "
                             f"drop --lora {spec.rank} to resume it, or start a LoRA run with another --out")
        return
    try:
        cfg = json.loads(cfg_p.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{cfg_p} is not readable JSON ({e}); resume from an earlier checkpoint") from None
    r, alpha, targets = cfg.get("r"), cfg.get("lora_alpha"), _targets(cfg.get("target_modules"))
    if spec is None:
        raise InputError(f"the run being resumed trains LoRA adapters of rank {r} ({cfg_p.parent.name}/"
                         f"adapter_config.json); add --lora {r} to resume it")
    if r != spec.rank:
        raise InputError(f"--lora {spec.rank} differs from the run being resumed (rank {r}, in {ck.name}/"
                         f"adapter_config.json); resume with --lora {r}, or start a new run with another --out")
    if alpha is not None and float(alpha) != float(spec.alpha):
        raise InputError(f"--lora-alpha {spec.alpha:g} differs from the run being resumed (alpha {float(alpha):g}, in "
                         f"{ck.name}/adapter_config.json); resume with --lora-alpha {float(alpha):g}")
    if targets and targets != set(spec.targets):
        want = ",".join(t for t in PROJ if t in targets)
        raise InputError(f"--lora-targets {','.join(spec.targets)} differs from the run being resumed ({want}, in "
                         f"{ck.name}/adapter_config.json); resume with --lora-targets {want}")


def adapter_folder(path: str | Path) -> Path:
    """An adapter folder as given, or a LoRA training run's folder: the checkpoint it stands for
    (`loading.run_checkpoint`: its `latest`, else its newest checkpoint)."""
    from ..loading import run_checkpoint

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return path
    ck = run_checkpoint(path)
    return ck if ck is not None and (ck / "adapter_config.json").is_file() else path


def _read_adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = adapter_folder(path)
    cfg_p, w_p = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_p.is_file() or not w_p.is_file():
        raise CheckpointError(f"{path} is not a LoRA adapter folder (needs adapter_config.json and "
                              "adapter_model.safetensors, as PEFT writes)")
    try:
        cfg = json.loads(cfg_p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{cfg_p} is not valid JSON ({e}); re-download or re-save the adapter") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_p} must contain a JSON object; re-download or re-save the adapter")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path} holds a {cfg.get('peft_type')} adapter; blockpress loads LoRA adapters only")
    try:
        return cfg, load_file(str(w_p))
    except Exception as e:  # safetensors raises its own error type for a bad header or a short file
        raise CheckpointError(f"{w_p} is not a readable safetensors file ({e}); it may be truncated: re-download "
                              "or re-save the adapter") from None


_KEY = re.compile(r"^(layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


def _adapter_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT keys -> {our linear name: {"A": .., "B": ..}} from the decoder keys (encoder keys checked)."""
    dec, enc = {}, {}
    for k, v in tensors.items():
        for prefix, dst in ((DEC, dec), (ENC, enc)):
            if k.startswith(prefix):
                m = _KEY.match(k[len(prefix):])
                if not m:  # a bias, a saved module, an embedding adapter: dropping it would run another model
                    raise CheckpointError(f"the adapter holds {k}, which is not a LoRA A/B weight of a text-layer "
                                          "projection; blockpress loads plain LoRA adapters only")
                if not v.is_floating_point():
                    raise CheckpointError(f"the adapter's {k} is {str(v.dtype).removeprefix('torch.')}, not floating "
                                          "point; re-save the adapter")
                dst.setdefault(m.group(1), {})[m.group(2)] = v
    if not dec:
        if enc:
            dec = enc
        else:
            raise CheckpointError("the adapter has no text-layer LoRA keys (expected "
                                  f"'{DEC}layers.N.self_attn.q_proj.lora_A.weight')")
    for name, ab in dec.items():  # a pair without its other half, or weights that are not numbers
        half = next((x for x in "AB" if x not in ab), None)
        if half is not None:
            raise CheckpointError(f"the adapter has {name}'s lora_{'AB'.replace(half, '')} but not its lora_{half}; "
                                  "the adapter's weights file is incomplete: re-download or re-save the adapter")
        if not all(bool(torch.isfinite(t).all()) for t in ab.values()):
            raise CheckpointError(f"the adapter's weights for {name} hold NaN or inf (a diverged run?); use another "
                                  "checkpoint of it")
    differs = [n for n in enc if n in dec and any(not torch.equal(enc[n][x], dec[n][x]) for x in "AB" if x in enc[n])]
    if differs:
        print(f"blockpress: the adapter's encoder and decoder LoRA weights differ ({len(differs)} modules, e.g. "
              f"{differs[0]}); blockpress shares one stack and uses the decoder weights", file=sys.stderr)
    return dec


def load_adapter_weights(module: nn.Module, path: str | Path) -> None:
    """Copy adapter weights from a folder into adapters already attached with add_lora."""
    _, tensors = _read_adapter(Path(path))
    mods = dict(module.named_modules())
    for name, ab in _adapter_tensors(tensors).items():
        lin = mods[name]
        with torch.no_grad():
            lin.lora_A.weight.copy_(ab["A"])
            lin.lora_B.weight.copy_(ab["B"])


def _check_base_model(base: Any, module: nn.Module, path: str | Path) -> None:
    """When the adapter names a base model this machine holds (a folder or a shipped model; a Hub id is not
    fetched), its vocabulary must be this model's: a text adapter on the Sudoku model (same layer shapes)
    would otherwise load and write noise."""
    if not isinstance(base, str) or not base:
        return
    from ..loading import SHIPPED_MODELS

    folder = SHIPPED_MODELS.get(base, Path(base))
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return
    text = raw.get("text_config") or raw if isinstance(raw, dict) else None
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    have = module.config.text.vocab_size if hasattr(module, "config") else None
    if isinstance(vocab, int) and have is not None and vocab != have:
        raise CheckpointError(f"{path} was trained on {base} (vocabulary {vocab}), but this model's vocabulary is "
                              f"{have}; load the adapter on its base model")


# PEFT options that change what an adapter computes and that blockpress does not implement, with the value that
# means "not used" (None and an empty list / dict mean it too): loading past one would run another model, silently
UNSUPPORTED = {"use_dora": (False, "DoRA's magnitude vectors"), "bias": ("none", "trained bias terms"),
               "lora_bias": (False, "a bias on lora_B"), "modules_to_save": (None, "whole trained modules"),
               "rank_pattern": ({}, "per-module ranks"), "alpha_pattern": ({}, "per-module alphas"),
               "fan_in_fan_out": (False, "transposed weights")}


def _refuse_unsupported_options(cfg: dict) -> None:
    for key, (off, what) in UNSUPPORTED.items():
        value = cfg.get(key)
        if value not in (None, False, [], {}, off):
            raise CheckpointError(f"adapter_config.json's {key} is {value!r}: the adapter uses {what}, which "
                                  f"blockpress does not load; train a plain LoRA adapter ({key}={off!r})")


def apply_adapter(model, path: str | Path, merge: bool = False) -> list[str]:
    """Load a PEFT LoRA adapter folder into a blockpress model (BlockDiffusionLM or its module).

    merge=False attaches the adapter (unmerged, exact); merge=True folds `scale * B @ A` into the
    shared weights once. Returns the adapted module names."""
    module = getattr(model, "module", model)
    cfg, tensors = _read_adapter(Path(path))
    ab_all = _adapter_tensors(tensors)
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", cfg.get("r", 8))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError(f"adapter_config.json's r is {r!r}; it must be the adapter's rank, a whole number >= 1: "
                              "re-download or re-save the adapter")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise CheckpointError(f"adapter_config.json's lora_alpha is {alpha!r}; it must be a finite number (PEFT "
                              "scales the adapter by lora_alpha / r): re-download or re-save the adapter")
    alpha = float(alpha)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r  # rsLoRA scales by 1/sqrt(r)
    _refuse_unsupported_options(cfg)
    _check_base_model(cfg.get("base_model_name_or_path"), module, path)
    mods = dict(module.named_modules())
    checked = []  # every layer is checked before any is changed: a bad adapter leaves the model as it was
    for name, ab in ab_all.items():
        lin = mods.get(name)
        eight_bit = _quantized(lin)  # kernels/linear_q.py: the adapter runs beside it
        if lin is None and type(mods.get(name.rpartition(".")[0])).__name__ == "QuantizedMLP":
            raise InputError(f"adapter targets {name}, but this model holds its dense MLP in int4 (--linears "
                             "int4-mlp), which adapters cannot attach to; load with --linears native or int8")
        if not (eight_bit or isinstance(lin, nn.Linear)):
            raise CheckpointError(f"adapter targets {name}, which this model does not have; wrong base model?")
        if eight_bit and merge:
            raise InputError(f"{name} holds 8-bit weights (--linears), which an adapter cannot be merged into; "
                             "drop --merge-adapter (the adapter then runs beside them) or load with --linears native")
        like = torch.empty(0, device=lin.weight_scale.device, dtype=module.dtype) if eight_bit else lin.weight
        A, B = ab["A"].to(like), ab["B"].to(like)
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise CheckpointError(f"adapter weights for {name} have shapes A {list(A.shape)}, B {list(B.shape)}; "
                                  "expected A [r, in] and B [out, r]")
        if A.shape[0] != r:
            raise CheckpointError(f"adapter_config.json says r={r} but the weights for {name} have rank "
                                  f"{A.shape[0]}; the config and weights do not belong together")
        if A.shape[1] != lin.in_features or B.shape[0] != lin.out_features:
            raise CheckpointError(f"adapter weights for {name} map {A.shape[1]} -> {B.shape[0]} features, this "
                                  f"model's layer maps {lin.in_features} -> {lin.out_features}; the adapter was "
                                  "trained on another base model")
        if not merge and hasattr(lin, "lora_A"):
            raise InputError(f"{name} already has a LoRA adapter attached; load the model again to apply another "
                             "(or merge=True to fold this one in)")
        checked.append((name, lin, A, B))
    if not merge:  # an adapter's hook adds to its own projection's output: one GEMM each (merging folds in place)
        merge_projections_(module, False)
    for name, lin, A, B in checked:
        if merge:
            with torch.no_grad():
                lin.weight += scale * (B @ A)
        else:
            lin.lora_A = nn.Linear(A.shape[1], A.shape[0], bias=False, device=A.device, dtype=A.dtype)
            lin.lora_B = nn.Linear(B.shape[1], B.shape[0], bias=False, device=B.device, dtype=B.dtype)
            with torch.no_grad():
                lin.lora_A.weight.copy_(A)
                lin.lora_B.weight.copy_(B)
            lin.lora_A.weight.requires_grad_(False)
            lin.lora_B.weight.requires_grad_(False)
            lin.lora_scale = scale
            lin._lora_handle = lin.register_forward_hook(_hook)
    return [name for name, *_ in checked]


def _fold(weight: torch.Tensor, lin: nn.Module) -> None:
    """weight += the adapter on `lin` (scale * B @ A), in place: the one fold of a merge and of a save."""
    with torch.no_grad():
        weight += lin.lora_scale * (lin.lora_B.weight @ lin.lora_A.weight)


def merge_lora(module: nn.Module) -> int:
    """Fold every attached adapter into its weight (once) and remove it. Returns the count merged."""
    n = 0
    for lin in list(module.modules()):
        if isinstance(lin, nn.Linear) and hasattr(lin, "lora_A"):
            _fold(lin.weight, lin)
            remove_lora_from(lin)
            n += 1
    if hasattr(module, "lora_spec"):
        del module.lora_spec
    return n


def folded_tensors(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """What a save of a model with adapters attached writes: the module's parameters and buffers by name, each adapted
    weight a copy with its adapter folded in (as `merge_lora` folds it: the same bits), the adapters' own tensors left
    out; the module is not changed. None where no adapter is attached. An adapter beside 8-bit weights cannot be
    folded: InputError naming what can be saved instead."""
    adapted = {name: lin for name, lin in module.named_modules() if hasattr(lin, "lora_A")}
    if not adapted:
        return None
    for name, lin in adapted.items():
        if _quantized(lin):
            raise InputError(f"{name} holds 8-bit weights (--linears) with a LoRA adapter beside them, which a "
                             "checkpoint cannot hold folded in; save the adapter (blockpress.train.lora.save_adapter)"
                             ", or load the model with linears='native' to save the merged model")
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        if is_adapter_tensor(name):
            continue
        if owner in adapted and leaf == "weight":
            t = t.detach().clone()
            _fold(t, adapted[owner])
        out[name] = t
    return out


def remove_lora_from(lin: nn.Linear) -> None:
    lin._lora_handle.remove()
    del lin.lora_A, lin.lora_B, lin.lora_scale, lin._lora_handle
