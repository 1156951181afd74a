"""Sudoku as a block-diffusion task: puzzle generation, exact solving and checking, a held-out
test split, a char-level tokenizer, evaluation, and `solve()` with a DiffusionGemma model.

Encoding conventions
--------------------
- A grid (puzzle or solution) is an 81-character string of digits, row by row (cell i is row
  i // 9, column i % 9, box (row // 3) * 3 + col // 3). A blank is "0". `parse_grid` also takes
  "." for blanks and ignores whitespace, newlines and the separators "|", "-", "+", so a pasted
  grid (including `format_grid`'s output) parses; it always returns the normalised form.
- A solution has no "0". Graded difficulty is the number of blanks in the puzzle.

Model encoding (`VOCAB`, 826 ids: a char-level part plus one token per (cell, digit))
-------------------------------------------------------------------------------------
- ids: <pad>=0, <eos>=1, <bos>=2, <unk>=3, <mask>=4 (reserved, never produced by these
  helpers), "0".."9" = 5..14, "\\n" = 15, then the cell tokens `<rRcC:D>` (row R and column C
  in 1..9, D the given digit or 0 for a blank) at `CELL_ID0 + 10 * cell + D`.
- prompt = <bos> + one cell token per cell: `PROMPT_LEN` = 82 tokens, always, so batches need no
  padding. A cell token names its cell, so the model reads row/column/box membership from the
  token's embedding instead of having to infer absolute positions from relative (RoPE) offsets;
  and since cell tokens are most of the vocabulary, the uniform noise of the diffusion canvas is
  almost always visibly foreign (close to masked diffusion) rather than a plausible wrong digit.
- answer canvas = the 81 solution digits ("1".."9" ids) + one <eos>: `CANVAS_LEN` = 82 tokens.
- `decode_answer` keeps the first 81 digit tokens and skips everything else (<eos>, <pad>,
  cell tokens, stray specials), so it never raises on model output; it may return fewer than 81
  chars.

Held-out split (the guarantee)
------------------------------
- `test_set(blanks, n, seed=TEST_SEED)` is deterministic: puzzle i comes from its own
  `random.Random(f"{seed}/{blanks}/{i}")`, so a smaller n is a prefix of a larger one.
- Training draws from a different seed string (`TRAIN_SEED`), and `TrainStream` /
  `train_batch_iter` additionally drop every puzzle whose solution's `canonical_key` is in
  `exclude_keys` (by default the keys of the default evaluation sets, `heldout_keys()`).
  `canonical_key` is invariant under digit relabelling and the 8 rotations/reflections of the
  grid, so no training solution equals a held-out solution or any such transform of it; and as
  every held-out puzzle is keyed by its (unique) solution, no held-out puzzle is ever trained on.

Checking (`check`) never raises: a malformed prediction (wrong length, non-digits, None) simply
scores what is there. `solved` means: 81 digits 1-9, every row/column/box a permutation of 1..9,
every clue kept, and every cell equal to the (unique) solution.

This module imports only the standard library and numpy at top level; torch and the model are
imported lazily inside `solve` / `solve_batch`.
"""

from __future__ import annotations

import functools
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BlockpressError, ConfigError, InputError

__all__ = [
    "N_CELLS", "PROMPT_LEN", "CANVAS_LEN", "VOCAB", "PAD_ID", "EOS_ID", "BOS_ID", "UNK_ID",
    "MASK_ID", "DIGIT_ID0", "NEWLINE_ID", "CELL_ID0", "TEST_SEED", "VAL_SEED", "SPLITS", "TRAIN_SEED", "EVAL_BLANKS",
    "EVAL_N_PER", "MIN_BLANKS", "MAX_BLANKS", "DEFAULT_MODEL_PATH", "SudokuModelMissing",
    "parse_grid", "format_grid", "count_solutions", "solve_exact", "is_valid_solution",
    "random_full_grid", "generate_puzzle", "canonical_key", "test_set", "heldout_keys",
    "TrainStream", "train_batch_iter", "check", "build_tokenizer", "encode_prompt", "decode_prompt",
    "encode_target", "decode_answer", "evaluate", "format_report", "solve", "solve_batch",
    "FORMATS", "REPAIR_SCOPES", "with_clues", "read_answer", "broken_cells", "repair_canvas", "default_samples", "pick_candidate", "random_symmetry", "apply_symmetry", "cell_token", "encode_inplace", "model_format", "digit_of",
]

N_CELLS = 81

# ----------------------------------------------------------------------------- vocabulary
PAD_ID, EOS_ID, BOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
DIGIT_ID0 = 5  # id of "0"; digit d has id DIGIT_ID0 + d
NEWLINE_ID = 15
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
VOCAB.update({str(d): DIGIT_ID0 + d for d in range(10)})
VOCAB["\n"] = NEWLINE_ID
CELL_ID0 = 16  # cell token for (cell i, digit d) is CELL_ID0 + 10 * i + d (d = 0: blank)
VOCAB.update({f"<r{i // 9 + 1}c{i % 9 + 1}:{d}>": CELL_ID0 + 10 * i + d for i in range(N_CELLS) for d in range(10)})

PROMPT_LEN = 1 + N_CELLS  # <bos> + 81 cell tokens
# How a model reads a puzzle (its blockpress_task.json "format"):
# "prompt":  the puzzle is the prompt (<bos> + 81 cell tokens), the canvas is 81 digit tokens + <eos>;
# "inplace": the prompt is <bos> alone; the canvas is 81 cell tokens + <eos>, the clues held on it as
#            given tokens (infilling: `fixed_tokens` at inference, held positions in training).
FORMATS = ("prompt", "inplace")
CANVAS_LEN = N_CELLS + 1  # 81 solution digits + <eos>; must be >= N_CELLS + 1
assert CANVAS_LEN >= N_CELLS + 1

