"""Fast paths, each beside its torch reference, and the one place that chooses between them (select.py).

- experts: grouped GEMMs and the fused Triton kernel (moe_grouped.py); fp8 / int4 expert weights (quant.py);
  routing (softmax, top-k, renormalise, per-expert scale) in one Triton kernel (route.py);
- the custom ops a compiled block calls, so it traces as one graph (library.py; quant.py, linear_q.py, route.py);
- attention: SDPA reaching its fused kernels with grouped KV heads (attention.py); the fixed-shape passes'
  attention in one Triton kernel reading the cache in place (attention_fixed.py, opt-in);
- the 8-bit attention and dense-MLP projections (linear_q.py);
- the final-logit soft cap in one pass (softcap.py); the fused sampler (sampler_fused.py); self-conditioning over
  the top-K tokens (sc_topk.py); a compiled decoder block (compiled.py).
Importing this package changes nothing: `select.configure` sets what a model runs, from its options.
"""

from __future__ import annotations

from .linear_q import QuantizedLinear, quantize_linears_, quantized_linears
from .quant import QuantizedExperts, quantize_experts_
from .select import auto_experts_backend, check_names, configure, kernel_names, use

__all__ = ["configure", "use", "check_names", "auto_experts_backend", "kernel_names", "QuantizedExperts",
           "quantize_experts_", "QuantizedLinear", "quantize_linears_", "quantized_linears"]
