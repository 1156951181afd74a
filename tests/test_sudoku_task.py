"""Tests for blockpress.tasks.sudoku: generator, exact solver, checker, held-out split,
grid parsing, tokenizer round-trip, evaluation and the solve() wiring (with a fake model)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from blockpress.tasks import sudoku as S

# Wikipedia's example puzzle and its (published) solution; Arto Inkala's "hardest" puzzle.
WIKI = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
WIKI_SOL = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
INKALA = "800000000003600000070090200050007000000045700000100030001000068008500010090000400"


def _units():
    for u in range(9):
        yield [u * 9 + c for c in range(9)]
        yield [r * 9 + u for r in range(9)]
        br, bc = (u // 3) * 3, (u % 3) * 3
        yield [(br + dr) * 9 + bc + dc for dr in range(3) for dc in range(3)]


def _independently_valid(grid: str) -> bool:
    return len(grid) == 81 and all(sorted(grid[i] for i in unit) == list("123456789") for unit in _units())


def _rotate(grid: str) -> str:  # 90 degrees clockwise
    return "".join(grid[(8 - c) * 9 + r] for r in range(9) for c in range(9))


def _relabel(grid: str, perm: str) -> str:  # digit d -> perm[d-1]
    return "".join(perm[int(ch) - 1] for ch in grid)


# ----------------------------------------------------------------------------- generator
@pytest.mark.parametrize("blanks", [35, 45, 55])
def test_generated_puzzles_have_exact_blanks_and_unique_solution(blanks):
    rng = random.Random(1000 + blanks)
    for _ in range(3):
        puzzle, solution = S.generate_puzzle(rng, blanks)
        assert len(puzzle) == 81 and len(solution) == 81
        assert puzzle.count("0") == blanks
        assert _independently_valid(solution)
        assert all(p == "0" or p == s for p, s in zip(puzzle, solution))
        assert S.count_solutions(puzzle) == 1
        assert S.solve_exact(puzzle) == solution


def test_generator_deterministic_and_rejects_bad_blanks():
    a = [S.generate_puzzle(random.Random(7), 40) for _ in range(2)]
    assert a[0] == a[1]
    assert S.generate_puzzle(random.Random(8), 40) != a[0]
    for bad in (-1, 65, 40.0, "40", True):
        with pytest.raises(ValueError, match="blanks"):
            S.generate_puzzle(random.Random(0), bad)


def test_random_full_grids_are_valid_and_varied():
    rng = random.Random(3)
    grids = {S.random_full_grid(rng) for _ in range(5)}
    assert len(grids) == 5 and all(_independently_valid(g) for g in grids)


# ----------------------------------------------------------------------------- solver
def test_solver_solves_known_puzzles():
    assert S.solve_exact(WIKI) == WIKI_SOL
    assert S.count_solutions(WIKI) == 1
    sol = S.solve_exact(INKALA)
    assert sol is not None and _independently_valid(sol)
    assert all(p == "0" or p == s for p, s in zip(INKALA, sol))
    assert S.count_solutions(INKALA, limit=5) == 1
    for puz, s in ((WIKI, WIKI_SOL), (INKALA, sol)):
        r = S.check(puz, s)
        assert r["solved"] and r["valid"] and r["cell_accuracy"] == 1.0 and r["clues_kept"] == 1.0


def test_solution_counting_and_unsolvable():
    # Blank two cells forming a deadly pattern? Simpler: blank a whole solution -> many solutions.
    assert S.count_solutions("0" * 81, limit=2) == 2
    assert S.count_solutions("0" * 81, limit=7) == 7
    # Remove enough clues from WIKI that it stops being unique.
    loose = "0" * 27 + S.parse_grid(WIKI)[27:]
    assert S.count_solutions(loose, limit=2) == 2
    conflict = "11" + "0" * 79  # same digit twice in row 1
    assert S.count_solutions(conflict) == 0 and S.solve_exact(conflict) is None
    # A consistent-looking but unsolvable grid: row 1 needs a 9 in cell 9, column 9 forbids it.
    dead = "12345678" + "0" + "0" * 8 + "9" + "0" * 63
    assert S.count_solutions(dead) == 0


# ----------------------------------------------------------------------------- checker
def test_check_detects_single_wrong_cell():
    puz = S.parse_grid(WIKI)
    blanks = [i for i, ch in enumerate(puz) if ch == "0"]
    i = blanks[0]
    wrong = WIKI_SOL[:i] + str(int(WIKI_SOL[i]) % 9 + 1) + WIKI_SOL[i + 1:]
    r = S.check(puz, wrong)
    assert not r["solved"] and not r["valid"] and r["well_formed"]
    assert r["cell_accuracy"] == pytest.approx((len(blanks) - 1) / len(blanks))
    assert r["clues_kept"] == 1.0


def test_check_detects_clue_overwrite_and_relabelled_grid():
    puz = S.parse_grid(WIKI)
    clues = [i for i, ch in enumerate(puz) if ch != "0"]
    i = clues[0]
    over = WIKI_SOL[:i] + str(int(WIKI_SOL[i]) % 9 + 1) + WIKI_SOL[i + 1:]
    r = S.check(puz, over)
    assert not r["solved"] and r["clues_kept"] == pytest.approx((len(clues) - 1) / len(clues))
    assert r["cell_accuracy"] == 1.0
    # A valid grid that ignores the clues: valid but not solved.
    other = _relabel(WIKI_SOL, "234567891")
    r = S.check(puz, other)
    assert r["valid"] and not r["solved"] and r["clues_kept"] == 0.0 and r["cell_accuracy"] == 0.0


@pytest.mark.parametrize("pred", [None, "", "abc", WIKI_SOL[:40], WIKI_SOL + "1", WIKI_SOL[:80] + "x",
                                  12345, [5, 3, 4], object()])
def test_check_never_raises_on_malformed(pred):
    r = S.check(WIKI, pred, solution=WIKI_SOL)
    assert r["solved"] is False and r["valid"] is False
    assert 0.0 <= r["cell_accuracy"] <= 1.0 and 0.0 <= r["clues_kept"] <= 1.0


def test_check_scores_partial_prediction():
    r = S.check(WIKI, WIKI_SOL[:40])  # first 40 cells right, rest missing
    puz = S.parse_grid(WIKI)
    blanks = [i for i, ch in enumerate(puz) if ch == "0"]
    clues = [i for i, ch in enumerate(puz) if ch != "0"]
    assert r["cell_accuracy"] == pytest.approx(sum(i < 40 for i in blanks) / len(blanks))
    assert r["clues_kept"] == pytest.approx(sum(i < 40 for i in clues) / len(clues))
    assert not r["well_formed"]
    # a pretty-printed full answer is accepted
    assert S.check(WIKI, S.format_grid(WIKI_SOL))["solved"]


# ----------------------------------------------------------------------------- held-out split
def test_canonical_key_invariances():
    k = S.canonical_key(WIKI_SOL)
    assert S.canonical_key(_relabel(WIKI_SOL, "937182645")) == k
    assert S.canonical_key(_rotate(WIKI_SOL)) == k
    transposed = "".join(WIKI_SOL[c * 9 + r] for r in range(9) for c in range(9))
    assert S.canonical_key(_relabel(transposed, "123456798")) == k
    other = S.random_full_grid(random.Random(11))
    assert S.canonical_key(other) != k


def test_test_set_deterministic_prefix_and_seeded():
    S._test_set_cached.cache_clear()
    a = S.test_set(45, 4)
    S._test_set_cached.cache_clear()
    b = S.test_set(45, 4)
    assert a == b and len(a) == 4
    assert S.test_set(45, 2) == a[:2]
    assert all(p.count("0") == 45 and S.count_solutions(p) == 1 for p, _ in a)
    assert len({s for _, s in a}) == 4
    assert S.test_set(45, 2, seed="another-seed") != a[:2]


def test_train_stream_skips_excluded_keys():
    plain = S.TrainStream(random.Random(5), (40, 44), exclude_keys=())
    first = [next(plain) for _ in range(4)]
    # exclude the first two (via transformed copies, to exercise the canonical key)
    keys = {S.canonical_key(_rotate(first[0][1])), S.canonical_key(_relabel(first[1][1], "987654321"))}
    stream = S.TrainStream(random.Random(5), (40, 44), exclude_keys=keys)
    got = [next(stream) for _ in range(2)]
    assert stream.skipped == 2 and stream.produced == 2
    assert all(S.canonical_key(sol) not in keys for _, sol in got)
    assert got == first[2:4]  # same rng: the two excluded ones were dropped, nothing else


def test_train_stream_disjoint_from_default_heldout():
    held = S.heldout_keys()
    assert len(held) == len(S.EVAL_BLANKS) * S.EVAL_N_PER  # all held-out solutions distinct
    it = S.train_batch_iter(None, (35, 45), batch_size=4)  # default seed + default held-out keys
    batch = next(it)
    assert len(batch) == 4
    for puzzle, sol in batch:
        assert S.canonical_key(sol) not in held
        assert 35 <= puzzle.count("0") <= 45


def test_train_stream_rejects_bad_range():
    with pytest.raises(ValueError, match="blanks_range"):
        S.TrainStream(random.Random(0), (50, 40), exclude_keys=())


# ----------------------------------------------------------------------------- parsing
def test_parse_grid_accepts_dots_zeros_and_pretty_grids():
    zeros = WIKI.replace(".", "0")
    assert S.parse_grid(WIKI) == zeros == S.parse_grid(zeros)
    pretty = S.format_grid(WIKI)
    assert pretty.count("\n") == 10 and "|" in pretty and "+" in pretty
    assert S.parse_grid(pretty) == zeros
    rows = "\n".join(WIKI[r * 9:(r + 1) * 9] for r in range(9)) + "\n"
    assert S.parse_grid("  " + rows) == zeros


@pytest.mark.parametrize("bad, words", [
    (WIKI[:80], ["80 cells", "81"]),
    (WIKI + "1", ["82 cells", "81"]),
    ("x" + WIKI[1:], ["'x'", "row 1", "'.' or '0'"]),
    (WIKI[:40] + "a" + WIKI[41:], ["'a'", "row 5, column 5"]),
    ("55" + "0" * 79, ["twice", "row 1"]),
])
def test_parse_grid_rejects_bad_input_with_clear_messages(bad, words):
    with pytest.raises(ValueError) as e:
        S.parse_grid(bad)
    for w in words:
        assert w in str(e.value)


def test_parse_grid_rejects_non_string():
    with pytest.raises(ValueError, match="string"):
        S.parse_grid(list(WIKI))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- tokenizer
def test_token_ids_and_lengths():
    assert (S.PAD_ID, S.EOS_ID, S.BOS_ID, S.UNK_ID, S.MASK_ID) == (0, 1, 2, 3, 4)
    assert S.PROMPT_LEN == 82 and S.CANVAS_LEN == 82
    tok = S.build_tokenizer()
    for name, i in [("<pad>", 0), ("<eos>", 1), ("<bos>", 2), ("<unk>", 3), ("<mask>", 4), ("\n", 15)]:
        assert tok.token_to_id(name) == i
    assert [tok.token_to_id(str(d)) for d in range(10)] == list(range(5, 15))
    # one token per (cell, digit): row 1 col 1 blank is the first, row 9 col 9 digit 9 the last
    assert tok.token_to_id("<r1c1:0>") == S.CELL_ID0 and tok.token_to_id("<r9c9:9>") == S.CELL_ID0 + 809
    assert tok.token_to_id("<r2c3:7>") == S.CELL_ID0 + 10 * (9 + 2) + 7
    assert tok.get_vocab_size() == len(S.VOCAB) == 16 + 810


def test_tokenizer_round_trip():
    puz, sol = S.generate_puzzle(random.Random(21), 45)
    tok = S.build_tokenizer()
    p_ids, t_ids = S.encode_prompt(puz), S.encode_target(sol)
    assert len(p_ids) == S.PROMPT_LEN and p_ids[0] == S.BOS_ID
    assert len(t_ids) == S.CANVAS_LEN and t_ids[81:] == [S.EOS_ID] * (S.CANVAS_LEN - 81)
    cells = "".join(f"<r{i // 9 + 1}c{i % 9 + 1}:{ch}>" for i, ch in enumerate(puz))
    assert tok.encode("<bos>" + cells).ids == p_ids  # helpers agree with the HF tokenizer
    assert tok.encode(sol + "<eos>").ids == t_ids
    assert tok.decode(t_ids, skip_special_tokens=True) == sol
    assert tok.decode(p_ids, skip_special_tokens=False) == "<bos>" + cells
    assert tok.encode("1\n\n?").ids == [6, 15, 15, 3]
    assert S.decode_answer(t_ids) == sol and S.decode_answer(p_ids) == ""  # cell tokens are not answer digits
    assert S.decode_prompt(p_ids) == puz
    assert S.encode_prompt(puz.replace("0", ".")) == p_ids


def test_decode_answer_is_tolerant():
    sol = S.solve_exact(WIKI)
    ids = S.encode_target(sol)
    noisy = [S.PAD_ID, S.MASK_ID] + ids[:10] + [S.EOS_ID, 99, -3, S.NEWLINE_ID] + ids[10:]
    assert S.decode_answer(noisy) == sol
    assert S.decode_answer(np.array([ids])) == sol
    assert S.decode_answer(ids[:30]) == sol[:30]
    assert S.decode_answer([S.EOS_ID] * 5) == ""


# ----------------------------------------------------------------------------- evaluation
def test_evaluate_oracle_and_identity():
    levels = (35, 45)
    oracle = S.evaluate(lambda ps: [S.solve_exact(p) for p in ps], blanks_list=levels, n_per=3)
    assert set(oracle["per_blanks"]) == set(levels)
    for r in list(oracle["per_blanks"].values()) + [oracle["overall"]]:
        assert r["solve_rate"] == 1.0 and r["cell_accuracy"] == 1.0 and r["clues_kept"] == 1.0
    assert oracle["overall"]["n"] == 6
    ident = S.evaluate(lambda ps: list(ps), blanks_list=levels, n_per=3)
    o = ident["overall"]
    assert o["solve_rate"] == 0.0 and o["valid_rate"] == 0.0
    assert o["clues_kept"] == 1.0 and o["cell_accuracy"] == 0.0
    short = S.evaluate(lambda ps: [], blanks_list=(35,), n_per=2)  # too few predictions: scored as empty
    assert short["overall"]["solve_rate"] == 0.0 and short["overall"]["clues_kept"] == 0.0
    report = S.format_report(oracle)
    lines = report.splitlines()
    assert lines[0].startswith("| blanks") and len(lines) == 2 + len(levels) + 1
    assert "| 35 |" in report and "100.0%" in report


# ----------------------------------------------------------------------------- model entry points
def test_solve_without_model_raises_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "DEFAULT_MODEL_PATH", tmp_path / "sudoku")
    with pytest.raises(RuntimeError) as e:
        S.solve(WIKI)
    msg = str(e.value)
    assert "model=" in msg and "blockpress train sudoku" in msg and str(tmp_path) in msg
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(S, "DEFAULT_MODEL_PATH", tmp_path / "empty")
    with pytest.raises(S.SudokuModelMissing):
        S.solve_batch([WIKI])


def test_solve_rejects_bad_puzzle_before_loading_model():
    with pytest.raises(ValueError, match="81"):
        S.solve("123", model=object())


@pytest.mark.parametrize("kw, words", [
    (dict(samples=0), "samples must be a whole number"), (dict(samples=1.5), "samples must be"),
    (dict(samples=20000), "samples=20000 is over 1024 candidates"),  # was a memory-allocation traceback
    (dict(repair=-1), "repair must be a whole number"), (dict(repair=None), "repair must be"),
    (dict(repair_scope="rows"), "unknown repair_scope"), (dict(fixed_tokens=[[1]]), "not fixed_tokens"),
])
def test_solve_refuses_bad_options_with_an_input_error(kw, words):
    """A user's bad option is a BlockpressError (one line for the CLI, a 400 for a server), not a plain ValueError."""
    from blockpress.errors import InputError

    with pytest.raises(InputError, match=words):
        S.solve(WIKI, _CandidateModel({}, 1), **kw)
    with pytest.raises(InputError, match="at least one"):
        S.pick_candidate(WIKI, [])
    with pytest.raises(InputError, match="scope"):
        S.broken_cells(WIKI, WIKI_SOL, "rows")


