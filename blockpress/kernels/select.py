"""The one place that picks the kernels a model runs, from its options.

`configure(module, ...)` (what `BlockDiffusionLM` calls through `apply`, at load and in `configure`) quantises the
weights where the storage asks for it (one way: a quantised model stays quantised), then sets, on the module only:
- `module.ops` (model/ops.py): attention, the final-logit soft cap, the self-conditioning embedding (exact or
  top-K), the decoder block (eager or compiled) and the fixed-shape passes' attention kernel (opt-in);
- each `Router.kernel` (softmax, top-k, renormalisation and scale of the router's logits: the torch reference or
  one Triton kernel, kernels/route.py);
- each float `Experts.kernel` (a function of the expert weights), or each `QuantizedExperts`' backend, tiles and
  K sum; each `QuantizedLinear`'s backend and tiles;
- whether each layer's q/k/v and gate/up projections run as one GEMM each (`merge_projections`, model/layers.py
  `MergedLinear`: float or 8-bit; the int4 MLP's gate and up are one weight already).
Nothing else chooses a kernel: no registry, no module global, no method replaced.

"auto" resolves per device: experts -> "triton_checked" on a CUDA GPU with Triton (the kernel, compared with the
torch path on its first call per device, dtype and variant, and replaced by it with a warning if it fails or
disagrees), grouped GEMMs on a CPU that has them, else "dense"; attention -> "sdpa_gqa"; the soft cap and the
routing -> their checked Triton kernels on a GPU (the torch references elsewhere). `attention_kernel` (None: on
a Hopper GPU, `Options.attention_kernel_on`) gives the fixed-shape passes the checked Triton attention kernel on a
CUDA GPU (kernels/attention_fixed.py), and changes nothing elsewhere. Explicit "triton" skips the
first-use check (benchmarks and tests want the kernel, not a fallback); "loop" / "torch" are the references. With
compiled blocks the kernels a block calls are custom ops (kernels/library.py), so a block traces as one graph.
Where the Triton kernels run and no tiles / key runs are asked for, the ones `blockpress tune` kept for this card and
these shapes are used (`_tuned`, kernels/tuned.py), else the defaults.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import InputError
from ..model.layers import attention_eager, attention_sdpa, merge_projections_, softcap_logits
from ..model.ops import Ops
from ..options import EMBEDDING_FORMATS, LINEAR_FORMATS, PRECISIONS, Options
from ._triton import triton, usable_on
from .attention import attention_sdpa_gqa
from .attention_fixed import FIXED_ATTENTION, fixed_attention_op, parse_attention_tiles, with_split
from .compiled import compiled_block
from .library import FLOAT_EXPERTS, float_experts, float_experts_op, kernel_of
from .linear_q import (QuantizedLinear, as_linear_tiles, linear_tiles_spec, quantize_embeddings_, quantize_linears_,
                       quantized_linears)
from .moe_grouped import _grouped_mm_ok, _wgmma_target, as_tiles, default_tiles
from .quant import (QuantizedExperts, QuantizedMLP, check_experts_precision, quantize_experts_, quantize_mlp_,
                    run_format)
from .route import ROUTE, route_op
from .sc_topk import soft_embedding_topk
from .softcap import softcap_triton, softcap_triton_checked
from . import tuned

ATTENTION = {"eager": attention_eager, "sdpa": attention_sdpa, "sdpa_gqa": attention_sdpa_gqa}
SOFTCAP = {"torch": softcap_logits, "triton": softcap_triton, "triton_checked": softcap_triton_checked}
EXPERT_NAMES = ("auto", "scaled_mm", "w8a8", "torch", *FLOAT_EXPERTS)


def auto_experts_backend(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...] = ()) -> str:
    """experts="auto": the checked Triton kernel on a CUDA GPU with Triton, else grouped GEMMs where they run for
    `dtype` and the experts' widths (hidden and intermediate size: `torch._grouped_mm` needs 16-byte row strides),
    else the padded batched path ("dense")."""
    if device.type == "cuda" and usable_on(device):
        return "triton_checked"
    if _grouped_mm_ok(device, dtype, widths):
        return "grouped"
    return "dense"


def check_names(experts: str = "auto", attention: str = "auto", linears: str = "native") -> None:
    """ValueError naming the choices when a kernel name is unknown (cheap: before loading any weights)."""
    if linears not in LINEAR_FORMATS:
        raise ValueError(f"unknown linears format {linears!r}; use one of {', '.join(LINEAR_FORMATS)}")
    if experts not in EXPERT_NAMES:
        raise ValueError(f"unknown experts backend {experts!r}; use one of {sorted(EXPERT_NAMES)}")
    if attention != "auto" and attention not in ATTENTION:
        raise ValueError(f"unknown attention backend {attention!r}; use one of {sorted({'auto', *ATTENTION})}")


def _store(module, precision: str, group_size: int, linears: str, embeddings: str = "native") -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {PRECISIONS}")
    if embeddings not in EMBEDDING_FORMATS:
        raise ValueError(f"unknown embeddings format {embeddings!r}; use one of {', '.join(EMBEDDING_FORMATS)}")
    if embeddings == "int8":
        quantize_embeddings_(module)  # (a table that is 8-bit stays so)
    if precision != "native" and not any(isinstance(layer.experts, QuantizedExperts) for layer in module.layers):
        quantize_experts_(module, precision, group_size)
    if linears == "int4-mlp":
        quantize_mlp_(module, group_size)  # (layers that hold a QuantizedMLP keep it)
    elif linears != "native" and not quantized_linears(module):
        merge_projections_(module, False)  # the float merged weights go with the float projections they replace
        quantize_linears_(module, linears)


def _experts(module, asked: str, tiles, moe_sum: str, compiled: bool, mlp_tiles=None) -> str:
    """Set every layer's experts kernel for the `experts` option `asked`; returns what runs (for reports). "auto":
    the fastest kernel here (`auto_experts_backend`); "w8a8" (fp8 activations wherever the weights are fp8) on
    experts that are not fp8, beside fp8 projections: the same. compiled: the blocks are compiled, so float experts
    go through their custom op (kernels/library.py; quantised experts choose theirs themselves). mlp_tiles: the int4
    MLPs' tiles where they differ from the experts' (None: the same)."""
    dev, dtype = module.device, module.dtype
    held = module.layers[0].experts
    quantized = isinstance(held, QuantizedExperts)
    fp8_linears = "fp8" if any(m.fmt == "fp8" for m in quantized_linears(module)) else "native"
    check_experts_precision(asked, held.fmt if quantized else "native", fp8_linears)
    auto = asked == "auto" or (asked == "w8a8" and not (quantized and held.fmt == "fp8"))
    name = auto_experts_backend(dev, dtype, _expert_widths(held)) if auto else asked
    if name in ("triton", "triton_checked") and not usable_on(dev):  # (it failed at the first pass: a traceback)
        need = "Triton (pip install 'blockpress[gpu]')" if triton is None else \
            "a CUDA GPU (or Triton's CPU interpreter: TRITON_INTERPRET=1)"
        raise ValueError(f"the {name} experts backend runs Triton kernels, which need {need}; use the default "
                         "experts backend here")
    if name == "scaled_mm":  # torch._scaled_grouped_mm: fp8 x fp8 on Hopper-class GPUs only
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            raise ValueError("the scaled_mm experts backend needs a CUDA GPU with fp8 matmuls (compute capability "
                             ">= 8.9: Ada, Hopper); use the default experts backend here")
    backend = "torch" if asked == "loop" else name if name in ("triton", "scaled_mm", "w8a8", "torch") else "auto"
    for layer in module.layers:  # int4 MLPs run on the quantised experts' kernels: "triton" where it runs, else torch
        if isinstance(layer.mlp, QuantizedMLP):
            mlp = layer.mlp.experts
            mlp.backend, mlp.moe_sum = "torch" if backend == "torch" else "auto", moe_sum
            mlp.tiles = tiles if mlp_tiles is None else mlp_tiles
    if quantized:
        for layer in module.layers:  # "triton" where it runs, else the torch reference
            layer.experts.backend, layer.experts.tiles, layer.experts.moe_sum = backend, tiles, moe_sum
        return module.layers[0].experts.resolved_backend(torch.empty(0, device=dev, dtype=dtype))
    name = "loop" if name == "torch" else name  # the plain PyTorch reference: "loop" and "torch" alike
    if name not in FLOAT_EXPERTS:
        raise ValueError(f"unknown experts backend {name!r}; use one of {sorted(FLOAT_EXPERTS)}")
    kernel = (float_experts_op if compiled else float_experts)(name, tiles, moe_sum)
    for layer in module.layers:
        layer.experts.kernel = kernel
    return name


def _expert_widths(experts) -> tuple[int, ...]:
    """The hidden and intermediate size of an `Experts` module (its down projection [E, H, Im]); () for quantised
    experts, which choose their kernels themselves."""
    down = getattr(experts, "down_proj", None)
    return tuple(down.shape[1:]) if isinstance(down, torch.Tensor) else ()


def _tuned(dev: torch.device, key: str, check) -> str | int | None:
    """The setting `blockpress tune` kept for `key` on this device, where the Triton kernels run (None: none kept,
    or kernels that have no such setting here)."""
    return tuned.lookup(dev, key, check) if usable_on(dev) else None


def _check_attention_tiles(spec) -> None:
    if not isinstance(spec, str):
        raise TypeError(f"an attention tiles spec is a string, got {spec!r}")
    parse_attention_tiles(spec)


def _attention_tiles(dev, text, dtype, tiles: str | None, split: int | None, from_file: dict) -> str:
    """The attention kernel's tiles spec: `tiles` as asked, else the ones tuned for this card and shapes (noted in
    `from_file`), else the defaults (''); an asked `split` sets every kind of layer's key runs over them."""
    if tiles is None:
        tiles = from_file["attention_tiles"] = _tuned(dev, tuned.attention_key(text, dtype), _check_attention_tiles)
    return with_split(tiles, split)


