"""Generation invariants: streaming == non-streaming, seeds, private generators, padding and
multi-turn parity with transformers, fast paths vs references, and clear input errors."""

import pytest
import torch

import blockpress
from blockpress.errors import InputError, SamplingError
from blockpress.kernels import kernel_names, use
from blockpress.model.moe import experts_dense, experts_loop
from blockpress.testing import count_host_reads
from hf_oracle import TINY_TEXT

transformers = pytest.importorskip("transformers")
from transformers import EntropyBoundSamplerConfig  # noqa: E402

pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd
KW = dict(max_new_tokens=32, max_denoising_steps=6, eos_token_id=[1], pad_token_id=0)


@pytest.fixture(scope="module")
def bp(hf_tiny_dir):
    path, _ = hf_tiny_dir
    # the oracle's fp32 on the CPU, also on a machine with a GPU
    m = blockpress.load(path, device="cpu", dtype="float32", progress=False)
    use(m.module, attention="eager")
    return m


def ids(B=2, T=20, seed=0):
    return torch.randint(5, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def test_stream_equals_generate_and_seed_repeats(bp):
    x = ids()
    torch.manual_seed(3)
    events = list(bp.stream(x, **KW))
    torch.manual_seed(3)
    r = bp.generate(x, **KW)
    final = events[-1].result
    assert torch.equal(final.sequences, r.sequences)
    drafts = [e for e in events if isinstance(e, blockpress.Draft)]
    commits = [e for e in events if isinstance(e, blockpress.Commit)]
    assert len(commits) == 2 and sum(c.steps for c in commits) == len(drafts)
    assert torch.equal(torch.cat([c.tokens for c in commits], 1), r.new_tokens)
    assert drafts[-1].tokens.shape == (2, bp.canvas_length)
    torch.manual_seed(3)
    assert torch.equal(bp.generate(x, **KW).sequences, r.sequences)
    torch.manual_seed(4)
    assert not torch.equal(bp.generate(x, **KW).sequences, r.sequences)


def test_generation_builds_no_autograd_graph_and_leaves_the_callers_mode(bp):
    """Every pass of the canvas loop runs without autograd (a graph would hold every activation of every step:
    gigabytes, and 3x the time on a CPU), while the caller's code between events keeps its own grad mode."""
    seen = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: seen.append(torch.is_grad_enabled()))
    try:
        with torch.enable_grad():
            for _ in bp.stream(ids(), **KW):
                assert torch.is_grad_enabled()
            bp.generate(ids(), **KW)
    finally:
        hook.remove()
    assert seen and not any(seen)


def test_private_generator_leaves_global_rng_alone(bp):
    x = ids()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = bp.generate(x, generator=torch.Generator().manual_seed(11), **KW)
    assert torch.equal(torch.get_rng_state(), before)
    b = bp.generate(x, generator=torch.Generator().manual_seed(11), **KW)
    assert torch.equal(a.sequences, b.sequences)
    # and a private generator seeded like the global one gives the reference stream
    torch.manual_seed(11)
    c = bp.generate(x, **KW)
    assert torch.equal(a.sequences, c.sequences)


def test_left_padded_batch_matches_transformers(hf_tiny_dir, bp):
    _, hf = hf_tiny_dir
    rows = [ids(1, 20, 1)[0].tolist(), ids(1, 13, 2)[0].tolist()]
    torch.manual_seed(5)
    r = bp.generate(rows, **KW)  # ragged lists: left-padded with an attention mask
    x = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    for i, row in enumerate(rows):
        x[i, 20 - len(row):] = torch.tensor(row)
        mask[i, 20 - len(row):] = 1
    # transformers 5.23's eager attention crashes building the decoder padding mask from the integer
    # canvas (the bug spec 4.10 notes for the static path), so the oracle runs its sdpa attention here
    hf.set_attn_implementation("sdpa")
    try:
        torch.manual_seed(5)
        o = hf.generate(x, attention_mask=mask, t_min=0.4, t_max=0.8,
                        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), **KW)
    finally:
        hf.set_attn_implementation("eager")
    assert mask[1, :7].sum() == 0  # row 1 really is left-padded
    assert torch.equal(o.sequences, r.sequences)
    assert torch.equal(o.tokens_per_forward, r.tokens_per_forward)


def test_multi_turn_cache_reuse_matches_transformers(hf_tiny_dir, bp):
    _, hf = hf_tiny_dir
    x = ids(1, 20, 7)
    kw = dict(KW, max_new_tokens=16)
    gk = dict(t_min=0.4, t_max=0.8, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1))
    torch.manual_seed(1)
    o1 = hf.generate(x, **gk, **kw)
    torch.manual_seed(1)
    r1 = bp.generate(x, **kw)
    assert torch.equal(o1.sequences, r1.sequences) and r1.cache.length == 20
    turn2 = torch.cat([r1.sequences[:, -16:], ids(1, 5, 8)], dim=1)  # last canvas + new turn
    torch.manual_seed(2)
    o2 = hf.generate(turn2, past_key_values=o1.past_key_values, **gk, **kw)
    torch.manual_seed(2)
    r2 = bp.generate(turn2, cache=r1.cache, **kw)
    assert torch.equal(o2.sequences, r2.sequences)
    assert r2.cache.length == 20 + 21  # the second turn encoded only the new tokens


