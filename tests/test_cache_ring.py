"""The sliding layers' ring (model/cache.py): a cache that keeps only the last window + reserve positions of its
sliding layers gives the same keys, values, logits and tokens as one that keeps every position, in the eager
passes, the fixed-shape (CUDA-graph) passes, the engine, the server's worker, and against transformers."""

import pytest
import torch

pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd

import blockpress
from blockpress.model.cache import KVCache, ring_slots
from blockpress.engine.graphs import GraphedPasses
from blockpress.kernels import use
from blockpress.testing import cuda_graphs
from hf_oracle import TINY_TEXT

SHAPES = [(2, 4), (1, 8), (2, 4)]  # (kv heads, head dim): sliding, full, sliding
SLIDING = [True, False, True]
W = 4


def _pair(capacity=16, reserve=8, batch=2):
    """(every position, ring) caches of the same shapes."""
    return [KVCache(SHAPES, batch, capacity, torch.float32, "cpu", SLIDING, window=W, reserve=r)
            for r in (None, reserve)]


def _write(caches, S, seed):
    """The same random K/V for S positions written at the caches' length, as a pass would."""
    g = torch.Generator().manual_seed(seed)
    T0 = caches[0].length
    kv = [(torch.randn(caches[0].batch, h, S, d, generator=g), torch.randn(caches[0].batch, h, S, d, generator=g))
          for h, d in SHAPES]
    for c in caches:
        assert c.length == T0
        c.ensure_capacity(T0 + S, write=S)
        for i, (k, v) in enumerate(kv):
            c.write(i, k, v, T0)
        c.length = T0 + S


def _same_reads(a, b, extra=0):
    """Every read a pass can make after writing `extra` positions past the length: sliding layers the window
    before them (and what was written), full layers everything."""
    L = a.length
    assert b.length == L
    for i, sliding in enumerate(SLIDING):
        lo = max(0, L - W) if sliding else 0
        for x, y in zip(a.span(i, lo, L + extra), b.span(i, lo, L + extra)):
            assert torch.equal(x, y), (i, lo, L)


@pytest.mark.parametrize("chunks,slots", [([5, 3, 8, 1, 1, 7, 8, 8, 2], W + 8), ([11, 8, 8, 1], W + 11)])
def test_ring_reads_equal_every_position_reads(chunks, slots):
    """Chunks written one after another (some wrap around the ring's end): every read equals the flat cache's. A
    first write larger than the reserve (11 > 8) makes the ring that much wider."""
    flat, ring = _pair()
    for n, S in enumerate(chunks):
        _write([flat, ring], S, n)
        _same_reads(flat, ring)
    assert ring.ring == slots and flat.ring is None and flat.capacity == ring.capacity
    assert [t.shape[2] for t in ring.keys] == [slots, ring.capacity, slots]
    assert ring.nbytes() < flat.nbytes()


def test_ring_starts_once_it_is_smaller_and_widens_for_a_larger_write():
    flat, ring = _pair(capacity=8)
    _write([flat, ring], 6, 0)
    assert ring.ring is None  # W + 8 = 12 slots would be no smaller than 8 positions
    _write([flat, ring], 6, 1)  # grown to 16 positions: now the ring is smaller
    assert ring.capacity == 16 and ring.ring == 12
    _same_reads(flat, ring)
    for n in range(2, 5):  # past the ring's size: early positions are overwritten
        _write([flat, ring], 7, n)
    assert ring.high - ring.ring > 0
    _write([flat, ring], 10, 5)  # more than the 8 it was made for: widened (W + 10), keeping what it holds
    assert ring.ring == W + 10
    _same_reads(flat, ring)
    _write([flat, ring], 3, 6)
    _same_reads(flat, ring)
    fresh_flat, fresh = _pair(capacity=64)
    _write([fresh_flat, fresh], 3, 7)
    _write([fresh_flat, fresh], 60, 8)  # a ring as large as the cache, and nothing lost yet: every position again
    assert fresh.ring is None and fresh.capacity == 64
    _same_reads(fresh_flat, fresh)


