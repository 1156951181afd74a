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
    assert json.loads((ASSET / "blockpress_task.json").read_text()) == {"task": "sudoku", "format": "prompt",
                                                                        "samples": 8}
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


def test_solve_returns_every_clue_and_a_solved_grid_unchanged(lm, capsys):
    """The shipped model ("prompt" format: the clues are in the prompt, not held on the canvas) can draw <eos>
    early or another digit at a clue; the answer is the grid the rules judged, clues written in: a complete
    valid grid comes back as given and counts as solved (seed 1 drew <eos> after 56 digits: 26 clues lost)."""
    solved = sd.solve_exact("53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79")
    for seed in range(3):
        assert sd.solve(solved, lm, generator=torch.Generator().manual_seed(seed)) == solved
    assert sd.solve(solved, lm, samples=1, repair=2, generator=torch.Generator().manual_seed(1)) == solved
    one_blank = "0" + solved[1:]
    assert sd.solve(one_blank, lm, samples=1, generator=torch.Generator().manual_seed(1)) == solved
    puzzles = [p for p, _ in sd.test_set(55, 4)]
    for p, pred in zip(puzzles, sd.solve_batch(puzzles, lm, samples=2, generator=torch.Generator().manual_seed(0))):
        assert all(pred[i] == p[i] for i in range(81) if p[i] != "0")
    assert cli_main(["run", str(ASSET), solved, "--seed", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["answer"] == solved and r["solved"] and r["clues_kept"] == 1.0


def test_asset_loads_in_transformers_with_the_same_logits():
    """transformers 5.23 loads the shipped folder and its decoder logits equal ours (fp32)."""
    transformers = pytest.importorskip("transformers")
    from blockpress.testing import decoder_logits_gap_vs_transformers

    assert transformers.DiffusionGemmaConfig.from_pretrained(ASSET).canvas_length == sd.CANVAS_LEN
    ids = torch.tensor([sd.encode_prompt(p) for p, _ in sd.test_set(45, 2)])
    canvas = torch.randint(0, len(sd.VOCAB), (2, sd.CANVAS_LEN), generator=torch.Generator().manual_seed(0))
    assert decoder_logits_gap_vs_transformers(ASSET, ids, canvas) < 1e-4


@pytest.fixture(scope="module")
def single():
    """`blockpress eval sudoku --samples 1`: one candidate per puzzle."""
    return json.loads((PUBLISHED.parent / "sudoku-eval-single.json").read_text())["default+samples=1"]


@pytest.mark.parametrize("which", ["default", "single"])
def test_published_eval_is_consistent(published, single, which):
    """The published numbers follow from the published predictions (recomputed with sd.check)."""
    res = published["default"] if which == "default" else single
    assert set(res["per_blanks"]) == {str(b) for b in sd.EVAL_BLANKS} and res["n_per"] == sd.EVAL_N_PER
    for b, r in res["per_blanks"].items():
        pairs = sd.test_set(int(b), r["n"])
        rows = [sd.check(p, pred, sol) for (p, sol), pred in zip(pairs, r["predictions"])]
        assert len(rows) == r["n"] == sd.EVAL_N_PER
        assert r["solve_rate"] == pytest.approx(sum(x["solved"] for x in rows) / len(rows))
        assert r["cell_accuracy"] == pytest.approx(sum(x["cell_accuracy"] for x in rows) / len(rows))
        assert r["clues_kept"] == pytest.approx(sum(x["clues_kept"] for x in rows) / len(rows))


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_eval_cli_reproduces_the_published_predictions(published, tmp_path):
    """`blockpress eval sudoku` (the documented command) on a prefix of the held-out sets gives exactly the
    published predictions: per-puzzle generators make each result independent of n and batching."""
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "sudoku", "--n", "2", "--blanks", "35", "55", "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["default"]["per_blanks"]
    for b in ("35", "55"):
        assert fresh[b]["predictions"] == published["default"]["per_blanks"][b]["predictions"][:2], b


def test_eval_cli_without_row_compaction_gives_the_same_answers(single, tmp_path):
    """`--no-compact-rows` (every puzzle in every pass of its batch, the reference loop) gives the published
    one-candidate predictions, as the default compacted loop does."""
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "sudoku", "--n", "4", "--blanks", "45", "--samples", "1", "--no-compact-rows",
                     "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["default+samples=1"]["per_blanks"]["45"]["predictions"]
    assert fresh == single["per_blanks"]["45"]["predictions"][:4]


@pytest.mark.slow
def test_eval_cli_reproduces_the_whole_published_table(published, tmp_path):
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "sudoku", "--json", str(out)]) == 0
    fresh = json.loads(out.read_text())["default"]["per_blanks"]
    for b, r in published["default"]["per_blanks"].items():
        assert fresh[b]["predictions"] == r["predictions"], b