def test_sliding_ring_cache_matches_transformers(hf_tiny_dir, bp, monkeypatch):
    """The sliding layers' ring (a 45-token prompt encoded 8 at a time, 3 canvases: 93 positions through 8 + 32 ring
    slots), a left-padded batch, then a second turn on the returned cache: transformers' tokens, whose sliding
    layers keep their last W - 1 tokens."""
    _, hf = hf_tiny_dir
    monkeypatch.setattr(bp.module, "prefill_chunk", 8)
    x = ids(2, 45, 21)
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[1, :6] = 0
    kw = dict(KW, max_new_tokens=48, eos_token_id=None)  # no row ends: the second turn goes on from each
    gk = dict(t_min=0.4, t_max=0.8, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1))
    hf.set_attn_implementation("sdpa")  # the eager path's padding-mask bug (test_left_padded_batch_...)
    try:
        torch.manual_seed(4)
        o1 = hf.generate(x, attention_mask=mask, **gk, **kw)
        torch.manual_seed(4)
        r1 = bp.generate(x, attention_mask=mask, **kw)
        assert r1.cache.ring == 8 + 32 and r1.cache.keys[0].shape[2] == 40 < r1.cache.length
        assert torch.equal(o1.sequences, r1.sequences)
        assert torch.equal(o1.tokens_per_forward, r1.tokens_per_forward)
        turn2 = torch.cat([r1.sequences[:, -16:], ids(2, 5, 22)], dim=1)
        mask2 = torch.cat([mask, torch.ones(2, r1.sequences.shape[1] - 45 + 5, dtype=torch.long)], dim=1)
        torch.manual_seed(5)
        o2 = hf.generate(turn2, attention_mask=mask2, past_key_values=o1.past_key_values, **gk, **dict(kw, max_new_tokens=16))
        torch.manual_seed(5)
        r2 = bp.generate(turn2, cache=r1.cache, **dict(kw, max_new_tokens=16))
        assert torch.equal(o2.sequences, r2.sequences)
    finally:
        hf.set_attn_implementation("eager")


def test_sdpa_and_dense_experts_agree_with_references(bp):
    x, canvas = ids(), ids(2, 16, 9)
    cache = bp.module.new_cache(2, 20)
    bp.module.encode(x, cache)
    ref = bp.module.decode(canvas, cache)
    try:
        use(bp.module, attention="sdpa")
        use(bp.module, experts="dense")
        fast = bp.module.decode(canvas, cache)
    finally:
        use(bp.module, attention="eager")
        use(bp.module, experts="loop")
    assert (fast - ref).abs().max() < 2e-5
    g = torch.Generator().manual_seed(0)
    xs, gu, dn = torch.randn(50, 64, generator=g), torch.randn(8, 48, 64, generator=g), torch.randn(8, 64, 24, generator=g)
    w = torch.rand(50, 3, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(50)])
    assert torch.allclose(experts_dense(xs, w, idx, gu, dn), experts_loop(xs, w, idx, gu, dn), atol=1e-5)


def test_invalid_inputs_get_clear_errors(bp):
    x = ids()
    with pytest.raises(SamplingError, match="max_denoising_steps"):
        bp.generate(x, max_denoising_steps=-2)
    with pytest.raises(SamplingError, match="entropy_bound"):
        bp.generate(x, entropy_bound=0)
    with pytest.raises(InputError, match="max_position_embeddings=4096; shorten the prompt$"):
        bp.generate(torch.randint(5, 512, (1, 4090)), max_new_tokens=32)
    room = (4096 - 4000) // bp.canvas_length * bp.canvas_length  # the number a fix needs (it said only "lower it")
    with pytest.raises(InputError, match=f"lower max_new_tokens to at most {room} or shorten the prompt"):
        bp.generate(torch.randint(5, 512, (1, 4000)), max_new_tokens=200)
    with pytest.raises(InputError, match="vocabulary"):
        bp.generate(torch.tensor([[5, 600]]))
    with pytest.raises(InputError, match="empty"):
        bp.generate([])
    with pytest.raises(InputError, match="integer token ids, got a torch.float32 tensor"):
        bp.generate(x.float())
    with pytest.raises(InputError, match="integer token ids, got 3.5"):
        bp.generate([[5, 3.5]])
    with pytest.raises(SamplingError, match=r"eos_token_id=512: must be a token id .*\[0, 512\)"):
        bp.generate(x, eos_token_id=[1, 512])
    with pytest.raises(SamplingError, match="pad_token_id=-1"):
        bp.generate(x, pad_token_id=-1)
    with pytest.raises(InputError, match="tokenizer"):
        bp.generate_text("hi")  # this checkpoint has no tokenizer.json
    # an AttributeError from deep inside before
    with pytest.raises(InputError, match="generator must be a torch.Generator .* got int"):
        bp.generate(x, generator=5)
    with pytest.raises(InputError, match="cache must be the KVCache of an earlier result"):
        bp.generate(x, cache="x")
    with pytest.raises(InputError, match="attention_mask row 0 masks every token"):
        bp.generate(x[:1], attention_mask=torch.zeros_like(x[:1]))  # generated from nothing before
    with pytest.raises(InputError, match="model must be a folder"):
        blockpress.load(None)
    with pytest.raises(InputError, match="'meta' holds none"):
        blockpress.load("kjv", device="meta")