def test_crop_refuses_positions_the_ring_dropped():
    flat, ring = _pair(capacity=40)
    for n in range(5):
        _write([flat, ring], 7, n)  # 35 positions through a ring of 12
    ring.crop(33)  # the window before 33 is still held
    flat.crop(33)
    _same_reads(flat, ring)
    with pytest.raises(ValueError, match="sliding layers keep the last 12 positions"):
        ring.crop(20)
    flat.crop(20)  # the flat cache holds everything


def test_row_operations_on_rings():
    """rows / view_rows / move_rows / select_rows / put_rows / append_rows keep every row's reads those of the flat
    cache, across layouts (a ring into a wider one, a flat cache into a ring)."""
    flat, ring = _pair(batch=3)
    for n, S in enumerate([7, 8, 6, 5]):
        _write([flat, ring], S, n)
    idx = torch.tensor([2, 0])
    _same_reads(flat.rows(idx), ring.rows(idx))
    _same_reads(flat.view_rows(1, 3), ring.view_rows(1, 3))
    for c in (flat, ring):
        c.move_rows([0, 2], [2, 0])
    _same_reads(flat, ring)
    # copy into slots of a different layout (a wider ring, more rows; a flat cache cannot take a ring's rows)
    wide = KVCache(SHAPES, 4, 64, torch.float32, "cpu", SLIDING, window=W, reserve=20)
    wide.put_rows(1, ring)
    wide.length = ring.length
    _same_reads(flat, wide.view_rows(1, 4))
    with pytest.raises(RuntimeError, match="gone"):
        KVCache(SHAPES, 3, 64, torch.float32, "cpu", SLIDING, window=W).put_rows(0, ring)
    # appending a flat cache's rows to a ring (and a ring to a flat cache): both become the ring
    other_flat, other = _pair(capacity=26, batch=1, reserve=None)  # both flat; `other` joins the ring
    _write([other_flat, other], 26, 9)
    assert other.ring is None
    for c, o in ((flat, other_flat), (ring, other)):
        c.append_rows(o)
    assert ring.ring == W + 8 and ring.batch == 4
    _same_reads(flat, ring)
    for c in (flat, ring):
        c.select_rows([3, 1])
    _same_reads(flat, ring)


def test_views_cannot_change_the_layout():
    _, ring = _pair(capacity=32)
    _write([ring], 20, 0)
    view = ring.view_rows(0, 1)
    view.ensure_capacity(30, write=8)  # fits: nothing to do
    with pytest.raises(RuntimeError, match="view"):
        view.ensure_capacity(40, write=8)
    with pytest.raises(RuntimeError, match="view"):
        view.ensure_capacity(30, write=24)  # its ring (W + 20) is too narrow


def test_ring_slots_rule():
    assert ring_slots(1024, 2048, 40_000) == 3072  # the 26B model at a 40K-token context
    assert ring_slots(1024, 2048, 3072) is None  # no smaller than keeping every position
    assert ring_slots(1024, 2048, 40_000, write=4096) == 5120
    assert ring_slots(None, 2048, 40_000) is None and ring_slots(1024, None, 40_000) is None


# ------------------------------------------------------------------------------------------------- model level

TINY = TINY_TEXT  # spec 6.1's tiny config: 2 full layers of 6, a window of 8


@pytest.fixture(scope="module")
def tiny():
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": TINY, "canvas_length": 8}, seed=0)
    for p in m.module.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    m.module.prefill_chunk = 8  # ring: W 8 + max(8, 2 canvases) = 24 slots
    use(m.module, attention="eager")
    return m


def _twins(m, B=2, S=30, capacity=64, seed=3):
    """A flat and a ring cache holding the same left-padded prompt, encoded in chunks of 8."""
    ids = torch.randint(5, 512, (B, S), generator=torch.Generator().manual_seed(seed))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[-1, :5] = False
    caches = [m.new_cache(B, capacity, ring=r) for r in (False, True)]
    outs = [m.encode(ids, c, pad_mask=pad) for c in caches]
    assert caches[0].ring is None and caches[1].ring == 24
    assert torch.equal(outs[0], outs[1])
    return caches


