"""Merged projections (model/layers.py MergedLinear, option `merge_projections`): each layer's q/k/v (q/k in a full
layer) and gate/up run as one GEMM each at inference, with the weights concatenated once and the parameters views of
them. On a CPU the merged GEMM gives the separate GEMMs' numbers bit for bit (fp32 and bf16), so the CPU tests ask
for equality; the GPU test bounds the difference (cuBLAS picks its algorithm per shape)."""

import collections
import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import blockpress
from blockpress import kernels
from blockpress.errors import InputError
from blockpress.kernels.linear_q import QuantizedLinear
from blockpress.lab.presets import preset_config
from blockpress.model.layers import merge_projections_
from blockpress.options import Options

pytestmark = pytest.mark.no_grad

C = 16  # the tiny preset's canvas


def _lm(dtype=torch.float32, merge=True, device="cpu", **options):
    return blockpress.from_config(preset_config("tiny")[0], device=device, dtype=dtype, seed=0, init_std=0.3,
                                  merge_projections=merge, **options)


def _merged(module):
    return [m.merged for m in module.modules() if getattr(m, "merged", None) is not None]


def _inputs(module, batch=2, prompt=21):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, module.text.vocab_size, (batch, prompt), generator=g)
    return ids.to(module.device), torch.randint(0, module.text.vocab_size, (batch, C), generator=g).to(module.device)


def _passes(module, ids, canvas):
    """A prompt's prefill (its last layer writing K/V only), a denoising step, one with self-conditioning and a
    commit fused with the next step: their logits and the cache they leave."""
    cache = module.new_cache(ids.shape[0], ids.shape[1] + 3 * C)
    module.encode(ids, cache, output=False)
    z = module.decode(canvas, cache)
    z2 = module.decode(canvas.flip(-1), cache, z)
    z3 = module.encode_decode(canvas, canvas.flip(-1), cache, sc_logits=z2)
    return [z, z2, z3, *cache.keys, *cache.values]


