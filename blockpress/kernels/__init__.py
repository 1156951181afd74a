"""Fast paths, each beside its torch reference, and the one place that chooses between them.

Importing this package registers the extra backends (registration only; the model files keep
their references):
- experts (`model.moe.EXPERT_BACKENDS`): "grouped" (torch._grouped_mm, moe_grouped.py),
  "triton" (fused Triton kernel, moe_grouped.py), "triton_checked" (the same, compared with the torch
  path on its first call and replaced by it, with a warning, if it disagrees or fails);
- attention (`model.layers.ATTENTION_BACKENDS`): "sdpa_gqa" (attention.py);
- the final-logit soft cap (`model.layers.SOFTCAP_BACKENDS`): "triton", "triton_checked" (softcap.py).
Low-precision experts (quant.py) replace `layer.experts` by module swap, 8-bit linears (linear_q.py) the
attention and dense-MLP projections; the fused sampler
(sampler_fused.py) and the CUDA-graph decoder (graphs.py) are opt-in.

`configure(module, ...)` applies a choice ("auto" resolves per device) and returns what it chose,
so benchmarks can print it. Choices for "auto":
- experts: CUDA + Triton -> "triton_checked"; Hopper bf16 or CPU -> "grouped"; else the model's "dense"
  (explicit "triton" skips the first-use check: benchmarks and tests want the kernel, not a fallback).
- attention: "sdpa_gqa".
"""

from __future__ import annotations

import torch

from ..model.layers import ATTENTION_BACKENDS
from ..model.moe import EXPERT_BACKENDS
from ._triton import triton, usable_on
from .attention import attention_sdpa_gqa
from .compiled import blocks_compiled, compile_blocks_
from .moe_grouped import _grouped_mm_ok, experts_grouped, experts_triton, experts_triton_checked
from .linear_q import LINEAR_FORMATS, QuantizedLinear, quantize_linears_, quantized_linears
from .quant import QuantizedExperts, quantize_experts_
from .softcap import softcap_triton  # noqa: F401  (registers the soft-cap backends)

EXPERT_BACKENDS.setdefault("grouped", experts_grouped)
EXPERT_BACKENDS.setdefault("triton", experts_triton)
EXPERT_BACKENDS.setdefault("triton_checked", experts_triton_checked)
ATTENTION_BACKENDS.setdefault("sdpa_gqa", attention_sdpa_gqa)

PRECISIONS = ("native", "fp8", "int4")


def auto_experts_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and usable_on(device):
        return "triton_checked"
    if _grouped_mm_ok(device, dtype):
        return "grouped"
    return "dense"


def check_names(experts: str = "auto", attention: str = "auto", linears: str = "native") -> None:
    """ValueError naming the choices when a backend name is unknown (cheap: before loading any weights)."""
    if linears not in LINEAR_FORMATS:
        raise ValueError(f"unknown linears format {linears!r}; use one of {', '.join(LINEAR_FORMATS)}")
    known = {"auto", "scaled_mm", "torch", *EXPERT_BACKENDS}
    if experts not in known:
        raise ValueError(f"unknown experts backend {experts!r}; use one of {sorted(known)}")
    if attention != "auto" and attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; use one of {sorted({'auto', *ATTENTION_BACKENDS})}")


def configure(module, experts: str = "auto", attention: str = "auto", precision: str = "native",
              group_size: int = 64, sc_topk: int | None = None, linears: str = "native",
              compile_blocks: bool | None = None) -> dict:
    """Apply backend / precision choices to a DiffusionGemmaModel in place; return the choices.
    sc_topk: None (exact self-conditioning) or K (soft embedding over the top-K tokens: kernels/sc_topk.py).
    linears: "native", or "int8" / "fp8" (attention and dense-MLP projections in 8 bits: kernels/linear_q.py);
    a module that already holds 8-bit linears keeps them. Their kernel follows `experts`: "loop" / "torch" (the
    references) -> the torch reference, "triton" -> the kernel unchecked, "scaled_mm" -> fp8 linears with fp8
    activations too (w8a8, like the experts), else "auto" (checked on first use).
    compile_blocks: True / False wraps / unwraps each decoder block in torch.compile (kernels/compiled.py; opt-in,
    inference); None leaves it as it is."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {PRECISIONS}")
    check_names(experts, attention, linears)
    dev, dtype = module.device, module.dtype
    if precision != "native" and not any(isinstance(layer.experts, QuantizedExperts) for layer in module.layers):
        quantize_experts_(module, precision, group_size)
    if linears != "native" and not quantized_linears(module):
        quantize_linears_(module, linears)
    asked = experts
    if experts == "auto":
        experts = auto_experts_backend(dev, dtype)
    quantized = isinstance(module.layers[0].experts, QuantizedExperts)
    if experts == "scaled_mm":  # torch._scaled_grouped_mm: fp8 x fp8 on Hopper-class GPUs only
        if not (quantized and module.layers[0].experts.fmt == "fp8"):
            raise ValueError("the scaled_mm experts backend needs fp8 experts; add --precision fp8")
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            raise ValueError("the scaled_mm experts backend needs a CUDA GPU with fp8 matmuls (compute capability "
                             ">= 8.9: Ada, Hopper); use the default experts backend here")
    # the final-logit soft cap: one Triton pass on a GPU (checked on first use), the reference elsewhere
    module.softcap_backend = "torch" if asked in ("loop", "torch") or not (dev.type == "cuda" and usable_on(dev)) \
        else "triton" if asked == "triton" else "triton_checked"
    for m in quantized_linears(module):  # QuantizedLinear: the experts' choice where it applies, else "auto"
        m.backend = "torch" if asked in ("loop", "torch") else "triton" if asked == "triton" else \
            "scaled_mm" if asked == "scaled_mm" and m.fmt == "fp8" else "auto"
    if quantized:
        for layer in module.layers:  # QuantizedExperts: "triton" where it runs, else the torch reference
            layer.experts.backend = "torch" if experts == "loop" else \
                experts if experts in ("triton", "scaled_mm", "torch") else "auto"  # "loop": the reference
        resolved = module.layers[0].experts.resolved_backend(torch.empty(0, device=dev, dtype=dtype))
    else:
        if experts not in EXPERT_BACKENDS:
            raise ValueError(f"unknown experts backend {experts!r}; use one of {sorted(EXPERT_BACKENDS)}")
        module.set_experts_backend(experts)
        resolved = experts
    if attention == "auto":
        attention = "sdpa_gqa"
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; use one of {sorted(ATTENTION_BACKENDS)}")
    module.attention_backend = attention
    if sc_topk is not None and int(sc_topk) < 1:
        raise ValueError(f"sc_topk must be a positive number of tokens or None, got {sc_topk}")
    module.sc_topk = None if sc_topk is None else int(sc_topk)
    if compile_blocks is not None:
        compile_blocks_(module, compile_blocks)
    q = (quantized_linears(module) or [None])[0]
    return {"compiled_blocks": blocks_compiled(module), "experts": resolved, "attention": attention,
            "precision": precision, "sc_topk": module.sc_topk,
            "linears": "native" if q is None else
            f"{q.fmt} {q.resolved_backend(torch.empty(0, device=dev, dtype=dtype))}",
            "softcap": module.softcap_backend,
            "triton": None if triton is None else triton.__version__}


__all__ = ["configure", "compile_blocks_", "check_names", "auto_experts_backend", "PRECISIONS", "LINEAR_FORMATS",
           "QuantizedExperts", "quantize_experts_", "QuantizedLinear", "quantize_linears_"]
