"""Infilling: fill holes inside a text, with the text on both sides in view (what an AR model can't do).

A template is text with holes: `[MASK]` is one token, `[MASK:n]` is n tokens (tokens of the model's
tokenizer). Everything before the first hole is the prompt (encoded once, causally); from the first
hole on, the text is laid out on the canvas(es): the given tokens are held fixed from the first
denoising step to the commit, the holes start as noise and denoise as usual, so every hole sees the
text after it within the same canvas (a canvas of C tokens; text further right is not seen, as a
block-diffusion model reads only earlier canvases). This is exactly the training distribution: in
training, unreplaced canvas positions are clean tokens at arbitrary places.

The result's text is the template with each hole marker replaced by its fill: every byte outside the
markers is kept. Tokenizers attach a space to the word after it (" created" is one token), so a single
space right before a hole is laid out inside the hole: "God [MASK] the" is encoded as "God" + hole +
" the". That space is still the template's: a fill the model begins with a space (" created") comes
back as "created", one that begins otherwise ("ullik") as is, and the text keeps "God " either way.
A hole's length is exact, but a fill ends at the first end-of-text token the model puts in the hole
(the checkpoint's eos ids, else the tokenizer's <eos>), and special tokens are not shown, so a fill
can come back shorter: the model's way of saying the hole needed fewer tokens. Text after the template
is not generated: the canvas past the template's last token is free (the model may continue the text
there), then discarded, and adaptive stopping watches only the holes.

Markers are case-sensitive and exact: `[MASK]`, `[MASK:n]` with n in 1..4096 written in digits. Any other
text starting "[MASK" or "[mask" (`[MASK: 2]`, `[MASK:-1]`, `[mask]`, an unclosed `[MASK:3`) is an
InputError naming it, rather than kept as text by accident. `\\[MASK` is the escape: the text "[MASK"
(`\\[MASK]` is a literal "[MASK]"; the backslash is dropped, and is the one byte of the template not kept).

The server's `/v1/completions` with `suffix` (OpenAI's insert mode) is the same operation with one hole:
`prompt + "[MASK:max_tokens]" + suffix` (a prompt's one trailing space laid out in the hole, as here; its text
is the fill).

    lm = blockpress.load("kjv")
    lm.infill("In the beginning God [MASK] the heaven and the earth.", seed=0).text
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InputError

HOLE = re.compile(r"\[MASK(?::([0-9]+))?\]")
# where a hole marker, an escaped one or a malformed one starts
MARKER = re.compile(r"(\\?)\[mask", re.IGNORECASE | re.ASCII)
MAX_HOLE = 4096


@dataclass
class Template:
    prefix: str  # text before the first hole (the prompt), as laid out
    pieces: list[str | int]  # after the prefix: text pieces (as laid out) and hole lengths, in order
    outside: list[str] = field(default_factory=list)  # the template's text around the holes, byte for byte
    spaced: list[bool] = field(default_factory=list)  # per hole: the template's space before it is laid out in it

    @property
    def holes(self) -> list[int]:
        return [p for p in self.pieces if isinstance(p, int)]

    def text(self, fills: list[str]) -> str:
        """The template with hole k replaced by fills[k]."""
        return "".join(t + f for t, f in zip(self.outside, [*fills, ""]))


@dataclass
class InfillResult:
    text: str  # the template with every hole marker replaced by its fill (the text around them kept byte for byte)
    fills: list[str]  # what replaced each marker, in order (up to the first end-of-text token in the hole)
    prompt_ids: list[int]
    region_ids: list[int]  # the canvas tokens from the first hole to the template's end (fills included)
    hole_mask: list[bool]  # over region_ids: True where the model chose the token
    result: Any = field(repr=False, default=None)  # the engine's GenerationResult


def space_in_hole(text: str) -> bool:
    """Whether the text before a hole ends in one space that the hole's first token carries (laid out in the hole;
    the text keeps it, and a fill that begins with a space drops it). Two spaces or more stay the text's."""
    return text.endswith(" ") and not text.endswith("  ")


def unspaced(fill: str, spaced: bool) -> str:
    """A hole's text: where the template's space before it is laid out in the hole (`spaced`), a fill that begins
    with a space does not repeat it (the text keeps the template's)."""
    return fill[1:] if spaced and fill.startswith(" ") else fill


def parse_template(template: str) -> Template:
    """Split on `[MASK]` / `[MASK:n]`; raises InputError when there is no hole, a length is 0 or absurd, or a
    marker is malformed (see the module docstring; `\\[MASK` is the text "[MASK")."""
    if not isinstance(template, str):
        raise InputError(f"an infill template is a string, got {type(template).__name__}")
    outside, holes, text, pos = [], [], "", 0
    for m in MARKER.finditer(template):
        if m.start() < pos:
            continue
        text += template[pos:m.start()]
        if m.group(1):  # escaped: the text "[MASK", without the backslash
            text += template[m.start(1) + 1:m.end()]
            pos = m.end()
            continue
        hole = HOLE.match(template, m.start())
        if hole is None:
            bad = re.match(r"\[[^\[\]\n]{0,24}\]|\[[^\s\[]*", template[m.start():]).group(0)
            raise InputError(f"malformed hole marker {bad!r} in the template; write [MASK] (one token) or [MASK:n] "
                             f"(n tokens, 1..{MAX_HOLE}), or \\[MASK for the text [MASK")
        digits = hole.group(1)
        n = 1 if digits is None else int(digits) if len(digits) <= 6 else MAX_HOLE + 1  # (int() stops at 4300 digits)
        if not 1 <= n <= MAX_HOLE:
            shown = hole.group(0) if len(hole.group(0)) <= 16 else f"[MASK:{digits[:6]}...]"
            raise InputError(f"hole {shown} must hold 1..{MAX_HOLE} tokens")
        outside.append(text)
        holes.append(n)
        text, pos = "", hole.end()
    if not holes:
        raise InputError("the template has no hole; mark one with [MASK] (one token) or [MASK:n] (n tokens)")
    outside.append(text + template[pos:])
    # a single space right before a hole is laid out in the hole (the hole's first token carries it)
    spaced = [space_in_hole(t) for t in outside[:-1]]
    laid = [t[:-1] if sp else t for t, sp in zip(outside, spaced)] + outside[-1:]
    pieces: list[str | int] = []
    for t, n in zip(laid[1:], holes):
        pieces += [n] + ([t] if t else [])
    return Template(laid[0], pieces, outside, spaced)