def _equal(got, want):
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class GemmCount(TorchDispatchMode):
    """The ops a call runs, counted at the dispatcher (F.linear arrives there as `mm`)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _gemms(fn) -> int:
    with GemmCount() as count:
        fn()
    return count.ops["mm"] + count.ops["addmm"]


def _saved(layers, kv_only_last=False) -> int:
    """GEMMs merging saves in a pass over `layers`: q/k/v -> 1 (sliding) or q/k -> 1 (full), gate/up -> 1; a last
    layer that writes K/V only (a prefill's) runs k/v as 1 in a sliding layer."""
    body = layers[:-1] if kv_only_last else layers
    n = sum(2 if layer.full else 3 for layer in body)
    return n + (0 if layers[-1].full else 1) if kv_only_last else n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_generation_gives_the_separate_projections_tokens_and_logits(dtype):
    """A seeded generation (prefill, denoising steps, commits, adaptive stops) gives the same tokens merged and
    unmerged, and every pass the same logits and cache bit for bit (a CPU GEMM sums each output column in the same
    order whatever the other columns)."""
    kw = dict(max_new_tokens=3 * C, max_denoising_steps=6, eos_token_id=None, pad_token_id=0,
              stability_threshold=0, confidence_threshold=2.5)
    rows = [[7, 8, 9, 10, 11], list(range(20, 45)), [300, 5, 301]]
    got = {}
    for merge in (False, True):
        lm = _lm(dtype, merge)
        assert len(_merged(lm.module)) == (2 * len(lm.module.layers) if merge else 0)
        seqs = lm.generate(rows, generator=torch.Generator().manual_seed(3), **kw).sequences
        got[merge] = [seqs, *_passes(lm.module, *_inputs(lm.module))]
    _equal(got[True], got[False])


def test_the_merged_path_is_taken_one_gemm_per_group():
    """Counted at the dispatcher, not mocked: merged, a denoising pass runs 2 GEMMs fewer per sliding layer (q/k/v)
    and 1 fewer per full layer (q/k), and 1 fewer per layer for gate/up; a prefill whose last layer writes K/V only
    runs a sliding layer's k and v as one GEMM over the merged weight's last rows (no q computed)."""
    counts = {}
    for merge in (False, True):
        m = _lm(merge=merge).module
        ids, canvas = _inputs(m)
        cache = m.new_cache(2, ids.shape[1] + C)
        counts[merge] = (_gemms(lambda: m.encode(ids, cache, output=False)), _gemms(lambda: m.decode(canvas, cache)))
    layers = m.layers
    assert counts[False][1] - counts[True][1] == _saved(layers) == 16  # 4 sliding, 2 full layers
    assert counts[False][0] - counts[True][0] == _saved(layers, kv_only_last=True)
    attn = m.layers[0].self_attn  # sliding
    x = torch.randn(2, 5, attn.q_proj.in_features)
    cos = sin = torch.ones(5, attn.head_dim)
    want = attn.project(x, cos, sin)
    assert _gemms(lambda: attn.project_kv(x, cos, sin)) == 1 and _gemms(lambda: attn.project(x, cos, sin)) == 1
    _equal(attn.project_kv(x, cos, sin), want[1:])
    attn.merge(False)
    assert _gemms(lambda: attn.project_kv(x, cos, sin)) == 2 and _gemms(lambda: attn.project(x, cos, sin)) == 3
    _equal(attn.project(x, cos, sin), want)


def test_merged_weights_are_views_and_the_state_dict_and_saved_checkpoint_are_unchanged(tmp_path):
    """The projections' parameters become views of the merged tensor (the same objects: no second copy of any
    weight), the state dict keeps its names, shapes and values, and `lm.save` writes the same bytes."""
    plain, merged = _lm(merge=False), _lm(merge=True)
    sd_plain, sd_merged = plain.module.state_dict(), merged.module.state_dict()
    assert list(sd_plain) == list(sd_merged)
    assert all(torch.equal(sd_plain[k], sd_merged[k]) and sd_merged[k].is_contiguous() for k in sd_plain)
    groups = _merged(merged.module)
    for g in groups:
        (whole,) = g.tensors
        storage = whole.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == storage for p in g.parts)
        assert sum(p.weight.numel() for p in g.parts) == whole.numel()

    def held_bytes(module):  # every distinct storage the parameters and the merged tensors hold
        ts = [*module.parameters(), *(t for g in _merged(module) for t in g.tensors)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())

    assert held_bytes(merged.module) == held_bytes(plain.module)  # not doubled
    plain.save(tmp_path / "plain")
    merged.save(tmp_path / "merged")
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == \
        (tmp_path / "merged" / "model.safetensors").read_bytes()
    back = blockpress.load(tmp_path / "merged", progress=False, tokenizer=False)
    assert len(_merged(back.module)) == 2 * len(back.module.layers)  # merged at load, by default
    back_plain = blockpress.load(tmp_path / "merged", progress=False, tokenizer=False, merge_projections=False)
    assert not _merged(back_plain.module)
    ids, canvas = _inputs(back.module)
    _equal(_passes(back.module, ids, canvas), _passes(back_plain.module, ids, canvas))


def test_weights_changed_in_place_reach_the_merged_gemm_and_moves_merge_again():
    """Writes into a parameter (loading a state dict, folding an adapter in) land in the merged tensor; `.to()`
    moves the weights one by one and merges them again (views of the new merged tensor); a deep copy runs
    unmerged (its parameters are clones)."""
    lm, ref = _lm(), _lm(merge=False)
    g = torch.Generator().manual_seed(1)
    new = {k: torch.randn(v.shape, generator=g) * 0.3 if "proj" in k else v for k, v in ref.module.state_dict().items()}
    lm.module.load_state_dict(new)
    ref.module.load_state_dict(new)
    ids, canvas = _inputs(lm.module)
    _equal(_passes(lm.module, ids, canvas), _passes(ref.module, ids, canvas))
    for module in (lm.module, ref.module):
        module.to(torch.bfloat16)
    assert len(_merged(lm.module)) == 2 * len(lm.module.layers) and not _merged(ref.module)
    g0 = _merged(lm.module)[0]
    assert g0.tensors[0].dtype == torch.bfloat16
    assert all(p.weight.untyped_storage().data_ptr() == g0.tensors[0].untyped_storage().data_ptr() for p in g0.parts)
    _equal(_passes(lm.module, ids, canvas), _passes(ref.module, ids, canvas))
    twin = copy.deepcopy(lm.module)
    assert not _merged(twin)
    _equal(_passes(twin, ids, canvas), _passes(ref.module, ids, canvas))