@pytest.mark.parametrize("attention", ["eager", "sdpa_gqa"])
def test_eager_passes_on_a_ring_are_bit_identical(tiny, attention):
    m = tiny.module
    use(m, attention=attention)
    try:
        flat, ring = _twins(m)
        canvas = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
        sc = torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(5))
        for _ in range(4):  # commits past the ring's end (30 + 32 positions through 24 slots)
            assert torch.equal(m.decode(canvas, flat, sc), m.decode(canvas, ring, sc))
            assert torch.equal(m.encode(canvas, flat), m.encode(canvas, ring))
        assert torch.equal(m.encode_decode(canvas, canvas, flat, None, sc),
                           m.encode_decode(canvas, canvas, ring, None, sc))
        assert ring.high - ring.ring > 40 and flat.length == ring.length == 70
        assert ring.capacity == flat.capacity == 128  # grown for the full layers; the ring is still 24 slots
    finally:
        use(m, attention="eager")


def _held(cache, C=8):
    """Every layer's K/V below the length, in position order: all of them, or those a ring still holds after a
    canvas of C more is written."""
    L = cache.length
    return [t.clone() for i in range(len(cache.keys))
            for t in cache.span(i, max(0, L - cache.ring + C) if cache._ringed(i) else 0, L)]


@pytest.mark.parametrize("attention", ["eager", "sdpa_gqa"])
@pytest.mark.parametrize("ring", [False, True])
def test_the_eager_decoder_writes_its_canvas_in_place_bit_identically(tiny, monkeypatch, attention, ring):
    """Without autograd and with room, the eager decoder (and the fused commit + first step) write the canvas's K/V
    past the cache's length and attend over one span of the cache; with the room taken away they concatenate the
    cached keys and the canvas's. The logits are the same bit for bit, through the ring's wrap; positions below
    the length are never touched, the canvas's K/V are where they belong, and the commits leave the same cache."""
    from blockpress.model.cache import KVCache

    m = tiny.module
    use(m, attention=attention)
    try:
        room = _twins(m)[ring]
        cat = _twins(m)[ring]
        canvas = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
        sc = torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(5))
        scratch = KVCache.scratch_room

        def concatenated(fn, *args):  # the same pass with the room taken away
            monkeypatch.setattr(KVCache, "scratch_room", lambda *a: False)
            try:
                return fn(*args)
            finally:
                monkeypatch.setattr(KVCache, "scratch_room", scratch)

        for step in range(4):  # 30 + 32 positions: the ring (24 slots) wraps
            T = room.length
            assert room.scratch_room(T, 8)
            below = _held(room)
            want = concatenated(m.decode, canvas, cat, sc)
            assert torch.equal(m.decode(canvas, room, sc), want)
            assert all(torch.equal(a, b) for a, b in zip(_held(room), below))  # read only below the length
            full = next(i for i, layer in enumerate(m.layers) if layer.full)
            assert room.span(full, T, T + 8)[0].abs().sum() > 0  # the canvas's keys are past the length
            assert cat.span(full, T, T + 8)[0].abs().sum() == 0  # (concatenating leaves the slots as they were)
            if step == 2:
                got = m.encode_decode(canvas, canvas, room, None, sc)
                assert torch.equal(got, concatenated(m.encode_decode, canvas, canvas, cat, None, sc))
            else:
                assert torch.equal(m.encode(canvas, room), m.encode(canvas, cat))
            assert all(torch.equal(a, b) for a, b in zip(_held(room), _held(cat)))
        assert room.length == 62 and (room.ring is not None) == ring
    finally:
        use(m, attention="eager")


