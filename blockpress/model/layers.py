"""Building blocks of the DiffusionGemma text stack: RMSNorm, rotary tables, attention, dense MLP.

Shape legend: B batch, S query chunk, L key length, H hidden, nh query heads, kv KV heads,
D head dim, I intermediate size.

Numerics follow spec section 2.12: norm statistics in fp32 (result cast back), rotary angles in
fp32 with cos/sin cast to the activation dtype, attention scaling exactly 1.0 and softmax in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 in fp32, times `weight` (not 1 + weight), cast back to x.dtype."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm_reference` as one call to torch's RMSNorm (statistics in fp32 for 16-bit inputs too).

    The model runs ~11 norms per layer per pass; at batch 1 on a CPU each costs its op count in
    dispatch, not arithmetic (7 ops in the reference, 1 here: 30 -> 20 us each on a small model).
    Bit-identical to the reference on CPU in fp32/bf16/fp16 (tests/test_layers_fast.py); a CUDA
    kernel may round differently, which the GPU test bounds."""
    if weight is not None and weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """fp32 inverse frequencies [D/2] for 'default' or 'proportional' RoPE, on the default device. (Computed on the
    CPU: arithmetic on the meta device, where loading builds the model, imports torch._dynamo, ~1 s a start.)"""
    theta = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (theta ** exponents)
    if params.get("rope_type", "default") == "proportional":
        n_rot = int((float(params.get("partial_rotary_factor", 1.0)) * head_dim) // 2)
        inv[n_rot:] = 0.0
        factor = params.get("factor")
        if factor is not None:
            inv = inv / float(factor)
    return inv.to(torch.get_default_device())


def rope_cos_sin_reference(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [S] (int) -> cos, sin [S, D] in `dtype` (angles computed in fp32)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [S, D/2]
    emb = torch.cat([angles, angles], dim=-1)  # [S, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, S, D]; half-split convention: dim i pairs with i + D/2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """The tables `apply_rope` takes: cos [S, D] and sin [S, D] with its first half negated.

    Folding the sign of the rotation into the table turns the reference's rotate-half (two slices,
    a negation and a concatenation per call) into one `roll`; -a * b == a * -b exactly, so the
    result is bit-identical to `apply_rope_reference(x, *rope_cos_sin_reference(...))`."""
    cos, sin = rope_cos_sin_reference(inv_freq, positions, dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, h, S, D] with the tables of `rope_cos_sin`: x * cos + [x2, x1] * [-sin, sin]."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask: 0 where `allowed`, the dtype's minimum elsewhere. Consumes `allowed` (negated in
    place; pass a tensor no one reads after), so that the one mask-sized float tensor is the only allocation: at a
    128K-token prompt the full layers' mask of a 2,048-token chunk is 0.54 GB in bf16, and a copy of it, or of its
    boolean negation, counts."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(allowed.logical_not_(), torch.finfo(dtype).min)


def attention_eager(q, k, v, mask):
    """Reference attention. q [B,nh,S,D], k/v [B,kv,L,D], mask additive [B|1,1,S|1,L] or None."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: query head h reads KV head h // groups
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))  # scaling is exactly 1.0
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def attention_sdpa(q, k, v, mask):
    """Fused path (torch SDPA): same function as `attention_eager` up to rounding."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


class MergedLinear:
    """Bias-free projections of one input as one GEMM (inference): their weights concatenated along the output rows
    into one tensor per weight field, and each part's own field re-pointed at its rows (`.data`: the same parameter
    or buffer object, now a view), so no weight is held twice and the modules, their names and the state dict stay
    as they were (saving, loading, LoRA and training see the separate projections).

    A part is an `nn.Linear` without bias (field `weight`, product `F.linear`) or a module naming its fields in
    `MERGE_FIELDS` with a product `linear_with(x, *fields)` (the 8-bit `QuantizedLinear`: int8 / fp8 rows and their
    per-row scales). The owner (`Projections`) runs it where `live_merge` says it computes what the parts would."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.parts = tuple(getattr(owner, n) for n in names)
        first = self.parts[0]
        self.fields = ("weight",) if isinstance(first, nn.Linear) else first.MERGE_FIELDS
        self.linear = F.linear if isinstance(first, nn.Linear) else first.linear_with
        self.sizes = tuple(p.out_features for p in self.parts)
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: the parameters may train later
            self.tensors = tuple(torch.cat([getattr(p, f) for p in self.parts]) for f in self.fields)
            row = 0
            for p, n in zip(self.parts, self.sizes):
                for f, whole in zip(self.fields, self.tensors):
                    getattr(p, f).data = whole[row:row + n]  # the old tensor goes once nothing else holds it
                row += n
        # what `intact` checks, read from the modules' own tables (an nn.Module attribute lookup costs ~0.5 us)
        self.held = tuple((name, p, tuple((p._parameters if f in p._parameters else p._buffers, f, getattr(p, f))
                                          for f in self.fields)) for name, p in zip(names, self.parts))

    @staticmethod
    def mergeable(owner: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether the projections `names` of `owner` can run as one: one kind, bias-free, no hooks (a LoRA adapter
        adds its product in one), plain tensors on one device in one dtype (not a sharded training copy), the same
        kernel settings (8-bit)."""
        parts = [getattr(owner, n, None) for n in names]
        kind = type(parts[0])
        if not (issubclass(kind, nn.Linear) or hasattr(kind, "MERGE_FIELDS")) \
                or any(type(p) is not kind or p._forward_hooks or p._forward_pre_hooks for p in parts):
            return False
        if issubclass(kind, nn.Linear):
            fields = [(p.weight,) for p in parts]
            if any(p.bias is not None for p in parts):
                return False
        else:
            fields = [tuple(getattr(p, f) for f in kind.MERGE_FIELDS) for p in parts]
            if len({(p.fmt, p.backend, p.tiles_spec) for p in parts}) > 1:
                return False
        return all(type(t.data) is torch.Tensor for ts in fields for t in ts) \
            and all(len({(t.device, t.dtype) for t in column}) == 1 for column in zip(*fields))

    def intact(self, owner: nn.Module) -> bool:
        """Whether `owner` still holds the same parts with the same weight tensors and no hooks: a module swapped
        (quantised), a parameter replaced (a sharded training copy, loading with assign) or an adapter attached
        since the merge turns the merged GEMM off (falls back to the parts)."""
        modules = owner._modules
        for name, p, held in self.held:
            if modules.get(name) is not p or p._forward_hooks or p._forward_pre_hooks:
                return False
            for table, f, t in held:
                if table.get(f) is not t:
                    return False
        return True

    def __call__(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """The parts' outputs [..., out] from one product. first: skip the parts before it (their rows lead, so the
        rest is one slice of the merged weight)."""
        tensors = self.tensors
        if first:
            row = sum(self.sizes[:first])
            tensors = tuple(t[row:] for t in tensors)
        return self.linear(x, *tensors).split(self.sizes[first:], dim=-1)

    def __deepcopy__(self, memo):
        return None  # a deep copy's parameters are clones, not views of a merged tensor: the copy runs unmerged


class Projections(nn.Module):
    """A module whose input projections (`MERGED`, or what `merge_names` says) may run as one GEMM: `self.merged`,
    a `MergedLinear` or None. Merging is an inference setting (kernels.configure, option `merge_projections`)."""

    MERGED: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.merged: MergedLinear | None = None

    def merge_names(self) -> tuple[str, ...]:
        return self.MERGED

    def merge(self, on: bool = True) -> bool:
        """Merge the projections (on) or run them one by one (off; the weights stay where they are, views of the
        merged tensor). Parts that cannot be merged (`MergedLinear.mergeable`) are left separate. Returns whether
        they are merged."""
        names = self.merge_names()
        if not on or not MergedLinear.mergeable(self, names):
            self.merged = None
        elif self.merged is None or not self.merged.intact(self):
            self.merged = None  # its tensors go before the new ones are made
            self.merged = MergedLinear(self, names)
        return self.merged is not None

    def live_merge(self) -> MergedLinear | None:
        """The merged projections where they compute what the parts would: merged, intact, and no autograd (the
        parts' parameters get no gradient through the merged tensor)."""
        m = self.merged
        return m if m is not None and not torch.is_grad_enabled() and m.intact(self) else None

    def _apply(self, fn, recurse=True):  # .to() / .half(): the weights move one by one; merged again afterwards
        was, self.merged = self.merged is not None, None
        out = super()._apply(fn, recurse)
        if was:
            self.merge()
        return out


def merge_projections_(module: nn.Module, on: bool) -> int:
    """`Projections.merge(on)` on every such module in `module`; returns how many run merged."""
    return sum(m.merge(on) for m in module.modules() if isinstance(m, Projections))


class Attention(Projections):
    """Sliding or full attention. Full layers have no v_proj: V = v_norm(k_proj(x)) (k = v). Merged (inference): q, k
    and v (q and k in a full layer) in one GEMM, q's rows first."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, full: bool, eps: float):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.full = n_heads, n_kv, head_dim, full
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.v_proj = None if full else nn.Linear(hidden, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.eps = eps

    def merge_names(self) -> tuple[str, ...]:
        return ("q_proj", "k_proj") if self.v_proj is None else ("q_proj", "k_proj", "v_proj")

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,S,H] -> q [B,nh,S,D], k [B,kv,S,D], v [B,kv,S,D] (post-norm, post-RoPE)."""
        B, S, _ = x.shape
        q, k, v = self._projections(x, queries=True)
        q = self.q_norm(q.view(B, S, self.n_heads, self.head_dim)).transpose(1, 2)  # [B, heads, S, D]
        return (apply_rope(q, cos, sin), *self._kv(k, v, cos, sin))

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,S,H] -> k, v [B,kv,S,D] (post-norm, post-RoPE): what the KV cache keeps of a layer."""
        _, k, v = self._projections(x, queries=False)
        return self._kv(k, v, cos, sin)

    def _projections(self, x: torch.Tensor, queries: bool):
        """q (None without queries), k, v [B,S,out] of x; v is k in a full layer. Merged: one GEMM (without queries,
        over the merged weight's k and v rows only: no q computed), else one per projection."""
        m = self.live_merge()
        if m is not None:
            q, k, *v = m(x) if queries else (None, *m(x, first=1))
        else:
            q, k = self.q_proj(x) if queries else None, self.k_proj(x)
            v = [] if self.v_proj is None else [self.v_proj(x)]
        return q, k, v[0] if v else k

    def _kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, S, _ = k.shape
        k_raw, v_raw = k.view(B, S, self.n_kv, self.head_dim), v.view(B, S, self.n_kv, self.head_dim)
        k = self.k_norm(k_raw).transpose(1, 2)
        v = rms_norm(v_raw, None, self.eps).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


def softcap_logits(logits: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `cap * tanh(logits / cap)` of the LM head's product (the reference; no autograd: in place, so one
    [B, C, V] fp32 buffer is live instead of three, 268 MB each on the 26B model). Each of its four passes
    reads and writes the whole tensor: kernels/softcap.py does the same in one. out: an fp32 tensor of the
    logits' shape to write into (CUDA graphs: one logits buffer shared by every captured pass)."""
    return (logits.float() if out is None else out.copy_(logits)).div_(cap).tanh_().mul_(cap)


SOFTMAX_CHUNK = 1 << 24  # elements per fp32 chunk of `softmax_rows` (64 MB)


SOFTMAX_IN_DTYPE_ON_CUDA = True  # softmax_rows on a GPU: one kernel in the input's dtype (tests switch it off)


def softmax_rows(z: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.softmax(z.float(), -1).to(dtype)`, computed a block of rows at a time into the `dtype` result (`out`,
    a contiguous `dtype` tensor of z's shape, when given and no gradient is recorded: the same numbers, written there
    instead of a new tensor).

    Each row's softmax is independent of the others, so the result is the same (bit for bit on CPU, tested;
    a GPU picks its softmax kernel by the row length: a GPU test checks it, not yet run); what changes is
    memory: for the 26B model's self-conditioning input ([256, 262144] per row of the batch) the one-shot form
    holds an fp32 copy and an fp32 softmax (268 MB each) at once, this holds 64 MB chunks of them. Under
    autograd: the one-shot form.

    On a CUDA GPU, when z already has the result's dtype (bf16 logits held between steps): `torch.softmax(z)`,
    one kernel that reads bf16, computes in fp32 (CUDA's softmax accumulates bf16 in float) and writes bf16.
    The fp32 round trip costs ~1.3 GB of traffic a step on the 26B model (the cast, the fp32 softmax, the copy
    back), this ~0.4 GB. Not bit for bit: its sum runs in another order, so an element on a bf16 rounding
    boundary may round the other way (a GPU test bounds it, not yet run). The meta device (memory accounting,
    lab/memory.py) takes the GPU's path."""
    V = z.shape[-1]
    if z.requires_grad or (out is not None and torch.is_grad_enabled()):
        out = None
    if out is not None and (out.shape != z.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"softmax_rows(out=...) takes a contiguous {dtype} tensor of shape {list(z.shape)}")
    if (z.is_cuda or z.is_meta) and z.dtype == dtype and not z.requires_grad and SOFTMAX_IN_DTYPE_ON_CUDA:
        return torch.softmax(z, dim=-1) if out is None else torch.ops.aten._softmax.out(z, -1, False, out=out)
    rows = max(1, SOFTMAX_CHUNK // max(V, 1))
    flat = z.reshape(-1, V)
    if z.requires_grad or (flat.shape[0] <= rows and out is None):
        return torch.softmax(z.float(), dim=-1).to(dtype)
    res = (torch.empty(flat.shape, dtype=dtype, device=z.device) if out is None else out).view(flat.shape)
    for i in range(0, flat.shape[0], rows):
        res[i:i + rows] = torch.softmax(flat[i:i + rows].float(), dim=-1)
    return res.view(z.shape)


class MLP(Projections):
    """Gated GELU(tanh) MLP: down(gelu(gate(x)) * up(x)). Merged (inference): gate and up in one GEMM."""

    MERGED = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.live_merge()
        gate, up = m(x) if m is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(gelu_tanh(gate) * up)


def embed_scale(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(H) cast to the weight dtype (53.0 in bf16 for H = 2816)."""
    return torch.tensor(math.sqrt(hidden), dtype=torch.float32).to(dtype)