def configure(module, experts: str = "auto", attention: str = "auto", precision: str = "native",
              group_size: int = 64, sc_topk: int | None = None, linears: str = "native", compile: bool = False,
              moe_tiles=None, moe_sum: str = "kernel", linear_tiles=None,
              merge_projections: bool | None = None,
              attention_kernel: bool | None = None, attention_split: int | None = None,
              attention_tiles: str | None = None, embeddings: str = "native") -> dict:
    """Apply kernel / storage choices to a DiffusionGemmaModel in place; return what was chosen.
    sc_topk: None (exact self-conditioning) or K (soft embedding over the top-K tokens: kernels/sc_topk.py).
    linears: "native", or "int8" / "fp8" (attention and dense-MLP projections in 8 bits: kernels/linear_q.py);
    a module that already holds 8-bit linears keeps them. Their kernel follows `experts`: "loop" / "torch" (the
    references) -> the torch reference, "triton" -> the kernel unchecked, "scaled_mm" / "w8a8" -> fp8 linears with
    fp8 activations too (torch._scaled_mm / the Triton kernel, like the experts; int8 linears stay weight-only),
    else "auto" (checked on first use). "w8a8" thus means fp8 activations wherever the weights are fp8: it needs
    fp8 experts or fp8 linears, and experts in another format run as "auto" beside fp8 linears. moe_tiles /
    linear_tiles: spec strings of the Triton kernels' tiles (None: the tiles tuned for this card, format and shapes,
    `_tuned`, else the defaults, `moe_grouped.default_tiles` for the experts); moe_sum: "kernel" or "atomic".
    merge_projections: each layer's q/k/v and gate/up projections as one GEMM each (None: `Options.merges`'
    default); layers whose projections cannot merge (a LoRA adapter attached) run them one by one.
    attention_kernel: the fixed-shape passes' attention in the checked Triton kernel, on a CUDA GPU only (None:
    `Options.attention_kernel_on`; elsewhere it changes nothing); attention_tiles: that kernel's tiles per kind of
    layer (an attention tiles spec, kernels/attention_fixed.py `parse_attention_tiles`; None: the tuned ones, else
    the defaults); attention_split: its key runs per row block for every layer, over the tiles' (None: as they
    say, else 1). embeddings: "native", or
    "int8" (the embedding table, which is also the LM head, with a scale per token: kernels/linear_q.py
    QuantizedEmbedding; its LM head takes the projections' kernel choice). The returned dict's "tuned" names what
    came from `blockpress tune`'s file."""
    check_names(experts, attention, linears)
    if moe_sum not in ("kernel", "atomic"):
        raise ValueError(f"unknown MoE sum {moe_sum!r}; use 'kernel' (deterministic, default) or 'atomic'")
    if sc_topk is not None and (isinstance(sc_topk, bool) or not isinstance(sc_topk, int) or sc_topk < 1):
        raise ValueError(f"sc_topk must be a positive number of tokens or None, got {sc_topk}")
    _store(module, precision, group_size, linears, embeddings)
    if sc_topk is not None and module.quantized_table is not None:
        raise ValueError("sc_topk (self-conditioning over the top-K tokens) reads a float embedding table; this model "
                         "holds it in int8: use exact self-conditioning (sc_topk=None)")
    dev, dtype = module.device, module.dtype
    from_file = {}  # the settings that came from `blockpress tune`'s file
    lin = quantized_linears(module)
    if linear_tiles is None and lin:  # none asked for: the ones tuned for this card, format and shapes, else defaults
        key = tuned.linears_key(module.text, run_format(lin[0].fmt, experts), dtype)
        linear_tiles = from_file["linear_tiles"] = _tuned(dev, key, as_linear_tiles)
    lin_tiles = as_linear_tiles(linear_tiles)
    held, wgmma = module.layers[0].experts, _wgmma_target(dev)
    fmt = held.fmt if isinstance(held, QuantizedExperts) else "native"
    if moe_tiles is None:  # none asked for: the ones tuned for this card and these shapes, else the defaults
        key = tuned.experts_key(module.text, run_format(fmt, experts), dtype, getattr(held, "group_size", None))
        from_file["moe_tiles"] = _tuned(dev, key, as_tiles)
        mlp = module.layers[0].mlp
        if isinstance(mlp, QuantizedMLP):
            key = tuned.experts_key(module.text, "int4", dtype, mlp.experts.group_size, mlp=True)
            from_file["mlp_tiles"] = _tuned(dev, key, as_tiles)
        tiles = as_tiles(from_file["moe_tiles"]) if from_file["moe_tiles"] else default_tiles(fmt, wgmma)
        mlp_tiles = as_tiles(from_file["mlp_tiles"]) if from_file.get("mlp_tiles") else default_tiles("int4", wgmma)
    else:
        tiles, mlp_tiles = as_tiles(moe_tiles), None  # an int4 MLP: the tiles asked for too
    resolved = _experts(module, experts, tiles, moe_sum, compile, mlp_tiles)
    if "triton" not in resolved:  # kernels with no tiles (grouped GEMMs, scaled_mm, the references) ignore them
        from_file.pop("moe_tiles", None)
    fast = dev.type == "cuda" and usable_on(dev)
    softcap = routing = "torch" if experts in ("loop", "torch") or not fast else "triton" if experts == "triton" \
        else "triton_checked"
    _routing(module, routing, compile)
    table = [module.quantized_table] if module.quantized_table is not None else []
    for m in quantized_linears(module) + table:  # 8-bit: the experts' choice where it applies, else "auto"
        m.backend = "torch" if experts in ("loop", "torch") else "triton" if experts == "triton" else \
            experts if experts in ("scaled_mm", "w8a8") and m.fmt == "fp8" else "auto"
        m.tiles, m.tiles_spec = lin_tiles, linear_tiles_spec(lin_tiles)
    merged = merge_projections_(module, Options(merge_projections=merge_projections).validate().merges())
    attention = "sdpa_gqa" if attention == "auto" else attention
    fixed = "triton_checked" if fast and Options(attention_kernel=attention_kernel).validate().attention_kernel_on(dev) \
        else None
    attention_tiles = _attention_tiles(dev, module.text, dtype, attention_tiles, attention_split, from_file) \
        if fixed is not None else with_split(attention_tiles, attention_split)  # (a spec asked is checked anyway)
    module.ops = Ops(attention=ATTENTION[attention], softcap=SOFTCAP[softcap], soft_embedding=_soft_embedding(sc_topk),
                     block=compiled_block() if compile else None,
                     fixed_attention=_fixed_attention(fixed, compile, attention_tiles))
    q = (quantized_linears(module) or [None])[0]
    probe = torch.empty(0, device=dev, dtype=dtype)
    mlp4 = module.layers[0].mlp.experts if isinstance(module.layers[0].mlp, QuantizedMLP) else None
    lin = "native" if q is None and mlp4 is None else f"int4-mlp {mlp4.resolved_backend(probe)}" if q is None else \
        f"{q.fmt} {q.resolved_backend(probe)}"
    for key, runs in (("mlp_tiles", mlp4), ("linear_tiles", q)):  # tuned tiles a kernel without tiles ignores
        if runs is not None and "triton" not in runs.resolved_backend(probe):
            from_file.pop(key, None)
    return {"compiled_blocks": bool(compile), "experts": resolved, "attention": attention, "attention_kernel": fixed,
            **({"attention_tiles": attention_tiles} if fixed is not None else {}),
            "precision": precision,
            "sc_topk": sc_topk, "softcap": softcap, "routing": routing, "moe_tiles": tiles.spec(), "moe_sum": moe_sum,
            "linears": lin, "embeddings": "native" if not table else f"int8 {table[0].resolved_backend(probe)}",
            "merged_projections": merged,
            **({"linear_tiles": q.tiles_spec} if q is not None else {}),
            "triton": None if triton is None else triton.__version__,
            **({"tuned": {k: v for k, v in from_file.items() if v is not None}}
               if any(v is not None for v in from_file.values()) else {})}