def test_huge_stability_threshold_means_never_stop_early(bp, monkeypatch):
    """A threshold beyond the step budget can never be met; it must not size the argmax history (it once
    tried to allocate threshold x canvas int64s: 256 GB for 10**9) and must give the fixed-step tokens."""
    x = ids()
    kw = dict(KW, confidence_threshold=1e9)  # confident always: only stability could stop a row
    sizes = []
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, *a, **k: (sizes.append(tuple(size)), full(size, *a, **k))[1])
    huge = bp.generate(x, generator=torch.Generator().manual_seed(5), **dict(kw, stability_threshold=10**9))
    assert sizes and max(s[0] for s in sizes if len(s) == 3) == KW["max_denoising_steps"]
    fixed = bp.generate(x, generator=torch.Generator().manual_seed(5),
                        **dict(KW, stability_threshold=None, confidence_threshold=None))
    assert torch.equal(huge.sequences, fixed.sequences)
    assert huge.steps_per_canvas == fixed.steps_per_canvas == [KW["max_denoising_steps"]] * 2


def test_generate_text_with_tokenizer(hf_tiny_dir, tmp_path):
    from blockpress.testing import build_tiny_gemma_tokenizer

    path, _ = hf_tiny_dir
    import shutil

    shutil.copytree(path, tmp_path / "m")
    build_tiny_gemma_tokenizer(tmp_path / "m")
    m = blockpress.load(tmp_path / "m", device="cpu", progress=False)
    text = m.generate_text([{"role": "user", "content": "Hello there"}], seed=0, max_new_tokens=16,
                           max_denoising_steps=4, eos_token_id=[1, 106], pad_token_id=0)
    assert isinstance(text, str)
    again = m.generate_text([{"role": "user", "content": "Hello there"}], seed=0, max_new_tokens=16,
                            max_denoising_steps=4, eos_token_id=[1, 106], pad_token_id=0)
    assert text == again
    prompt = m.encode_chat("Hello there", enable_thinking=True)
    assert prompt[0] == 2 and 98 in prompt  # <bos> ... <|think|>


def test_per_row_generators_make_rows_batch_invariant(bp):
    x = ids(3, 20, 4)
    for kw in (dict(KW, stability_threshold=None, confidence_threshold=None),  # fixed steps
               dict(KW, max_new_tokens=48, stability_threshold=0, confidence_threshold=6.2135)):  # early stop
        gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
        batched = bp.generate(x, generator=gens, **kw)
        for b, s in enumerate((10, 11, 12)):
            alone = bp.generate(x[b:b + 1], generator=[torch.Generator().manual_seed(s)], **kw).sequences[0]
            n = alone.shape[0]  # alone, a finished row stops; in the batch it is padded afterwards
            assert torch.equal(alone, batched.sequences[b, :n]) and (batched.sequences[b, n:] == 0).all()
        assert len(set(batched.forward_passes.tolist())) > 1 or kw["stability_threshold"] is None
    single = bp.generate(x[:1], generator=torch.Generator().manual_seed(10), **kw)
    assert torch.equal(single.sequences[0], batched.sequences[0])  # list of one == one generator
    with pytest.raises(InputError, match="one per row"):
        bp.generate(x, generator=gens[:2], **kw)


@pytest.mark.parametrize("gen", ["per_row", "one"])
@pytest.mark.parametrize("case", ["plain", "fixed_tokens", "fuse_commit"])
def test_row_compaction_gives_the_same_tokens(bp, case, gen, monkeypatch):
    """compact_rows=True (the default with per-row generators): once a row stops denoising, the decoder runs
    on the other rows only. Same drafts, sequences, passes and step counts as the full-batch loop (left
    padding, early stopping at different steps, 3 canvases; infilling; a fused commit). With one generator for
    the batch the sampler still draws for every row, so the random stream is the full loop's. Random weights
    never repeat an argmax, so stopping here is by entropy alone; test_sudoku_model covers the stability
    history."""
    rows = [ids(1, 20, 1)[0].tolist(), ids(1, 13, 2)[0].tolist(), ids(1, 17, 3)[0].tolist()]
    kw = dict(KW, max_new_tokens=48, stability_threshold=0, confidence_threshold=6.212)
    if case == "fixed_tokens":
        kw["fixed_tokens"] = torch.tensor([[-1, 7, -1, 9] * 6, [5] * 3 + [-1] * 21, [-2] * 4 + [-1] * 20])
    elif case == "fuse_commit":
        kw["fuse_commit"] = True
    runs, sizes = [], []
    for compact in (False, True):
        gens = [torch.Generator().manual_seed(s) for s in (4, 5, 6)] if gen == "per_row" else \
            torch.Generator().manual_seed(4)
        seen = []
        decode = bp.module.decode
        monkeypatch.setattr(bp.module, "decode", lambda x, *a, **k: seen.append(x.shape[0]) or decode(x, *a, **k))
        runs.append(list(bp.stream(rows, generator=gens, compact_rows=compact, **kw)))
        monkeypatch.undo()
        sizes.append(seen)
    assert set(sizes[0]) == {3} and min(sizes[1]) < 3, "the compacted run must skip stopped rows"
    assert sum(sizes[1]) < sum(sizes[0])
    full, fast = runs[0][-1].result, runs[1][-1].result
    assert len(full.steps_per_canvas) == 3 and len(set(full.forward_passes.tolist())) > 1
    for name in ("sequences", "tokens_per_forward", "forward_passes"):
        assert torch.equal(getattr(full, name), getattr(fast, name)), name
    assert full.steps_per_canvas == fast.steps_per_canvas
    drafts = [[e for e in r if isinstance(e, blockpress.Draft)] for r in runs]
    assert len(drafts[0]) == len(drafts[1])
    for d0, d1 in zip(*drafts):  # every intermediate canvas (Drafts hold their own copies)
        assert torch.equal(d0.tokens, d1.tokens) and torch.equal(d0.done, d1.done)
        assert torch.equal(d0.accepted[~d0.done], d1.accepted[~d1.done])