def layout(tokenizer, template: Template) -> tuple[list[int], list[int], list[int]]:
    """-> (prompt ids: BOS when the tokenizer has one + the prefix; region ids with -1 at every hole;
    the number of region tokens of each piece)."""
    bos = tokenizer.bos_token_id
    prompt = ([bos] if bos is not None else []) + (tokenizer.encode(template.prefix) if template.prefix else [])
    if not prompt:
        raise InputError("this tokenizer has no BOS token, so the template needs some text before the first hole")
    region: list[int] = []
    lengths: list[int] = []
    for p in template.pieces:
        ids = [-1] * p if isinstance(p, int) else tokenizer.encode(p)
        region.extend(ids)
        lengths.append(len(ids))
    return prompt, region, lengths


def whole_canvases(region: list[int], canvas_length: int) -> tuple[int, list[int]]:
    """(max_new_tokens covering `region` in whole canvases, region padded to it with -2: free positions
    past the template, whose tokens are discarded and which adaptive stopping ignores)."""
    n_new = math.ceil(len(region) / canvas_length) * canvas_length
    return n_new, region + [-2] * (n_new - len(region))


@dataclass
class Plan:
    """What `infill` runs: the prompt, the region with -1 at holes, and the engine keywords."""

    template: Template
    prompt: list[int]
    region: list[int]
    lengths: list[int]  # region tokens per template piece
    kwargs: dict[str, Any]


def plan(lm, template: str, **sampling) -> Plan:
    """Parse and lay out `template` for `lm`; sampling keywords are validated here (SamplingError)."""
    tok = lm._need_tokenizer()
    if "max_new_tokens" in sampling:
        raise InputError("infill sets max_new_tokens from the template; make the holes longer or shorter instead")
    if "eos_token_id" in sampling:
        raise InputError("infill does not stop at an end-of-text token (a fill ends at the first one in its hole); "
                         "drop eos_token_id")
    tpl = parse_template(template)
    prompt, region, lengths = layout(tok, tpl)
    n_new, fixed = whole_canvases(region, lm.canvas_length)
    limit = lm.config.text.max_position_embeddings
    if len(prompt) + n_new > limit:
        raise InputError(f"the template needs {len(prompt) + n_new} positions (its text and holes, in whole canvases of "
                         f"{lm.canvas_length}), more than the model's {limit}; shorten the holes or the text")
    kw = {"pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else 0, **sampling,
          "max_new_tokens": n_new, "eos_token_id": None, "fixed_tokens": torch.tensor([fixed])}
    lm.generation_config(**{k: v for k, v in kw.items() if k != "fixed_tokens"})
    return Plan(tpl, prompt, region, lengths, kw)


def finish(lm, p: Plan, result) -> InfillResult:
    """The engine's result -> the filled text and each hole's fill."""
    tok = lm.tokenizer
    out = result.new_tokens[0, :len(p.region)].tolist()
    stops = set(lm.generation_config().eos_token_id or ([tok.eos_token_id] if tok.eos_token_id is not None else []))
    fills, at = [], 0
    spaced = iter(p.template.spaced)
    for piece, n in zip(p.template.pieces, p.lengths):  # each hole's own slice, adjacent holes kept apart
        if isinstance(piece, int):
            ids = out[at:at + n]
            cut = next((j for j, t in enumerate(ids) if t in stops), len(ids))
            fills.append(unspaced(tok.decode(ids[:cut], skip_special_tokens=True), next(spaced)))
        at += n
    return InfillResult(p.template.text(fills), fills, p.prompt, out, [t < 0 for t in p.region], result)


def infill(lm, template: str, *, seed: int | None = None, generator: torch.Generator | None = None,
           sampler: str | None = None, logit_bias: dict | None = None, **sampling) -> InfillResult:
    """Fill the holes of `template` with `lm` (a BlockDiffusionLM with a tokenizer). Sampling keywords as
    in generate, but max_new_tokens (set from the template) and eos_token_id (the end of text does not stop
    infilling) are refused; seed or generator, not both; sampler: None is the model's (`lm.configure`);
    logit_bias: as in generate (the holes' tokens only: the text around them is held)."""
    from .engine.generate import seed_or_generator

    p = plan(lm, template, **sampling)
    generator = seed_or_generator(seed, generator, lm.device)
    result = lm.generate([p.prompt], generator=generator, sampler=sampler, logit_bias=logit_bias, **p.kwargs)
    return finish(lm, p, result)