# ----------------------------------------------------------------------------- split / eval
TEST_SEED = "blockpress-sudoku-test"
VAL_SEED = "blockpress-sudoku-val"  # the validation split: choices (sampler, checkpoint) are made here, never on the test set
SPLITS = {"test": TEST_SEED, "val": VAL_SEED}
TRAIN_SEED = "blockpress-sudoku-train"
EVAL_BLANKS = (35, 40, 45, 50, 55)
EVAL_N_PER = 50
MIN_BLANKS = 0
MAX_BLANKS = 64  # 17 clues is the proven minimum; generate_puzzle is practical up to 58

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "assets" / "sudoku"


class SudokuModelMissing(BlockpressError, RuntimeError):
    """No sudoku model was passed and none is installed at DEFAULT_MODEL_PATH."""


# ============================================================================= grid I/O
_SEPARATORS = str.maketrans("", "", " \t\r\n\f\v|-+")


def parse_grid(s: str, *, check_conflicts: bool = True) -> str:
    """Validate and normalise a grid to 81 chars of "0".."9" ("0" = blank).

    Accepts "." or "0" for blanks and ignores whitespace/newlines and "|", "-", "+" (so a pasted
    pretty grid works). With check_conflicts, a digit repeated in a row/column/box is rejected.
    Raises InputError (a ValueError) naming the problem and the fix.
    """
    if not isinstance(s, str):
        raise InputError(f"sudoku grid must be a string, got {type(s).__name__}; pass 81 digits "
                         "row by row with '.' or '0' for blanks")
    flat = s.translate(_SEPARATORS).replace(".", "0")
    for i, ch in enumerate(flat):
        if not ("0" <= ch <= "9"):
            where = f"cell {i + 1} (row {i // 9 + 1}, column {i % 9 + 1})" if i < N_CELLS else f"position {i + 1}"
            raise InputError(f"sudoku grid has invalid character {ch!r} at {where}; use digits 1-9 "
                             "and '.' or '0' for blanks (spaces, newlines, '|', '-', '+' are ignored)")
    if len(flat) != N_CELLS:
        raise InputError(f"sudoku grid has {len(flat)} cells, expected 81 (9 rows of 9); give one "
                         "digit per cell row by row, with '.' or '0' for blanks")
    if check_conflicts:
        _raise_on_conflict(flat)
    return flat


