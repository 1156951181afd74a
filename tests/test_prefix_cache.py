"""The server's prefix cache (engine/prefix.py): a prompt that starts like a kept one takes that prefix's K/V and
encodes only the rest, which is the chunked prefill of the same prompt; with CUDA graphs' slots, rings and
eviction."""

import random

import pytest
import torch

pytestmark = pytest.mark.no_grad  # inference: conftest runs each test without autograd

import blockpress
from blockpress.engine.prefix import PrefixCache, common_prefix
from blockpress.kernels import use
from blockpress.server.metrics import Metrics
from blockpress.server.worker import Job, Worker
from blockpress.testing import cuda_graphs, drive_worker
from hf_oracle import TINY_TEXT


@pytest.fixture(scope="module")
def tiny():
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": TINY_TEXT, "canvas_length": 8},
                               seed=0)
    for p in m.module.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    m.module.prefill_chunk = 8  # a ring of W 8 + max(8, 2 canvases) = 24 slots once a cache is longer
    use(m.module, attention="eager")
    return m


def _ids(n, seed):
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _job(tiny, prompt, seed, new=16):
    cfg = tiny.generation_config(max_new_tokens=new, max_denoising_steps=3, eos_token_id=None,
                                 stability_threshold=None, confidence_threshold=None)
    return Job(list(prompt), cfg, seed=seed)


class _Encoded:
    """Records the token count of every cache-only encoder call (a prefill or a commit; observes the model, changes
    nothing)."""

    def __init__(self, module, monkeypatch):
        self.calls, depth = [], [0]
        real = module.encode

        def encode(ids, cache, *a, **k):
            if k.get("output") is False and not depth[0]:  # a chunked prefill's chunks are calls within the call
                self.calls.append(ids.shape[1])
            depth[0] += 1
            try:
                return real(ids, cache, *a, **k)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(module, "encode", encode)


def test_common_prefix_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(500):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        b = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


def test_next_turn_encodes_only_what_is_new_and_gets_the_chunked_prefills_cache(tiny, monkeypatch):
    """Turn 2 = turn 1's prompt + 12 new tokens: it reuses all of turn 1's prompt, the encoder sees only the 12, and
    the cache it decodes from is bit for bit the one of encoding [0, 40) and then [40, 52) as two chunks."""
    m = tiny.module
    first, second = _ids(40, 1), None
    second = first + _ids(12, 2)
    w = Worker(tiny, max_batch=1)
    seen = _Encoded(m, monkeypatch)
    drive_worker(w, {0: [_job(tiny, first, 1)]})
    assert seen.calls[0] == 40
    seen.calls.clear()
    h = w.submit(_job(tiny, second, 2))
    w.canvas()  # admission (the prefill) and the first canvas
    assert seen.calls[0] == 12  # the new tokens only (later calls are the commit's)
    pc = w.runner.prefixes
    assert (pc.hits, pc.tokens_reused) == (1, 40)
    assert len(pc.entries) == 1 and len(next(iter(pc.entries))) == 52  # turn 2 replaced turn 1's entry
    # the cache turn 2 was admitted with: the kept copy of its prompt
    kept = next(iter(pc.entries.values()))
    ref = m.new_cache(1, kept.capacity)
    ids = torch.tensor([second])
    real = type(m).encode.__get__(m)
    real(ids[:, :40], ref, output=False)
    real(ids[:, 40:], ref, output=False)
    for i in range(len(ref.keys)):
        assert torch.equal(kept.keys[i], ref.keys[i][:, :, :kept.keys[i].shape[2]])
        assert torch.equal(kept.values[i], ref.values[i][:, :, :kept.values[i].shape[2]])
    while w.busy:
        w.canvas()
    h.drain()


