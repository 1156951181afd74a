"""The pre-quantised checkpoint layouts `save` writes, read by compressed-tensors' own code (the library
llm-compressor writes them with and vLLM reads them with): an independent reading of the same files. Needs
`pip install compressed-tensors` (not a blockpress dependency).

    python benchmarks/quantized_layout_oracle.py

For a tiny random model saved in each storage blockpress has (int4 experts by group with int8 projections; fp8
experts with the dense MLP in int4; fp8 experts and projections, which `save` describes as llm-compressor does, one
group targeting "Linear"; int4 experts beside float projections):
- the quantization_config validates as compressed-tensors' QuantizationConfig;
- every quantised tensor's module is targeted by exactly one config group (its matcher: names, regexes and the
  "Linear" class, less the ignore list), and no float projection or router is (a reader would look for scales there);
- that group's compressor (`pack-quantized` / `float-quantized`) decompresses the stored tensors into the weights
  blockpress computes with (its modules' dequantisation), to the bit;
- the same compressor, given those weights and the stored scales, compresses them into the stored tensors.
Prints each result, then a JSON line."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import is_match
from torch import nn
from safetensors.torch import load_file

import blockpress
from blockpress.kernels.linear_q import QuantizedLinear
from blockpress.train import sizes

VARIANTS = {"int4 experts + int8 projections": dict(precision="int4", group_size=32, linears="int8"),
            "fp8 experts + int4 MLP": dict(precision="fp8", linears="int4-mlp", group_size=16),
            "fp8 experts + fp8 projections": dict(precision="fp8", linears="fp8"),
            "int4 experts, float projections": dict(precision="int4", group_size=32)}
LINEAR = nn.Linear(1, 1, bias=False)
QUANTISED = re.compile(r"^(.*)\.(weight|weight_packed)$")
EXPERT = re.compile(r"layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj$")
PROJ = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)$")


def ours(lm, name: str) -> torch.Tensor:
    """The fp32 weight blockpress computes with for checkpoint module `name`, from its loaded modules."""
    m, n = EXPERT.search(name), PROJ.search(name)
    if m:
        ex, e, proj = lm.module.layers[int(m.group(1))].experts, int(m.group(2)), m.group(3)
    else:
        layer = lm.module.layers[int(n.group(1))]
        lin = getattr(getattr(layer, n.group(2)), n.group(3), None)
        if isinstance(lin, QuantizedLinear):
            return lin.dequantize(torch.float32)
        ex, e, proj = layer.mlp.experts, 0, n.group(3).removesuffix("_proj")
    if proj == "down":
        return ex.dequantize("down", e).float()
    w = ex.dequantize("gate_up", e).float()
    return w[:ex.inter] if proj == "gate" else w[ex.inter:]


def check(lm, folder: Path) -> dict:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    sd = load_file(folder / "model.safetensors")
    diff, one_group, float_targeted, same_bytes, modules = 0.0, True, [], True, 0
    for key, t in sd.items():
        m = QUANTISED.match(key)
        if not m:
            continue
        name = m.group(1)
        # each projection is an nn.Linear in a model llm-compressor quantises: its matcher, by name and by class
        groups = [g for g in parsed.config_groups.values() if is_match(name, LINEAR, g.targets, parsed.ignore or [])]
        if t.is_floating_point() and t.dtype != torch.float8_e4m3fn:  # a float weight
            if groups and "proj" in name:
                float_targeted.append(name)
            continue
        modules += 1
        if len(groups) != 1:
            one_group = False
            continue
        scheme = groups[0]
        compressor = BaseCompressor.get_value_from_registry(scheme.format or parsed.format)
        local = {k.removeprefix(name + "."): v for k, v in sd.items() if k.startswith(name + ".weight")}
        theirs = compressor.decompress(local, scheme)["weight"].float()
        mine = ours(lm, name)
        diff = max(diff, float((theirs - mine).abs().max()))
        again = compressor.compress({"weight": mine.to(local["weight_scale"].dtype), "weight_scale":
                                     local["weight_scale"]}, scheme)
        stored = "weight_packed" if "weight_packed" in local else "weight"
        a, b = again[stored], local[stored]
        same_bytes &= a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return {"config_validates": True, "quantised_modules": modules, "each_in_one_group": one_group,
            "float_projections_targeted": float_targeted, "dequantize_max_abs_diff": diff,
            "compress_same_bytes": same_bytes}


def main() -> dict:
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        flt = blockpress.from_config(sizes.model_config("nano", vocab_size=256, canvas_length=8, context=16),
                                     seed=0).save(Path(tmp) / "float")
        for i, (label, opts) in enumerate(VARIANTS.items()):
            lm = blockpress.load(flt, progress=False, **opts)
            out[label] = check(lm, lm.save(Path(tmp) / f"v{i}"))
            print(f"{label}: {out[label]}")
    print(json.dumps({"bench": "quantized_layout_oracle", **out}))
    return out


if __name__ == "__main__":
    main()
