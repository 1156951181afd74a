"""How a loaded model runs: one options object, decided at `load()` (or `lm.configure()`), validated once.

- Engine: `sampler` ("exact": the reference's arithmetic and random draws; "fast": the fused one-pass sampler,
  another random stream, which also applies the final soft cap to the LM head's product), `fuse_commit` (encode
  a committed canvas in the next canvas's first denoising pass), `compact_rows` (denoise only the rows still
  denoising; None: on with a random stream per row), `cuda_graphs` (replay the model's passes as CUDA graphs; None:
  on a CUDA GPU where the kernels can be captured, see `graphs_on`; True on a CPU runs the same passes on their
  fixed buffers without capture, which is what the tests check), `compile`
  (torch.compile of the decoder blocks).
- Kernels: `experts`, `attention` ("auto": the fastest path that runs here; "loop" / "sdpa" the references),
  `sc_topk` (self-conditioning over the top-K tokens, an approximation), the Triton kernels' settings
  `moe_tiles`, `moe_sum`, `linear_tiles` (None: the tiles `blockpress tune` kept for this card, kernels/tuned.py,
  else the defaults), and `merge_projections` (each layer's q/k/v and
  gate/up projections as one GEMM each, inference only; None: on, see `merges`); `attention_kernel` (the
  fixed-shape passes' attention in one Triton kernel that reads the cache in place, kernels/attention_fixed.py;
  None: on a Hopper GPU, see `attention_kernel_on`), `attention_tiles` (that kernel's tiles per kind of layer, a
  spec such as "sliding:bm=32,split=2;full:split=1"; None: the tiles `blockpress tune` kept, else the defaults) and
  `attention_split` (that kernel's key tiles of a row block in that many runs for every layer, merged by a second
  kernel: more programs at batch 1; None: as the tiles say, else one run).
- Storage, fixed at load: `precision` of the experts ("native", "fp8", "int4", with `group_size`) and of the
  attention / dense-MLP projections (`linears`: "native", "int8", "fp8" for both; "int4-mlp": the dense MLP alone
  in int4 through the expert kernels), and of the token embedding table that is also the LM head (`embeddings`:
  "native", or "int8" with a scale per token, kernels/linear_q.py `QuantizedEmbedding`).

Kernel names and tile specs are checked by `kernels.select` when they are applied (still once, at load or
configure); everything else here. A bad value is an `InputError` naming the field and the choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import InputError

# the dtypes a model computes in, by every name load's dtype= and each command's --dtype take -> torch's name
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}

SAMPLERS = ("exact", "fast")
PRECISIONS = ("native", "fp8", "int4")
LINEAR_FORMATS = ("native", "int8", "fp8", "int4-mlp")
EMBEDDING_FORMATS = ("native", "int8")
MOE_SUMS = ("kernel", "atomic")
ENGINE_FIELDS = ("sampler", "fuse_commit", "compact_rows", "cuda_graphs", "compile")
STORAGE_FIELDS = ("precision", "group_size", "linears", "embeddings")


@dataclass(frozen=True)
class Options:
    sampler: str = "exact"
    fuse_commit: bool | None = None  # None: on where the model runs on a CUDA GPU (`fused`)
    compact_rows: bool | None = None
    cuda_graphs: bool | None = None  # None: on a CUDA GPU whose kernels can be captured (`graphs_on`)
    compile: bool = False
    experts: str = "auto"
    attention: str = "auto"
    sc_topk: int | None = None
    moe_tiles: str | None = None
    moe_sum: str = "kernel"
    linear_tiles: str | None = None
    attention_kernel: bool | None = None  # None: on Hopper GPUs (`attention_kernel_on`)
    attention_split: int | None = None  # None: as attention_tiles say, else 1
    attention_tiles: str | None = None  # None: the tiles tuned for this card (kernels/tuned.py), else the defaults
    precision: str = "native"
    group_size: int = 64
    linears: str = "native"
    embeddings: str = "native"
    merge_projections: bool | None = None  # None: merged (`merges`)

    def replace(self, **changes) -> "Options":
        """These options with `changes`, validated."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise InputError(f"unknown option {unknown[0]!r}; the options are "
                             f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> "Options":
        def one_of(name, choices):
            if getattr(self, name) not in choices:
                what = {"linears": "linears format", "embeddings": "embeddings format",
                        "moe_sum": "MoE sum"}.get(name, name)
                raise InputError(f"unknown {what} {getattr(self, name)!r}; use one of {', '.join(map(str, choices))}")

        one_of("sampler", SAMPLERS)
        one_of("precision", PRECISIONS)
        one_of("linears", LINEAR_FORMATS)
        one_of("embeddings", EMBEDDING_FORMATS)
        one_of("moe_sum", MOE_SUMS)
        if not isinstance(self.compile, bool):
            raise InputError(f"option compile must be True or False, got {self.compile!r}")
        if self.cuda_graphs not in (None, True, False):
            raise InputError(f"option cuda_graphs must be None (automatic), True or False, got {self.cuda_graphs!r}")
        if self.fuse_commit not in (None, True, False):
            raise InputError(f"option fuse_commit must be None (automatic), True or False, got {self.fuse_commit!r}")
        if self.attention_kernel not in (None, True, False):
            raise InputError(f"option attention_kernel must be None (automatic), True or False, got "
                             f"{self.attention_kernel!r}")
        if self.attention_split is not None and (isinstance(self.attention_split, bool) or not isinstance(
                self.attention_split, int) or not 1 <= self.attention_split <= 16):
            raise InputError(f"attention_split must be None (tuned, else 1) or a whole number of key runs from 1 to "
                             f"16, got {self.attention_split!r}")
        if self.attention_tiles is not None and not isinstance(self.attention_tiles, str):
            raise InputError(f"attention_tiles must be None (tuned, else the defaults) or a spec string such as "
                             f"'sliding:bm=32,split=2', got {self.attention_tiles!r}")
        if self.merge_projections not in (None, True, False):
            raise InputError(f"option merge_projections must be None (automatic), True or False, got "
                             f"{self.merge_projections!r}")
        if self.compact_rows not in (None, True, False):
            raise InputError(f"option compact_rows must be None, True or False, got {self.compact_rows!r}")
        if self.sc_topk is not None and (isinstance(self.sc_topk, bool) or not isinstance(self.sc_topk, int)
                                         or self.sc_topk < 1):
            raise InputError(f"sc_topk must be a positive number of tokens or None, got {self.sc_topk!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise InputError(f"group_size must be a positive integer, got {self.group_size!r}")
        if self.sc_topk is not None and self.embeddings != "native":
            raise InputError("sc_topk (self-conditioning over the top-K tokens) reads float embeddings; with "
                             "embeddings='int8' use exact self-conditioning (sc_topk=None)")
        if self.compile and self.experts in ("loop", "torch"):
            raise InputError("compile and the reference kernels (experts='loop'): the references are for checking "
                             "the fast paths as written; drop one of them")
        return self

    def fused(self, device: torch.device) -> bool:
        """Whether commits ride on the next canvas's first step for a model on `device`. None (the default) turns
        it on on a CUDA GPU: one weight read fewer per canvas (+4.6 % tok/s on an H200), where bf16 never matches
        the fp32 reference bit for bit anyway; and off on a CPU, where the fused pass's 2C-row GEMMs round
        differently from two C-row ones (fp32, last bits), which can flip a near-tie draw a few steps later (5 of
        the 66 seeded cases of benchmarks/token_check.py): the default keeps reference parity there."""
        return self.fuse_commit if self.fuse_commit is not None else device.type == "cuda"

    def graphs_on(self, device: torch.device, capturable: bool) -> bool:
        """Whether the engine replays the model's passes from CUDA graphs (capturable: its kernels never read the
        host, `kernels.select.host_syncs`). None (the default) turns them on on a CUDA GPU where they can be
        captured: a batch-1 step of the 26B model takes 25 ms replayed against 71 ms launched from Python on an H200
        (benchmarks/results/2026-11-26-h200-engine.md): the fixed-shape passes on fixed buffers, the eager engine's
        tokens in fp32 (bf16 may round otherwise); off on a CPU, where there is nothing to capture. True asks for them (on a CPU: the fixed-shape passes without capture, the tests' plumbing)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return device.type == "cuda" and capturable

    def merges(self) -> bool:
        """Whether each layer's q/k/v (q/k in a full layer) and gate/up projections run as one GEMM each (inference;
        model/layers.py `MergedLinear`: the weights concatenated once, the parameters views of them). None (the
        default) merges on every device: on a CPU the merged GEMM gives the separate GEMMs' numbers bit for bit
        (fp32 and bf16 with MKL; tests/test_merged_projections.py, the 66 cases of benchmarks/token_check.py), so
        the reference's tokens stay; on a GPU each projection is a launch that moves a few microseconds of bytes
        (205 a pass on the 26B model, 120 merged), and cuBLAS may round the wider GEMM differently, as bf16 never
        matches the reference bit for bit anyway. On an H100: −0.38 ms of a 21.8 ms step
        (benchmarks/results/2026-11-27-h100-stack.md)."""
        return self.merge_projections is not False

    def attention_kernel_on(self, device: torch.device) -> bool:
        """Whether the fixed-shape passes (CUDA graphs, compiled blocks) run their attention in the Triton kernel
        (kernels/attention_fixed.py; elsewhere a mask over the cache through SDPA). None (the default) turns it on
        on a CUDA GPU of compute capability 9 (H100, H200), where it was timed: the compiled, graphed fp8 step of the
        26B model at batch 1 went from 18.81 to 17.56 ms on an H100. Its tiles need ~160-210 KB of shared memory a
        block, more than most other GPUs give (it would fall back to SDPA with a warning there); True asks for it
        anywhere on CUDA. On a CPU it never runs (the interpreter would be far slower than SDPA)."""
        if device.type != "cuda":
            return False
        if self.attention_kernel is not None:
            return self.attention_kernel
        import torch

        return torch.cuda.get_device_capability(device)[0] == 9

    def changed(self, other: "Options") -> set[str]:
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)}
