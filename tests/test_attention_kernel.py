"""kernels/attention_fixed.py: the fixed-shape passes' attention in one Triton kernel that reads the cache in place,
against `model.layers.attention_eager` with the mask of the rules in model/keys.py (Triton's interpreter on a CPU,
the compiled kernel on a GPU)."""

import copy
import types
import warnings

import pytest
import torch

import blockpress
from blockpress import kernels
from blockpress.config import FULL, SLIDING
from blockpress.kernels import moe_grouped
from blockpress.kernels.attention_fixed import (fixed_attention_checked, fixed_attention_op, fixed_attention_torch,
                                                fixed_attention_triton)
from blockpress.model.keys import decoder_sees, encoder_sees
from blockpress.model.layers import additive_mask, attention_eager
from blockpress.options import Options

from hf_oracle import TINY_TEXT
from kernel_device import DEV, needs_triton

pytestmark = [pytest.mark.no_grad, needs_triton]

W = 8  # the sliding window of these tests


def _cache(B, kv, D, R, end, dtype, seed, pad=True):
    """K/V of positions [0, end) (position order, [B, kv, end, D]) and the same in a layer's buffers of R slots
    (position p in slot p % R: a ring once end > R, else slot p), and a padding mask [B, end + 5] (row 1 padded on
    the left; with pad, row 0 has a hole in its middle too)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, kv, end, D, generator=g).to(dtype) for _ in range(2))
    keys, values = (torch.zeros(B, kv, R, D, dtype=dtype) for _ in range(2))
    for p in range(end):  # later positions overwrite earlier ones, as the passes write
        keys[:, :, p % R], values[:, :, p % R] = k[:, :, p], v[:, :, p]
    valid = torch.ones(B, end + 5, dtype=torch.bool)
    if pad:
        valid[-1, :5] = False
        valid[0, end // 2:end // 2 + 3] = False
    return k.to(DEV), v.to(DEV), keys.to(DEV), values.to(DEV), valid.to(DEV)


def _rules_mask(t, T0, S, C, valid, dtype):
    """[B, 1, S+C, T0+S+C] additive: the chunk's rows by `encoder_sees` (and the padding), the canvas's by
    `decoder_sees`, over the positions [0, T0+S+C) in order."""
    model = types.SimpleNamespace(window=W, bidirectional_encoder=False)
    kpos = torch.arange(T0 + S + C, device=valid.device)
    valid = valid[:, :T0 + S + C]
    rows = []
    if S:
        rows.append(encoder_sees(model, t, T0 + torch.arange(S, device=valid.device), kpos, T0 + S)[None]
                    & valid[:, None])
    if C:
        rows.append(decoder_sees(model, t, T0 + S, C, kpos, valid)[:, None].expand(-1, C, -1))
    return additive_mask(torch.cat(rows, 1)[:, None], dtype)


CASES = [  # (layer type, query heads per KV head, head dim, slots of a sliding layer: None for every position)
    (FULL, 1, 16, None), (SLIDING, 2, 16, None), (FULL, 8, 32, None), (SLIDING, 2, 16, W + 16),
    (SLIDING, 8, 32, W + 16), (FULL, 2, 64, None)]
ROWS = [(0, 8), (5, 0), (8, 8), (1, 0)]  # (S, C): a canvas, an encoder chunk, a fused commit + canvas, an AR token


def _compare(t, G, D, R, dtype, T, tiles=None, B=2, kv=2, seed=0, rows=ROWS):
    """The kernel against attention_eager with the rules' mask for each (S, C) of `rows` (the pass's rows at
    [T - S, T + C)); fp32: within fp32 summation order; bf16: against the fp32 function of the same bf16 inputs, no
    further off than attention_eager in bf16 (which rounds its scores to bf16 before the softmax) or the output's
    own rounding."""
    end = T + max(C for _, C in rows)
    k, v, keys, values, valid = _cache(B, kv, D, R or end + 5, end, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for S, C in rows:
        T0 = T - S
        q = (torch.randn(B, kv * G, S + C, D, generator=g) / D ** 0.25).to(dtype).to(DEV)
        start = torch.tensor(T0, device=DEV)
        got = fixed_attention_triton(q, keys, values, valid, start, S, W if t == SLIDING else 0, R is not None,
                                     tiles=tiles)
        n = T0 + S + C
        mask = _rules_mask(t, T0, S, C, valid, torch.float32)
        want = attention_eager(q.float(), k[:, :, :n].float(), v[:, :, :n].float(), mask)
        err = (got.float() - want).abs().max().item()
        if dtype == torch.float32:
            assert err < 1e-5, (S, C, err)
        else:
            eager = attention_eager(q, k[:, :, :n], v[:, :, :n], mask.to(dtype)).float()
            rel = ((got.float() - want).norm() / want.norm()).item()
            rel_eager = ((eager - want).norm() / want.norm()).item()
            assert rel <= max(1.5 * rel_eager, 6e-3), (S, C, rel, rel_eager)  # ~4e-3: the bf16 output's rounding
            assert err <= 2 * (eager - want).abs().max().item() + 2 ** -8, (S, C, err)
        assert got.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,G,D,R", CASES)
def test_the_kernel_is_the_rules_of_every_pass(t, G, D, R, dtype):
    """Full and sliding layers, GQA groups 1 / 2 / 8, padding rows (a left-padded row, a hole in another), a ring
    that wrapped (29 positions through 24 slots), T = 21 not a multiple of the key tile (16); a canvas, an encoder
    chunk, a fused commit + canvas and one token."""
    _compare(t, G, D, R, dtype, T=21)


@pytest.mark.parametrize("t,R", [(SLIDING, W + 16), (FULL, None)])
def test_long_caches_other_tiles_and_a_ring_round_several_times(t, R):
    """T = 61 (the ring of 24 slots wrapped twice), query tiles of 32 rows (4 queries of a group of 8 per tile), the
    output's columns in two programs (DV = 16 of 32)."""
    _compare(t, 8, 32, R, torch.float32, T=61, tiles={"BM": 32, "BN": 16, "DV": 16}, B=1, kv=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [FULL, SLIDING])