def test_the_decoder_does_not_write_a_cache_it_has_no_room_in_or_under_autograd(tiny):
    """A cache exactly as long as its positions (`rows`, for a pass over part of a batch) or a pass under autograd
    (training): the decoder concatenates instead, and the cache's buffers stay as they were."""
    m = tiny.module
    cache = _twins(m)[0]
    canvas = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
    before = [t.clone() for t in cache.keys + cache.values]
    with torch.enable_grad():  # first: a pass without autograd would write its canvas there
        assert cache.scratch_room(cache.length, 8)
        got = m.decode(canvas, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, before))
    sub = cache.rows(torch.arange(2))
    assert sub.capacity == sub.length and not sub.scratch_room(sub.length, 8)
    before = [t.clone() for t in sub.keys + sub.values]
    want = m.decode(canvas, cache)
    assert got.requires_grad and torch.equal(got.detach(), want)
    assert torch.equal(m.decode(canvas, sub), want)
    assert all(torch.equal(a, b) for a, b in zip(sub.keys + sub.values, before))
    roomy = cache.rows(torch.tensor([1]), room=8)  # what row compaction takes: room for its canvas
    assert roomy.capacity == roomy.length + 8 and roomy.scratch_room(roomy.length, 8) and roomy.has_padding
    assert torch.equal(m.decode(canvas[1:], roomy), m.decode(canvas[1:], cache.rows(torch.tensor([1]))))


@pytest.mark.parametrize("ring", [False, True])
def test_an_encoder_pass_for_the_cache_alone_writes_the_same_cache(tiny, ring):
    """`encode(..., output=False)` (a prompt's prefill, a commit): the same cache bit for bit as a full encoder pass,
    chunked with padding and as one commit, eagerly and as the fixed-shape (CUDA-graph) pass; nothing is returned, and
    the last layer's feed-forward half never runs (only its K/V are written)."""
    m = tiny.module
    ids = torch.randint(5, 512, (2, 30), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 30, dtype=torch.bool)
    pad[-1, :5] = False
    canvas = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
    last = m.layers[-1]
    runs = []
    handles = [mod.register_forward_hook(lambda *a: runs.append(1)) for mod in (last.mlp, last.experts, m.norm)]
    try:
        full, kv = (m.new_cache(2, 64, ring=ring) for _ in range(2))
        assert m.encode(ids, full, pad_mask=pad) is not None and runs
        runs.clear()
        assert m.encode(ids, kv, pad_mask=pad, output=False) is None and not runs  # chunked: 4 chunks of 8
        assert m.encode(canvas, kv, output=False) is None and not runs
        assert m.encode(canvas, kv, output=False, start=torch.tensor(kv.length)) is None and not runs
    finally:
        for h in handles:
            h.remove()
    m.encode(canvas, full)
    m.encode(canvas, full, start=torch.tensor(full.length))
    kv.length = full.length = full.length + 8
    assert full.length == kv.length == 46 and (kv.ring is not None) == ring
    assert all(torch.equal(a, b) for a, b in zip(_held(full, 0), _held(kv, 0)))


def test_fixed_shape_passes_on_a_ring_match_the_eager_passes(tiny):
    """The fixed-shape passes (what CUDA graphs capture; run without capture) on a ring cache: the canvas's K/V written as scratch past the
    length (wrapping), the window gathered modulo the ring; the same logits and hidden states as the eager passes
    on a flat cache, and the same cache."""
    m = tiny.module
    flat, ring = _twins(m)
    canvas = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
    sc = torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(5))
    on = torch.ones(2, dtype=torch.bool)
    tol = 5e-5  # fp32, values of order 1: the ring's gathered window sums in another order than the flat cache
    for step in range(3):
        T = flat.length
        ring.ensure_capacity(T + 16, write=16)
        got = m.decode(canvas, ring, sc, on, start=torch.tensor(T))
        ring.note_write(T, 8)
        assert (got - m.decode(canvas, flat, sc)).abs().max() < tol
        if step == 1:  # a fused commit + first step, then a plain commit
            got = m.encode_decode(canvas, canvas, ring, None, sc, on, start=torch.tensor(T))
            ring.note_write(T, 16)
            want = m.encode_decode(canvas, canvas, flat, None, sc)
        else:
            got = m.encode(canvas, ring, start=torch.tensor(T))
            ring.note_write(T, 8)
            want = m.encode(canvas, flat)
        ring.length = flat.length
        assert (got - want).abs().max() < tol
    L = flat.length
    for i, layer in enumerate(m.layers):
        lo = 0 if layer.full else L - 8
        for x, y in zip(flat.span(i, lo, L), ring.span(i, lo, L)):
            assert (x - y).abs().max() < tol


