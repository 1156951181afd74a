"""Depth growth (`blockpress.train.grow`): a grown checkpoint computes what its source does, and then trains."""

import json

import pytest
import torch

import blockpress
from blockpress.errors import InputError
from blockpress.loading import SHIPPED_MODELS
from blockpress.train import objective as obj
from blockpress.train.grow import grow_depth

SRC = SHIPPED_MODELS["assistant"]
QUESTIONS = ["What is 47 + 38?", "Convert 3 km to m.", "How many letters are in banana?"]


def _batch(lm):
    tok = lm.tokenizer
    exs = [(lm.encode_chat(q), tok.encode("It is 85.")) for q in QUESTIONS]
    cfg = obj.ObjectiveConfig(seed=0, ar_weight=1.0)
    return obj.collate(exs, lm.canvas_length, lm.config.text.vocab_size, cfg, 0), cfg


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "g"
    cfg = grow_depth(SRC, out, times=2)
    return cfg, blockpress.load(str(SRC), progress=False), blockpress.load(str(out), progress=False)


def test_grown_model_keeps_the_source_tokens_and_loss(pair):
    cfg, src, grown = pair
    text = cfg["text_config"]
    assert text["num_hidden_layers"] == 8 and len(grown.module.layers) == 8
    assert text["layer_types"][3] == text["layer_types"][7] == "full_attention"
    assert sorted(text["per_layer_config"]) == ["3", "7"]
    for q in QUESTIONS:
        ids = src.encode_chat(q)
        a, b = (m.generate([ids], generator=torch.Generator().manual_seed(1), max_new_tokens=32).new_tokens
                for m in (src, grown))
        assert torch.equal(a, b), q
    batch, ocfg = _batch(src)
    with torch.no_grad():
        la, _ = obj.compute_loss(src.module, batch, ocfg)
        lb, _ = obj.compute_loss(grown.module, batch, ocfg)
    assert float(la) == float(lb)


def test_grown_blocks_learn(pair):
    """The added blocks' zeroed output norms get gradient, so training moves them off the identity."""
    _, _, grown = pair
    batch, ocfg = _batch(grown)
    with torch.enable_grad():
        loss, _ = obj.compute_loss(grown.module, batch, ocfg)
        loss.backward()
    for layer in grown.module.layers[4:]:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            assert torch.count_nonzero(norm.weight) == 0
            assert float(norm.weight.grad.abs().sum()) > 0
    grown.module.zero_grad(set_to_none=True)


def test_grow_repeats_layer_types_the_config_leaves_to_the_default_rule(tmp_path):
    """A config without layer_types (4 layers: the rule makes the last one full): the grown config names them, the
    stack's pattern twice, not the rule's pattern for 8 layers (full at 6 and 8), and the grown model keeps the
    tokens."""
    from hf_oracle import TINY_TEXT

    text = {**{k: v for k, v in TINY_TEXT.items() if k != "layer_types"}, "num_hidden_layers": 4}
    lm = blockpress.from_config({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": 8}, seed=0)
    lm.save(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["text_config"].pop("layer_types", None)
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    grown_cfg = grow_depth(tmp_path / "src", tmp_path / "g")
    types = grown_cfg["text_config"]["layer_types"]
    assert types == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    src, grown = blockpress.load(str(tmp_path / "src"), progress=False), blockpress.load(str(tmp_path / "g"),
                                                                                          progress=False)
    ids = torch.randint(5, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = (m.generate(ids, generator=torch.Generator().manual_seed(2), max_new_tokens=16).new_tokens
            for m in (src, grown))
    assert torch.equal(a, b)


def test_grow_refuses_bad_input(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        grow_depth(tmp_path, tmp_path / "g")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "x").write_text("")
    with pytest.raises(InputError, match="not empty"):
        grow_depth(SRC, tmp_path / "g")
    with pytest.raises(InputError, match=">= 2"):
        grow_depth(SRC, tmp_path / "h", times=1)
    assert json.loads((SRC / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4