def test_head_dim_512_at_a_small_sequence(t, dtype):
    """The 26B model's full-layer head dim (and its 8 query heads per KV head), on a short cache."""
    _compare(t, 8, 512, None, dtype, T=19, B=1, kv=1, rows=[(0, 8), (4, 4)])


@pytest.mark.parametrize("t,G,D,R,dtype,T,tiles", [
    (SLIDING, 8, 32, W + 16, torch.float32, 61, {"BM": 32, "BN": 16, "DV": 16, "SPLIT": 2}),
    (FULL, 2, 64, None, torch.bfloat16, 21, {"SPLIT": 3}),
    (FULL, 8, 512, None, torch.float32, 19, {"SPLIT": 2})])
def test_the_keys_split_into_runs_merge_to_the_same_attention(t, G, D, R, dtype, T, tiles):
    """SPLIT runs of the key tiles per row block (flash-decoding's split, for more programs at batch 1), merged by
    their log-sum-exps: a ring wrapped twice with the output's columns in two programs, a run that sees no key (3
    runs of 2 tiles) in bf16, head dim 512."""
    _compare(t, G, D, R, dtype, T=T, tiles=tiles, B=1 if D == 512 else 2, kv=1 if D == 512 else 2,
             rows=[(0, 8), (4, 4)] if D == 512 else ROWS)


@needs_triton
def test_a_row_that_sees_no_key_is_zero_in_both_and_keeps_the_kernel_on(monkeypatch):
    """A left-padding position with nothing valid before it sees no key: the kernel writes 0, the reference (SDPA over
    a mask of finfo.min) wrote the mean of every slot, so a first call with such a row switched a correct kernel off
    ("disagrees ... please report")."""
    monkeypatch.setattr(moe_grouped, "FIRST_USE", {})
    g = torch.Generator().manual_seed(0)
    B, kv, G, D, S, P = 2, 1, 2, 16, 6, 6
    q, keys, values = (torch.randn(B, h, n, D, generator=g).to(DEV) for h, n in ((kv * G, S), (kv, P), (kv, P)))
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded by 3: its first 3 positions see nothing
    args = (q, keys, values, valid.to(DEV), torch.tensor(0, device=DEV), S, 0, False)
    ref = fixed_attention_torch(*args)
    assert (ref[1, :, :3] == 0).all() and (ref[0] != 0).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "disagrees" warning
        got = fixed_attention_checked(*args)
    assert torch.allclose(got, ref, atol=1e-5) and all(v for v in moe_grouped.FIRST_USE.values())


