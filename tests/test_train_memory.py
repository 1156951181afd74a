"""benchmarks/train_memory.py: the meta-device accounting of one training step agrees with a real CPU step on the
tiny model (parameters, gradients, AdamW state), and its components move the right way."""

import importlib.util
from pathlib import Path

import pytest
import torch

from blockpress.train import objective as obj

_spec = importlib.util.spec_from_file_location("train_memory", Path(__file__).parents[1] / "benchmarks" / "train_memory.py")
tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tm)

KW = dict(preset="tiny", prompt_tokens=32, canvas=None, steps=1)


@pytest.fixture(scope="module")
def predictions():
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = tm.predict(**KW, **kw)
        return cache[key]
    return get


def _real_step(lora: int):
    """A real training step on the CPU (bf16 tiny model): -> (weights, trainable, grads, AdamW state) bytes."""
    torch.manual_seed(0)
    m, _ = tm.build("tiny", "native", "native", 0, device="cpu")
    weights = tm._bytes(m.parameters()) + tm._bytes(b for n, b in m.named_buffers() if not n.startswith("inv_freq"))
    if lora:
        from blockpress.train.lora import LoraSpec, add_lora

        add_lora(m, LoraSpec(rank=lora, alpha=2.0 * lora))  # fp32 adapters, as the trainer's
    m.train()
    batch = obj.collate([(list(range(2, 34)), list(range(40, 56)))], m.config.canvas_length, m.text.vocab_size,
                        obj.ObjectiveConfig(), step=0)
    opt, params = tm.make_optimizer(m, foreach=None)
    loss, _ = obj.compute_loss(m, batch, obj.ObjectiveConfig())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    grads = tm._bytes(p.grad for p in params)
    state = tm._bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return weights, tm._bytes(params), grads, state


@pytest.mark.parametrize("lora", [0, 4])
def test_predicted_bytes_equal_a_real_cpu_step(predictions, lora):
    p = predictions(precision="native", lora=lora)
    weights, trainable, grads, state = _real_step(lora)
    assert p["weights_bytes"] == weights
    assert p["trainable_bytes"] == trainable and p["grad_bytes"] == grads
    assert p["optimizer_state_bytes"] == state == 2 * trainable  # exp_avg + exp_avg_sq in the params' dtype
    if lora:
        assert p["lora_param_bytes"] == trainable


def test_quantised_weights_agree_with_the_loaders_estimate():
    from blockpress.config import ModelConfig
    from blockpress.lab.presets import preset_config
    from blockpress.loading import estimated_weight_bytes
    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    with torch.device("meta"):
        m = DiffusionGemmaModel(ModelConfig.from_dict(preset_config("tiny")[0])).to(torch.bfloat16)
    scalars = sum(b.numel() * 2 for n, b in m.named_buffers() if "layer_scalar" in n)  # buffers, not in the estimate
    for prec in ("int4", "fp8"):
        assert tm.build("tiny", prec, "native", 4)[1] == \
            estimated_weight_bytes(m, torch.bfloat16, prec) + scalars


def test_lora_trains_fewer_bytes_than_full_fine_tuning(predictions):
    full, lora = predictions(precision="native", lora=0), predictions(precision="native", lora=4)
    assert lora["grad_bytes"] < full["grad_bytes"]
    assert lora["optimizer_state_bytes"] < full["optimizer_state_bytes"]
    assert lora["predicted_peak_bytes"] < full["predicted_peak_bytes"]


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_checkpointing_lowers_the_saved_activations(predictions):
    on = predictions(precision="int4", lora=4)
    off = predictions(precision="int4", lora=4, checkpointing=False)
    assert on["saved_activation_bytes"] < off["saved_activation_bytes"]
    assert on["grad_bytes"] == off["grad_bytes"]


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_fsdp_divides_the_sharded_parts(predictions):
    two = predictions(precision="native", lora=0, procs=2)
    m, weights = tm.build("tiny", "native", "native", 0)
    four = {"fsdp": tm.fsdp(m, two["phases"], weights, 4)}
    four["predicted_peak_bytes"] = four["fsdp"]["peak"]
    whole = 8 * two["trainable_bytes"]  # fp32 params + grads + two AdamW moments (the trace's params are bf16)
    assert two["trainable_bytes"] == tm._bytes(m.parameters())
    assert two["fsdp"]["sharded_bytes"] == whole / 2 and four["fsdp"]["sharded_bytes"] == whole / 4
    assert four["predicted_peak_bytes"] < two["predicted_peak_bytes"]
    assert two["fsdp"]["gathered_bytes"] == four["fsdp"]["gathered_bytes"]
    # FSDP2's two backwards (decoder, then encoder) never hold every layer's decoder gradient at once; one would
    assert two["fsdp"]["peak"] < two["fsdp"]["one_backward_peak_bytes"]


def test_train_step_benchmark_trains_and_reports_a_prediction():
    """benchmarks/train_step.py (what a GPU session runs for the measured side): QLoRA steps on the tiny preset run
    and report their time (the prediction beside them is train_memory.predict, tested above; its two-step trace
    takes most of a minute even on the tiny preset, so it is left out here)."""
    spec = importlib.util.spec_from_file_location("train_step", Path(__file__).parents[1] / "benchmarks" /
                                                  "train_step.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    r = ts.run(preset="tiny", precision="int4", linears="int8", lora=4, prompt_tokens=8, steps=2, device="cpu",
               predict=False)
    assert len(r["steps"]) == 2 and all(s["seconds"] > 0 and s["loss"] > 0 for s in r["steps"])
    assert r["measured_peak_bytes"] is None and r["predicted_peak_bytes"] is None  # measured on CUDA only
    assert r["steps"][0]["loss"] != r["steps"][1]["loss"]  # the adapters trained between the two steps