def apply(module, old: Options | None, new: Options) -> dict | None:
    """Make `module` run as `new` says (it ran as `old`; None: a module just built or loaded). Returns `configure`'s
    answer where its kernels changed (CUDA graphs captured before must be captured again), else None."""
    fields = {f.name for f in dataclasses.fields(Options)} - {"sampler", "fuse_commit", "compact_rows", "cuda_graphs"}
    changed = new.changed(old) & fields if old is not None else fields
    if not changed:
        return None
    try:
        return configure(module, experts=new.experts, attention=new.attention, precision=new.precision,
                         group_size=new.group_size, sc_topk=new.sc_topk, linears=new.linears, compile=new.compile,
                         moe_tiles=new.moe_tiles, moe_sum=new.moe_sum, linear_tiles=new.linear_tiles,
                         merge_projections=new.merge_projections, attention_kernel=new.attention_kernel,
                         attention_split=new.attention_split, attention_tiles=new.attention_tiles,
                         embeddings=new.embeddings)
    except ValueError as e:
        raise InputError(str(e)) from None


def host_syncs(module) -> list[str]:
    """The experts kernels of `module` that read values back on the host (counts of the routing): they cannot be
    captured in a CUDA graph. The grouped GEMMs and the Triton kernels do not."""
    names = set()
    for layer in module.layers:
        ex = layer.experts
        if isinstance(ex, QuantizedExperts):
            if ex.backend not in ("triton", "auto", "w8a8", "triton-a8"):
                names.add(f"{ex.backend} ({ex.fmt})")
        else:
            name = kernel_of(ex.kernel)
            if name not in ("grouped", "triton", "triton_checked"):
                names.add(f"experts_{name}" if name else getattr(ex.kernel, "__name__", str(ex.kernel)))
    return sorted(names)