def test_a_bad_split_is_refused():
    q = torch.zeros(1, 2, 4, 16, device=DEV)
    keys = torch.zeros(1, 1, 8, 16, device=DEV)
    with pytest.raises(ValueError, match="SPLIT"):
        fixed_attention_triton(q, keys, keys, torch.ones(1, 8, dtype=torch.bool, device=DEV),
                               torch.tensor(0, device=DEV), 0, 0, False, tiles={"SPLIT": 0})


def test_attention_tiles_specs_per_kind_of_layer():
    """An attention tiles spec: a part for every kind of layer or for one ('kind:'), later parts over earlier ones;
    one written form; `attention_split` sets every kind's key runs over it; a bad part is named."""
    from blockpress.kernels.attention_fixed import attention_tiles_spec, kind_tiles, parse_attention_tiles, with_split

    assert parse_attention_tiles("") == parse_attention_tiles(None) == {} and with_split(None, None) == ""
    got = parse_attention_tiles("bm=32,split=2; full:dv=128,split=1")
    assert got == {"sliding": {"BM": 32, "SPLIT": 2}, "full": {"BM": 32, "DV": 128, "SPLIT": 1}}
    assert attention_tiles_spec(got) == "sliding:bm=32,split=2;full:bm=32,dv=128,split=1"
    assert parse_attention_tiles(attention_tiles_spec(got)) == got  # the written form reads back the same
    assert with_split("full:dv=128", 3) == "sliding:split=3;full:dv=128,split=3"
    assert with_split("full:dv=128", None) == "full:dv=128"
    assert dict(kind_tiles("full:dv=128", 0)) == {"DV": 128} and kind_tiles("full:dv=128", 8) == ()
    for bad, words in (("bm=0", "bad attention tile setting 'bm=0'"), ("bk=64", "bk=64"), ("bm", "'bm'"),
                       ("middle:bm=32", "unknown kind of layer 'middle'")):
        with pytest.raises(ValueError, match=words):
            parse_attention_tiles(bad)


def test_the_torch_reference_reads_the_same_slots():
    """`fixed_attention_torch` (the first-use check's reference: the rules' mask over every slot, the position
    each holds computed on the device) is the same function, ring or not."""
    for t, R in ((SLIDING, W + 16), (SLIDING, None), (FULL, None)):
        k, v, keys, values, valid = _cache(2, 1, 16, R or 34, 29, torch.float32, 3)
        for S, C in ROWS:
            T0 = 21 - S
            q = torch.randn(2, 2, S + C, 16, generator=torch.Generator().manual_seed(S)).to(DEV)
            got = fixed_attention_torch(q, keys, values, valid, torch.tensor(T0, device=DEV), S,
                                        W if t == SLIDING else 0, R is not None)
            n = T0 + S + C
            want = attention_eager(q, k[:, :, :n], v[:, :, :n], _rules_mask(t, T0, S, C, valid, torch.float32))
            assert (got - want).abs().max() < 1e-5
            assert got.stride() == fixed_attention_triton(q, keys, values, valid, torch.tensor(T0, device=DEV), S,
                                                          W if t == SLIDING else 0, R is not None).stride()


@pytest.fixture(scope="module")
def tiny():
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": TINY_TEXT, "canvas_length": 8},
                               seed=0).module.to(DEV)
    for p in m.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    m.prefill_chunk = 8  # a ring: W 8 + max(8, 2 canvases) = 24 slots
    kernels.use(m, attention="sdpa_gqa")
    return m


def _passes(m, cache, canvas, kernel, tiles=""):
    """A denoising step, a fused commit + step and a commit, in their fixed-shape form, with `kernel` as the
    fixed-shape attention (None: the masks) at `tiles` (an attention tiles spec); returns their outputs and the cache
    after them."""
    kernels.use(m, attention_kernel=kernel, attention_tiles=tiles)
    try:
        cache = copy.deepcopy(cache)
        T = cache.length
        start = torch.tensor(T, device=DEV)
        out = [m.decode(canvas, cache, start=start), m.encode_decode(canvas, canvas.flip(-1), cache, start=start)]
        cache.note_write(T, 16)
        out.append(m.encode(canvas, cache, start=start + 8))  # the commit of the canvas after
        cache.note_write(T + 8, 8)
        return out, cache
    finally:
        kernels.use(m, attention_kernel=None)


@pytest.mark.parametrize("ring,tiles", [(False, ""), (True, ""), (True, "split=2"),
                                        (True, "sliding:bm=32,split=3;full:bn=32,split=2")])