def test_solve_batch_wiring_with_fake_model():
    torch = pytest.importorskip("torch")
    pairs = S.test_set(35, 2)
    calls = []

    class FakeOut:
        def __init__(self, sequences):
            self.sequences = sequences

    class FakeModel:
        def generate(self, ids, **kw):
            calls.append((ids.clone(), kw))
            by_prompt = {tuple(S.encode_prompt(p)): s for p, s in pairs}
            canvas = []
            for row in ids:
                sol = by_prompt[tuple(row.tolist())]
                target = S.encode_target(sol)
                if sol == pairs[1][1]:
                    target[5] = S.EOS_ID  # one digit missing -> result padded with "0"
                canvas.append(target)
            return FakeOut(torch.cat([ids, torch.tensor(canvas)], dim=1))

    preds = S.solve_batch([p for p, _ in pairs], FakeModel(), temperature=0.0)
    ids, kw = calls[0]
    assert ids.shape == (2, S.PROMPT_LEN)
    assert kw == {"max_new_tokens": S.CANVAS_LEN, "eos_token_id": [1], "pad_token_id": 0, "temperature": 0.0}
    assert preds[0] == pairs[0][1]
    shifted = pairs[1][1][:5] + pairs[1][1][6:]  # 80 digits, padded with "0", the clues written in
    assert preds[1] == S.with_clues(pairs[1][0], shifted) and S.check(pairs[1][0], preds[1])["cell_accuracy"] < 1
    assert S.solve(pairs[0][0], model=FakeModel()) == pairs[0][1]