def _raise_on_conflict(flat: str) -> None:
    seen: dict[tuple[str, int, str], int] = {}
    for i, ch in enumerate(flat):
        if ch == "0":
            continue
        r, c = divmod(i, 9)
        for unit, idx in (("row", r), ("column", c), ("box", (r // 3) * 3 + c // 3)):
            key = (unit, idx, ch)
            if key in seen:
                raise InputError(f"sudoku grid has digit {ch} twice in {unit} {idx + 1} (cells "
                                 f"{seen[key] + 1} and {i + 1}); fix the clues so each row, column "
                                 "and 3x3 box holds each digit at most once")
            seen[key] = i


def format_grid(s: str) -> str:
    """Render a grid as a 9x9 block with 3x3 box separators; blanks shown as ".".

    The output parses back with `parse_grid` to the same grid. Conflicting clues are allowed
    (this is a display helper; it is also used to show wrong predictions).
    """
    flat = parse_grid(s, check_conflicts=False)
    lines = []
    for r in range(9):
        if r and r % 3 == 0:
            lines.append("------+-------+------")
        row = flat[r * 9:(r + 1) * 9].replace("0", ".")
        lines.append(" | ".join(" ".join(row[b:b + 3]) for b in (0, 3, 6)))
    return "\n".join(lines)


# ============================================================================= exact solver
# Bitmask backtracking with MRV (fewest candidates first). Digit d <-> bit 1 << (d - 1).
_FULL = 0x1FF
_POP = [bin(m).count("1") for m in range(512)]
_BITS = [[(1 << k, k + 1) for k in range(9) if m >> k & 1] for m in range(512)]
_ROW = [i // 9 for i in range(N_CELLS)]
_COL = [i % 9 for i in range(N_CELLS)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(N_CELLS)]
_UNITS = ([[i for i in range(N_CELLS) if _ROW[i] == u] for u in range(9)]  # 9 rows, 9 columns, 9 boxes
          + [[i for i in range(N_CELLS) if _COL[i] == u] for u in range(9)]
          + [[i for i in range(N_CELLS) if _BOX[i] == u] for u in range(9)])
_DIGITS = frozenset("123456789")


def _to_cells(puzzle: str | Sequence[int]) -> list[int]:
    if isinstance(puzzle, str):
        return [ord(ch) - 48 for ch in parse_grid(puzzle, check_conflicts=False)]
    cells = [int(v) for v in puzzle]
    if len(cells) != N_CELLS or any(not 0 <= v <= 9 for v in cells):
        raise InputError("sudoku grid must be 81 values in 0..9 (0 = blank)")
    return cells


def _search(cells: list[int], limit: int, forbid: dict[int, int] | None = None,
            rng: random.Random | None = None) -> tuple[int, list[int] | None]:
    """Count solutions of `cells` up to `limit` (0 = no limit); return (count, first solution).

    forbid maps cell -> bitmask of digits that cell may not take (used for the uniqueness trick
    in the generator). rng shuffles the digit order (used to build random full grids).
    """
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    empties: list[int] = []
    for i, v in enumerate(cells):
        if v:
            bit = 1 << (v - 1)
            r, c, b = _ROW[i], _COL[i], _BOX[i]
            if (rows[r] | cols[c] | boxes[b]) & bit:
                return 0, None  # conflicting clues
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
        else:
            empties.append(i)
    forb = [0] * N_CELLS
    if forbid:
        for i, m in forbid.items():
            forb[i] |= m
    grid = list(cells)
    found = [0]
    first: list[list[int]] = []
    ROW, COL, BOX, POP, BITS = _ROW, _COL, _BOX, _POP, _BITS

    def rec() -> bool:  # True = stop (limit reached)
        if not empties:
            found[0] += 1
            if not first:
                first.append(grid.copy())
            return bool(limit) and found[0] >= limit
        best_k, best_m, best_n = -1, 0, 10
        for k, i in enumerate(empties):
            m = ~(rows[ROW[i]] | cols[COL[i]] | boxes[BOX[i]] | forb[i]) & 0x1FF
            n = POP[m]
            if n < best_n:
                if n == 0:
                    return False
                best_k, best_m, best_n = k, m, n
                if n == 1:
                    break
        i = empties[best_k]
        empties[best_k] = empties[-1]
        empties.pop()
        r, c, b = ROW[i], COL[i], BOX[i]
        choices = BITS[best_m]
        if rng is not None and best_n > 1:
            choices = choices.copy()
            rng.shuffle(choices)
        for bit, d in choices:
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            grid[i] = d
            stop = rec()
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[b] &= ~bit
            if stop:
                return True
        grid[i] = 0
        empties.append(i)
        # restore the original order so MRV tie-breaking stays deterministic
        empties[best_k], empties[-1] = empties[-1], empties[best_k]
        return False

    rec()
    return found[0], (first[0] if first else None)


def count_solutions(puzzle: str | Sequence[int], limit: int = 2) -> int:
    """Number of solutions, capped at `limit` (limit=0: count all; can be slow for sparse grids)."""
    return _search(_to_cells(puzzle), max(0, int(limit)))[0]


def solve_exact(puzzle: str | Sequence[int]) -> str | None:
    """One solution as an 81-digit string (the unique one for a proper puzzle), or None."""
    _, sol = _search(_to_cells(puzzle), 1)
    return None if sol is None else "".join(map(str, sol))


def is_valid_solution(grid: str) -> bool:
    """True iff grid is 81 digits 1-9 and every row, column and box is a permutation of 1..9."""
    if not isinstance(grid, str) or len(grid) != N_CELLS or not all("1" <= ch <= "9" for ch in grid):
        return False
    return all({grid[i] for i in unit} == _DIGITS for unit in _UNITS)


# ============================================================================= generator
def random_full_grid(rng: random.Random) -> str:
    """A random complete valid grid (randomised MRV backtracking from an empty grid)."""
    _, sol = _search([0] * N_CELLS, 1, rng=rng)
    assert sol is not None
    return "".join(map(str, sol))


def _dig(solution: list[int], order: list[int], blanks: int) -> list[int] | None:
    """Blank cells of `solution` in `order` while the puzzle stays unique; None if < blanks.

    Uniqueness trick: if the current puzzle is unique, blanking cell c (true digit v) keeps it
    unique iff there is no solution with c != v, i.e. the search with v forbidden at c fails.
    A cell that cannot be blanked now can never be blanked later (fewer clues only add
    solutions), so one pass yields a minimal puzzle along this order.
    """
    puzzle = list(solution)
    n_blank = 0
    remaining = len(order)
    for c in order:
        if n_blank == blanks:
            return puzzle
        if n_blank + remaining < blanks:
            return None
        remaining -= 1
        v = puzzle[c]
        puzzle[c] = 0
        if _search(puzzle, 1, forbid={c: 1 << (v - 1)})[0]:
            puzzle[c] = v  # another solution exists: c must stay a clue
        else:
            n_blank += 1
    return puzzle if n_blank == blanks else None


def generate_puzzle(rng: random.Random, blanks: int, *, orders_per_grid: int = 4,
                    max_grids: int = 200) -> tuple[str, str]:
    """A (puzzle, solution) pair with exactly `blanks` blank cells and a unique solution.

    A random full grid is dug in random cell orders (up to orders_per_grid orders per grid,
    then a new grid) until exactly `blanks` cells are blank. Deterministic given rng's state.
    Timing (1 CPU core): ~2 ms at 45 blanks, ~7 ms at 55, ~60 ms at 58; 59+ is rare for this
    digging strategy (60 usually fails). Raises RuntimeError after max_grids grids.
    """
    if isinstance(blanks, bool) or not isinstance(blanks, (int, np.integer)) or not MIN_BLANKS <= blanks <= MAX_BLANKS:
        raise ValueError(f"blanks must be an int in {MIN_BLANKS}..{MAX_BLANKS} (got {blanks!r}); "
                         "unique puzzles need at least 17 clues")
    blanks = int(blanks)
    cells = list(range(N_CELLS))
    for _ in range(max_grids):
        sol = random_full_grid(rng)
        sol_cells = [ord(ch) - 48 for ch in sol]
        for _ in range(orders_per_grid):
            rng.shuffle(cells)
            puzzle = _dig(sol_cells, cells, blanks)
            if puzzle is not None:
                return "".join(map(str, puzzle)), sol
    raise RuntimeError(f"could not generate a unique sudoku with {blanks} blanks in {max_grids} "
                       "grids; use fewer blanks (up to 58 is practical)")


def random_symmetry(rng: random.Random) -> tuple[list[int], dict[str, str]]:
    """A random validity-preserving transform of a grid: (cell map, digit map).

    Bands and the rows inside each band are permuted, stacks and the columns inside each stack too,
    the grid is transposed half of the time, and the digits 1-9 are relabelled. Every such transform
    maps a puzzle with a unique solution to one with a unique solution and the same number of blanks."""
    rows = [3 * b + r for b in rng.sample(range(3), 3) for r in rng.sample(range(3), 3)]
    cols = [3 * b + c for b in rng.sample(range(3), 3) for c in rng.sample(range(3), 3)]
    if rng.random() < 0.5:
        cells = [rows[c] * 9 + cols[r] for r in range(9) for c in range(9)]
    else:
        cells = [rows[r] * 9 + cols[c] for r in range(9) for c in range(9)]
    digits = dict(zip("123456789", rng.sample("123456789", 9)))
    digits["0"] = "0"
    return cells, digits


def apply_symmetry(grid: str, symmetry: tuple[list[int], dict[str, str]]) -> str:
    """The grid (81 chars, "0" = blank) under a transform from `random_symmetry`."""
    cells, digits = symmetry
    flat = parse_grid(grid, check_conflicts=False)
    return "".join(digits[flat[i]] for i in cells)


# ============================================================================= held-out split
_SYMMETRIES: list[list[int]] = []
for _t in range(8):  # the 8 rotations/reflections of the square, as index maps
    _m = []
    for _r in range(9):
        for _c in range(9):
            rr, cc = (_c, _r) if _t & 4 else (_r, _c)
            rr = 8 - rr if _t & 1 else rr
            cc = 8 - cc if _t & 2 else cc
            _m.append(rr * 9 + cc)
    _SYMMETRIES.append(_m)
del _t, _m, _r, _c


def canonical_key(solution: str) -> str:
    """Fingerprint invariant under digit relabelling and the 8 rotations/reflections.

    For each symmetry, read the grid in transformed order and relabel digits by first
    appearance (first new digit -> "1", ...; "0" stays "0"); the key is the minimum string.
    Equal keys <=> the grids are equal up to those transforms.
    """
    flat = parse_grid(solution, check_conflicts=False)
    best = None
    for perm in _SYMMETRIES:
        relabel = {"0": "0"}
        out = []
        for i in perm:
            ch = flat[i]
            lab = relabel.get(ch)
            if lab is None:
                lab = relabel[ch] = str(len(relabel))
            out.append(lab)
        s = "".join(out)
        if best is None or s < best:
            best = s
    return best  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _test_set_cached(blanks: int, n: int, seed: str) -> tuple[tuple[str, str], ...]:
    return tuple(generate_puzzle(random.Random(f"{seed}/{blanks}/{i}"), blanks) for i in range(n))


def test_set(blanks: int, n: int, seed: str = TEST_SEED) -> list[tuple[str, str]]:
    """Deterministic held-out (puzzle, solution) pairs; puzzle i depends only on (seed, blanks, i)."""
    return list(_test_set_cached(int(blanks), int(n), str(seed)))


test_set.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def heldout_keys(blanks_list: Iterable[int] = EVAL_BLANKS, n_per: int = EVAL_N_PER,
                 seed: str = TEST_SEED) -> frozenset[str]:
    """canonical_key of every solution in the given held-out sets (default: evaluate()'s sets)."""
    return frozenset(canonical_key(sol) for b in blanks_list for _, sol in test_set(b, n_per, seed))


class TrainStream:
    """Endless training (puzzle, solution) pairs that never hit the held-out split.

    blanks is drawn uniformly from blanks_range = (lo, hi) inclusive. Any puzzle whose solution's
    canonical_key is in exclude_keys is dropped (counted in `skipped`). exclude_keys=None means
    `heldout_keys()` (evaluate()'s default sets; computed once, takes a few seconds).
    """

    def __init__(self, rng: random.Random | None = None, blanks_range: tuple[int, int] = (20, 58),
                 exclude_keys: Iterable[str] | None = None):
        lo, hi = (int(x) for x in blanks_range)
        if not MIN_BLANKS <= lo <= hi <= MAX_BLANKS:
            raise ValueError(f"blanks_range must satisfy {MIN_BLANKS} <= lo <= hi <= {MAX_BLANKS}, "
                             f"got {blanks_range!r}")
        self.rng = rng if rng is not None else random.Random(TRAIN_SEED)
        self.blanks_range = (lo, hi)
        self.exclude_keys = frozenset(heldout_keys() if exclude_keys is None else exclude_keys)
        self.skipped = 0
        self.produced = 0

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return self

    def __next__(self) -> tuple[str, str]:
        while True:
            puzzle, sol = generate_puzzle(self.rng, self.rng.randint(*self.blanks_range))
            if self.exclude_keys and canonical_key(sol) in self.exclude_keys:
                self.skipped += 1
                continue
            self.produced += 1
            return puzzle, sol


def train_batch_iter(rng: random.Random | None, blanks_range: tuple[int, int] = (20, 58),
                     exclude_keys: Iterable[str] | None = None,
                     batch_size: int = 32) -> Iterator[list[tuple[str, str]]]:
    """Endless batches (lists of batch_size (puzzle, solution) pairs) from a TrainStream."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stream = TrainStream(rng, blanks_range, exclude_keys)
    while True:
        yield [next(stream) for _ in range(batch_size)]


# ============================================================================= checker
def _as_pred(prediction: Any) -> str:
    if prediction is None:
        return ""
    if not isinstance(prediction, str):
        try:
            prediction = "".join(str(x) for x in prediction)
        except TypeError:
            prediction = str(prediction)
    return prediction.translate(_SEPARATORS)


def check(puzzle: str, prediction: Any, solution: str | None = None) -> dict[str, Any]:
    """Score one prediction against a puzzle; never raises on a malformed prediction.

    Returns {solved, cell_accuracy, clues_kept, valid, well_formed}:
    - cell_accuracy: fraction of the puzzle's blank cells the prediction gets right (cells
      missing from a short prediction, or non-digits, count as wrong; 1.0 if no blanks);
    - clues_kept: fraction of given clues the prediction reproduces at their position;
    - valid: 81 digits 1-9 with every row/column/box a permutation of 1..9;
    - well_formed: exactly 81 chars of 0-9 (after removing whitespace/separators);
    - solved: valid and every cell equals the solution.
    The reference solution is `solution` or, if None, solve_exact(puzzle) (puzzles are assumed
    proper, i.e. uniquely solvable). The puzzle itself must be a valid grid string.
    """
    puz = parse_grid(puzzle, check_conflicts=False)
    ref = parse_grid(solution, check_conflicts=False) if solution is not None else solve_exact(puz)
    pred = _as_pred(prediction)
    padded = pred[:N_CELLS].ljust(N_CELLS, "\0")
    blanks = [i for i, ch in enumerate(puz) if ch == "0"]
    clues = [i for i, ch in enumerate(puz) if ch != "0"]
    if ref is None:
        right = 0
    else:
        right = sum(1 for i in blanks if padded[i] == ref[i])
    kept = sum(1 for i in clues if padded[i] == puz[i])
    well_formed = len(pred) == N_CELLS and all("0" <= ch <= "9" for ch in pred)
    valid = well_formed and is_valid_solution(pred)
    solved = bool(valid and ref is not None and pred == ref)
    return {
        "solved": solved,
        "cell_accuracy": right / len(blanks) if blanks else 1.0,
        "clues_kept": kept / len(clues) if clues else 1.0,
        "valid": bool(valid),
        "well_formed": bool(well_formed),
    }


# ============================================================================= tokenisation
def build_tokenizer():
    """HF `tokenizers.Tokenizer` for VOCAB: one token per character, specials registered as special,
    cell tokens (`<r1c1:0>` ..) as added tokens, so they round-trip through encode/decode.

    decode(ids) concatenates tokens (no spaces); decode(..., skip_special_tokens=True) drops
    <pad>/<eos>/<bos>/<unk>/<mask>. Unknown characters map to <unk>.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False) for t, i in VOCAB.items() if i >= CELL_ID0])
    return tok