def test_a_tiny_models_fixed_shape_passes_with_the_kernel(tiny, ring, tiles):
    """The tiny model (head dims 16 and 32, groups 2 and 4, a window of 8) on a left-padded 30-token prompt: the
    fixed-shape passes with the kernel selected give the logits and hidden states of the default fixed-shape passes
    (masks over the cache, SDPA), on a cache that keeps every position and on a ring (24 slots, wrapping); the keys
    in one run, in two for every layer (`attention_split=2` sets that), and each kind of layer with tiles of its
    own (what `blockpress tune` keeps)."""
    B = 2
    ids = torch.randint(5, 512, (B, 30), generator=torch.Generator().manual_seed(3)).to(DEV)
    pad = torch.ones(B, 30, dtype=torch.bool, device=DEV)
    pad[-1, :5] = False
    cache = tiny.new_cache(B, 64, ring=ring)
    tiny.encode(ids, cache, pad_mask=pad)
    assert (cache.ring == 24) == ring
    cache.ensure_capacity(cache.length + 16, write=16)
    canvas = torch.randint(0, 512, (B, 8), generator=torch.Generator().manual_seed(4)).to(DEV)
    want, c1 = _passes(tiny, cache, canvas, None)
    got, c2 = _passes(tiny, cache, canvas, "triton", tiles)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for a, b in zip(c2.keys + c2.values, c1.keys + c1.values):  # the same K/V written
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1)


