"""Preallocated (static) KV cache written by the encoder pass and read by the decoder pass.

Layout per layer: keys/values [B, kv, slots, D], post-k_norm+RoPE keys and post-v_norm values.

- Full-attention layers keep every position: slot p holds position p (slots = `capacity`).
- Sliding layers read at most the `window` positions before the ones a pass writes (the
  reference keeps only the last W-1 tokens), so once the cache is longer than `window + reserve` they keep a
  *ring* of that many slots, position p in slot p % ring (`ring`; None: they keep every position, like the
  full layers). On the 26B model the 25 sliding layers hold 91 % of the K/V bytes per position, so at a 32K-token
  context a row's cache holds 1.3 GB instead of 7.4 GB (bf16).
  `reserve` is the most positions one pass writes (a prefill chunk, or a canvas and a commit fused); a larger
  write (`ensure_capacity(..., write=S)`) widens the ring first, or makes the layers flat again when nothing was
  dropped yet. Reads (`span`) return the positions in order, so attention sees the same keys in the same order
  as with every position kept: the same numbers, bit for bit.

Invariants:
- `length` is the number of encoded tokens (= the absolute position of the next chunk).
- The encoder writes [length, length + S) and advances `length`. The decoder passes write a canvas's K/V past
  `length` as scratch (`scratch_room`; the eager passes only without autograd, else they concatenate), which no pass
  sees as cached (the next decoder pass writes its own canvas there first, the static passes mask keys at or past
  `length`) and the commit overwrites (`note_write` records it for the ring's bookkeeping).
- `valid` [B, capacity] bool marks key positions that are real tokens (False = left padding); it is indexed by
  position for every layer, ring or not.
- With a ring, positions before `high - ring` are gone (`high`: one past the highest position ever written);
  `crop` refuses to go back to where a sliding layer would need one of them.
"""

from __future__ import annotations

import torch

from ..errors import InputError


def rounded_capacity(needed: int, limit: int) -> int:
    """The positions a cache on reused buffers is made with for `needed`: the next power of two, at most `limit`
    (the model's positions) unless `needed` is more. Such caches, and the CUDA graphs captured on their buffers,
    then come in a few sizes instead of one per prompt length (a server's slots, a Python loop over prompts)."""
    return max(needed, min(1 << (needed - 1).bit_length(), limit))


def ring_slots(window: int | None, reserve: int | None, capacity: int, write: int = 0) -> int | None:
    """The sliding layers' ring size for a cache of `capacity` positions whose passes write at most
    max(reserve, write) positions, or None where keeping every position is no larger (or no window / reserve)."""
    if window is None or reserve is None:
        return None
    ring = window + max(reserve, write)
    return ring if ring < capacity else None