def test_row_compaction_is_off_by_default_with_one_generator(bp, monkeypatch):
    """With one generator (or none) for the batch, the default is the reference's loop: every row in every pass."""
    seen = []
    decode = bp.module.decode
    monkeypatch.setattr(bp.module, "decode", lambda x, *a, **k: seen.append(x.shape[0]) or decode(x, *a, **k))
    out = bp.generate(ids(3), generator=torch.Generator().manual_seed(4),
                      **dict(KW, max_new_tokens=48, stability_threshold=0, confidence_threshold=6.212))
    assert set(seen) == {3} and len(set(out.forward_passes.tolist())) > 1  # rows stopped, and stayed in the pass


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_fixed_steps_read_nothing_back_per_step(bp, sampler, monkeypatch):
    """With fixed steps a denoising step never waits for the device: twice the steps, the same number of
    host reads and host-to-device tensors (they come per generation and per canvas, not per step); adaptive
    stopping at batch 1 reads one flag per step."""
    x = ids(1, 20, 5)
    before = kernel_names(bp.module)["experts"]
    use(bp.module, experts="grouped")  # sync-free (the GPU paths); "loop", the reference, reads counts
    try:
        fixed = {**KW, "stability_threshold": None, "confidence_threshold": None, "sampler": sampler}
        del fixed["max_denoising_steps"]
        counts = {}
        for steps in (4, 8):
            for mode, kw in (("fixed", fixed), ("adaptive", dict(fixed, stability_threshold=1, confidence_threshold=1e-9))):
                gen = torch.Generator().manual_seed(0)
                bp.generate(x, generator=gen, max_denoising_steps=steps, **kw)  # warm: caches made once
                r = []
                counts[mode, steps] = count_host_reads(
                    monkeypatch, lambda: r.append(bp.generate(x, generator=gen, max_denoising_steps=steps, **kw)))
                assert r[0].steps_per_canvas == [steps, steps]  # never stops early (entropy never under 1e-9)
    finally:
        use(bp.module, experts=before)
    assert counts["fixed", 8] == counts["fixed", 4]
    assert counts["adaptive", 8] - counts["adaptive", 4] == 2 * 4  # 2 canvases x 4 more steps x 1 flag


@pytest.mark.gpu
def test_a_generator_on_another_device_than_the_model_is_a_clear_error(hf_tiny_dir):
    path, _ = hf_tiny_dir
    m = blockpress.load(path, device="cuda", dtype="bfloat16", progress=False)
    with pytest.raises(blockpress.InputError, match=r"torch.Generator\(device='cuda'\)"):
        m.generate(ids(1, 20, 5), generator=torch.Generator().manual_seed(0), **KW)
    out = m.generate(ids(1, 20, 5), generator=torch.Generator("cuda").manual_seed(0), **KW)  # CPU ids are moved
    assert out.sequences.shape == (1, 20 + KW["max_new_tokens"])


