"""The live canvas view shared by `blockpress run` and `blockpress chat` (rich).

After every denoising step the current canvas is drawn token by token: positions accepted in
this step are highlighted, positions whose argmax did not change since the previous step are
plain, the rest (still noise) are dim. Committed text accumulates above the canvas. A Sudoku
model's canvas is drawn as a 9x9 grid instead (`SudokuRenderer`).

Invariants: the view only reads events (`Draft`, `Commit`) for one batch row; it never changes
generation. Without a terminal (pipes, tests) nothing is drawn live.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

ACCEPTED, STABLE, NOISE, COMMITTED = "bold green", "default", "dim", "default"


def visible(piece: str) -> str:
    """Show whitespace-only pieces and control characters so the canvas keeps its shape."""
    return piece.replace("\n", "⏎").replace("\t", "→").replace("\r", "")


class TextRenderer:
    """Token pieces of a text model."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def pieces(self, tokens: list[int]) -> list[str]:
        """Each position's text (`Tokenizer.pieces`: a multi-byte character at the token that completes it)."""
        return [visible(p) for p in self.tok.pieces(tokens)]

    def canvas(self, tokens: list[int], accepted: list[bool], prev: list[int] | None) -> Text:
        out = Text()
        for j, (t, piece) in enumerate(zip(tokens, self.pieces(tokens))):
            style = ACCEPTED if accepted[j] else (STABLE if prev is not None and prev[j] == t else NOISE)
            out.append(piece, style=style)
        return out


class SudokuRenderer:
    """A 9x9 grid: clues bold, digits the model wrote highlighted when accepted, noise dim."""

    def __init__(self, puzzle: str, digit_of):
        """digit_of(token id) -> the digit 0-9 it writes, or -1 (sudoku.digit_of for the model's format)."""
        self.puzzle, self.digit_of = puzzle, digit_of

    def grid(self, cells: list[tuple[str, str]]) -> Text:
        out = Text()
        for r in range(9):
            if r and r % 3 == 0:
                out.append("------+-------+------\n", style="dim")
            for c in range(9):
                if c and c % 3 == 0:
                    out.append("| ", style="dim")
                ch, style = cells[r * 9 + c]
                out.append(ch + " ", style=style)
            out.append("\n")
        return out

    def canvas(self, tokens: list[int], accepted: list[bool], prev: list[int] | None) -> Text:
        cells = []
        for i in range(81):
            if self.puzzle[i] != "0":
                cells.append((self.puzzle[i], "bold"))
                continue
            t = tokens[i] if i < len(tokens) else -1
            d = self.digit_of(t)
            ch = str(d) if 1 <= d <= 9 else "·"
            style = ACCEPTED if i < len(accepted) and accepted[i] else (
                STABLE if prev is not None and prev[i] == t else NOISE)
            cells.append((ch, style))
        return self.grid(cells)


class CanvasView:
    """`with CanvasView(renderer, console, live) as v: v.draft(ev); v.commit(ev, text)`."""

    def __init__(self, renderer, console: Console | None = None, live: bool = True, title: str = "canvas",
                 show_committed: bool = True):
        self.r = renderer
        self.console = console or Console()
        self.live_on = live and self.console.is_terminal
        self.title = title
        self.show_committed = show_committed
        self.committed = Text()
        self.body: Text = Text("")
        self.header = ""
        self._prev: list[int] | None = None
        self._live: Live | None = None

    def __enter__(self) -> "CanvasView":
        if self.live_on:
            self._live = Live(self._render(), console=self.console, refresh_per_second=20, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def _render(self):
        panel = Panel(self.body, title=f"{self.title} {self.header}".strip(), title_align="left",
                      border_style="cyan")
        return Group(self.committed, panel) if self.show_committed else panel

    def draft(self, canvas: int, step: int, max_steps: int, tokens: list[int], accepted: list[bool]) -> None:
        if self._live is None:
            return
        self.header = f"· canvas {canvas + 1} · step {step}/{max_steps}"
        self.body = self.r.canvas(tokens, accepted, self._prev)
        self._prev = tokens
        self._live.update(self._render())

    def commit(self, text: str) -> None:
        """A canvas committed; `text` is the new committed text (already cleaned for display)."""
        self._prev = None
        if self._live is None:
            return
        self.committed.append(text)
        self._live.update(self._render())