class KVCache:
    def __init__(self, layer_shapes, batch: int, capacity: int, dtype: torch.dtype, device,
                 sliding=None, window: int | None = None, reserve: int | None = None):
        """layer_shapes: list of (kv_heads, head_dim) per layer; sliding: per layer, True where the layer only reads
        the last `window` positions (None: no layer does); reserve: the most positions one pass writes (None: no
        ring, every layer keeps every position)."""
        self.capacity, self.batch = capacity, batch
        self.sliding = [bool(s) for s in sliding] if sliding is not None else [False] * len(layer_shapes)
        self.window = window if any(self.sliding) else None
        self.reserve = reserve
        self.ring = ring_slots(self.window, reserve, capacity)
        self.keys = [torch.zeros(batch, kv, self._slots(i), d, dtype=dtype, device=device)
                     for i, (kv, d) in enumerate(layer_shapes)]
        self.values = [torch.zeros(batch, kv, self._slots(i), d, dtype=dtype, device=device)
                       for i, (kv, d) in enumerate(layer_shapes)]
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0
        self.has_padding = False
        self._high = [0]  # one past the highest position written; a box shared with the views on these buffers
        self.view = False  # True: rows of another cache's buffers (its layout cannot change from here)

    # layout ---------------------------------------------------------------------------------------------
    def _ringed(self, i: int) -> bool:
        return self.ring is not None and self.sliding[i]

    def _slots(self, i: int) -> int:
        return self.ring if self._ringed(i) else self.capacity

    @property
    def high(self) -> int:
        return self._high[0]

    def forget_writes(self) -> None:
        """Nothing written so far is anyone's any more (a server's slots taken by a fresh group, which starts again
        at position 0): the ring's bookkeeping restarts, for this cache and every view on its buffers. Left as it
        was, the old `high` would mark the new group's positions as gone, and a copy of its rows (`put_rows`, when
        the slots grow) would skip them."""
        self._high[0] = 0

    def note_write(self, start: int, n: int) -> None:
        """Positions [start, start + n) were written (by `write`, or by a static pass on the device)."""
        self._high[0] = max(self._high[0], start + n)

    def slot_index(self, i: int, pos: torch.Tensor) -> torch.Tensor:
        """The slots of layer i holding positions `pos` (a device tensor: the static passes' writes and gathers)."""
        return self.kind_slots(self.sliding[i], pos)

    def kind_slots(self, sliding: bool, pos: torch.Tensor) -> torch.Tensor:
        """The slots holding positions `pos` in every sliding layer (sliding=True) or every other layer: each kind
        of layer shares one layout."""
        return pos % self.ring if self.ring is not None and sliding else pos

    def _present_from(self) -> int:
        """The first position every layer still holds."""
        return 0 if self.ring is None else max(0, self.high - self.ring)

    def _held_from(self, i: int) -> int:
        """The first position layer i still holds."""
        return self._present_from() if self._ringed(i) else 0

    def _move_positions(self, ring: int | None, capacity: int) -> None:
        """Lay the layers out for `ring` / `capacity` on new buffers. A layer that keeps every position keeps
        [0, length); a ring keeps the last positions it can hold of those this layout still holds."""
        if self.view:
            raise RuntimeError("internal: the layout of a view on another cache's rows cannot change "
                               "(size the cache it is a view of first)")
        L, dev = self.length, self.valid.device
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                ringed = self.sliding[i] and ring is not None
                if ringed and self._ringed(i) and ring == self.ring:
                    continue  # the same ring
                if not ringed and not self._ringed(i):  # every position, before and after: grow in place
                    if capacity == self.capacity:
                        continue
                    out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])
                    out[:, :, :min(self.capacity, capacity)] = t[:, :, :capacity]
                    store[i] = out
                    continue
                a = self._held_from(i)
                if ringed:
                    a = max(a, L - ring)
                elif a > 0:
                    raise RuntimeError(f"internal: positions [0, {a}) are gone; the sliding layers must keep a ring")
                out = t.new_zeros(*t.shape[:2], ring if ringed else capacity, t.shape[-1])
                pos = torch.arange(a, L, device=dev)
                out.index_copy_(2, pos % ring if ringed else pos, t.index_select(2, self.slot_index(i, pos)))
                store[i] = out
        if ring != self.ring:
            self._high = [L]  # a ring's bookkeeping restarts: what it holds ends at the length
        self.ring = ring
        if capacity != self.capacity:
            valid = torch.ones(self.batch, capacity, dtype=torch.bool, device=dev)
            n = min(self.capacity, capacity)
            valid[:, :n] = self.valid[:, :n]
            self.valid, self.capacity = valid, capacity

    def ensure_capacity(self, needed: int, write: int = 0) -> None:
        """Room for positions [0, needed) and for a pass that writes `write` positions and reads the `window`
        before them. Layers keeping every position grow by copying when `needed` exceeds the capacity (at least
        doubling); the sliding layers take a ring once it is smaller than the capacity, and a wider one (or every
        position again, where none is gone yet) for a pass that writes more than the ring was made for."""
        cap = max(needed, 2 * self.capacity) if needed > self.capacity else self.capacity
        ring = self.ring
        if self.window is not None and self.reserve is not None and (ring is None or ring < self.window + write):
            ring = ring_slots(self.window, self.reserve, cap, write)
            if ring is None and self._present_from() > 0:  # positions are gone: it stays a ring, a wide enough one
                ring = self.window + max(self.reserve, write)
        if ring == self.ring and cap == self.capacity:
            return
        if self.view:
            raise RuntimeError(f"internal: a view on another cache's rows needs {needed} positions (has "
                               f"{self.capacity}) or a ring of {ring} (has {self.ring}); grow the cache it is a view "
                               "of first")
        self._move_positions(ring, cap)

    # reads and writes -----------------------------------------------------------------------------------
    def set_padding(self, start: int, mask: torch.Tensor) -> None:
        """mask [B, S] bool for the chunk written at `start` (True = real token)."""
        self.valid[:, start:start + mask.shape[1]] = mask
        self.has_padding = self.has_padding or not bool(mask.all())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        S = k.shape[2]
        self.note_write(start, S)
        if not self._ringed(layer):
            self.keys[layer][:, :, start:start + S] = k
            self.values[layer][:, :, start:start + S] = v
            return
        R = self.ring
        if S + self.window > R:
            raise RuntimeError(f"internal: a write of {S} positions into a ring of {R} (window {self.window}); call "
                               f"ensure_capacity(..., write={S}) first")
        a = start % R
        n = min(S, R - a)
        for store, x in ((self.keys, k), (self.values, v)):
            store[layer][:, :, a:a + n] = x[:, :, :n]
            if n < S:
                store[layer][:, :, :S - n] = x[:, :, n:]

    def scratch_room(self, start: int, n: int) -> bool:
        """Whether a pass may write positions [start, start + n) in place as scratch (a canvas's K/V): they fit
        without growing the cache (the layers keeping every position have the slots, a ring holds the `window`
        positions before them too), and no gradient flows through the buffers (a training cache, encoded under
        autograd, must not change in place)."""
        return (start + n <= self.capacity and (self.ring is None or n + self.window <= self.ring)
                and not any(t.requires_grad for t in self.keys + self.values))

    def span(self, layer: int, lo: int, hi: int):
        """Keys and values of positions [lo, hi), in position order (a view where they are contiguous)."""
        if not self._ringed(layer):
            return self.keys[layer][:, :, lo:hi], self.values[layer][:, :, lo:hi]
        R = self.ring
        if hi - lo > R:
            raise RuntimeError(f"internal: positions [{lo}, {hi}) do not fit a ring of {R}")
        a = lo % R
        b = a + (hi - lo)
        if b <= R:
            return self.keys[layer][:, :, a:b], self.values[layer][:, :, a:b]
        return tuple(torch.cat([t[layer][:, :, a:], t[layer][:, :, :b - R]], dim=2) for t in (self.keys, self.values))

    def crop(self, length: int) -> None:
        """Forget everything from `length` on (used for multi-turn rollback and training)."""
        self._check_end(length)
        self.length = length
        self.valid[:, length:] = True
        self.has_padding = not bool(self.valid[:, :length].all())

    def _check_end(self, length: int) -> None:
        """InputError (a ValueError) unless positions [0, length) can be this cache's content: no more than it holds,
        and its sliding layers still hold the window before `length`."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot crop a cache of length {self.length} to {length}; give a length in 0.."
                             f"{self.length}")
        if self.ring is not None and max(0, length - self.window) < self._present_from():
            raise InputError(f"cannot crop a cache of length {self.length} to {length}: its sliding layers keep the "
                             f"last {self.ring} positions written, and position {max(0, length - self.window)} is "
                             "gone; encode the text again from the start (or keep a copy of the cache before going "
                             "on)")

    def prefix(self, length: int, whole: bool = False) -> "KVCache":
        """Positions [0, length) as a cache on the same buffers (no copy; read it, e.g. `put_rows` from it): what
        `crop(length)` would leave, without changing this cache. ValueError where crop would refuse, or, with
        `whole` (for a cache that keeps every position: `put_rows` into one needs them all), where a sliding layer's
        ring no longer holds position 0."""
        self._check_end(length)
        if whole and self._present_from() > 0:
            raise InputError(f"positions [0, {self._present_from()}) of this cache's sliding layers are gone")
        out = self._like(self.keys, self.values, self.valid, self.batch, self.capacity, length, False)
        out.has_padding = not bool(self.valid[:, :length].all())
        out._high, out.view = self._high, True
        return out

    # rows -----------------------------------------------------------------------------------------------
    def _like(self, keys, values, valid, batch: int, capacity: int, length: int, has_padding: bool) -> "KVCache":
        out = KVCache.__new__(KVCache)
        out.keys, out.values, out.valid = keys, values, valid
        out.batch, out.capacity, out.length, out.has_padding = batch, capacity, length, has_padding
        out.sliding, out.window, out.reserve, out.ring = self.sliding, self.window, self.reserve, self.ring
        out._high, out.view = [self.high], False
        return out

    def _held(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """The slots of layer i's buffer t that can hold positions [0, length): a ring's all, else the first
        `length`."""
        return t if self._ringed(i) else t[:, :, :self.length]

    def rows(self, index: torch.Tensor, room: int = 0) -> "KVCache":
        """A copy of the rows `index` [b] (positions [0, length), and up to `room` slots past them where this cache
        has them: a decoder pass's scratch canvas, see `scratch_room`), for decoder passes over part of the batch
        (row compaction); the encoder must not write to it."""
        n = min(self.length + room, self.capacity)

        def held(i, t):
            return t if self._ringed(i) else t[:, :, :n]

        sub = self._like([held(i, t)[index] for i, t in enumerate(self.keys)],
                         [held(i, t)[index] for i, t in enumerate(self.values)],
                         self.valid[index, :n], int(index.numel()), n, self.length, False)
        sub.has_padding = self.has_padding and not bool(sub.valid[:, :self.length].all())
        return sub

    def view_rows(self, lo: int, hi: int) -> "KVCache":
        """Rows [lo, hi) as a cache on the same storage (no copy; writes go to this cache's buffers), with this
        cache's length. Rows [0, hi) of a buffer are addressed from the same pointer for every hi, which is what
        lets the server's CUDA graphs of several batch sizes share one set of buffers."""
        view = self._like([t[lo:hi] for t in self.keys], [t[lo:hi] for t in self.values], self.valid[lo:hi], hi - lo,
                          self.capacity, self.length, self.has_padding)
        view._high, view.view = self._high, True  # the same buffers: the same positions written
        return view

    def move_rows(self, dst, src) -> None:
        """Rows `dst` take the K/V (positions [0, length)) and the padding mask of rows `src` (lists or index
        tensors), all sources read before any is written: a permutation of the rows, or the kept rows moved down.
        Row compaction under CUDA graphs uses it to put the rows still at work into a prefix of the buffers."""
        dev = self.valid.device
        dst, src = (torch.as_tensor(i, dtype=torch.long, device=dev) for i in (dst, src))
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                held = self._held(i, t)
                held[dst] = held[src]  # the right side is gathered into a new tensor first
        self.valid[dst] = self.valid[src]

    def put_rows(self, lo: int, src: "KVCache") -> None:
        """Rows [lo, lo + src.batch) take src's K/V of positions [0, src.length) (those it still holds, as far as
        this layout holds them) and its padding mask; this cache's capacity must hold them. The layouts may
        differ (a ring or not, its size)."""
        L, dev = src.length, self.valid.device
        if L > self.capacity:
            raise RuntimeError(f"internal: {L} positions do not fit a cache of capacity {self.capacity}")
        rows = slice(lo, lo + src.batch)
        for mine, theirs in ((self.keys, src.keys), (self.values, src.values)):
            for i, (t, s) in enumerate(zip(mine, theirs)):
                a = src._held_from(i)
                if self._ringed(i):
                    a = max(a, L - self.ring)
                elif a > 0:
                    raise RuntimeError(f"internal: positions [0, {a}) are gone; copy into a cache with a ring")
                pos = torch.arange(a, L, device=dev)
                t[rows].index_copy_(2, self.slot_index(i, pos), s.index_select(2, src.slot_index(i, pos)))
        self.valid[rows, :L] = src.valid[:, :L]
        self.note_write(0, L)

    def append_rows(self, other: "KVCache") -> None:
        """Concatenate `other`'s rows (a cache of the same length) to this one's, in place; the layouts are made
        the same first (the larger capacity; a ring where either has one)."""
        if other.length != self.length:
            raise RuntimeError(f"internal: appending rows of length {other.length} to a cache of length {self.length}")
        cap = max(self.capacity, other.capacity)
        rings = [r for r in (self.ring, other.ring) if r is not None]
        ring = max(rings) if rings else None
        for c in (self, other):
            if c.ring != ring or c.capacity != cap:
                c._move_positions(ring, cap)
        self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([a, b]) for a, b in zip(self.values, other.values)]
        self.valid = torch.cat([self.valid, other.valid])
        self.batch += other.batch
        self.has_padding = self.has_padding or other.has_padding
        self._high = [max(self.high, other.high)]

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the given batch rows (in place)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.valid = self.valid.index_select(0, idx)
        self.batch = len(keep)
        self.has_padding = not bool(self.valid[:, :self.length].all())

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