@pytest.mark.gpu
def test_fixed_steps_do_not_synchronise_on_cuda(hf_tiny_dir):
    """On a GPU, PyTorch's sync debug mode counts the synchronising calls: no more with twice the steps."""
    import warnings

    from blockpress.kernels import configure

    path, _ = hf_tiny_dir
    m = blockpress.load(path, device="cuda", dtype="bfloat16", progress=False)
    configure(m.module)  # the sync-free experts backend for this GPU (triton, else grouped)
    x = ids(1, 20, 5).cuda()
    kw = {k: v for k, v in KW.items() if k != "max_denoising_steps"}
    # no EOS: with one, 4 steps can end the generation a canvas earlier than 8 (seen on an H200), and each canvas
    # has its own (batched) stop checks
    kw.update(stability_threshold=None, confidence_threshold=None, eos_token_id=None)
    counts = []
    for steps in (4, 4, 8):  # the first count is a warm-up: a one-off sync inside torch.cuda under the debug mode
        m.generate(x, generator=torch.Generator("cuda").manual_seed(0), max_denoising_steps=steps, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m.generate(x, generator=torch.Generator("cuda").manual_seed(0), max_denoising_steps=steps, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts[1] == counts[2], counts


def test_chunked_prefill_equals_the_whole_prompt_at_once(bp, monkeypatch):
    """A long prompt is encoded `prefill_chunk` tokens at a time (no autograd, causal encoder): the same hidden
    states and cache as one pass over it, with chunks shorter than the sliding window and longer, left padding
    longer than a chunk (a row whose first chunk is all padding), and the same generated tokens. A bidirectional
    encoder, and autograd, encode the whole prompt in one pass."""
    m = bp.module
    rows = [ids(1, 37, 1)[0].tolist(), ids(1, 9, 2)[0].tolist()]  # 28 positions of padding in row 2
    x, mask = bp._prepare(rows, None)
    assert m.window == 8 and m.prefill_chunk and not m.bidirectional_encoder
    calls = []
    encode = type(m).encode
    monkeypatch.setattr(type(m), "encode", lambda self, ids, *a, **k: calls.append(ids.shape[1]) or encode(
        self, ids, *a, **k))
    outs = {}
    for chunk in (None, 5, 16):
        monkeypatch.setattr(m, "prefill_chunk", chunk)
        calls.clear()
        cache = m.new_cache(2, 40)  # grown once to hold the prompt
        with torch.no_grad():
            h = m.encode(x, cache, pad_mask=mask)
        outs[chunk] = (h, cache, list(calls))
    h0, c0, _ = outs[None]
    for chunk in (5, 16):
        h, c, seen = outs[chunk]
        assert seen == [37] + [min(chunk, 37 - i) for i in range(0, 37, chunk)]
        # padding positions hold whatever their (fully masked) attention gives; nothing ever attends to them
        real = mask.bool()
        assert c.length == 37 and (h - h0)[real].abs().max() < 2e-5 and torch.equal(c.valid, c0.valid)
        for a, b in zip(c0.keys + c0.values, c.keys + c.values):
            assert (a[:, :, :37] - b[:, :, :37]).transpose(1, 2)[real].abs().max() < 2e-5
    monkeypatch.setattr(m, "prefill_chunk", None)
    want = bp.generate(rows, generator=torch.Generator().manual_seed(3), **KW).sequences
    monkeypatch.setattr(m, "prefill_chunk", 5)
    assert torch.equal(bp.generate(rows, generator=torch.Generator().manual_seed(3), **KW).sequences, want)
    for whole in ("autograd", "bidirectional"):
        calls.clear()
        cache = m.new_cache(2, 40)
        if whole == "bidirectional":
            monkeypatch.setattr(m, "bidirectional_encoder", True)
            with torch.no_grad():
                m.encode(x, cache, pad_mask=mask)
            monkeypatch.setattr(m, "bidirectional_encoder", False)
        else:
            with torch.enable_grad():
                m.encode(x, cache, pad_mask=mask)
        assert calls == [37], whole


def test_fused_commit_pass_equals_encode_then_decode(bp):
    """encode_decode(chunk, canvas) = encode(chunk) then decode(canvas): logits and the cache it leaves,
    with the chunk past the sliding window, left padding in the cache, and self-conditioning logits."""
    m = bp.module
    rows = [ids(1, 20, 1)[0].tolist(), ids(1, 13, 2)[0].tolist()]
    x, mask = bp._prepare(rows, None)
    C = bp.canvas_length
    assert m.window < 20 + C  # the chunk's queries and the canvas's reach past the window
    caches = []
    for _ in range(2):
        c = m.new_cache(2, 20 + 3 * C)
        m.encode(x, c, pad_mask=mask)
        caches.append(c)
    for k, sc in enumerate((None, torch.randn(2, C, 512, generator=torch.Generator().manual_seed(3)))):
        chunk, canvas = ids(2, C, 10 + k), ids(2, C, 20 + k)
        m.encode(chunk, caches[0])
        ref = m.decode(canvas, caches[0], sc)
        got = m.encode_decode(chunk, canvas, caches[1], sc_logits=sc)
        assert (got - ref).abs().max() < 2e-5
        assert caches[1].length == caches[0].length
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            assert (a - b).abs().max() < 2e-5
    # the encoder and decoder layer_scalars really differ in this model: each segment used its own
    assert any(not torch.equal(layer.layer_scalar, layer.encoder_layer_scalar) for layer in m.layers)


def _counted(fn, counts, name):
    """fn, counting its calls in counts[name] (the real method still runs)."""
    def call(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)
    return call


@pytest.mark.parametrize("sampler,per_row", [("exact", False), ("fast", False), ("exact", True)])
def test_fuse_commit_gives_the_same_tokens(bp, sampler, per_row, monkeypatch):
    """fuse_commit=True: one encoder call (the prompt) and one fused pass per later canvas; the same
    sequences and tokens per forward as the reference loop (left-padded batch, adaptive stopping, 3 canvases)."""
    rows = [ids(1, 20, 1)[0].tolist(), ids(1, 13, 2)[0].tolist()]
    kw = dict(KW, max_new_tokens=48, eos_token_id=None, sampler=sampler)
    outs, calls = [], []
    for fuse in (False, True):
        gen = [torch.Generator().manual_seed(s) for s in (1, 2)] if per_row else torch.Generator().manual_seed(1)
        counts = {}
        for name in ("encode", "encode_decode"):
            monkeypatch.setattr(bp.module, name, _counted(getattr(bp.module, name), counts, name))
        outs.append(bp.generate(rows, generator=gen, fuse_commit=fuse, **kw))
        monkeypatch.undo()
        calls.append(counts)
    assert calls == [{"encode": 3}, {"encode": 1, "encode_decode": 2}]
    assert len(outs[0].steps_per_canvas) == 3
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].tokens_per_forward, outs[1].tokens_per_forward)
    assert outs[0].steps_per_canvas == outs[1].steps_per_canvas and outs[1].cache.length == outs[0].cache.length