def _gen(lm, ids, ring, **kw):
    lm.module.ring_cache = ring
    try:
        torch.manual_seed(0)
        return lm.generate(ids, **kw)
    finally:
        lm.module.ring_cache = True


@pytest.mark.parametrize("fuse", [False, True])
def test_engine_tokens_with_a_ring(tiny, fuse):
    """A 30-token padded prompt and 5 canvases (70 positions through 24 ring slots), adaptive stopping, batch 2:
    the same tokens and forward passes as with every position kept, eagerly and through the CUDA-graph plumbing;
    then a second turn on the returned cache."""
    ids = torch.randint(5, 512, (2, 30), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=40, max_denoising_steps=5, stability_threshold=1,
              confidence_threshold=0.5, fuse_commit=fuse, eos_token_id=None)
    want = _gen(tiny, ids, False, **kw)
    got = _gen(tiny, ids, True, **kw)
    assert got.cache.ring == 24 and want.cache.ring is None
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.forward_passes, want.forward_passes)
    turn = torch.randint(5, 512, (2, 11), generator=torch.Generator().manual_seed(7))
    more = dict(kw, attention_mask=None, max_new_tokens=16)
    nxt = []
    for r in (want, got):
        torch.manual_seed(1)
        nxt.append(tiny.generate(torch.cat([r.sequences[:, -8:], turn], 1), cache=r.cache, **more).sequences)
    assert torch.equal(nxt[0], nxt[1])
    with cuda_graphs(tiny):
        graphed = _gen(tiny, ids, True, **kw)
    assert graphed.cache.ring == 24 and torch.equal(graphed.sequences, want.sequences)


@pytest.mark.parametrize("second", [10, 70])
def test_worker_slots_start_their_ring_afresh_for_a_new_group(tiny, second):
    """Server slots under the CUDA-graph plumbing: a first request runs alone to position 100 through the 24-slot
    ring and finishes; a fresh group then starts at position 0 on the same slots, and a request joining it regrows
    them (1 -> 2 rows), which copies the running row's K/V. The slots' ring bookkeeping (the highest position
    written) survived the drained group, so that copy skipped positions the new group still reads: a crash when
    the new group was shorter than the old one's high minus the ring (second=10), wrong tokens otherwise (70).
    Tokens as a worker without graphs that keeps every position."""
    from blockpress.server.worker import Job, Worker
    from blockpress.testing import drive_worker

    m = tiny.module

    def job(n_prompt, n_new, seed):
        g = torch.Generator().manual_seed(seed)
        cfg = tiny.generation_config(max_new_tokens=n_new, max_denoising_steps=3, eos_token_id=None,
                                     stability_threshold=None, confidence_threshold=None)
        return Job(torch.randint(5, 512, (n_prompt,), generator=g).tolist(), cfg, seed=seed)

    plan = {0: [job(60, 40, 1)], 7: [job(second, 32, 2)], 8: [job(second - 20 if second > 20 else 10, 16, 3)]}
    m.ring_cache = False
    try:
        want = drive_worker(Worker(tiny, max_batch=3), plan)
    finally:
        m.ring_cache = True
    with cuda_graphs(tiny):
        s = Worker(tiny, max_batch=3)
        got = drive_worker(s, plan)
    assert s.runner._slots.ring == 24 and s.runner._slots.batch >= 2  # the ring was in use and the slots regrew
    assert got == want