@pytest.mark.parametrize("graphs", [False, True])
def test_tokens_match_a_worker_without_the_cache(tiny, graphs):
    """A conversation of three turns, each extending the last, and a repeat of the last prompt (a whole match that
    encodes nothing): the same tokens as a worker that keeps nothing (fp32: chunked and whole prefills agree here
    token for token), with the CUDA graphs' slot plumbing too (the kept prefix is copied into the slots)."""
    base = _ids(30, 3)
    third = base + _ids(10, 4) + _ids(9, 5)
    prompts = [base, base + _ids(10, 4), third, third]
    plan = {4 * i: [_job(tiny, p, 10 + i)] for i, p in enumerate(prompts)}
    want = drive_worker(Worker(tiny, max_batch=2, prefix_cache=0), plan)
    if graphs:
        with cuda_graphs(tiny):
            w = Worker(tiny, max_batch=2)
            got = drive_worker(w, plan)
    else:
        w = Worker(tiny, max_batch=2)
        got = drive_worker(w, plan)
    assert w.runner.prefixes.hits == 3
    assert got == want


def test_a_ring_that_lost_the_window_is_a_miss_not_wrong_keys(tiny):
    """A kept 60-token prompt's sliding layers hold a ring of its last 24 positions: a prompt sharing only its first
    20 tokens needs positions 12-19, which are gone, so it encodes from the start (a miss) and gets the tokens of a
    worker without the cache."""
    long = _ids(60, 6)
    short = long[:20] + _ids(8, 7)
    plan = {0: [_job(tiny, long, 1)], 5: [_job(tiny, short, 2)]}
    w = Worker(tiny, max_batch=1)
    got = drive_worker(w, plan)
    assert next(iter(w.runner.prefixes.entries.values())).ring == 24
    assert (w.runner.prefixes.hits, w.runner.prefixes.misses) == (0, 2)
    assert got == drive_worker(Worker(tiny, max_batch=1, prefix_cache=0), plan)


def test_rows_joining_a_running_batch_neither_take_nor_leave_prefixes(tiny, monkeypatch):
    """A row left-padded to join a running batch sits at positions that depend on the batch: it is encoded whole."""
    base = _ids(24, 8)
    w = Worker(tiny, max_batch=2)
    seen = _Encoded(tiny.module, monkeypatch)
    w.submit(_job(tiny, base + _ids(30, 9), 1, new=64))
    w.canvas()
    assert seen.calls == [54] and w.runner.cache.length == 54  # alone at [0, 54): kept
    seen.calls.clear()
    w.submit(_job(tiny, base + _ids(20, 10), 2))
    w.canvas()  # the first canvas's commit, then the second prompt joins at [E - 44, E)
    assert seen.calls == [8, 44] and len(w.runner.cache.valid) == 2  # the commit, then the prompt whole
    while w.busy:
        w.canvas()
    assert w.runner.prefixes.hits == 0 and len(w.runner.prefixes.entries) == 1


def test_eviction_keeps_the_budget_and_the_count_least_recently_used_first(tiny):
    m = tiny.module
    caches = []
    for s in range(3):
        c = m.new_cache(1, 20)
        m.encode(torch.tensor([_ids(20, 20 + s)]), c, output=False)
        caches.append(c)
    size = caches[0].nbytes()
    pc = PrefixCache(budget=2 * size)
    prompts = [_ids(20, 20 + s) for s in range(3)]
    pc.store(prompts[0], caches[0])
    pc.store(prompts[1], caches[1])
    assert pc.match(prompts[0] + [7])[0] == 20  # prompt 0 is now the most recently used
    pc.store(prompts[2], caches[2])
    assert set(pc.entries) == {tuple(prompts[0]), tuple(prompts[2])} and pc.bytes == 2 * size
    assert pc.match(prompts[1]) is None
    PrefixCache(budget=size - 1).store(prompts[0], caches[0])  # larger than the budget: not kept (no error)
    few = PrefixCache(budget=10 * size, max_entries=2)
    for prompt, cache in zip(prompts, caches):
        few.store(prompt, cache)
    assert set(few.entries) == {tuple(prompts[1]), tuple(prompts[2])}  # the oldest went: 2 prompts at most
    short = PrefixCache(budget=size)
    short.store(prompts[0][:10], caches[0])  # shorter than min_tokens: nothing worth keeping
    assert not short.entries