def encode_prompt(puzzle: str) -> list[int]:
    """<bos> + one cell token per cell (cell i holding digit d, 0 = blank -> CELL_ID0 + 10 i + d):
    always PROMPT_LEN ids."""
    flat = parse_grid(puzzle, check_conflicts=False)
    return [BOS_ID] + [CELL_ID0 + 10 * i + ord(ch) - 48 for i, ch in enumerate(flat)]


def encode_target(solution: str) -> list[int]:
    """81 solution digit ids + <eos> fill: always CANVAS_LEN ids."""
    flat = parse_grid(solution, check_conflicts=False)
    return [DIGIT_ID0 + ord(ch) - 48 for ch in flat] + [EOS_ID] * (CANVAS_LEN - N_CELLS)


def cell_token(i: int, d: int) -> int:
    """The id of cell i (0..80, row by row) holding digit d (0 = blank)."""
    return CELL_ID0 + 10 * i + d


def encode_inplace(puzzle: str, solution: str | None = None) -> tuple[list[int], list[int], list[int]]:
    """The "inplace" format: (prompt, fixed, response).

    prompt = [<bos>]; fixed = CANVAS_LEN ids for `fixed_tokens` (the clue's cell token at every clue,
    -1 at every blank, <eos> after the grid); response = the solution's cell tokens + <eos> fill, or []
    when no solution is given. Training holds the fixed positions clean and scores only the blanks."""
    flat = parse_grid(puzzle, check_conflicts=False)
    fixed = [cell_token(i, ord(ch) - 48) if ch != "0" else -1 for i, ch in enumerate(flat)]
    fixed += [EOS_ID] * (CANVAS_LEN - N_CELLS)
    response = []
    if solution is not None:
        sol = parse_grid(solution, check_conflicts=False)
        response = [cell_token(i, ord(ch) - 48) for i, ch in enumerate(sol)] + [EOS_ID] * (CANVAS_LEN - N_CELLS)
    return [BOS_ID], fixed, response