def test_cache_bytes_of_the_26b_model_at_a_long_context():
    """What a 32K-token cache of the 26B model holds: 25 sliding layers x 8 KV heads x 256 dims in a ring of
    1024 + 2048 slots, 5 full layers x 2 KV heads x 512 dims at every position (K and V, bf16)."""
    from blockpress.lab.presets import preset_config
    from blockpress.config import ModelConfig
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    config, _, _ = preset_config("real-26b")
    with torch.device("meta"):
        m = DiffusionGemmaModel(ModelConfig.from_dict(config)).to(torch.bfloat16)
    P = 32768
    sliding, full = 25 * 2 * 8 * 256 * 2, 5 * 2 * 2 * 512 * 2  # bytes per position, all layers of a kind
    assert m.cache_bytes(1, P) == sliding * 3072 + full * P + P
    m.ring_cache = False
    assert m.cache_bytes(1, P) == (sliding + full + 1) * P


def test_a_conversation_grows_into_a_ring(tiny):
    """Multi-turn (`cache=` the previous result's): a short first turn leaves a cache that keeps every position; a
    long second turn grows it past the ring's size, so its sliding layers become a ring mid-conversation, and the
    third turn wraps it. The tokens of every turn equal those of a conversation that keeps every position."""
    kw = dict(max_new_tokens=8, max_denoising_steps=4, stability_threshold=None, confidence_threshold=None,
              eos_token_id=None)
    turns = [torch.randint(5, 512, (1, n), generator=torch.Generator().manual_seed(10 + n)) for n in (6, 40, 12)]
    runs = {}
    for ring in (False, True):
        tiny.module.ring_cache = ring
        try:
            out, cache, rings = [], None, []
            for i, t in enumerate(turns):
                ids = t if cache is None else torch.cat([out[-1][:, -8:], t], 1)  # last canvas + the new turn
                r = tiny.generate(ids, cache=cache, generator=torch.Generator().manual_seed(i), **kw)
                out.append(r.sequences)
                cache = r.cache
                rings.append(cache.ring)
            runs[ring] = (out, rings)
        finally:
            tiny.module.ring_cache = True
    assert runs[True][1][0] is None and runs[True][1][1] == runs[True][1][2] == 24 and runs[False][1] == [None] * 3
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0]))


@pytest.mark.gpu
def test_captured_graphs_on_a_ring_match_the_eager_passes():
    """Real CUDA-graph capture on a ring cache (the slot arithmetic baked into the graphs): a 30-token prompt, then
    denoising steps and commits through 24 slots, several times round the ring; the captured passes' logits and
    hidden states match the eager passes' on a cache keeping every position, and a later step replays only."""
    triton = pytest.importorskip("triton")  # noqa: F841  (the capture needs experts without host syncs in fp32)
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": TINY, "canvas_length": 8},
                               seed=0).module.cuda()
    use(m, experts="triton")
    m.prefill_chunk = 8
    ids = torch.randint(5, 512, (2, 30), device="cuda")
    flat, ring = m.new_cache(2, 128, ring=False), m.new_cache(2, 128)
    for c in (flat, ring):
        m.encode(ids, c)
    assert ring.ring == 24 and flat.ring is None
    g = GraphedPasses(m)
    for _ in range(6):  # 48 positions more: twice round the ring
        canvas = torch.randint(0, 512, (2, 8), device="cuda")
        sc = torch.randn(2, 8, 512, device="cuda")
        assert (g.decode(canvas, ring, sc) - m.decode(canvas, flat, sc)).abs().max() < 1e-4
        assert (g.encode(canvas, ring) - m.encode(canvas, flat)).abs().max() < 1e-4
    canvas = torch.randint(0, 512, (2, 8), device="cuda")
    out = g.encode_decode(canvas, canvas, ring)
    assert (out - m.encode_decode(canvas, canvas, flat)).abs().max() < 1e-4
    captures = g.captures
    assert (g.decode(canvas, ring) - m.decode(canvas, flat)).abs().max() < 1e-4
    assert g.captures == captures and all(c.graph is not None for c in g.captured.values())