def test_fused_commit_is_on_by_default_on_a_gpu_only(bp, monkeypatch):
    """fuse_commit=None (the default) fuses commits where the model runs on a CUDA GPU and not on a CPU: there a
    fused pass's GEMMs round differently (fp32, last bits), so the default keeps the reference's tokens. Explicit
    values win; anything else is refused in one line."""
    from blockpress.options import Options

    assert Options().fuse_commit is None and bp.options.fuse_commit is None
    assert Options().fused(torch.device("cuda")) is True and Options().fused(torch.device("cpu")) is False
    assert Options(fuse_commit=False).fused(torch.device("cuda")) is False
    assert Options(fuse_commit=True).fused(torch.device("cpu")) is True
    with pytest.raises(blockpress.InputError, match="fuse_commit must be None"):
        Options().replace(fuse_commit="yes")
    counts = {}
    for name in ("encode", "encode_decode"):
        monkeypatch.setattr(bp.module, name, _counted(getattr(bp.module, name), counts, name))
    bp.generate([ids(1, 9, 1)[0].tolist()], generator=torch.Generator().manual_seed(1),
                **dict(KW, max_new_tokens=32, eos_token_id=None))
    assert counts == {"encode": 2}  # the prompt, then a commit pass of its own (a CPU model)


def test_cuda_graphs_are_on_by_default_on_a_gpu_whose_kernels_can_be_captured():
    """cuda_graphs=None (the default) replays the passes from CUDA graphs where the model runs on a CUDA GPU and no
    experts kernel reads the host (those cannot be captured: then the passes launch from Python, rather than fail);
    never on a CPU. Explicit values win; anything else is refused in one line."""
    from blockpress.kernels.select import host_syncs
    from blockpress.options import Options

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert Options().cuda_graphs is None
    assert Options().graphs_on(cuda, True) is True and Options().graphs_on(cpu, True) is False
    assert Options().graphs_on(cuda, False) is False
    assert Options(cuda_graphs=False).graphs_on(cuda, True) is False
    assert Options(cuda_graphs=True).graphs_on(cpu, True) is True  # the plumbing without capture (the tests')
    with pytest.raises(blockpress.InputError, match="cuda_graphs must be None"):
        Options().replace(cuda_graphs="yes")
    lm = blockpress.load("sudoku", progress=False)
    assert lm.passes is lm.module  # a CPU: the module's own passes
    assert not host_syncs(lm.module) and Options().graphs_on(cuda, not host_syncs(lm.module))
    lm.configure(experts="loop")  # the reference reads each expert's token count on the host
    assert host_syncs(lm.module) and not Options().graphs_on(cuda, not host_syncs(lm.module))


def test_to_decides_the_kernels_and_passes_again_for_the_new_dtype():
    """`lm.to(...)` chooses the kernels as `load` would for the new device and dtype (on this CPU the experts' auto
    kernel is the grouped GEMM in fp32 and the dense one in fp16), drops fixed-shape passes built for the old ones,
    and generates what a model loaded in that dtype generates. A quantized model refuses a cast in one line."""
    from blockpress.engine.graphs import GraphedPasses
    from blockpress.kernels.select import kernel_of

    def experts(lm):
        return kernel_of(lm.module.layers[0].experts.kernel)

    lm = blockpress.load("kjv", progress=False, cuda_graphs=True)  # the fixed-shape passes (no capture on a CPU)
    old = lm.passes
    assert isinstance(old, GraphedPasses) and experts(lm) == "grouped"
    lm.to(dtype=torch.float16)
    fresh = blockpress.load("kjv", progress=False, dtype="float16", cuda_graphs=True)
    assert lm.dtype == torch.float16 and experts(lm) == experts(fresh) == "dense"
    assert lm.module.inv_freq_full_attention.dtype == torch.float32  # the rotary frequencies are not cast (as loaded)
    assert isinstance(lm.passes, GraphedPasses) and lm.passes is not old and lm.passes.module is lm.module
    ids = [fresh.tokenizer.encode("In the beginning God")]
    outs = [m.generate(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(1)).new_tokens
            for m in (lm, fresh)]
    assert torch.equal(*outs)
    lm.to(dtype="float32")
    assert experts(lm) == "grouped" and lm.dtype == torch.float32
    q = blockpress.load("kjv", progress=False, precision="int4")
    with pytest.raises(blockpress.InputError, match="quantized weights.*load it again with dtype='float16'"):
        q.to(dtype=torch.float16)
    with pytest.raises(blockpress.InputError, match="is not one the model computes in"):
        q.to(dtype="half-ish")
    # each of these was a raw torch error (TypeError, RuntimeError, AssertionError without a CUDA build)
    for bad in (torch.int8, torch.float8_e4m3fn):
        with pytest.raises(blockpress.InputError, match="is not one the model computes in"):
            q.to(dtype=bad)
    # an int8 embedding table is quantized storage too: the cast left its fp32 rows beside bf16 projections (a torch
    # dtype error at the first generate)
    e8 = blockpress.load("kjv", progress=False, embeddings="int8")
    with pytest.raises(blockpress.InputError, match="embeddings='int8'"):
        e8.to(dtype=torch.bfloat16)
    assert lm.to(dtype="bf16").dtype == torch.bfloat16  # the names load takes ("bf16" was refused here)
    with pytest.raises(blockpress.InputError, match="unknown device 'tpu'"):
        q.to("tpu")
    # storage is chosen at load: configure quantised the weights in place, and could not undo it
    with pytest.raises(blockpress.InputError, match="storage precision is chosen at load"):
        q.configure(precision="native")
    assert q.configure(precision=q.options.precision).precision == q.options.precision  # unchanged: fine