@pytest.mark.slow  # (opt-in: --runslow; the default suite stays within 10 minutes on 2 cores)
def test_repair_edits_only_the_broken_cells_of_the_shipped_model(lm):
    """One repair round on real predictions (one candidate each, so repair is what changes them): cells that
    broke no rule and every clue stay as they were, solved puzzles are untouched, and the broken cells are
    denoised again (the canvas changes there)."""
    from blockpress.cli.eval import puzzle_seed

    pairs = sd.test_set(55, 6)  # this model re-draws most broken cells identically: 6 puzzles change 2 cells (4: none)
    puzzles = [p for p, _ in pairs]

    def gens():
        return [torch.Generator().manual_seed(puzzle_seed(0, p)) for p in puzzles]

    first = sd.solve_batch(puzzles, lm, generator=gens(), samples=1)
    fixed = sd.solve_batch(puzzles, lm, generator=gens(), samples=1, repair=1)
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


def test_published_45_blank_eval_on_200_puzzles(published, single):
    """benchmarks/results/sudoku-eval-45x200.json (`blockpress eval sudoku --blanks 45 --n 200`, with and
    without `--samples 1`): its numbers follow from its predictions, its first 50 are the published eval's
    (a puzzle's answer depends on the puzzle and its seed alone), and it is the README's 95.5 % / 90.5 %."""
    big = json.loads((PUBLISHED.parent / "sudoku-eval-45x200.json").read_text())
    pairs = sd.test_set(45, 200)
    for key, first50, want in (("default", published["default"], 191), ("default+samples=1", single, 181)):
        r = big[key]["per_blanks"]["45"]
        solved = [sd.check(p, pred, sol)["solved"] for (p, sol), pred in zip(pairs, r["predictions"])]
        assert r["n"] == len(r["predictions"]) == 200 and sum(solved) == want
        assert r["solve_rate"] == pytest.approx(want / 200)
        assert r["predictions"][:50] == first50["per_blanks"]["45"]["predictions"]


def test_published_samples_keep_every_single_candidate_solution(published, single):
    """The shipped default (up to 8 candidates) against one candidate: candidate 1 is the samples=1 pass
    itself (same batches, same seeds), so every puzzle one candidate solved has the same answer, and the
    other candidates only ever replace a grid that breaks a rule."""
    default = published["default"]["per_blanks"]
    for b, r in single["per_blanks"].items():
        for (p, sol), one, best in zip(sd.test_set(int(b), r["n"]), r["predictions"], default[b]["predictions"]):
            if not sd.broken_cells(p, one, "cells"):
                assert best == one
            assert len(sd.broken_cells(p, best, "cells")) <= len(sd.broken_cells(p, one, "cells"))
    assert published["default"]["overall"]["solve_rate"] > single["overall"]["solve_rate"]


def test_published_repair_eval_is_consistent(single):
    """benchmarks/results/sudoku-eval-repair.json (`blockpress eval sudoku --samples 1 --repair 8`): its
    numbers follow from its predictions, and every puzzle one candidate solved is still solved (a repair
    round never touches a grid that breaks no rule; both runs share the first pass: same batches, seeds)."""
    repaired = json.loads((PUBLISHED.parent / "sudoku-eval-repair.json").read_text())["default+samples=1+repair=8"]
    default = single["per_blanks"]
    for b, r in repaired["per_blanks"].items():
        pairs = sd.test_set(int(b), r["n"])
        rows = [sd.check(p, pred, sol) for (p, sol), pred in zip(pairs, r["predictions"])]
        assert r["solve_rate"] == pytest.approx(sum(x["solved"] for x in rows) / len(rows))
        assert r["cell_accuracy"] == pytest.approx(sum(x["cell_accuracy"] for x in rows) / len(rows))
        for (p, sol), before, after in zip(pairs, default[b]["predictions"], r["predictions"]):
            if sd.check(p, before, sol)["solved"]:
                assert after == before
    assert repaired["overall"]["solve_rate"] >= single["overall"]["solve_rate"]