def _routing(module, name: str, compiled: bool) -> None:
    """Set every layer's routing kernel: the reference traces into a compiled block as it is, the kernels go through
    their custom op there."""
    if name not in ROUTE:
        raise ValueError(f"unknown routing kernel {name!r}; use one of {sorted(ROUTE)}")
    route = ROUTE[name] if name == "torch" or not compiled else functools.partial(route_op, kernel=name)
    for layer in module.layers:
        layer.router.kernel = route


def _fixed_attention(name: str | None, compiled: bool, tiles: str = ""):
    """`Ops.fixed_attention` for a `FIXED_ATTENTION` name (None: none, the passes' masks) with the kernel's tiles (an
    attention tiles spec, '' the defaults): through its custom op in compiled blocks."""
    if name is None:
        return None
    if name not in FIXED_ATTENTION:
        raise ValueError(f"unknown attention kernel {name!r}; use one of {sorted(FIXED_ATTENTION)} or None")
    if compiled:
        return functools.partial(fixed_attention_op, kernel=name, tiles=tiles)
    return FIXED_ATTENTION[name] if not tiles else functools.partial(FIXED_ATTENTION[name], tiles=tiles)


def _soft_embedding(sc_topk: int | None):
    return None if sc_topk is None else functools.partial(soft_embedding_topk, k=sc_topk)