def digit_of(token: int, format: str = "prompt") -> int:
    """The digit (0-9) a canvas token writes in `format`, or -1 for any other token."""
    if format == "inplace":
        return (token - CELL_ID0) % 10 if CELL_ID0 <= token < CELL_ID0 + 10 * N_CELLS else -1
    d = token - DIGIT_ID0
    return d if 0 <= d <= 9 else -1


def model_format(model: Any) -> str:
    """The puzzle format a loaded sudoku model was trained with ("prompt" unless its
    blockpress_task.json says otherwise)."""
    from . import task_info

    fmt = task_info(model).get("format", "prompt")
    if fmt not in FORMATS:
        raise ConfigError(f"the model's blockpress_task.json names sudoku format {fmt!r}; "
                         f"this version of blockpress knows {FORMATS}")
    return fmt


def decode_prompt(ids: Any) -> str:
    """The puzzle (81 chars, "0" = blank) held by a prompt's cell tokens; other ids are skipped."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    cells = ["0"] * N_CELLS
    for t in ids:
        k = int(t) - CELL_ID0
        if 0 <= k < 10 * N_CELLS:
            cells[k // 10] = chr(48 + k % 10)
    return "".join(cells)


def decode_answer(ids: Any, format: str = "prompt") -> str:
    """The first 81 digit tokens of one sequence as a string; every other id is skipped.

    format "inplace": canvas position i is cell i; its digit is that of the cell token there (`<r1c1:5>`
    -> "5", whichever cell the token names), "0" for any other token; always 81 chars for 81+ ids.

    Takes a list/tuple of ints, a 1-D numpy array or torch tensor, or a 2-D one with one row.
    May return fewer than 81 chars if the sequence holds fewer digit tokens.
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise InputError(f"decode_answer takes one sequence, got a batch of {len(ids)}; "
                             "call it once per row")
        ids = list(ids[0])
    if format not in FORMATS:
        raise InputError(f"unknown sudoku format {format!r}; use one of {FORMATS}")
    if format == "inplace":
        return "".join(str(max(digit_of(int(t), format), 0)) for t in ids[:N_CELLS])
    out = []
    for t in ids:
        try:
            d = digit_of(int(t), format)
        except (TypeError, ValueError):
            continue
        if d >= 0:
            out.append(chr(48 + d))
            if len(out) == N_CELLS:
                break
    return "".join(out)