def test_training_writes_generation_defaults_for_one_canvas():
    from blockpress.cli.train import SUDOKU_GENERATION

    assert SUDOKU_GENERATION["max_new_tokens"] == S.CANVAS_LEN
    assert SUDOKU_GENERATION["eos_token_id"] == [S.EOS_ID] and SUDOKU_GENERATION["pad_token_id"] == S.PAD_ID


def test_inplace_encoding_round_trip():
    puzzle, solution = S.test_set(45, 1)[0]
    prompt, fixed, response = S.encode_inplace(puzzle, solution)
    assert prompt == [S.BOS_ID] and len(fixed) == len(response) == S.CANVAS_LEN
    for i, ch in enumerate(puzzle):
        if ch == "0":
            assert fixed[i] == -1
        else:
            assert fixed[i] == response[i] == S.cell_token(i, int(ch))
    assert fixed[81:] == response[81:] == [S.EOS_ID]
    assert S.decode_answer(response, "inplace") == solution
    assert S.decode_answer(response) == ""  # cell tokens are not digit tokens in the prompt format
    assert S.encode_inplace(puzzle)[2] == []
    assert S.digit_of(S.cell_token(80, 9), "inplace") == 9 and S.digit_of(S.DIGIT_ID0 + 9, "inplace") == -1
    with pytest.raises(ValueError, match="unknown sudoku format"):
        S.decode_answer(response, "grid")