def test_the_checked_kernel_the_op_and_the_option(tiny, monkeypatch):
    """The checked kernel compares itself with the torch reference on its first call per variant: a wrong kernel is
    replaced by the reference, with a warning. The custom op gives the kernel's numbers and passes opcheck.
    `configure` selects it only on a CUDA GPU, and only when the option asks."""
    k, v, keys, values, valid = _cache(2, 2, 16, 24, 29, torch.float32, 5)
    q = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(6)).to(DEV)
    args = (q, keys, values, valid, torch.tensor(21, device=DEV), 0, W, True)
    monkeypatch.setattr(moe_grouped, "FIRST_USE", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fixed_attention_checked(*args), fixed_attention_torch(*args))  # the first call: compared
        assert torch.equal(fixed_attention_checked(*args), fixed_attention_triton(*args))  # then the kernel's
    monkeypatch.setattr(moe_grouped, "FIRST_USE", {})
    monkeypatch.setattr("blockpress.kernels.attention_fixed.fixed_attention_triton",
                        lambda *a: fixed_attention_torch(*a) * 1.1)
    with pytest.warns(RuntimeWarning, match="attention kernel is off"):
        got = fixed_attention_checked(*args)
    assert torch.equal(got, fixed_attention_torch(*args))
    monkeypatch.undo()

    assert torch.equal(fixed_attention_op(*args, "triton"), fixed_attention_triton(*args))
    torch.library.opcheck(fixed_attention_op, (*args, "triton"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(fixed_attention_op(*args, "triton", "split=2"), fixed_attention_triton(*args, tiles="split=2"))
    torch.library.opcheck(fixed_attention_op, (*args, "triton", "split=2"),
                          test_utils=("test_schema", "test_faketensor"))
    # a spec's part for the other kind of layer (args: a sliding one) changes nothing; its own part is what runs
    assert torch.equal(fixed_attention_triton(*args, tiles="full:split=2;sliding:bm=32"),
                       fixed_attention_triton(*args, tiles={"BM": 32}))

    assert Options().attention_kernel is None and Options().attention_split is None  # None: tuned, else one run
    with pytest.raises(blockpress.InputError):
        Options().replace(attention_kernel="yes")
    for bad in (0, 17, 1.5, True):
        with pytest.raises(blockpress.InputError, match="attention_split"):
            Options().replace(attention_split=bad)
    m = copy.deepcopy(tiny)
    choice = kernels.configure(m, experts="grouped" if DEV.type == "cpu" else "auto", attention_kernel=True)
    on_gpu = DEV.type == "cuda"
    assert choice["attention_kernel"] == ("triton_checked" if on_gpu else None)
    assert kernels.kernel_names(m)["attention_kernel"] == choice["attention_kernel"]
    auto = Options().attention_kernel_on(DEV)
    assert kernels.configure(m, experts="grouped" if DEV.type == "cpu" else "auto")["attention_kernel"] == \
        ("triton_checked" if auto else None)
    assert kernels.configure(m, experts="grouped" if DEV.type == "cpu" else "auto",
                             attention_kernel=False)["attention_kernel"] is None
    kernels.use(m, attention_kernel="triton")
    assert kernels.kernel_names(m)["attention_kernel"] == "triton"
    assert kernels.kernel_names(m)["attention_tiles"] == ""
    kernels.use(m, attention_kernel="triton", attention_tiles="split=3")
    assert kernels.kernel_names(m)["attention_tiles"] == "sliding:split=3;full:split=3"
    with pytest.raises(blockpress.InputError, match="attention_tiles"):
        Options().replace(attention_tiles=3)
    with pytest.raises(ValueError, match="bad attention tile setting 'bk=32'"):
        kernels.configure(m, experts="grouped" if DEV.type == "cpu" else "auto", attention_tiles="bk=32")


def test_the_kernel_is_on_by_default_on_hopper_only(monkeypatch):
    """Timed on an H100 (the fixed-shape passes' attention, -1.25 ms of an 18.8 ms step): on by default on compute
    capability 9; elsewhere on CUDA only when asked (its tiles need more shared memory than most GPUs give); never
    on a CPU."""
    for cap, on in (((9, 0), True), ((8, 9), False), ((8, 0), False), ((10, 0), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert Options().attention_kernel_on(torch.device("cuda")) is on, cap
        assert Options(attention_kernel=True).attention_kernel_on(torch.device("cuda"))
        assert not Options(attention_kernel=False).attention_kernel_on(torch.device("cuda"))
    assert not Options(attention_kernel=True).attention_kernel_on(torch.device("cpu"))


def test_a_compiled_block_with_the_kernel_is_one_graph_without_breaks(tiny):
    """Compiled blocks in the fixed-shape pass with the kernel selected: its custom op is one node, no graph break,
    one graph per kind of layer, the eager logits; the same with the keys in two runs (~50 s on 2 cores: four
    compiles)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    m = copy.deepcopy(tiny)
    ids = torch.randint(5, 512, (1, 13), generator=torch.Generator().manual_seed(3)).to(DEV)
    cache = m.new_cache(1, 40)
    m.encode(ids, cache)
    canvas = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(4)).to(DEV)
    start = torch.tensor(cache.length, device=DEV)
    kernels.use(m, attention_kernel="triton")
    want = m.decode(canvas, cache, start=start)
    kernels.configure(m, experts="grouped" if DEV.type == "cpu" else "auto", attention="sdpa_gqa", compile=True)
    kernels.use(m, routing="torch", attention_kernel="triton")
    assert kernels.kernel_names(m)["attention_kernel"] == "triton"
    torch._dynamo.reset()
    counters.clear()
    got = m.decode(canvas, cache, start=start)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # Block.forward for a sliding and a full layer
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    kernels.use(m, routing="torch", attention_kernel="triton", attention_tiles="split=2")  # the op with its tiles
    got = m.decode(canvas, cache, start=start)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 4  # recompiled: the tiles are a constant of the graph
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("t,G,D", [(SLIDING, 2, 256), (FULL, 8, 512)])
def test_the_26b_shapes_on_a_gpu(t, G, D):
    """The 26B model's attention at batch 1 (a canvas of 256 after 5,072 cached tokens, 16 query heads; the sliding
    layers' window of 1,024 in a ring of 1,024 + 2,048 slots, wrapped), bf16, the compiled kernel with its default
    tiles against the torch reference; a fused commit + canvas too."""
    if DEV.type != "cuda":
        pytest.skip("the compiled kernel (CUDA, TRITON_INTERPRET unset)")
    kv, T, C, Wr = 16 // G, 2000 + 3 * 1024, 256, 1024
    R = Wr + 2048 if t == SLIDING else T + 2 * C
    g = torch.Generator(device="cuda").manual_seed(0)
    keys, values = (torch.randn(1, kv, R, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    valid = torch.ones(1, T + 2 * C, dtype=torch.bool, device="cuda")
    valid[0, :7] = False
    for S in (0, C):
        q = (torch.randn(1, 16, S + C, D, device="cuda", generator=g) / D ** 0.25).to(torch.bfloat16)
        args = (q, keys, values, valid, torch.tensor(T - S, device="cuda"), S, Wr if t == SLIDING else 0,
                t == SLIDING)
        got, want = fixed_attention_triton(*args).float(), fixed_attention_torch(*args).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2
        assert (got - want).abs().max().item() < 6e-2