def test_autograd_replaced_parameters_and_hooks_fall_back_to_the_separate_projections():
    """Never a wrong number: with autograd on, the merged GEMM would leave q/k/v and gate/up without gradients, so
    the separate ones run (the same gradients as an unmerged model); a parameter replaced after merging (a sharded
    training copy, loading with assign=True) or a hook on a projection turns the merged path off."""
    lm, ref = _lm(), _lm(merge=False)
    ids, canvas = _inputs(lm.module)
    with torch.enable_grad():
        for m in (lm.module, ref.module):
            cache = m.new_cache(2, ids.shape[1] + C)
            m.encode(ids, cache)
            m.decode(canvas, cache).float().square().mean().backward()
    for (n, p), (_, q) in zip(lm.module.named_parameters(), ref.module.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        assert p.grad is None or torch.equal(p.grad, q.grad), n
    attn = lm.module.layers[0].self_attn
    x = torch.randn(1, 3, attn.q_proj.in_features)
    cos = sin = torch.ones(3, attn.head_dim)
    handle = attn.k_proj.register_forward_hook(lambda mod, i, out: out + 1)
    assert attn.live_merge() is None and _gemms(lambda: attn.project(x, cos, sin)) == 3
    handle.remove()
    assert attn.live_merge() is not None
    attn.v_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.v_proj.weight))
    assert attn.live_merge() is None
    assert torch.equal(attn.project(x, cos, sin)[2], torch.zeros(1, attn.n_kv, 3, attn.head_dim))
    assert attn.merge() and attn.live_merge() is not None  # merged again from what it holds now
    assert torch.equal(attn.project(x, cos, sin)[2], torch.zeros(1, attn.n_kv, 3, attn.head_dim))


def test_lora_adapters_unmerge_and_folded_adapters_stay_merged(tmp_path):
    """Attaching adapters (training, or an unmerged adapter at load) runs the projections one by one (each adapter's
    hook adds to its projection's output); a later configure merges only the groups without an adapter. Folding an
    adapter into the weights (merge=True) writes into the merged tensor: the merged GEMM keeps running, with the
    numbers of an unmerged model folded the same way."""
    from blockpress.train import lora as L

    lm = _lm()
    spec = L.LoraSpec(rank=2, alpha=4.0, targets=("v_proj", "up_proj"))  # full layers have no v_proj
    L.add_lora(lm.module, spec)
    assert not _merged(lm.module)
    g = torch.Generator().manual_seed(2)
    for p in L.lora_state(lm.module).values():
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
    L.save_adapter(lm.module, tmp_path / "ad", spec)
    lm.configure(merge_projections=False)
    lm.configure(merge_projections=True)
    layers = lm.module.layers
    assert [layer.self_attn.merged is not None for layer in layers] == [layer.full for layer in layers]
    assert all(layer.mlp.merged is None for layer in layers)
    ids, canvas = _inputs(lm.module)
    want = _passes(lm.module, ids, canvas)

    attached, folded, plain = _lm(), _lm(), _lm(merge=False)
    L.apply_adapter(attached, tmp_path / "ad")
    assert not _merged(attached.module)
    _equal(_passes(attached.module, ids, canvas), want)
    L.apply_adapter(folded, tmp_path / "ad", merge=True)
    L.apply_adapter(plain, tmp_path / "ad", merge=True)
    assert len(_merged(folded.module)) == 2 * len(folded.module.layers)
    _equal(_passes(folded.module, ids, canvas), _passes(plain.module, ids, canvas))


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t  # fp8 has no == on a CPU


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_projections_merge_rows_and_scales(fmt):
    """8-bit projections (--linears int8 / fp8) merge too: int8 / fp8 rows and their per-row scales concatenated,
    run by the first part's kernel and settings; the same logits (the torch reference kernel on a CPU: the rows are
    dequantised one by one either way) and one GEMM per group."""
    got = {}
    for merge in (False, True):
        lm = _lm(merge=merge, linears=fmt)
        m = lm.module
        assert isinstance(m.layers[0].self_attn.q_proj, QuantizedLinear)
        ids, canvas = _inputs(m)
        cache = m.new_cache(2, ids.shape[1] + C)
        m.encode(ids, cache)
        got[merge] = _gemms(lambda: m.decode(canvas, cache)), _passes(m, ids, canvas), m.state_dict()
    assert got[False][0] - got[True][0] == _saved(m.layers)
    _equal(got[True][1], got[False][1])
    assert list(got[True][2]) == list(got[False][2])
    assert all(torch.equal(_bits(got[True][2][k]), _bits(got[False][2][k])) for k in got[True][2])
    g = m.layers[0].self_attn.merged
    q, scale = g.tensors
    assert q.dtype == m.layers[0].self_attn.q_proj.weight_q.dtype and scale.shape == (q.shape[0],)
    assert all(p.weight_q.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() for p in g.parts)