def test_inplace_source_holds_the_clues():
    from blockpress.train.data import SudokuSource

    prompt, response, held = SudokuSource((40, 44), format="inplace").example(0, 3)
    assert prompt == [S.BOS_ID] and len(held) == len(response) == S.CANVAS_LEN
    assert 40 <= held.count(False) <= 44 and held[81]  # the blanks are free, clues and <eos> held
    assert all(S.digit_of(t, "inplace") > 0 for t in response[:81])


def test_random_symmetry_keeps_puzzles_proper():
    import random

    rng = random.Random(0)
    for puzzle, solution in S.test_set(45, 4):
        for _ in range(5):
            sym = S.random_symmetry(rng)
            p2, s2 = S.apply_symmetry(puzzle, sym), S.apply_symmetry(solution, sym)
            assert S.is_valid_solution(s2) and p2.count("0") == 45
            assert S.count_solutions(p2) == 1 and S.solve_exact(p2) == s2
            assert all(a == "0" or a == b for a, b in zip(p2, s2))  # clues are the solution's digits
    seen = {S.apply_symmetry(S.test_set(45, 1)[0][1], S.random_symmetry(rng)) for _ in range(50)}
    assert len(seen) == 50  # a large group: draws differ


def test_augmented_source_reuses_bases_deterministically_and_respects_the_split():
    from blockpress.train.data import SudokuSource
    from blockpress.errors import InputError

    a = SudokuSource((40, 50), augment=4, exclude_keys=frozenset())
    b = SudokuSource((40, 50), augment=4, exclude_keys=frozenset())
    window = [a.example(s, 1) for s in range(4, 8)]  # steps 4-7 share base (1, 1)
    assert [b.example(s, 1) for s in (7, 5, 6, 4)] == [window[3], window[1], window[2], window[0]]
    puzzles = [S.decode_prompt(p) for p, _ in window]
    assert len(set(puzzles)) == 4 and len({p.count("0") for p in puzzles}) == 1
    assert a.example(8, 1) != window[0]
    # a transformed solution that lands on a held-out key is redrawn
    _, s1 = a._puzzle(5, 1)
    c = SudokuSource((40, 50), augment=4, exclude_keys=frozenset({S.canonical_key(s1)}))
    assert S.canonical_key(c._puzzle(5, 1)[1]) != S.canonical_key(s1)
    with pytest.raises(InputError, match="augment must be an integer >= 1"):
        SudokuSource((40, 50), augment=0)


