"""Preallocated (static) KV cache written by the encoder pass and read by the decoder pass.

Layout per layer: keys/values [B, kv, capacity, D], post-k_norm+RoPE keys and post-v_norm values.
Every layer stores all positions [0, length); the sliding-window semantics of the reference
(sliding layers keep only the last W-1 tokens) are applied when reading (`context`), so the
stored state is the same for both layer types and a cache can be cropped or extended exactly.

Invariants:
- `length` is the number of encoded tokens (= the absolute position of the next chunk).
- The encoder writes [length, length + S) and advances `length`. The eager decoder never writes; the static
  (CUDA-graph) passes write a canvas's K/V past `length` as scratch, which no pass sees as cached (keys at or
  past `length` are masked) and the commit overwrites.
- `padding` [B, capacity] bool marks key positions that are real tokens (False = left padding).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layer_shapes, batch: int, capacity: int, dtype: torch.dtype, device):
        """layer_shapes: list of (kv_heads, head_dim) per layer."""
        self.capacity, self.batch = capacity, batch
        self.keys = [torch.zeros(batch, kv, capacity, d, dtype=dtype, device=device) for kv, d in layer_shapes]
        self.values = [torch.zeros(batch, kv, capacity, d, dtype=dtype, device=device) for kv, d in layer_shapes]
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0
        self.has_padding = False

    def ensure_capacity(self, needed: int) -> None:
        """Grow (by copying) when a later turn needs more room than was preallocated."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)

        def grow(t):
            out = t.new_zeros(*t.shape[:2], new_cap, t.shape[-1])
            out[:, :, : self.capacity] = t
            return out

        self.keys = [grow(t) for t in self.keys]
        self.values = [grow(t) for t in self.values]
        valid = torch.ones(self.batch, new_cap, dtype=torch.bool, device=self.valid.device)
        valid[:, : self.capacity] = self.valid
        self.valid, self.capacity = valid, new_cap

    def set_padding(self, start: int, mask: torch.Tensor) -> None:
        """mask [B, S] bool for the chunk written at `start` (True = real token)."""
        self.valid[:, start:start + mask.shape[1]] = mask
        self.has_padding = self.has_padding or not bool(mask.all())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        S = k.shape[2]
        self.keys[layer][:, :, start:start + S] = k
        self.values[layer][:, :, start:start + S] = v

    def span(self, layer: int, lo: int, hi: int):
        return self.keys[layer][:, :, lo:hi], self.values[layer][:, :, lo:hi]

    def crop(self, length: int) -> None:
        """Forget everything from `length` on (used for multi-turn rollback and training)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length
        self.valid[:, length:] = True
        self.has_padding = not bool(self.valid[:, :length].all())

    def rows(self, index: torch.Tensor) -> "KVCache":
        """A read-only copy of the rows `index` [b] (positions [0, length) only), for a decoder pass over
        part of the batch (row compaction); the encoder must not write to it."""
        sub = KVCache.__new__(KVCache)
        sub.keys = [t[index, :, :self.length] for t in self.keys]
        sub.values = [t[index, :, :self.length] for t in self.values]
        sub.valid = self.valid[index, :self.length]
        sub.batch, sub.capacity, sub.length = int(index.numel()), self.length, self.length
        sub.has_padding = self.has_padding and not bool(sub.valid.all())
        return sub

    def view_rows(self, lo: int, hi: int) -> "KVCache":
        """Rows [lo, hi) as a cache on the same storage (no copy; writes go to this cache's buffers), with this
        cache's length. Rows [0, hi) of a buffer are addressed from the same pointer for every hi, which is what
        lets the server's CUDA graphs of several batch sizes share one set of buffers."""
        view = KVCache.__new__(KVCache)
        view.keys = [t[lo:hi] for t in self.keys]
        view.values = [t[lo:hi] for t in self.values]
        view.valid = self.valid[lo:hi]
        view.batch, view.capacity, view.length, view.has_padding = hi - lo, self.capacity, self.length, self.has_padding
        return view

    def move_rows(self, dst, src) -> None:
        """Rows `dst` take the K/V (positions [0, length)) and the padding mask of rows `src` (lists or index
        tensors), all sources read before any is written: a permutation of the rows, or the kept rows moved down.
        Row compaction under CUDA graphs uses it to put the rows still at work into a prefix of the buffers."""
        dev = self.valid.device
        dst, src = (torch.as_tensor(i, dtype=torch.long, device=dev) for i in (dst, src))
        L = self.length
        for t in self.keys + self.values:
            t[dst, :, :L] = t[src, :, :L]  # the right side is gathered into a new tensor first
        self.valid[dst] = self.valid[src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def front_order(active: list[int], rows: int) -> list[int]:
    """The row order (new row s takes old row order[s]) that puts the `active` rows (ascending) into rows
    [0, len(active)) with the fewest moves: each inactive row in that range trades places with an active row
    beyond it."""
    k, order = len(active), list(range(rows))
    for hole, mover in zip([i for i in range(k) if i not in active], [i for i in active if i >= k]):
        order[hole], order[mover] = mover, hole
    return order