# ============================================================================= evaluation
def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def evaluate(solve_fn: Callable[[list[str]], Sequence[Any]], blanks_list: Iterable[int] = EVAL_BLANKS,
             n_per: int = EVAL_N_PER, seed: str = TEST_SEED) -> dict[str, Any]:
    """Run solve_fn (list of puzzles -> list of predictions, one call per level) on the held-out sets.

    Returns {"per_blanks": {blanks: {n, solve_rate, cell_accuracy, clues_kept, valid_rate,
    seconds, predictions (the predicted grids, in test-set order)}}, "overall": {same without
    predictions, pooled over all puzzles}, "n_per", "seed"}. A prediction list
    that is too short counts the missing ones as empty predictions.
    """
    per: dict[int, dict[str, float]] = {}
    pooled: list[dict[str, Any]] = []
    total_s = 0.0
    for blanks in blanks_list:
        pairs = test_set(blanks, n_per, seed)
        puzzles = [p for p, _ in pairs]
        t0 = time.perf_counter()
        preds = list(solve_fn(list(puzzles)))
        dt = time.perf_counter() - t0
        total_s += dt
        preds += [""] * (len(pairs) - len(preds))
        rows = [check(p, pred, sol) for (p, sol), pred in zip(pairs, preds)]
        pooled += rows
        per[int(blanks)] = _summarise(rows, dt)
        per[int(blanks)]["predictions"] = [_as_pred(pred) for pred in preds[: len(pairs)]]
    return {"per_blanks": per, "overall": _summarise(pooled, total_s), "n_per": n_per, "seed": seed}