# ----------------------------------------------------------------------------- repair (editing in place)
def _wiki_puzzle() -> str:
    return S.parse_grid(WIKI)


def test_broken_cells_finds_what_breaks_a_rule_and_nothing_else():
    puz = _wiki_puzzle()
    assert S.broken_cells(puz, WIKI_SOL) == [] and S.broken_cells(puz, WIKI_SOL, "cells") == []
    blanks = [i for i in range(81) if puz[i] == "0"]
    # swap two blank cells of row 0 that hold different digits: no repeat in the row, repeats in 2 columns
    a, b = [i for i in blanks if i < 9][:2]
    g = list(WIKI_SOL)
    g[a], g[b] = g[b], g[a]
    g = "".join(g)
    cells = S.broken_cells(puz, g, "cells")
    assert a in cells and b in cells
    for i in cells:  # every listed cell holds a digit repeated in one of its units (checked independently)
        assert puz[i] == "0"
        assert any(sum(g[j] == g[i] for j in unit) > 1 for unit in _units() if i in unit)
    units = S.broken_cells(puz, g)  # "units": every blank of a unit that holds a repeat
    assert set(cells) <= set(units) and S.broken_cells(puz, g, "all") == blanks
    assert S.broken_cells(puz, WIKI_SOL, "all") == []
    for i in set(blanks) - set(units):
        assert all(len({g[j] for j in unit}) == 9 for unit in _units() if i in unit)
    # a clue overwritten in the grid is read back at its clue, so the repeat shows on the blank side
    clue = next(i for i in range(81) if puz[i] != "0")
    over = WIKI_SOL[:clue] + str(int(WIKI_SOL[clue]) % 9 + 1) + WIKI_SOL[clue + 1:]
    assert S.broken_cells(puz, over) == []
    # non-digits and short predictions break their units; clues are never listed
    hole = WIKI_SOL[:a] + "0" + WIKI_SOL[a + 1:]
    assert a in S.broken_cells(puz, hole, "cells")
    assert {i for i in blanks if i >= 40} <= set(S.broken_cells(puz, WIKI_SOL[:40], "cells"))
    assert all(puz[i] == "0" for i in S.broken_cells(puz, ""))
    with pytest.raises(ValueError, match="scope"):
        S.broken_cells(puz, WIKI_SOL, "rows")