_UNSET = object()


def use(module, *, attention: str | None = None, experts: str | None = None, softcap: str | None = None,
        sc_topk=_UNSET, routing: str | None = None, attention_kernel=_UNSET, attention_tiles: str = "") -> None:
    """Change some of a configured module's kernels by name and leave the others as they are (tests comparing a
    fast path with its reference, the trainer's experts). attention_kernel: a `FIXED_ATTENTION` name or None, on any
    device (Triton's interpreter on a CPU), with `attention_tiles` (an attention tiles spec)."""
    changes = {}
    if attention_kernel is not _UNSET:
        changes["fixed_attention"] = _fixed_attention(attention_kernel, module.ops.block is not None,
                                                      with_split(attention_tiles, None))
    if attention is not None:
        check_names(attention=attention)
        changes["attention"] = ATTENTION[attention]
    if softcap is not None:
        changes["softcap"] = SOFTCAP[softcap]
    if sc_topk is not _UNSET:
        changes["soft_embedding"] = _soft_embedding(sc_topk)
    if changes:
        module.ops = dataclasses.replace(module.ops, **changes)
    if routing is not None:
        _routing(module, routing, module.ops.block is not None)
    if experts is not None:
        check_names(experts=experts)
        ex = module.layers[0].experts
        tiles, moe_sum = (ex.tiles, ex.moe_sum) if isinstance(ex, QuantizedExperts) else \
            (getattr(ex.kernel, "keywords", {}).get("tiles", as_tiles(None)),
             getattr(ex.kernel, "keywords", {}).get("moe_sum", "kernel"))
        mlp = next((layer.mlp.experts for layer in module.layers if isinstance(layer.mlp, QuantizedMLP)), None)
        _experts(module, experts, tiles, moe_sum, module.ops.block is not None, None if mlp is None else mlp.tiles)