def _summarise(rows: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    return {
        "n": len(rows),
        "solve_rate": _mean([float(r["solved"]) for r in rows]),
        "cell_accuracy": _mean([r["cell_accuracy"] for r in rows]),
        "clues_kept": _mean([r["clues_kept"] for r in rows]),
        "valid_rate": _mean([float(r["valid"]) for r in rows]),
        "seconds": seconds,
    }


def format_report(results: dict[str, Any]) -> str:
    """evaluate()'s results as a markdown table (one row per blanks level + overall)."""
    head = ("| blanks | n | solved | cell acc | clues kept | valid | s |\n"
            "|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]

    def row(name: str, r: dict[str, float]) -> str:
        return (f"| {name} | {r['n']} | {100 * r['solve_rate']:.1f}% | {100 * r['cell_accuracy']:.1f}% "
                f"| {100 * r['clues_kept']:.1f}% | {100 * r['valid_rate']:.1f}% | {r['seconds']:.2f} |")

    for b, r in results["per_blanks"].items():
        lines.append(row(str(b), r))
    lines.append(row("**all**", results["overall"]))
    return "\n".join(lines)


# ============================================================================= model entry points
def require_sudoku_model(lm: Any, name: Any) -> None:
    """InputError unless `lm`'s blockpress_task.json says task sudoku (a text model would be scored as noise)."""
    from . import task_info

    if task_info(lm).get("task") != "sudoku":
        raise InputError(f"{name} is not a Sudoku model (its blockpress_task.json does not say task sudoku); leave "
                         "the model unset for the shipped one, or train one with `blockpress train sudoku`")


_LOADED: dict[str, Any] = {}  # models solve() loaded from a path, kept: a loop of solve() calls loads once


def _resolve_model(model: Any) -> Any:
    """A loaded model as given; None -> the shipped model; a folder path (or a shipped model's name) ->
    that model, which must be a Sudoku model. Loaded once per path and process."""
    if model is not None and not isinstance(model, (str, Path)):
        if not callable(getattr(model, "generate", None)):
            raise InputError(f"model must be a loaded blockpress model or a checkpoint folder, got "
                             f"{type(model).__name__}")
        return model
    if model is None:
        path = Path(DEFAULT_MODEL_PATH)
        if not (path / "config.json").is_file():
            raise SudokuModelMissing(f"no sudoku model at {path}; pass model=blockpress.load(<dir>) or "
                                     "train one with `blockpress train sudoku`")
    else:
        path = model
    key = str(path)
    if key not in _LOADED:
        import blockpress  # lazy: pulls in torch and the model code

        lm = blockpress.load(path, progress=sys.stderr.isatty())
        if model is not None:
            require_sudoku_model(lm, model)
        _LOADED[key] = lm
    return _LOADED[key]


def with_clues(puzzle: str, grid: Any) -> str:
    """`grid` (a prediction; a short one padded with "0") with every clue of `puzzle` written in: the answer
    `solve` returns for that prediction and the grid `broken_cells` judges. A model whose canvas holds the
    clues only in the prompt ("prompt" format) may draw another digit or none at a clue; it is the clue."""
    puz = parse_grid(puzzle, check_conflicts=False)
    return "".join(p if p != "0" else ch for p, ch in zip(puz, _as_pred(grid)[:N_CELLS].ljust(N_CELLS, "0")))


def read_answer(puzzle: str, ids: Any, format: str = "prompt") -> str:
    """The answer one canvas (ids) gives for `puzzle`: its digits (`decode_answer`) with the clues written in
    (`with_clues`); what `solve` and `blockpress run` return."""
    return with_clues(puzzle, decode_answer(ids, format))


def broken_cells(puzzle: str, grid: str, scope: str = "units") -> list[int]:
    """The blank cells of `puzzle` that `grid` visibly breaks, by the rules alone (never the solution).

    The grid judged is `with_clues(puzzle, grid)`, the grid `solve` returns for that prediction. scope
    "cells": blank cells holding a non-digit or a digit repeated in their row, column or box; "units":
    every blank cell of a row, column or box that holds a repeat or a non-digit; "all": every blank cell
    once anything is broken (a fresh attempt). A complete grid with no repeat that keeps the clues is a
    solution, so [] means `with_clues(puzzle, grid)` solves the puzzle (the unique solution of a proper one).
    """
    if scope not in REPAIR_SCOPES:
        raise InputError(f"unknown repair scope {scope!r}; use one of {REPAIR_SCOPES}")
    puz = parse_grid(puzzle, check_conflicts=False)
    g = with_clues(puz, grid)
    bad: set[int] = set()
    for unit in _UNITS:
        seen: dict[str, list[int]] = {}
        for i in unit:
            seen.setdefault(g[i], []).append(i)
        hit = [i for d, cells in seen.items() for i in cells if d not in _DIGITS or len(cells) > 1]
        if hit:
            bad.update(unit if scope == "units" else range(N_CELLS) if scope == "all" else hit)
    return sorted(i for i in bad if puz[i] == "0")


REPAIR_SCOPES = ("units", "cells", "all")


def repair_canvas(puzzle: str, grid: str, free: Iterable[int], format: str = "prompt") -> list[int]:
    """`fixed_tokens` (CANVAS_LEN ids) for a repair round: the clue, else the grid's digit, at every cell;
    -1 (free) at the cells `free` and at cells the grid leaves blank; <eos> after the grid."""
    free = set(free)
    row = []
    for i, ch in enumerate(with_clues(puzzle, grid)):
        d = ord(ch) - 48
        row.append(-1 if i in free or not 1 <= d <= 9 else (cell_token(i, d) if format == "inplace" else DIGIT_ID0 + d))
    return row + [EOS_ID] * (CANVAS_LEN - N_CELLS)


MAX_SAMPLES = 1024  # candidates a puzzle (rows of one batch): past it, memory, not the answer, grows


def solve_batch(puzzles: Sequence[str], model: Any = None, *, samples: int | None = None, repair: int = 0,
                repair_scope: str = "units", **sampling: Any) -> list[str]:
    """Predict solutions for puzzles with one batched generate (prompts are all PROMPT_LEN long).

    Each result is 81 chars holding every clue (`with_clues`: the model's digits at the blanks; "0" where it
    produced fewer than 81 digit tokens), the grid the checks below judge. A puzzle with no blank comes back
    as given.
    sampling is passed through to model.generate (`generator` may be a list, one per puzzle).

    repair: up to this many rounds of editing in place. A round takes every prediction that breaks a
    rule (`broken_cells`: a digit repeated in a row, column or box), holds its other cells on the canvas
    (`fixed_tokens`) and denoises the broken cells again from noise. It uses the rules, never the
    solution; it stops early when no prediction breaks a rule.

    samples: up to this many candidate answers per puzzle, each denoised from its own noise; the answer is
    the first candidate that breaks no rule (`broken_cells` is empty: for a proper puzzle, its unique
    solution), else the one that breaks the fewest cells. Like repair it uses the rules, never the
    solution. Candidate 0 is the samples=1 pass itself; only the puzzles whose candidate 0 breaks a rule
    get candidates 1..K-1, side by side in one batch, so easy puzzles cost one pass and every puzzle that
    samples=1 solves gets the same answer. None takes the model's default (`default_samples`:
    blockpress_task.json "samples", else 1). With a list of generators, candidate j > 0 of puzzle k draws
    from a generator seeded by (generator k's initial seed, j). Repair rounds then edit the chosen answers.
    """
    flat = [parse_grid(p) for p in puzzles]
    if not flat:
        return []
    if not isinstance(repair, int) or isinstance(repair, bool) or repair < 0:
        raise InputError(f"repair must be a whole number of rounds >= 0, got {repair!r}")
    if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool) or samples < 1):
        raise InputError(f"samples must be a whole number of candidates >= 1, got {samples!r}")
    if samples is not None and samples > MAX_SAMPLES:
        raise InputError(f"samples={samples} is over {MAX_SAMPLES} candidates a puzzle (each is a row of one batch: "
                         "20,000 took over 5 GB); ask for fewer")
    if repair_scope not in REPAIR_SCOPES:
        raise InputError(f"unknown repair_scope {repair_scope!r}; use one of {REPAIR_SCOPES}")
    if "fixed_tokens" in sampling:
        raise InputError("solve_batch builds the canvas itself (the clues, and the held cells of a repair round); "
                         "pass the puzzle, not fixed_tokens")
    m = _resolve_model(model)
    fmt = model_format(m)
    if fmt == "inplace":  # the clues are held on the canvas (fixed_tokens); the model fills the blanks
        fixed = [encode_inplace(p)[1] for p in flat]
    else:
        fixed = None
    n_cand = default_samples(m) if samples is None else samples
    gens = sampling.get("generator")
    if isinstance(gens, (list, tuple)) and len(gens) != len(flat):
        raise InputError(f"generator: got {len(gens)} generators for {len(flat)} puzzles; pass one per puzzle "
                         "(or one for the whole batch)")
    preds = _generate(m, fmt, flat, fixed, sampling)  # candidate 0: exactly the samples=1 pass
    todo = [i for i in range(len(flat)) if broken_cells(flat[i], preds[i], "cells")] if n_cand > 1 else []
    if todo:  # candidates 1..K-1, only for the puzzles whose first candidate breaks a rule
        more = n_cand - 1
        sub = sampling
        if isinstance(gens, (list, tuple)):
            sub = {**sampling, "generator": [_candidate_generator(gens[i], j) for i in todo for j in range(1, n_cand)]}
        cands = _generate(m, fmt, [flat[i] for i in todo for _ in range(more)],
                          None if fixed is None else [fixed[i] for i in todo for _ in range(more)], sub)
        for r, i in enumerate(todo):
            preds[i] = pick_candidate(flat[i], [preds[i], *cands[r * more:(r + 1) * more]])
    for _ in range(repair):
        todo = [(k, cells) for k in range(len(flat)) if (cells := broken_cells(flat[k], preds[k], repair_scope))]
        if not todo:
            break
        keep = [k for k, _ in todo]
        rows = [repair_canvas(flat[k], preds[k], cells, fmt) for k, cells in todo]
        gens = sampling.get("generator")  # one per puzzle: the broken rows' own generators go on
        sub = {**sampling, "generator": [gens[k] for k in keep]} if isinstance(gens, (list, tuple)) else sampling
        redo = _generate(m, fmt, [flat[k] for k in keep], rows, sub)
        for k, pred in zip(keep, redo):
            preds[k] = pred
    return preds