def test_solve_batch_repair_holds_all_but_the_broken_cells():
    """A repair round re-denoises exactly the broken cells: the second generate holds the clues and every
    other cell at the first prediction (fixed_tokens), frees the broken ones, and runs only on broken rows."""
    torch = pytest.importorskip("torch")
    pairs = S.test_set(35, 2)
    good, bad = pairs[0][1], list(pairs[1][1])
    blanks = [i for i in range(81) if pairs[1][0][i] == "0"]
    blanks = [blanks[0], next(i for i in blanks if bad[i] != bad[blanks[0]])]
    bad[blanks[0]], bad[blanks[1]] = bad[blanks[1]], bad[blanks[0]]
    bad = "".join(bad)
    calls = []

    class FakeModel:
        def generate(self, ids, **kw):
            calls.append(kw)
            if len(calls) == 1:  # first pass: puzzle 0 solved, puzzle 1 with two cells swapped
                canvas = [S.encode_target(good), S.encode_target(bad)]
            else:  # repair: write the solution into the free cells
                canvas = [[f if f >= 0 else S.DIGIT_ID0 + int(pairs[1][1][i]) if i < 81 else S.EOS_ID
                           for i, f in enumerate(row)] for row in kw["fixed_tokens"].tolist()]
            return torch.cat([ids, torch.tensor(canvas)], dim=1)

    gens = [torch.Generator().manual_seed(k) for k in range(2)]
    preds = S.solve_batch([p for p, _ in pairs], FakeModel(), repair=3, generator=gens)
    assert preds == [good, pairs[1][1]]
    assert len(calls) == 2  # the second round finds nothing broken and stops
    fixed = calls[1]["fixed_tokens"].tolist()
    assert len(fixed) == 1 and calls[1]["generator"] == [gens[1]]
    free = S.broken_cells(pairs[1][0], bad)
    assert blanks[0] in free and blanks[1] in free
    for i in range(81):
        assert fixed[0][i] == (-1 if i in free else S.DIGIT_ID0 + int(bad[i]))
    assert fixed[0][81:] == [S.EOS_ID]
    for bad_rounds in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="repair"):
            S.solve_batch([pairs[0][0]], FakeModel(), repair=bad_rounds)
    with pytest.raises(ValueError, match="repair_scope"):
        S.solve_batch([pairs[0][0]], FakeModel(), repair_scope="rows")
    with pytest.raises(ValueError, match="pass the puzzle, not fixed_tokens"):
        S.solve_batch([pairs[0][0]], FakeModel(), fixed_tokens=torch.zeros(1, 82, dtype=torch.long))


