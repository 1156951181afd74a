"""Automatic prefix caching: the K/V a prompt left in the cache, kept for a later prompt that starts the same way.

A chat client sends the whole conversation every turn, so each turn's prompt is the previous one's (up to its
generation prompt) plus the reply and a new message. The encoder is causal, so the K/V of a prompt's first n
tokens depend on those n tokens only: a later prompt that starts with them can take their K/V and encode only the
rest, as one more chunk of a chunked prefill. For a 4K-token conversation the next turn then encodes its new
message instead of 4K tokens.

What is kept, and when it is reused:
- After a prompt is encoded alone at positions [0, S) (a row that joins an empty batch, the usual case of one
  user chatting), a copy of its K/V is kept with its token ids. Only positions [0, S) of a row whose prompt
  starts at 0 are kept: the encoder's K/V carry RoPE of their absolute positions, and a row that joins a running
  batch is left-padded to end where the batch's cache ends, so its positions depend on the batch.
- A row that joins an empty batch takes the entry with the longest common prefix (at least `min_tokens`): the
  entry's first n positions are copied into its cache and only its tokens [n, S) are encoded. A prompt that
  extends an entry replaces it, so a conversation keeps one entry that grows by a turn each time.
- Entries live on the model's device, least recently used evicted first, within `budget` bytes and
  `max_entries` prompts; one is kept only where the device has twice its size free, and all go when the server's
  slots must grow and would not fit otherwise (requests come before kept prompts).
- Not for a bidirectional encoder (every prompt token sees the later ones: a prefix's K/V depend on what follows).

Numerics: the prompt's tokens [n, S) are encoded as a chunk that attends to the cached [0, n), which is what
chunked prefill computes: the same function up to fp32 summation order as encoding the prompt whole. A prompt
that equals a kept one (n = S) encodes nothing and gets the same bits.
"""

from __future__ import annotations

from collections import OrderedDict

BUDGET = 1 << 30  # a server's default: bytes of K/V kept (a 4K-token prompt of the 26B model: 0.71 GB, its ring)


def common_prefix(a: tuple, b: tuple) -> int:
    """Length of the longest common prefix of two id tuples (slice comparisons in C, halving the range)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    def __init__(self, budget: int, min_tokens: int = 16, max_entries: int = 64):
        """budget: bytes of K/V kept at most (0: keep nothing); min_tokens: the shortest prefix worth reusing;
        max_entries: prompts kept at most (a lookup compares the prompt with each: a small model's entries are
        small, and thousands of them would make every admission scan thousands)."""
        self.budget, self.min_tokens, self.max_entries = budget, min_tokens, max_entries
        self.entries: OrderedDict[tuple[int, ...], object] = OrderedDict()  # prompt ids -> 1-row KVCache
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    def match(self, prompt: list[int], whole: bool = False):
        """(n, cache) for the longest kept prefix of `prompt` (a 1-row cache of positions [0, n) whose sliding
        layers still hold what position n needs; with `whole`, every position: for a cache without a ring), or None.
        The entries are tried longest shared prefix first (ties: the least recently used): one that cannot give its
        prefix (a ring that no longer holds the window before position n, a long prompt cut short; or `whole`) makes
        way for the next, so a long conversation kept as a ring does not hide the short entries that share its
        system prompt. Counts a hit or a miss."""
        prompt = tuple(prompt)
        shared = [(common_prefix(key, prompt), key) for key in self.entries]
        for n, key in sorted((x for x in shared if x[0] >= self.min_tokens), key=lambda x: -x[0]):  # (stable)
            try:
                part = self.entries[key].prefix(n, whole)
            except ValueError:
                continue
            self.entries.move_to_end(key)
            self.hits += 1
            self.tokens_reused += n
            return n, part
        self.misses += 1
        return None

    def store(self, prompt: list[int], cache) -> bool:
        """Keep `cache` (a 1-row copy holding positions [0, len(prompt))) for `prompt`; entries that are a prefix of
        it go (it answers every match they would). Whether it was kept (not when too large or too short)."""
        size = cache.nbytes()
        if size > self.budget or len(prompt) < self.min_tokens:
            return False
        key = tuple(prompt)
        for old in [k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(old)
        self.entries[key] = cache
        self.bytes += size
        while self.bytes > self.budget or len(self.entries) > self.max_entries:
            self._drop(next(iter(self.entries)))
        return True

    def covers(self, prompt: list[int]) -> bool:
        """Whether a kept entry already holds all of `prompt` (storing it again would add nothing)."""
        key = tuple(prompt)
        return any(len(k) >= len(key) and k[:len(key)] == key for k in self.entries)

    def clear(self) -> None:
        """Keep nothing (the device needs the memory)."""
        self.entries.clear()
        self.bytes = 0

    def _drop(self, key) -> None:
        self.bytes -= self.entries.pop(key).nbytes()
