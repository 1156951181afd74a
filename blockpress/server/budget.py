"""Prompt length against the server's limit, at a cost bounded by the limit, not by the request.

A request under the body-size limit can still be far over the prompt-token limit (a 0.8 MB tool
schema is ~200k tokens). Tokenising all of it to find that out costs seconds of CPU per request;
`encode_within` counts a long text piece by piece and gives up as soon as the count passes the
limit, so refusing a huge prompt costs about what encoding a `limit`-token prompt costs.

Invariants: a text that fits is encoded whole (the ids are exactly `encode(text)`); pieces are cut
just before whitespace, where Gemma's (SentencePiece) and byte-level BPE tokenizers never merge
across, and `SLACK` tokens per cut absorb any tokenizer that does, so a text is refused only when
it surely has more than `limit` tokens.
"""

from __future__ import annotations

from typing import Callable

PIECE_CHARS = 16384  # characters per counted piece
SLACK = 2  # tokens a cut may add, per cut


def _pieces(text: str, size: int):
    """`text` in consecutive pieces of about `size` characters, each cut just before a whitespace character
    when one is near (else at `size`)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            ws = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
            end = ws if ws > start else end
        yield text[start:end]
        start = end


def encode_within(encode: Callable[[str], list[int]], text: str, limit: int) -> list[int] | None:
    """`encode(text)`, or None when the text surely has more than `limit` tokens."""
    if len(text) <= 4 * limit:  # about the size of a prompt that fits: encoding it whole costs no more
        return encode(text)
    n = cuts = 0
    for piece in _pieces(text, PIECE_CHARS):
        n += len(encode(piece))
        if n - SLACK * cuts > limit:
            return None
        cuts += 1
    return encode(text)