# ----------------------------------------------------------------------------- samples (best of K by the rules)
def test_pick_candidate_keeps_the_grid_that_breaks_no_rule():
    puz = _wiki_puzzle()
    blanks = [i for i in range(81) if puz[i] == "0"]
    a, b = [i for i in blanks if i < 9][:2]
    swapped = list(WIKI_SOL)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    swapped = "".join(swapped)
    short = WIKI_SOL[:60]
    assert S.pick_candidate(puz, [swapped, short, WIKI_SOL, swapped]) == WIKI_SOL
    assert S.pick_candidate(puz, [WIKI_SOL, swapped]) == WIKI_SOL
    # none is right: the fewest broken cells wins, the earliest on ties
    assert len(S.broken_cells(puz, swapped, "cells")) < len(S.broken_cells(puz, short, "cells"))
    assert S.pick_candidate(puz, [short, swapped]) == swapped
    other = WIKI_SOL[:a] + "0" + WIKI_SOL[a + 1:]
    n_swapped, n_other = (len(S.broken_cells(puz, g, "cells")) for g in (swapped, other))
    assert S.pick_candidate(puz, [swapped, other]) == (swapped if n_swapped <= n_other else other)
    with pytest.raises(ValueError, match="at least one"):
        S.pick_candidate(puz, [])


def test_pick_candidate_returns_the_grid_it_judged_with_every_clue():
    """broken_cells judges a candidate with the clues written in; the grid picked is that grid, so a candidate
    that breaks no rule but drew another digit (or none) at a clue comes back as the solution."""
    puz = _wiki_puzzle()
    clues = [i for i in range(81) if puz[i] != "0"]
    lost = "".join("0" if i in clues[:5] else str(int(ch) % 9 + 1) if i == clues[5] else ch
                   for i, ch in enumerate(WIKI_SOL))
    assert S.broken_cells(puz, lost, "cells") == []
    assert S.pick_candidate(puz, [lost]) == S.with_clues(puz, lost) == WIKI_SOL
    assert S.check(puz, S.pick_candidate(puz, [lost]), WIKI_SOL)["solved"]
    short = WIKI_SOL[:40]
    assert S.pick_candidate(puz, [short]) == S.with_clues(puz, short)
    assert all(S.pick_candidate(puz, [short])[i] == puz[i] for i in clues)