def _name(table: dict, fn) -> str:
    fn = getattr(fn, "func", fn)
    return next((k for k, v in table.items() if v is fn), getattr(fn, "__name__", str(fn)))


def kernel_names(module) -> dict:
    """What a configured module runs, by the names `configure` takes."""
    ops, ex, route = module.ops, module.layers[0].experts, module.layers[0].router.kernel
    fixed = ops.fixed_attention
    return {"attention": _name(ATTENTION, ops.attention), "softcap": _name(SOFTCAP, ops.softcap),
            "attention_kernel": None if fixed is None else fixed.keywords["kernel"]
            if getattr(fixed, "func", None) is fixed_attention_op else _name(FIXED_ATTENTION, fixed),
            "attention_tiles": None if fixed is None else getattr(fixed, "keywords", {}).get("tiles", ""),
            "routing": route.keywords["kernel"] if getattr(route, "func", None) is route_op else _name(ROUTE, route),
            "experts": ex.backend if isinstance(ex, QuantizedExperts) else kernel_of(ex.kernel) or str(ex.kernel),
            "compiled_blocks": ops.block is not None,
            "sc_topk": None if ops.soft_embedding is None else ops.soft_embedding.keywords["k"]}


__all__ = ["configure", "apply", "use", "check_names", "auto_experts_backend", "kernel_names", "host_syncs"]
