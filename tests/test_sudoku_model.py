"""The shipped Sudoku model (blockpress/assets/sudoku): files, size, loadability, behaviour, and the
published evaluation (benchmarks/results/sudoku-eval.json), which CI reproduces on a prefix."""

import json
from pathlib import Path

import pytest
import torch

import blockpress
from blockpress.cli import main as cli_main
from blockpress.tasks import sudoku as sd

ASSET = sd.DEFAULT_MODEL_PATH
PUBLISHED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "sudoku-eval.json"


@pytest.fixture(scope="module")
def lm():
    return blockpress.load(ASSET, progress=False)


@pytest.fixture(scope="module")
def published():
    return json.loads(PUBLISHED.read_text())


def test_asset_files_and_size():
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "blockpress_task.json"):
        assert (ASSET / f).is_file(), f"missing {f} in {ASSET}"
    assert json.loads((ASSET / "blockpress_task.json").read_text()) == {"task": "sudoku", "format": "prompt"}
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 50 * 2**20
    tok = json.loads((ASSET / "tokenizer.json").read_text())
    want = json.loads(sd.build_tokenizer().to_str())
    assert tok["model"]["vocab"] == want["model"]["vocab"] and tok["added_tokens"] == want["added_tokens"]
    gen = json.loads((ASSET / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == sd.CANVAS_LEN and gen["eos_token_id"] == [sd.EOS_ID]


def test_asset_loads_and_solve_keeps_every_clue(lm):
    assert lm.canvas_length == sd.CANVAS_LEN and lm.config.text.vocab_size == len(sd.VOCAB)
    torch.manual_seed(0)
    for puzzle, solution in sd.test_set(45, 2):
        pred = sd.solve(puzzle, lm)  # the default sampler (generation_config.json), global RNG
        r = sd.check(puzzle, pred, solution)
        assert len(pred) == 81 and r["clues_kept"] == 1.0
        assert r["cell_accuracy"] > 1 / 9  # far above chance on the blanks


def test_asset_loads_in_transformers_with_the_same_logits():
    """transformers 5.23 loads the shipped folder and its decoder logits equal ours (fp32)."""
    transformers = pytest.importorskip("transformers")
    from blockpress.testing import decoder_logits_gap_vs_transformers

    assert transformers.DiffusionGemmaConfig.from_pretrained(ASSET).canvas_length == sd.CANVAS_LEN
    ids = torch.tensor([sd.encode_prompt(p) for p, _ in sd.test_set(45, 2)])
    canvas = torch.randint(0, len(sd.VOCAB), (2, sd.CANVAS_LEN), generator=torch.Generator().manual_seed(0))
    assert decoder_logits_gap_vs_transformers(ASSET, ids, canvas) < 1e-4


def test_published_eval_is_consistent(published):
    """The published numbers follow from the published predictions (recomputed with sd.check)."""
    res = published["default"]
    assert set(res["per_blanks"]) == {str(b) for b in sd.EVAL_BLANKS} and res["n_per"] == sd.EVAL_N_PER
    for b, r in res["per_blanks"].items():
        pairs = sd.test_set(int(b), r["n"])
        rows = [sd.check(p, pred, sol) for (p, sol), pred in zip(pairs, r["predictions"])]
        assert len(rows) == r["n"] == sd.EVAL_N_PER
        assert r["solve_rate"] == pytest.approx(sum(x["solved"] for x in rows) / len(rows))
        assert r["cell_accuracy"] == pytest.approx(sum(x["cell_accuracy"] for x in rows) / len(rows))
        assert r["clues_kept"] == pytest.approx(sum(x["clues_kept"] for x in rows) / len(rows))


def test_eval_cli_reproduces_the_published_predictions(published, tmp_path):
    """`blockpress eval sudoku` (the documented command) on a prefix of the held-out sets gives exactly the
    published predictions: per-puzzle generators make each result independent of n and batching."""
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "sudoku", "--n", "3", "--blanks", "35", "45", "55", "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["default"]["per_blanks"]
    for b in ("35", "45", "55"):
        assert fresh[b]["predictions"] == published["default"]["per_blanks"][b]["predictions"][:3], b


@pytest.mark.slow
def test_eval_cli_reproduces_the_whole_published_table(published, tmp_path):
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "sudoku", "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["default"]["per_blanks"]
    for b, r in published["default"]["per_blanks"].items():
        assert fresh[b]["predictions"] == r["predictions"], b


def test_repair_edits_only_the_broken_cells_of_the_shipped_model(lm):
    """One repair round on real predictions: cells that broke no rule and every clue stay as they were,
    solved puzzles are untouched, and the broken cells are denoised again (the canvas changes there)."""
    from blockpress.cli.eval import puzzle_seed

    pairs = sd.test_set(55, 4)
    puzzles = [p for p, _ in pairs]

    def gens():
        return [torch.Generator().manual_seed(puzzle_seed(0, p)) for p in puzzles]

    first = sd.solve_batch(puzzles, lm, generator=gens())
    fixed = sd.solve_batch(puzzles, lm, generator=gens(), repair=1)
    changed = 0
    assert any(sd.broken_cells(p, g) for p, g in zip(puzzles, first)), "nothing to repair: pick harder puzzles"
    for (p, sol), a, b in zip(pairs, first, fixed):
        free = set(sd.broken_cells(p, a))
        for i in range(81):
            if p[i] != "0":
                assert b[i] == p[i]
            elif i not in free:
                assert b[i] == a[i]
        changed += sum(a[i] != b[i] for i in free)
        assert sd.check(p, b, sol)["solved"] >= sd.check(p, a, sol)["solved"]
    assert changed > 0


def test_published_repair_eval_is_consistent(published):
    """benchmarks/results/sudoku-eval-repair.json (`blockpress eval sudoku --repair 8`): its numbers follow
    from its predictions, and every puzzle the default sampler solved is still solved (a repair round never
    touches a grid that breaks no rule; both runs share the first pass: same batches, same seeds)."""
    repaired = json.loads((PUBLISHED.parent / "sudoku-eval-repair.json").read_text())["default+repair=8"]
    default = published["default"]["per_blanks"]
    for b, r in repaired["per_blanks"].items():
        pairs = sd.test_set(int(b), r["n"])
        rows = [sd.check(p, pred, sol) for (p, sol), pred in zip(pairs, r["predictions"])]
        assert r["solve_rate"] == pytest.approx(sum(x["solved"] for x in rows) / len(rows))
        assert r["cell_accuracy"] == pytest.approx(sum(x["cell_accuracy"] for x in rows) / len(rows))
        for (p, sol), before, after in zip(pairs, default[b]["predictions"], r["predictions"]):
            if sd.check(p, before, sol)["solved"]:
                assert after == before
    assert repaired["overall"]["solve_rate"] > published["default"]["overall"]["solve_rate"]


def test_ar_vs_diffusion_bench_rescores_a_saved_ar_eval(tmp_path, capsys):
    """benchmarks/sudoku_ar_vs_diffusion.py --ar-results: the saved AR predictions re-scored on the same
    puzzles give the saved numbers; the diffusion rows run; one JSON line at the end; a file that does
    not cover --n is refused."""
    import runpy
    import sys

    root = PUBLISHED.parent.parent
    saved = root / "results" / "sudoku-ar-equal-data.json"
    argv = ["x", "--n", "2", "--blanks", "35", "45", "--steps", "1", "--threads", "1", "--png",
            str(tmp_path / "p.png"), "--ar-results", str(saved)]
    old = sys.argv
    try:
        sys.argv = argv
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(root / "sudoku_ar_vs_diffusion.py"), run_name="__main__")
        assert e.value.code == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        ar = [r for r in line["results"] if r["model"].startswith("autoregressive")]
        want = json.loads(saved.read_text())["ar"]["per_blanks"]
        rows = [sd.check(p, pred, sol) for b in (35, 45)
                for (p, sol), pred in zip(sd.test_set(b, 2), want[str(b)]["predictions"])]
        assert ar[0]["cell_accuracy"] == pytest.approx(sum(r["cell_accuracy"] for r in rows) / 4, abs=1e-4)
        assert [r["model"] for r in line["results"]][:2] == ["diffusion", "diffusion (adaptive)"]
        assert (tmp_path / "p.png").is_file()
        sys.argv = argv[:2] + ["999"] + argv[3:]
        with pytest.raises(SystemExit, match="fewer than 999 AR predictions"):
            runpy.run_path(str(root / "sudoku_ar_vs_diffusion.py"), run_name="__main__")
    finally:
        sys.argv = old