class _CandidateModel:
    """Fake model: the first generate writes candidate 0 of every puzzle, a later one candidates 1..K-1
    (rows come puzzle-major): `grids[puzzle][j]` is candidate j."""

    def __init__(self, grids, k, path=None):
        self.grids, self.k, self.calls, self.path = grids, k, [], path

    def generate(self, ids, **kw):
        import torch

        self.calls.append((ids.clone(), kw))
        by_prompt = {tuple(S.encode_prompt(p)): g for p, g in self.grids.items()}
        pick = (lambda r: 0) if len(self.calls) == 1 else (lambda r: 1 + r % (self.k - 1))
        canvas = [S.encode_target(by_prompt[tuple(row.tolist())][pick(r)][:81].ljust(81, "1"))
                  for r, row in enumerate(ids)]
        return torch.cat([ids, torch.tensor(canvas)], dim=1)


def test_solve_batch_samples_draws_more_candidates_only_where_the_first_breaks_a_rule():
    torch = pytest.importorskip("torch")
    (p0, s0), (p1, s1), (p2, s2) = S.test_set(35, 3)
    wrong0 = s0.replace("1", "x").replace("2", "1").replace("x", "2")  # digits 1/2 relabelled: clashes with clues
    b1 = [i for i in range(81) if p1[i] == "0"]
    i, j = b1[0], next(c for c in b1 if s1[c] != s1[b1[0]] and c // 9 == b1[0] // 9)
    swapped = list(s1)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    swapped = "".join(swapped)
    worse = s1[:40] + "1" * 41
    m = _CandidateModel({p0: [wrong0, s0, wrong0], p1: [worse, swapped, worse], p2: [s2, "1" * 81, "1" * 81]}, k=3)
    gens = [torch.Generator().manual_seed(s) for s in (7, 8, 9)]
    preds = S.solve_batch([p0, p1, p2], m, samples=3, generator=gens)
    # puzzle 0: the candidate that breaks no rule; 1: the fewest broken cells; 2: candidate 0 already solves it
    assert preds == [s0, swapped, s2]
    (ids0, kw0), (ids1, kw1) = m.calls
    assert ids0.shape == (3, S.PROMPT_LEN) and kw0["generator"] == gens  # the samples=1 pass itself
    assert ids1.tolist() == [S.encode_prompt(p0)] * 2 + [S.encode_prompt(p1)] * 2  # 2 more each, not for p2
    seeds = [g.initial_seed() for g in kw1["generator"]]
    assert len(kw1["generator"]) == 4 and len(set(seeds) | {7, 8}) == 6
    m2 = _CandidateModel(m.grids, k=3)
    S.solve_batch([p0, p1], m2, samples=3, generator=[torch.Generator().manual_seed(7),
                                                      torch.Generator().manual_seed(8)])
    assert [g.initial_seed() for g in m2.calls[1][1]["generator"]] == seeds  # a function of the puzzle's seed
    m3 = _CandidateModel(m.grids, k=3)
    assert S.solve_batch([p2], m3, samples=3) == [s2] and len(m3.calls) == 1  # nothing broken: one pass
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="samples"):
            S.solve_batch([p0], m, samples=bad)
    with pytest.raises(ValueError, match="one per puzzle"):
        S.solve_batch([p0, p1], m, samples=3, generator=gens[:1])


def test_solve_batch_samples_defaults_to_the_models_task_file(tmp_path):
    pytest.importorskip("torch")
    import json

    p0, s0 = S.test_set(35, 1)[0]
    (tmp_path / "blockpress_task.json").write_text(json.dumps({"task": "sudoku", "samples": 2}))
    m = _CandidateModel({p0: ["1" * 81, s0]}, k=2, path=tmp_path)
    assert S.default_samples(m) == 2 and S.solve(p0, m) == s0 and len(m.calls) == 2
    m.calls.clear()
    assert S.solve_batch([p0], m, samples=1) == [S.with_clues(p0, "1" * 81)] and len(m.calls) == 1  # the argument wins
    assert S.default_samples(_CandidateModel({}, 1)) == 1  # no task file: one candidate
    (tmp_path / "blockpress_task.json").write_text(json.dumps({"task": "sudoku", "samples": 0}))
    with pytest.raises(ValueError, match="blockpress_task.json sets samples=0"):
        S.solve(p0, m)