def default_samples(model: Any) -> int:
    """Candidates per puzzle a sudoku model solves with by default: its blockpress_task.json "samples"
    (chosen on the validation split when it was shipped), else 1."""
    from . import task_info

    k = task_info(model).get("samples", 1)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SAMPLES:
        raise ConfigError(f"the model's blockpress_task.json sets samples={k!r}; it must be a whole number in "
                          f"[1, {MAX_SAMPLES}] (fix or remove the field)")
    return k


def pick_candidate(puzzle: str, candidates: Sequence[Any]) -> str:
    """The candidate grid that breaks the fewest cells by the rules alone (`broken_cells(scope="cells")`),
    the earliest one on ties, with the clues written in (`with_clues`, the grid judged): a candidate that
    breaks none gives the puzzle's solution."""
    if not candidates:
        raise InputError("pick_candidate needs at least one candidate grid")
    counts = [len(broken_cells(puzzle, c, "cells")) for c in candidates]
    return with_clues(puzzle, candidates[counts.index(min(counts))])


def _candidate_generator(gen: Any, j: int) -> Any:
    """A generator for candidate j > 0 of a puzzle whose candidate 0 draws from `gen`: seeded by
    (gen's initial seed, j), so results depend on the puzzle's own seed alone, not on batching."""
    import hashlib

    import torch

    seed = int.from_bytes(hashlib.blake2b(f"{gen.initial_seed()}/{j}".encode(), digest_size=8).digest(),
                          "little") >> 1
    return torch.Generator(device=gen.device).manual_seed(seed)


def _generate(m: Any, fmt: str, flat: list[str], fixed: list[list[int]] | None, sampling: dict) -> list[str]:
    import torch

    if fmt == "inplace":
        ids = torch.tensor([[BOS_ID]] * len(flat), dtype=torch.long)
    else:
        ids = torch.tensor([encode_prompt(p) for p in flat], dtype=torch.long)
    if fixed is not None:
        sampling = {"fixed_tokens": torch.tensor(fixed, dtype=torch.long), **sampling}
    device = getattr(m, "device", None)
    if device is not None:
        ids = ids.to(device)
    # inplace: no end-of-text handling; an <eos> drawn at a blank must not pad the clues after it
    eos = [EOS_ID] if fmt == "prompt" else None
    out = m.generate(ids, **{"max_new_tokens": CANVAS_LEN, "eos_token_id": eos, "pad_token_id": PAD_ID, **sampling})
    seqs = getattr(out, "sequences", out)
    canvas = seqs[:, ids.shape[1]:]
    return [read_answer(p, row, fmt) for p, row in zip(flat, canvas)]


def solve(puzzle: str, model: Any = None, *, samples: int | None = None, repair: int = 0, **sampling: Any) -> str:
    """The 81-digit solution a DiffusionGemma sudoku model predicts for one puzzle.

    model: a loaded blockpress model, or a Sudoku checkpoint folder (loaded once per process; default: the
    shipped model, DEFAULT_MODEL_PATH; raises SudokuModelMissing, a RuntimeError, if none is installed).
    samples: candidates denoised side by side, the one that breaks no rule (else the fewest cells) kept;
    None = the model's default. repair: rounds of re-denoising the cells that break a rule (see
    `solve_batch`). Neither looks at a solution. The result holds every clue (a puzzle with no blank comes
    back as given); the rest is not verified: use `check(puzzle, result)`.
    """
    return solve_batch([puzzle], model, samples=samples, repair=repair, **sampling)[0]
