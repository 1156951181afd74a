"""The shipped text model (blockpress/assets/kjv): files, size, loadability in blockpress and transformers,
plain-text behaviour, and the published infill evaluation (benchmarks/results/kjv-infill.json), which CI
reproduces on a prefix."""

import json
from pathlib import Path

import pytest
import torch

import blockpress
from blockpress.cli import main as cli_main
from blockpress.loading import SHIPPED_MODELS

ASSET = SHIPPED_MODELS["kjv"]
PUBLISHED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "kjv-infill.json"


@pytest.fixture(scope="module")
def lm():
    return blockpress.load("kjv", progress=False)


def test_asset_files_and_size(lm):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "eval/heldout.txt"):
        assert (ASSET / f).is_file(), f"missing {f} in {ASSET}"
    assert sum(p.stat().st_size for p in ASSET.rglob("*") if p.is_file()) <= 50 * 2**20
    tok = lm.tokenizer
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")] == [0, 1, 2, 3, 4]
    assert not tok.is_chat and lm.generation_config().eos_token_id == [1]
    assert tok.decode(tok.encode("And God said, Let there be light")) == "And God said, Let there be light"


def test_generates_plain_text_from_a_plain_prompt(lm):
    out = lm.generate([lm.encode_chat("And the LORD spake unto Moses, saying,")],
                      generator=torch.Generator().manual_seed(0), max_new_tokens=64)
    text = lm.decode_new(out)
    assert text.strip() and "<" not in text  # no special-token text, no chat template
    assert out.steps_per_canvas and max(out.steps_per_canvas) <= lm.generation_config().max_denoising_steps


def test_asset_loads_in_transformers_with_the_same_logits(lm):
    pytest.importorskip("transformers")
    from blockpress.testing import decoder_logits_gap_vs_transformers

    ids = torch.tensor([lm.encode_chat("In the beginning God created the heaven and the earth.")])
    canvas = torch.randint(0, lm.config.text.vocab_size, (1, lm.canvas_length),
                           generator=torch.Generator().manual_seed(0))
    assert decoder_logits_gap_vs_transformers(ASSET, ids, canvas) < 1e-4


def test_eval_cli_reproduces_the_published_infill_rows(tmp_path):
    """`blockpress eval infill --n 4` gives exactly the first 4 rows of the published 200-passage eval (each
    example's seed depends only on its index)."""
    published = json.loads(PUBLISHED.read_text())["default"]
    out = tmp_path / "r.json"
    assert cli_main(["eval", "infill", "--n", "4", "--json", str(out)]) == 0
    mine = json.loads(out.read_text())["default"]
    for mode, rows in mine["rows"].items():
        assert rows == published["rows"][mode][:4], mode


def test_infill_cli_with_only_a_template_uses_the_shipped_text_model(capsys):
    assert cli_main(["infill", "In the beginning God [MASK] the heaven and the earth.", "--seed", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("In the beginning God") and out["text"].endswith(" the heaven and the earth.")
    assert len(out["fills"]) == 1 and sum(out["hole_mask"]) == 1
