"""Config derivation (spec 1.2) checked against transformers' own config classes, plus error messages."""

import json

import pytest

from blockpress.config import FULL, SLIDING, GenerationConfig, ModelConfig, fixed_steps
from blockpress.errors import ConfigError, SamplingError
from hf_oracle import TINY_TEXT, TINY_VISION

transformers = pytest.importorskip("transformers")

RELEASED_TEXT = dict(  # spec 1.5, the released text_config (raw global_* keys)
    hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704, num_hidden_layers=30,
    num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
    global_head_dim=512, num_experts=128, top_k_experts=8, vocab_size=262144, max_position_embeddings=262144,
    sliding_window=1024, rms_norm_eps=1e-6, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
    attention_bias=False, attention_dropout=0.0, use_bidirectional_attention="vision", tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16", model_type="diffusion_gemma_text",
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                        "partial_rotary_factor": 0.25}},
    some_future_key={"ignored": True},
)


def released(**text):
    return {"model_type": "diffusion_gemma", "canvas_length": 256, "eos_token_id": [1, 106],
            "text_config": {**RELEASED_TEXT, **text}, "vision_config": dict(TINY_VISION)}


def hf_text(d):
    from transformers import DiffusionGemmaConfig

    return DiffusionGemmaConfig(**{k: v for k, v in d.items() if k != "model_type"}).text_config


def geometry(cfg):
    return [(cfg.layer_types[i], cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) for i in range(cfg.num_hidden_layers)]


def test_released_config_resolves_per_spec():
    cfg = ModelConfig.from_dict(released()).text
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    assert full == [5, 11, 17, 23, 29]
    assert cfg.sliding_window == 1024  # "vision": no halving
    assert all((cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) == (512, 2) for i in full)
    assert all((cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) == (256, 8) for i in range(30) if i not in full)
    assert cfg.rope_parameters[FULL]["partial_rotary_factor"] == 0.25


def test_both_spellings_agree_and_match_transformers(tmp_path):
    from transformers import DiffusionGemmaConfig

    raw = {"model_type": "diffusion_gemma", "canvas_length": 16, "text_config": dict(TINY_TEXT),
           "vision_config": dict(TINY_VISION)}
    ours_raw = ModelConfig.from_dict(raw).text
    hf = DiffusionGemmaConfig(text_config=dict(TINY_TEXT), vision_config=dict(TINY_VISION), canvas_length=16)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"]  # transformers' spelling
    ours_saved = ModelConfig.from_dict(saved).text
    assert geometry(ours_raw) == geometry(ours_saved)
    assert ours_raw.sliding_window == ours_saved.sliding_window == 8
    # and our own save round-trips
    again = ModelConfig.from_dict(json.loads(json.dumps(ModelConfig.from_dict(saved).to_dict()))).text
    assert geometry(again) == geometry(ours_raw)


@pytest.mark.parametrize("bidir", [None, "vision", "all"])
@pytest.mark.parametrize("layers,types", [(7, None), (6, ["sliding_attention", "full_attention"] * 3), (3, None)])
def test_derived_fields_match_transformers(bidir, layers, types):
    text = dict(TINY_TEXT, num_hidden_layers=layers, layer_types=types, sliding_window=9,
                use_bidirectional_attention=bidir)
    if types is None:
        text.pop("layer_types")
    raw = {"model_type": "diffusion_gemma", "text_config": text, "vision_config": dict(TINY_VISION)}
    ours = ModelConfig.from_dict(raw).text
    ref = hf_text(raw)
    assert ours.layer_types == list(ref.layer_types)
    assert ours.layer_types[-1] == FULL
    assert ours.sliding_window == ref.sliding_window  # 9 -> 5 with "all"
    assert ours.sliding_window == (9 // 2 + 1 if bidir == "all" else 9)
    assert ours.to_dict()["sliding_window"] == 9  # serialisation writes the stored value back
    for i in range(layers):
        full = ours.layer_types[i] == FULL
        assert ours.layer_head_dim(i) == (32 if full else 16)
        assert ours.layer_kv_heads(i) == (1 if full else 2)


def test_default_pattern_and_forced_last_full():
    raw = {"model_type": "diffusion_gemma", "text_config": dict(TINY_TEXT, num_hidden_layers=7, layer_types=None)}
    cfg = ModelConfig.from_dict(raw).text
    assert cfg.layer_types == [SLIDING] * 5 + [FULL, FULL]


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", -3, "hidden_size"),
    ("num_experts", "many", "num_experts"),
    ("top_k_experts", 99, "top_k_experts"),
    ("layer_types", ["sliding_attention"], "layer_types"),
    ("layer_types", ["conv"] * 6, "layer_types"),
    ("use_bidirectional_attention", "both", "use_bidirectional_attention"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn"}}, "rope_type"),
    # each of these was a TypeError / AttributeError / ValueError at load, or a crash at the first generation
    ("rms_norm_eps", "abc", "'rms_norm_eps' must be a number > 0"),
    ("final_logit_softcapping", "x", "'final_logit_softcapping' must be a number"),
    ("per_layer_config", [1, 2], "'per_layer_config' must map layer indices"),
    ("rope_parameters", {"full_attention": {"rope_theta": "x"}}, "rope_parameters.full_attention.rope_theta"),
    ("rope_parameters", {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2.0}},
     "partial_rotary_factor' must be a number in"),
    ("eos_token_id", "1", "'eos_token_id' must be a token id"),
    # ignored before: the sliding layers rotated every dimension (transformers shrinks the table, then fails)
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "on 'default' RoPE, which rotates every dimension"),
    ("attention_bias", True, "attention_bias"),
])
def test_invalid_values_name_the_field(field, value, needle):
    raw = {"model_type": "diffusion_gemma", "text_config": {**TINY_TEXT, field: value}}
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)


