"""`blockpress infill [MODEL] TEMPLATE`: fill `[MASK]` / `[MASK:n]` holes, seeing the text on both sides.

TEMPLATE is text with holes (`[MASK]` one token, `[MASK:n]` n tokens; '-' or a pipe reads stdin).
The canvas is drawn live: the template's own tokens plain, the holes denoising. Then the filled text
(fills highlighted) and the stats line; `--json` prints {text, fills, token ids, stats} instead.
MODEL defaults to the shipped text model (blockpress/assets/kjv) when it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

from .run import (DEFAULT_MODEL, add_model_args, add_sampling_args, load_model, read_prompt, refuse_task_model,
                  sampling_kwargs, stats_line, stats_of)


def add_parser(p) -> None:
    add_model_args(p, default=f"the shipped text model, kjv: {DEFAULT_MODEL.parent / 'kjv'}")
    p.add_argument("template", nargs="?", metavar="TEMPLATE",
                   help="text with [MASK] (one token) or [MASK:n] (n tokens) holes; '-' reads stdin")
    add_sampling_args(p, max_new_tokens=False)  # the holes set the tokens to generate
    p.add_argument("--no-live", action="store_true", help="do not draw the canvas while it denoises")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, fills, token ids, stats")


class _HoleRenderer:
    """The canvas with the template's tokens plain and only the holes styled as they denoise."""

    def __init__(self, text_renderer, region: list[int], canvas: int):
        self.r, self.region, self.C, self.index = text_renderer, region, canvas, 0

    def canvas(self, tokens, accepted, prev):
        from rich.text import Text

        from .view import ACCEPTED, NOISE, STABLE

        out = Text()
        base = self.index * self.C
        for j, (t, piece) in enumerate(zip(tokens, self.r.pieces(tokens))):
            k = base + j
            if k >= len(self.region):
                break
            if self.region[k] >= 0:
                out.append(piece, style="default")
            else:
                style = ACCEPTED if accepted[j] else (STABLE if prev is not None and prev[j] == t else NOISE)
                out.append(piece, style=style + " underline")
        return out


def main(args) -> int:
    from ..engine.generate import seeded
    from rich.console import Console
    from rich.text import Text

    import blockpress

    from ..errors import InputError
    from ..infill import HOLE, finish, plan
    from ..loading import SHIPPED_MODELS
    from .view import CanvasView, TextRenderer

    one = args.model if args.template is None else None
    if one is not None and (HOLE.search(one) or " " in one.strip() or one == "-"  # `infill -`: stdin
                            or not (one in SHIPPED_MODELS or "/" in one or Path(one).exists())):
        # one argument with holes, words (no model's name has a space), or naming no model (not a shipped name, a
        # folder or an org/name Hub id): the template, default model
        args.template, args.model = one, None
    if args.model is None:  # the shipped text model (`run`'s default, the Sudoku model, has no text to fill)
        if not (SHIPPED_MODELS["kjv"] / "config.json").is_file():
            raise InputError(f"no MODEL given and the shipped text model is not installed at {SHIPPED_MODELS['kjv']}; "
                             "pass a checkpoint folder or Hub id")
        args.model = str(SHIPPED_MODELS["kjv"])
    template = read_prompt(args.template)
    if template is None or not template.strip():
        raise InputError("no TEMPLATE given; e.g. blockpress infill 'In the beginning God [MASK] the heaven'")
    lm = load_model(args)
    refuse_task_model(lm, "infill")
    p = plan(lm, template, **sampling_kwargs(args))
    console = Console(highlight=False, soft_wrap=True)  # text is never hard-wrapped (a pipe or a file gets it whole)
    gen = seeded(args.seed, lm.device) if args.seed is not None else None
    renderer = _HoleRenderer(TextRenderer(lm._need_tokenizer()), p.region, lm.canvas_length)
    view = CanvasView(renderer, console, live=not (args.no_live or args.json), title="infill",
                      show_committed=False)
    result = None
    with view:
        for ev in lm.stream([p.prompt], generator=gen, drafts=view.live_on, **p.kwargs):
            if isinstance(ev, blockpress.Draft):
                renderer.index = ev.canvas_index
                view.draft(ev.canvas_index, ev.step, ev.max_steps, ev.tokens[0].tolist(), ev.accepted[0].tolist())
            elif isinstance(ev, blockpress.Finished):
                result = ev.result
    r = finish(lm, p, result)
    stats = stats_of(result, sum(r.hole_mask))
    if args.json:
        print(json.dumps({"text": r.text, "fills": r.fills, "prompt_ids": r.prompt_ids, "token_ids": r.region_ids,
                          "hole_mask": r.hole_mask, "stats": stats}, ensure_ascii=False))
        return 0
    out = Text()
    for text, fill in zip(p.template.outside, [*r.fills, None]):  # r.text, the fills highlighted
        out.append(text)
        if fill is not None:
            out.append(fill, style="bold green underline")
    console.print(out)
    console.print(stats_line(stats), style="cyan", markup=False)
    return 0