def test_the_option_its_default_and_configure_report():
    """`merge_projections`: None (the default) merges on every device (the rule in `Options.merges`), False keeps
    one GEMM per projection; configure reports how many groups run merged; a bad value is one InputError."""
    assert Options().merge_projections is None and Options().merges() is True
    assert Options(merge_projections=False).merges() is False
    with pytest.raises(InputError, match="merge_projections must be None"):
        Options().replace(merge_projections="yes")
    lm = _lm(merge=None)
    n = 2 * len(lm.module.layers)
    assert len(_merged(lm.module)) == n
    m = lm.module
    assert kernels.configure(m, experts="grouped", merge_projections=False)["merged_projections"] == 0
    assert not _merged(m)
    assert kernels.configure(m, experts="grouped")["merged_projections"] == n
    assert merge_projections_(m, False) == 0 and merge_projections_(m, True) == n
    lm.configure(merge_projections=False)
    assert not _merged(lm.module)


def test_a_compiled_block_runs_the_merged_gemm_without_graph_breaks():
    """Under torch.compile the merged path traces into the block's graph: one graph per kind of layer (the merged
    tensors are graph inputs like the parameters, no recompile per layer), no graph break, and fewer linear calls in
    each graph. Counted with a backend that records dynamo's graphs and runs them as they are (inductor's are the
    same graphs; tests/test_compiled.py runs those, merged by default)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from blockpress.model.diffusion_gemma import Block

    def linears(merge):
        cfg = copy.deepcopy(preset_config("tiny")[0])
        cfg["text_config"].update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
        lm = blockpress.from_config(cfg, seed=0, init_std=0.3, merge_projections=merge)
        m = lm.module
        kernels.configure(m, experts="grouped", attention="sdpa_gqa", compile=True, merge_projections=merge)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(sum(n.op == "call_function" and "linear" in str(n.target) for n in gm.graph.nodes))
            return gm.forward

        ids, canvas = _inputs(m)
        cache = m.new_cache(2, ids.shape[1] + C)
        m.encode(ids, cache)
        start = torch.tensor(cache.length)
        want = m.decode(canvas, cache, start=start)
        m.ops = dataclasses.replace(m.ops, block=torch.compile(Block.forward, backend=backend))
        torch._dynamo.reset()
        counters.clear()
        got = m.decode(canvas, cache, start=start)
        assert dict(counters["graph_break"]) == {}
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # as test_compiled's: fp32 reassociation
        return graphs

    merged, plain = linears(True), linears(False)
    assert len(merged) == len(plain) == 2  # a sliding and a full block, 4 layers
    assert [a - b for a, b in zip(plain, merged)] == [3, 2]  # q/k/v + gate/up; q/k + gate/up


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_merged_projections_on_a_gpu_agree_with_the_separate_ones(dtype, tol):
    """On a CUDA GPU cuBLAS picks its algorithm per shape, so the merged GEMM may round differently from the
    separate ones: each pass's logits agree within tol of their largest (fp32: reassociation; bf16: a last-bit
    difference in an activation carried through six layers), and the merged path runs fewer GEMMs."""
    got = {}
    for merge in (False, True):
        m = _lm(dtype, merge, device="cuda", experts="auto", attention="auto").module
        ids, canvas = _inputs(m)
        got[merge] = _passes(m, ids, canvas)[:3]
    for a, b in zip(got[True], got[False]):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