def test_temperature_schedule_is_the_reference_formula_bit_for_bit():
    """The device-resident schedule gives, entry by entry, the reference's scalar fp32 arithmetic
    tau = t_min + (t_max - t_min) * (n / N) with n an int32 tensor."""
    from blockpress.sampling import temperature, temperature_schedule

    for N, lo, hi in ((16, 0.4, 0.8), (7, 0.1, 1.3), (128, 0.4, 0.8), (1, 0.5, 0.5), (33, 0.0, 2.0)):
        for n in range(N + 1):
            ref = lo + (hi - lo) * (torch.tensor(n, dtype=torch.int32) / N)
            got = temperature(n, N, lo, hi, "cpu")
            assert got.dtype == ref.dtype == torch.float32 and torch.equal(got, ref), (N, lo, hi, n)
    a = temperature_schedule(16, 0.4, 0.8, torch.device("cpu"))
    assert temperature_schedule(16, 0.4, 0.8, torch.device("cpu")) is a  # made once per schedule and device
    # a huge budget is made in chunks (10**12 steps once tried to allocate 4 TB), still bit for bit
    for N, n in ((10**12, 10**12), (10**12, 10**12 - 4097), (10**6, 4096), (10**6, 4095), (10**6, 123457)):
        ref = 0.4 + (0.8 - 0.4) * (torch.tensor(n, dtype=torch.int32 if N < 2**31 else torch.int64) / N)
        assert torch.equal(temperature(n, N, 0.4, 0.8, "cpu"), ref), (N, n)
    assert temperature_schedule(10**12, 0.4, 0.8, torch.device("cpu"), 0).numel() == 4096


def test_the_smallest_temperature_allowed_still_samples():
    """GenerationConfig refuses a positive t_min / t_max under MIN_TEMPERATURE: below fp32's range the exact
    sampler's probabilities became nan (t_max=1e-38 on the shipped chat model; the schema fuzzer's 5e-324). At the
    floor, over a long schedule (tau down to MIN_TEMPERATURE / 64), both samplers still sample: near-argmax."""
    from blockpress.config import MIN_TEMPERATURE

    lm = blockpress.load("assistant", progress=False)
    ids = lm.encode_chat("What is 2 + 3?")
    kw = dict(max_new_tokens=32, t_min=0.0, t_max=MIN_TEMPERATURE, max_denoising_steps=64)
    for sampler in ("exact", "fast"):
        out = lm.generate([ids], generator=torch.Generator().manual_seed(0), sampler=sampler, **kw)
        assert "2 + 3 = 5" in lm.decode_new(out), (sampler, lm.decode_new(out))
    with pytest.raises(SamplingError, match="t_max"):
        lm.generate([ids], **{**kw, "t_max": MIN_TEMPERATURE / 2})


def test_half_a_temperature_schedule_is_refused():
    """t_min=None, t_max=0.8 (or t_min=None alone, t_max from the checkpoint) silently ran without a schedule;
    it is a SamplingError saying to give both or neither, in every entry point (generate, infill, the CLI)."""
    from blockpress.cli import main as cli_main

    kjv = blockpress.load("kjv", progress=False)
    ids = [[kjv.tokenizer.bos_token_id] + kjv.tokenizer.encode("And God said")]
    for kw in (dict(t_min=None, t_max=0.8), dict(t_min=None), dict(t_max=None), dict(t_min=0.3, t_max=None)):
        with pytest.raises(SamplingError, match="a temperature schedule needs both; give both numbers, or both None"):
            kjv.generate(ids, max_new_tokens=8, **kw)
    with pytest.raises(SamplingError, match="invalid t_min=None with t_max=0.8"):
        kjv.infill("And God [MASK] the light", t_min=None)
    off = kjv.generate(ids, max_new_tokens=8, t_min=None, t_max=None, generator=torch.Generator().manual_seed(0))
    assert off.config.t_min is None and off.config.t_max is None
    assert cli_main(["run", "kjv", "And God", "--t-min", "none", "--no-live", "--threads", "1"]) == 2
    assert cli_main(["run", "kjv", "And God", "--t-min", "none", "--t-max", "none", "--no-live", "--threads", "1",
                     "--max-new-tokens", "8", "--steps", "2"]) == 0


