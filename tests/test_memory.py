"""Peak memory accounting on the meta device (blockpress/lab/memory.py, benchmarks/peak_memory.py): the
tracker counts what is alive at once, and a decoder step holds at most the logits' fp32 buffers it must."""

import json
import runpy
import sys
from pathlib import Path

import torch

from blockpress.config import GenerationConfig, ModelConfig
from blockpress.engine.step import single_step
from blockpress.lab.memory import LiveBytes, meta_backends
from blockpress.model.diffusion_gemma import DiffusionGemmaModel
from hf_oracle import TINY_TEXT, TINY_VISION

ROOT = Path(__file__).resolve().parents[1]


def test_live_bytes_counts_allocations_views_and_frees():
    with LiveBytes() as lb:
        a = torch.empty(1000, device="meta")  # 4 kB
        v = a[:10]  # a view: no new storage, keeps a's alive
        del a
        b = torch.empty(500, device="meta")  # 2 kB: 6 kB alive
        b.add_(1)  # in place: nothing new
        del v  # a's storage goes
        c = torch.empty(250, device="meta")  # 3 kB alive
    assert lb.peak == 6000 and lb.live == 3000
    del b, c


def test_live_bytes_counts_a_batched_matmul_once():
    """`x @ w.t()` on a 3-d x is mm then `_unsafe_view`, which the op schema does not mark as a view: its product
    is one allocation (the LM head's [B, C, V] logits were counted twice before)."""
    x, w = torch.empty(2, 3, 8, device="meta"), torch.empty(5, 8, device="meta")
    with LiveBytes() as lb:
        y = x @ w.t()
        z = y.reshape(6, 5).contiguous()  # a view: nothing new
    assert lb.peak == 2 * 3 * 5 * 4 and z.shape == (6, 5)


def test_a_decoder_step_holds_few_vocabulary_sized_buffers(monkeypatch):
    """A big vocabulary against a small model, so the [B, C, V] tensors are what counts: the decoder pass peaks at
    about one fp32 logits buffer plus its bf16 matmul, the exact sampler adds two (its softmax and multinomial's
    draws). Before the in-place softcap and entropy, and the chunked self-conditioning softmax, the same pass held
    three fp32 buffers and the step five."""
    import blockpress.model.layers as layers

    V, C = 1 << 16, 64
    monkeypatch.setattr(layers, "SOFTMAX_CHUNK", 1 << 20)  # 16 rows per chunk, as 64 of the 26B's 256 rows
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": C,
                                 "text_config": dict(TINY_TEXT, vocab_size=V, final_logit_softcapping=30.0),
                                 "vision_config": TINY_VISION})
    with torch.device("meta"):
        m = DiffusionGemmaModel(cfg).to(torch.bfloat16)
    m.materialize_buffers("meta")
    meta_backends(m)
    with torch.no_grad():  # restores the grad mode the test found
        cache = m.new_cache(1, 96)
        cache.length = 32
        canvas = torch.zeros(1, C, dtype=torch.long, device="meta")
        sc = torch.zeros(1, C, V, dtype=torch.bfloat16, device="meta")
        logits = C * V * 4
        with LiveBytes() as dec:
            out = m.decode(canvas, cache, sc)
        del out
        assert logits <= dec.peak <= 1.6 * logits, dec.top()
        gcfg = GenerationConfig.resolve({}, max_denoising_steps=4, t_min=0.4, t_max=0.8, stability_threshold=None,
                                        confidence_threshold=None)
        with LiveBytes() as step:
            out = single_step(m, canvas, sc, gcfg, cache, n=4)
        del out
        assert step.peak <= 3.2 * logits, step.top()


def test_peak_memory_script_on_the_tiny_preset(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["peak_memory.py", "--preset", "tiny", "--precision", "int4"])
    runpy.run_path(str(ROOT / "benchmarks" / "peak_memory.py"), run_name="__main__")
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["bench"] == "peak_memory" and result["passes"]["decode (exact)"] > 0
    for sampler in ("exact", "fast"):
        p = result["predicted_peak_bytes"][sampler]
        assert p["cuda_graphs"] >= p["eager"] > result["weights_bytes"] + result["kv_bytes"]
    # the fast sampler's passes hand it the LM head's product in bf16, not fp32 logits: a smaller buffer
    exact, fast = (result["predicted_peak_bytes"][s]["cuda_graphs"] for s in ("exact", "fast"))
    assert fast < exact
    assert any("predicted peak" in line for line in out)


