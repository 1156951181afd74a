"""The shipped Sudoku model (blockpress/assets/sudoku): files, size, loadability, behaviour."""

import json

import pytest
import torch

import blockpress
from blockpress.tasks import sudoku as sd

ASSET = sd.DEFAULT_MODEL_PATH


def test_asset_files_and_size():
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "blockpress_task.json"):
        assert (ASSET / f).is_file(), f"missing {f} in {ASSET}"
    assert json.loads((ASSET / "blockpress_task.json").read_text()) == {"task": "sudoku"}
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 50 * 2**20
    assert json.loads((ASSET / "tokenizer.json").read_text())["model"]["vocab"] == \
        json.loads(sd.build_tokenizer().to_str())["model"]["vocab"]
    gen = json.loads((ASSET / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == sd.CANVAS_LEN and gen["eos_token_id"] == [sd.EOS_ID]


def test_asset_loads_and_solves_keeping_clues():
    lm = blockpress.load(ASSET, progress=False)
    assert lm.canvas_length == sd.CANVAS_LEN and lm.config.text.vocab_size == len(sd.VOCAB)
    puzzle, solution = sd.test_set(35, 1)[0]
    g = torch.Generator().manual_seed(0)
    pred = sd.solve(puzzle, lm, generator=g)
    assert len(pred) == 81
    r = sd.check(puzzle, pred, solution)
    assert r["clues_kept"] >= 0.9 and r["cell_accuracy"] > 1 / 9


def test_asset_loads_in_transformers():
    transformers = pytest.importorskip("transformers")
    m = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(ASSET)
    assert m.config.canvas_length == sd.CANVAS_LEN


@pytest.mark.slow
def test_asset_eval_numbers():
    """The numbers reported for the shipped model (default sets, 50 puzzles per level)."""
    lm = blockpress.load(ASSET, progress=False)
    res = sd.evaluate(lambda ps: sd.solve_batch(ps, lm, generator=torch.Generator().manual_seed(0)))
    assert res["overall"]["clues_kept"] >= 0.95
    assert res["overall"]["cell_accuracy"] >= 0.3