def test_wrong_model_type_is_refused():
    with pytest.raises(ConfigError, match="diffusion_gemma"):
        ModelConfig.from_dict({"model_type": "gemma4", "text_config": {}})


def test_generation_config_priority_and_validation():
    ckpt = GenerationConfig.from_checkpoint_dict({
        "max_denoising_steps": 48, "max_new_tokens": 256, "t_max": 0.8, "t_min": 0.4, "stability_threshold": 1,
        "confidence_threshold": 0.005, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.25}})
    cfg = GenerationConfig.resolve(ckpt, max_denoising_steps=16)
    assert cfg.max_denoising_steps == 16 and cfg.entropy_bound == 0.25 and cfg.eos_token_id == [1, 106, 50]
    assert GenerationConfig.resolve({}).max_denoising_steps == 48  # reference default
    # another sampler class (the reference fails on it) ran as the entropy bound, silently
    for sc, shown in (({"_cls_name": "TopKSamplerConfig", "k": 4}, "'TopKSamplerConfig'"), ("greedy", "'greedy'")):
        with pytest.raises(ConfigError, match=f"sampler_config is {shown}; blockpress runs the reference's one"):
            GenerationConfig.from_checkpoint_dict({"sampler_config": sc})
    assert GenerationConfig.from_checkpoint_dict({"sampler_config": {"entropy_bound": 0.3}}) == {"entropy_bound": 0.3}
    for kw, name in [(dict(max_denoising_steps=0), "max_denoising_steps"), (dict(entropy_bound=-1.0), "entropy_bound"),
                     (dict(t_min=0.9, t_max=0.5), "t_max"), (dict(stability_threshold=-1), "stability_threshold"),
                     (dict(confidence_threshold=0), "confidence_threshold"), (dict(max_new_tokens=1.5), "max_new_tokens"),
                     (dict(t_min=float("nan")), "t_min"), (dict(eos_token_id="x"), "eos_token_id"),
                     (dict(t_min=0.0, t_max=5e-324), "t_max"), (dict(t_min=1e-9, t_max=0.8), "t_min")]:
        with pytest.raises(SamplingError, match=name):
            GenerationConfig.resolve({}, **kw)
    with pytest.raises(TypeError, match="unknown generation parameter"):
        GenerationConfig.resolve({}, temperature=0.7)
    with pytest.raises(SamplingError, match=r"\['steps'\] \('steps' is max_denoising_steps"):
        GenerationConfig.resolve({}, steps=4)  # another library's name: pointed to ours


def test_real_26b_architecture_parameter_counts():
    """Built on the meta device from the released config: counts equal the spec's (1.6) breakdown."""
    import torch

    from blockpress.model.diffusion_gemma import DiffusionGemmaModel

    with torch.device("meta"):
        m = DiffusionGemmaModel(ModelConfig.from_dict(released()))
    params = dict(m.named_parameters())
    total = sum(p.numel() for p in params.values())
    scalars = sum(b.numel() for n, b in m.named_buffers() if n.endswith("layer_scalar"))
    assert total + scalars == 25_250_986_812  # text-only tensors of the release
    assert sum(p.numel() for n, p in params.items() if ".experts." in n) == 22_837_985_280
    assert sum(p.numel() for n, p in params.items() if ".self_attn." in n) == 1_110_197_760
    assert sum(p.numel() for n, p in params.items() if n.startswith("self_conditioning")) == 17_844_992
    assert "layers.5.self_attn.v_proj.weight" not in params and "layers.4.self_attn.v_proj.weight" in params
    assert tuple(params["layers.5.self_attn.q_proj.weight"].shape) == (8192, 2816)


def test_fixed_steps_turns_adaptive_stopping_off_over_any_defaults():
    """The fixed-step mode (CLI / API `steps`, the chat eval's columns) overrides a checkpoint's stopping rule."""
    adaptive = GenerationConfig.resolve({"stability_threshold": 2, "confidence_threshold": 0.01})
    assert adaptive.adaptive
    fixed = GenerationConfig.resolve({"stability_threshold": 2, "confidence_threshold": 0.01}, **fixed_steps(5))
    assert not fixed.adaptive and fixed.max_denoising_steps == 5