def test_peak_memory_script_counts_the_sliding_ring(capsys, monkeypatch):
    """A prompt longer than the ring (tiny: window + 2,048 slots): the cache, and the predicted peak, are smaller with
    the ring than with every position kept (`--no-ring`), by the sliding layers' bytes past the ring."""
    runs = {}
    for flag in ([], ["--no-ring"]):
        monkeypatch.setattr(sys, "argv", ["peak_memory.py", "--preset", "tiny", "--prompt-tokens", "4096",
                                          "--new-tokens", "32", *flag])
        runpy.run_path(str(ROOT / "benchmarks" / "peak_memory.py"), run_name="__main__")
        runs[bool(flag)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ring, flat = runs[False], runs[True]
    assert flat["ring"] is None and ring["ring"] is not None
    assert ring["kv_bytes"] < flat["kv_bytes"]
    assert ring["predicted_peak_bytes"]["fast"]["eager"] < flat["predicted_peak_bytes"]["fast"]["eager"]


def test_a_long_prompts_prefill_holds_its_output_and_one_mask(monkeypatch):
    """A long prompt on a small model with a tiny prefill chunk, so that the hidden states it returns and the full
    layers' [chunk, prompt] mask are what counts: the prefill peaks at about the output plus one bf16 mask and its
    boolean (the chunks are written into the output; the mask is filled in place). Before, the chunks' list and
    their concatenation were both alive (twice the output), and the mask had a copy and a negated boolean."""
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": 16,
                                 "text_config": dict(TINY_TEXT, hidden_size=256, max_position_embeddings=1 << 16),
                                 "vision_config": TINY_VISION})
    with torch.device("meta"):
        m = DiffusionGemmaModel(cfg).to(torch.bfloat16)
    m.materialize_buffers("meta")
    meta_backends(m)
    m.prefill_chunk = 256
    S = 8192
    # the attention's own copy of a mask per query group (to fold the groups into one call; under a budget, see
    # test_sdpa_gqa_folds_grouped_heads_into_the_query_length) is not what this test counts
    monkeypatch.setattr("blockpress.kernels.attention.MASK_REPEAT_BYTES", 0)
    with torch.no_grad():  # restores the grad mode the test found
        cache = m.new_cache(1, S)
        ids = torch.zeros(1, S, dtype=torch.long, device="meta")
        with LiveBytes() as lb:
            out = m.encode(ids, cache)
    out_bytes, mask_bytes = S * 256 * 2, 256 * S * 2
    assert out.shape == (1, S, 256)
    assert lb.peak <= out_bytes + 1.5 * mask_bytes + 0.2 * out_bytes, lb.top()
    with torch.no_grad():  # what generate asks for: the cache alone, so no output is held
        cache = m.new_cache(1, S)
        with LiveBytes() as kv:
            assert m.encode(ids, cache, output=False) is None
    assert kv.peak <= 1.5 * mask_bytes + 0.2 * out_bytes < lb.peak - 0.7 * out_bytes, kv.top()


def test_a_decoder_pass_at_a_long_context_copies_no_layers_cache():
    """With room in the cache (generate's: one canvas past the last commit), the eager decoder writes the canvas's
    K/V there and attends over one span of the cache: a pass at a 32K-token context allocates a few activations, not
    a copy of a full layer's keys and values, which concatenating them with the canvas's made (the same pass on a
    cache without the room still does: on the 26B model 0.5 GB a layer at 128K)."""
    C, T = 16, 1 << 15
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": C,
                                 "text_config": dict(TINY_TEXT, max_position_embeddings=1 << 16),
                                 "vision_config": TINY_VISION})
    with torch.device("meta"):
        m = DiffusionGemmaModel(cfg).to(torch.bfloat16)
    m.materialize_buffers("meta")
    meta_backends(m)
    peaks = {}
    with torch.no_grad():
        for room in (True, False):
            cache = m.new_cache(1, T + C if room else T)
            cache.length = T
            canvas = torch.zeros(1, C, dtype=torch.long, device="meta")
            with LiveBytes() as lb:
                m.decode(canvas, cache)
            peaks[room] = lb
    full = next(i for i, layer in enumerate(m.layers) if layer.full)
    layer_kv = 2 * cache.keys[full].numel() * 2  # K and V of a full layer at T positions, bf16
    assert peaks[False].peak >= layer_kv, peaks[False].top()
    assert peaks[True].peak < 0.05 * layer_kv, peaks[True].top()