def test_load_turns_on_cuda_graphs_and_compile_from_python(tmp_path):
    """`blockpress.load(..., cuda_graphs=True)` runs the graphed fixed-shape passes (on a CPU: their plumbing,
    without capture) with the tokens of a plain load; `compile=True` compiles the decoder blocks. Both are options
    of the loaded model, validated at load."""
    from blockpress.engine.graphs import GraphedPasses
    from blockpress.kernels.select import kernel_names
    from test_server import build_tiny_model

    folder = build_tiny_model(tmp_path / "m")
    plain = blockpress.load(folder, progress=False)
    graphed = blockpress.load(folder, progress=False, cuda_graphs=True)
    assert graphed.options.cuda_graphs and isinstance(graphed.passes, GraphedPasses)
    assert not plain.options.cuda_graphs and plain.passes is plain.module
    ids = plain.encode_chat("Hello", chat=False)
    kw = dict(max_new_tokens=24, max_denoising_steps=3)
    want = plain.generate([ids], generator=[torch.Generator().manual_seed(1)], **kw).sequences
    assert torch.equal(graphed.generate([ids], generator=[torch.Generator().manual_seed(1)], **kw).sequences, want)
    compiled = blockpress.load(folder, progress=False, compile=True)
    assert compiled.options.compile and kernel_names(compiled.module)["compiled_blocks"]
    assert not kernel_names(plain.module)["compiled_blocks"]
    with pytest.raises(blockpress.BlockpressError, match="cuda_graphs"):
        blockpress.load(folder, progress=False, cuda_graphs="yes")


def test_a_cache_is_extended_in_place_and_another_models_is_refused(bp):
    """The cache a call is given is the one it extends (documented; a copy continues a prefix another way and
    leaves it as it was), and a cache of another layout is an InputError naming why (it was an IndexError deep in
    the cache, or a silent run on a cache whose dtype is not the model's)."""
    import copy

    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    base = bp.generate(ids(1), generator=g(0), **KW)
    c = base.cache
    n = c.length
    a = bp.generate([[9, 10]], cache=copy.deepcopy(c), generator=g(1), **KW)
    b = bp.generate([[9, 10]], cache=copy.deepcopy(c), generator=g(1), **KW)
    assert torch.equal(a.sequences, b.sequences) and c.length == n
    same = bp.generate([[9, 10]], cache=c, generator=g(1), **KW)
    assert same.cache is c and c.length > n and torch.equal(same.sequences, a.sequences)
    other = blockpress.from_config({"model_type": "diffusion_gemma", "canvas_length": bp.canvas_length,
                                    "text_config": {**TINY_TEXT, "num_hidden_layers": 2,
                                                    "layer_types": TINY_TEXT["layer_types"][:2]}}, seed=0)
    foreign = other.generate([[5, 6, 7]], max_new_tokens=8).cache
    with pytest.raises(InputError, match="cache is not this model's .2 layers, the model has"):
        bp.generate([[9, 10]], cache=foreign, **KW)
    half = copy.deepcopy(c)
    half.keys = [k.to(torch.bfloat16) for k in half.keys]
    with pytest.raises(InputError, match="torch.bfloat16 on cpu, the model is torch.float32"):
        bp.generate([[9, 10]], cache=half, **KW)


def test_api_misuse_is_an_input_error_not_a_python_one(bp, tmp_path):
    """A 0-d or 3-d tensor of ids, a row past the result, a shard size that is not a positive number of bytes:
    IndexError / TypeError before, or (shard_bytes=-5) a checkpoint of one tensor a file."""
    r = bp.generate(ids(1), **KW)
    for call, needle in [(lambda: bp.generate(torch.tensor(5), **KW), "input_ids must be \\[batch, length\\]"),
                         (lambda: bp.generate(torch.zeros(1, 2, 3, dtype=torch.long), **KW), "got shape \\[1, 2, 3\\]"),
                         (lambda: bp.decode_new(r, 5), "row 5 is not a row of this result"),
                         (lambda: bp.save(tmp_path / "a", shard_bytes="big"), "shard_bytes must be"),
                         (lambda: bp.save(tmp_path / "b", shard_bytes=-5), "shard_bytes must be"),
                         (lambda: bp.save(tmp_path / "c", shard_bytes=2.5), "shard_bytes must be"),
                         (lambda: r.cache.crop(10 ** 6), "cannot crop a cache of length")]:
        with pytest.raises(InputError, match=needle):
            call()
    assert not (tmp_path / "b").exists()
    # a whole number written as a float (docs/api.md's 5e9) is that many bytes
    assert sorted(p.name for p in bp.save(tmp_path / "d", shard_bytes=5e9).iterdir()) == sorted(
        p.name for p in bp.save(tmp_path / "e", shard_bytes=5 * 10 ** 9).iterdir())
