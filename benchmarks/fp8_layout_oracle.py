"""The fp8 checkpoint layout against compressed-tensors' own code (the library llm-compressor writes it with): an
independent reading of the same bytes. Needs `pip install compressed-tensors` (not a blockpress dependency).

    python benchmarks/fp8_layout_oracle.py

Checks, on random weights with rows spanning four decades:
- compressed-tensors' dequantize of blockpress's stored fp8 bytes and scales (by output channel) equals blockpress's
  own dequantisation, for a projection and for every expert of a gate_up / down pair;
- its quantize with blockpress's scales gives blockpress's bytes;
- the quantization_config `save` writes validates as its QuantizationConfig, and reads back as fp8 by channel.
Prints each result, then a JSON line."""

from __future__ import annotations

import json

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

from blockpress.kernels.linear_q import dequantize_rows
from blockpress.kernels.quant import dequantize_fp8, quantize_fp8
from blockpress.model.prequantized import fp8_channel_scheme, quantization_config


def main() -> dict:
    g = torch.Generator().manual_seed(0)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    out = {}
    w = torch.randn(96, 80, generator=g) * torch.logspace(-3, 1, 96)[:, None]
    q, s = quantize_fp8(w)
    theirs = dequantize(q, s[:, None], None, args=args, dtype=torch.float32)
    ours_w = dequantize_rows(q, s, "fp8", torch.float32)
    out["projection_dequantize_max_abs_diff"] = float((ours_w - theirs).abs().max())
    qt = quantize(w, s[:, None], torch.zeros_like(s[:, None]), args=args, dtype=torch.float8_e4m3fn)
    out["projection_quantize_same_bytes"] = torch.equal(qt.view(torch.uint8), q.view(torch.uint8))
    experts = torch.randn(4, 48, 80, generator=g) * torch.logspace(-3, 1, 48)[None, :, None]
    qe, se = quantize_fp8(experts)
    ours = dequantize_fp8(qe, se, torch.float32)
    out["experts_dequantize_max_abs_diff"] = max(
        float((dequantize(qe[e], se[e][:, None], None, args=args, dtype=torch.float32) - ours[e]).abs().max())
        for e in range(qe.shape[0]))
    qc = quantization_config()
    parsed = QuantizationConfig.model_validate(qc)
    wargs = parsed.config_groups["group_0"].weights
    kind = tuple(str(getattr(v, "value", v)) for v in (wargs.num_bits, wargs.type, wargs.strategy))
    out["saved_config_validates"] = kind == ("8", "float", "channel") and fp8_channel_scheme(qc) is None
    for k, v in out.items():
        print(f"{k}: {v}")
    print(json.dumps({"bench": "fp8_layout_oracle", **out}))
    return out


if __name__ == "__main__":
    main()