def test_the_metrics_count_hits_and_reused_tokens(tiny):
    metrics = Metrics()
    base = _ids(32, 11)
    w = Worker(tiny, max_batch=1, metrics=metrics)
    drive_worker(w, {0: [_job(tiny, base, 1)], 4: [_job(tiny, base + _ids(5, 12), 2)]})
    text = metrics.render()
    assert "blockpress_prefix_cache_hits_total 1" in text
    assert "blockpress_prefix_cache_tokens_total 32" in text


def test_no_prefix_cache_for_a_bidirectional_encoder():
    cfg = dict(TINY_TEXT, use_bidirectional_attention="all")
    m = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": cfg, "canvas_length": 8}, seed=0)
    assert Worker(m, max_batch=1).runner.prefixes is None


def test_a_ring_that_lost_the_window_makes_way_for_another_entry_with_the_prefix(tiny):
    """A long prompt kept as a ring and a short one kept whole share a 20-token start (a system prompt). A third
    prompt with that start was a miss: the lookup took the one entry with the longest shared prefix (ties: the
    least recently used, the ring), found its window gone and tried no other. Now the short entry serves it, with
    the tokens of a worker without the cache."""
    system = _ids(20, 8)
    plan = {0: [_job(tiny, system + _ids(40, 9), 1)], 5: [_job(tiny, system + _ids(8, 10), 2)],
            10: [_job(tiny, system + _ids(8, 11), 3)]}
    w = Worker(tiny, max_batch=1)
    got = drive_worker(w, plan)
    assert (w.runner.prefixes.hits, w.runner.prefixes.misses, w.runner.prefixes.tokens_reused) == (1, 2, 20)
    assert got == drive_worker(Worker(tiny, max_batch=1, prefix_cache=0), plan)


def test_a_short_prompt_in_a_cache_without_a_ring_after_a_long_one_is_served(tiny):
    """A kept 30-token prompt's sliding layers keep a ring of 24 slots (positions 0-5 gone). A 16-token prompt that
    is its start needs only positions 8-15 there, but its own cache (16 + one 8-token canvas) is small enough to keep
    every position: it cannot take a prefix with positions missing, so it encodes from the start (a miss), with the
    tokens of a worker without the cache."""
    long = _ids(30, 13)
    plan = {0: [_job(tiny, long, 1)], 5: [_job(tiny, long[:16], 2, new=8)]}
    w = Worker(tiny, max_batch=1)
    got = drive_worker(w, plan)
    assert (w.runner.prefixes.hits, w.runner.prefixes.misses) == (0, 2)
    assert got == drive_worker(Worker(tiny, max_batch=1, prefix_cache=0), plan)


def test_kept_prompts_make_room_for_the_slots(tiny, monkeypatch):
    """Under the CUDA graphs' slots a request that needs the slots to grow, where the device's spare memory would not
    hold them, first frees the kept prompts (requests come before the cache)."""
    with cuda_graphs(tiny):
        w = Worker(tiny, max_batch=1)
        drive_worker(w, {0: [_job(tiny, _ids(20, 14), 1)]})
        assert len(w.runner.prefixes.entries) == 1
        short = w.runner.slot_bytes(1, 512) - 1  # the 316 positions needed fit, doubled to 512 they do not
        monkeypatch.setattr(w.runner, "spare", lambda: short)
        drive_worker(w, {0: [_job(tiny, _ids(300, 15), 2)]})  # more positions than the slots hold
        assert 316 <= w.runner._slots.capacity < 512
    assert [len(k) for k in w.runner.prefixes.entries] in ([], [300])  # the 20-token prompt went