def test_ar_vs_diffusion_bench_rescores_a_saved_ar_eval(tmp_path, capsys):
    """benchmarks/sudoku_ar_vs_diffusion.py --ar-results: the saved AR predictions re-scored on the same
    puzzles give the saved numbers; the diffusion rows run; one JSON line at the end; a file that does
    not cover --n is refused."""
    import runpy
    import sys

    root = PUBLISHED.parent.parent
    saved = root / "results" / "sudoku-ar-equal-data.json"
    argv = ["x", "--n", "2", "--blanks", "35", "45", "--steps", "1", "--threads", "1", "--png",
            str(tmp_path / "p.png"), "--ar-results", str(saved), "--json", str(tmp_path / "s.json")]
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
        assert (tmp_path / "p.png").is_file() and json.loads((tmp_path / "s.json").read_text()) == line
        sys.argv = argv[:2] + ["999"] + argv[3:]
        with pytest.raises(SystemExit, match="fewer than 999 AR predictions"):
            runpy.run_path(str(root / "sudoku_ar_vs_diffusion.py"), run_name="__main__")
    finally:
        sys.argv = old


def test_row_compaction_on_the_shipped_model(lm, monkeypatch):
    """A trained model stops rows by the stable-and-confident rule (stability 1, a history per row): the
    compacted loop (the default with per-row generators) denoises only the rows still going and gives the
    same drafts and answers as the full-batch loop."""
    from blockpress.cli.eval import puzzle_seed

    puzzles = [p for p, _ in sd.test_set(45, 6)]
    ids = torch.tensor([sd.encode_prompt(p) for p in puzzles])
    runs, rows_run = [], []
    for compact in (False, True):
        gens = [torch.Generator().manual_seed(puzzle_seed(0, p)) for p in puzzles]
        seen = []
        decode = lm.module.decode
        monkeypatch.setattr(lm.module, "decode", lambda x, *a, **k: seen.append(x.shape[0]) or decode(x, *a, **k))
        runs.append([e for e in lm.stream(ids, generator=gens, compact_rows=compact, eos_token_id=[sd.EOS_ID],
                                          pad_token_id=sd.PAD_ID) if not isinstance(e, blockpress.Commit)])
        monkeypatch.undo()
        rows_run.append(sum(seen))
    full, fast = runs[0][-1].result, runs[1][-1].result
    assert len(set(full.forward_passes.tolist())) > 1  # rows stopped at different steps
    assert rows_run[1] == int(full.forward_passes.sum()) < rows_run[0]
    assert torch.equal(full.sequences, fast.sequences) and torch.equal(full.forward_passes, fast.forward_passes)
    for d0, d1 in zip(runs[0][:-1], runs[1][:-1]):
        assert torch.equal(d0.tokens, d1.tokens) and torch.equal(d0.done, d1.done)


def test_sudoku_cpu_bench_agrees_with_transformers(capsys):
    """benchmarks/bench_sudoku_cpu.py on a few puzzles: transformers 5.23 and blockpress draw the same tokens
    from one global seed on the trained model, compaction gives the uncompacted answers, one JSON line."""
    pytest.importorskip("transformers")
    import runpy
    import sys

    script = PUBLISHED.parent.parent / "bench_sudoku_cpu.py"
    old = sys.argv
    try:
        sys.argv = ["x", "--blanks", "45", "--n", "3", "--threads", "1"]
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old
    assert e.value.code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {r["engine"]: r for r in line["runs"]}
    assert runs["blockpress (reference draws)"]["token_agreement_vs_transformers"] == 1.0
    assert runs["blockpress (per-row seeds, compaction)"]["same_answers_as_uncompacted"] == 1.0
    assert runs["transformers"]["solve_rate"] == runs["blockpress (reference draws)"]["solve_rate"]


def test_solve_takes_a_model_folder_loads_it_once_and_refuses_a_text_model(monkeypatch):
    """solve(p, model=<folder>) loads a Sudoku checkpoint once per process (a loop of solve() calls does
    not reload it); a text model or a non-model is a clear InputError, not an AttributeError."""
    puzzle, _ = sd.test_set(35, 1)[0]
    loads = []
    real = blockpress.load
    monkeypatch.setattr(blockpress, "load", lambda *a, **k: (loads.append(a[0]), real(*a, **k))[1])
    monkeypatch.setattr(sd, "_LOADED", {})
    folder = str(sd.DEFAULT_MODEL_PATH)
    first = sd.solve(puzzle, model=folder, samples=1)
    assert sd.solve(puzzle, model=folder, samples=1) == first and len(loads) == 1
    assert sd.check(puzzle, first, sd.solve_exact(puzzle))["solved"]
    with pytest.raises(sd.InputError, match="kjv is not a Sudoku model"):
        sd.solve(puzzle, model="kjv")
    with pytest.raises(sd.InputError, match="model must be a loaded blockpress model or a checkpoint folder"):
        sd.solve(puzzle, model=5)
