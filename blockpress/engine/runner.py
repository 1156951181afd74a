"""The device side of a row batch: the model's passes, the rows' KV cache and the canvas waiting to be encoded.

Shape legend: B rows, S prompt length, C canvas length, V vocab, E the position the batch's cache ends at.

- `passes` is the module itself (eager) or `GraphedPasses` (CUDA graphs of the same passes, replayed on fixed
  buffers). Everything that calls the model goes through here.
- The cache: a Python batch uses one cache for its rows (a new one, from the graphs' pool under CUDA graphs, or
  the caller's). A server (`slots=True`) keeps its rows' cache, under CUDA graphs, in *slots*: one set of
  buffers of R rows x P positions (powers of two, grown by doubling, or just what is needed where doubling would
  not fit in the GPU's spare memory), the batch being their first B rows, a view that starts at the same address
  for every B. Rows that leave are moved down (the kept rows' K/V copied into the lowest slots), joining rows
  are prefilled (eagerly: a prompt's length varies) into the slots after them, so the graphs of every batch size
  stay valid and a server in steady state only replays.
- Row compaction (`compact`): once some rows have stopped denoising, the decoder runs on the others only. Under
  CUDA graphs the rows still at work are swapped into the lowest rows (slots) and the graphs of that batch size
  run on a prefix view; elsewhere their cache rows are copied out (once per set of rows). With one random stream
  for the batch the sampler still needs every row's logits: the stopped rows get zeros.
"""

from __future__ import annotations

import torch

from ..model.cache import KVCache, front_order, rounded_capacity


def spare_bytes(device) -> int | None:
    """Memory a new allocation on `device` can take (CUDA: free, plus what the caching allocator holds unused), or
    None where that is not known."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class Runner:
    def __init__(self, module, passes=None, slots: bool = False, compact: bool = True, max_rows: int = 8,
                 prefixes=None):
        """prefixes: an `engine.prefix.PrefixCache` that prompts encoded alone from position 0 are kept in and
        reused from (None: none; not for a bidirectional encoder, whose prefixes see what follows them)."""
        self.module = module
        self.prefixes = None if getattr(module, "bidirectional_encoder", False) else prefixes
        self.passes = passes if passes is not None else module
        # passes on fixed buffers (CUDA graphs, or a wrapper of them) hand out their self-conditioning input buffer
        self.graphs = self.passes if hasattr(self.passes, "sc_buffer") else None
        self.slots_mode, self.compact, self.max_rows = slots, compact, max_rows
        self.C = module.config.canvas_length
        self.V = module.text.vocab_size
        self.max_positions = module.text.max_position_embeddings
        self.cache: KVCache | None = None
        self.committed: torch.Tensor | None = None  # [B, C] the last committed canvas, not yet encoded
        self._slots: KVCache | None = None
        self._sub = None  # row compaction: (rows, their cache) made once per set of rows
        self.pass_rows = 0  # rows in the last decoder pass

    @property
    def device(self) -> torch.device:
        return self.module.device

    def spare(self) -> int | None:
        return spare_bytes(self.device)

    # ------------------------------------------------------------------ joining and leaving
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None, end: int, capacity: int,
                cache: KVCache | None = None, prompts: list | None = None) -> tuple[int, int]:
        """Encode joining rows' prompts (ids [B, S], left-padded; mask [B, S] bool or None) at positions
        [end - S, end) into their cache rows and add them after the batch's rows. cache: the caller's cache to
        continue (a whole Python batch; its length is end - S). prompts: the rows' prompt ids as host lists, for
        the prefix cache (one row encoded from position 0 takes a kept prefix and is kept). Returns the prefix
        cache's (tokens reused, tokens written) for that row: (0, 0) for any other admission."""
        B, S = ids.shape
        alone = self.prefixes is not None and prompts is not None and B == 1 and end == S and cache is None
        fresh = self.cache is None
        if cache is None:
            if self.slots_mode and self.graphs is not None:  # the rows after the batch's in the slots
                cache = self._slot_rows(B, capacity)
            elif self.graphs is not None:  # the graphs' pool: a few sizes, so a loop over prompts replays
                cache = self.passes.new_cache(B, self._room(B, capacity))
            else:
                cache = self.module.new_cache(B, capacity)
            cache.length = end - S  # positions [end - S, end); everything before is padding for these rows
            if end > S:
                cache.valid[:, :end - S] = False
                cache.has_padding = True
        kept = self.prefixes.match(prompts[0], whole=cache.ring is None) if alone else None
        n = written = 0
        if kept is not None:  # its first n positions' K/V as they were encoded: the rest is one more chunk
            n, part = kept
            cache.put_rows(0, part)
            cache.length, ids = n, ids[:, n:]
        # a server prefills eagerly (a capture here would evict the commit's graph); a Python batch as it encodes
        encode = self.module.encode if self.slots_mode else self.passes.encode
        if ids.shape[1]:
            encode(ids, cache, pad_mask=mask, output=False)
        if alone and not self.prefixes.covers(prompts[0]) and self._keep(prompts[0], cache):
            written = S - n
        if fresh:
            self.cache = cache
        elif self.slots_mode and self.graphs is not None:  # already in place after the batch's rows
            self.cache = self._group(self.cache.batch + B, end, self.cache.has_padding or cache.has_padding)
        else:
            self.cache.append_rows(cache)
        return n, written

    def _keep(self, prompt: list, cache: KVCache) -> bool:
        """Put a copy of a prompt's K/V (positions [0, S) of the 1-row `cache`) in the prefix cache, laid out as a
        cache of S positions is (a ring only where that is smaller): not the whole ring of a server's slots, which
        may have grown for a long request. Only where the device has twice its size free. Whether it was kept."""
        S = len(prompt)
        spare = self.spare()
        if spare is not None and spare <= 2 * self.module.cache_bytes(1, S):
            return False
        entry = self.module.new_cache(1, S)
        try:
            part = cache.prefix(S, whole=entry.ring is None)
        except ValueError:  # the slots' ring bookkeeping (positions written by an earlier group) counts some as gone
            return False
        entry.put_rows(0, part)
        entry.length = S
        return self.prefixes.store(prompt, entry)

    def keep(self, keep: list[int]) -> None:
        """Only the rows `keep` (ascending) stay."""
        if not keep:
            self.cache = self.committed = None
            return
        if self.slots_mode and self.graphs is not None:
            L, n = self.cache.length, len(keep)
            if keep != list(range(n)):
                self.cache.move_rows(list(range(n)), keep)
            self.cache = self._group(n, L, not bool(self._slots.valid[:n, :L].all()))
        else:
            self.cache.select_rows(keep)
        if self.committed is not None:
            self.committed = self.committed[keep]

    # ------------------------------------------------------------------ passes
    def commit(self) -> None:
        """Encode the committed canvas into the cache (only the cache is needed)."""
        self.passes.encode(self.committed, self.cache, output=False)
        self.committed = None

    def sc_out(self, B: int) -> torch.Tensor | None:
        """Where a step writes its self-conditioning logits: the CUDA-graphed decoder's own input buffer."""
        return None if self.graphs is None else self.graphs.sc_buffer(B, self.C)

    def decode(self, cv, pending: torch.Tensor | None = None, capped: bool = True):
        """The decoder's fp32 logits for this step and the rows they are for (None: every row; see
        `step.denoise_step`). pending: a committed canvas encoded in the same pass (`encode_decode`). capped=False:
        the LM head's product before the soft cap instead (model dtype; for the fast sampler, which applies it)."""
        B = len(cv.rows)
        run = [i for i in range(B) if not cv.done_host[i]]
        compact = self.compact and cv.sc is not None and len(run) < B
        self.pass_rows = len(run) if compact else B
        if pending is not None:
            return self.passes.encode_decode(pending, cv.x, self.cache, None, cv.sc, capped=capped), None
        if not compact:
            return self.passes.decode(cv.x, self.cache, cv.sc, capped=capped), None
        k = len(run)
        if self.graphs is not None:  # swap the rows at work into a prefix: the graphs of batch size k
            if run != list(range(k)):
                self._to_front(cv, run)
            if self._sub is None or self._sub[0] != k:
                self._sub = (k, self.cache.view_rows(0, k))
            return self.passes.decode(cv.x[:k], self._sub[1], cv.sc[:k], capped=capped), slice(0, k)
        if self._sub is None or self._sub[0] != run:
            self._sub = (run, self.cache.rows(torch.tensor(run, device=self.device), room=self.C))
        part = self.module.decode(cv.x[run], self._sub[1], cv.sc[run], capped=capped)  # [k, C, V]
        if cv.per_row:
            return part, run
        raw = part.new_zeros(B, *part.shape[1:])  # one stream: every row draws, the stopped ones from zeros
        raw[run] = part
        return raw, None

    def end_canvas(self, committed: torch.Tensor) -> None:
        self.committed, self._sub = committed, None

    def _to_front(self, cv, run: list[int]) -> None:
        """Swap rows so that `run` hold rows [0, len(run)): their K/V, padding, self-conditioning logits (in the
        graphs' buffer) and canvas state."""
        order = front_order(run, len(cv.rows))
        dst = [p for p, o in enumerate(order) if o != p]
        src = [order[p] for p in dst]
        self.cache.move_rows(dst, src)
        cv.sc[dst] = cv.sc[src]
        cv.permute(order)

    def restore(self, rows) -> None:
        """Put the rows back in their `index` order (a Python batch whose rows compaction moved): the cache too."""
        order = [r.index for r in rows]
        if order == sorted(order):
            return
        back = sorted(range(len(order)), key=order.__getitem__)
        self.cache.move_rows(list(range(len(order))), back)
        rows[:] = [rows[i] for i in back]

    # ------------------------------------------------------------------ slots (CUDA graphs, a server)
    def _group(self, n: int, length: int, has_padding: bool) -> KVCache:
        view = self._slots.view_rows(0, n)
        view.length, view.has_padding = length, has_padding
        return view

    def _slot_rows(self, n: int, needed: int) -> KVCache:
        """Slots for n joining rows after the batch's, with room for `needed` positions (the slots are regrown,
        the batch's rows copied, when they lack either): an empty cache on them, every position valid."""
        have = 0 if self.cache is None else self.cache.batch
        slots = self._slots
        if not have and slots is not None:  # a fresh batch: what earlier ones wrote on the slots is no one's
            slots.forget_writes()
        if slots is None or slots.batch < have + n or slots.capacity < needed:
            least = (max(have + n, slots.batch if slots is not None else 0),
                     max(needed, slots.capacity if slots is not None else 0))
            rows = max(least[0], min(self.max_rows, 1 << (have + n - 1).bit_length()))
            cap = rounded_capacity(least[1], self.max_positions)
            spare = self.spare()
            if spare is not None and self.prefixes is not None and self.slot_bytes(rows, cap) > spare:
                self.prefixes.clear()  # the requests' slots come before kept prompts
                spare = self.spare()
            if spare is not None and self.slot_bytes(rows, cap) > spare:  # doubling would not fit: what is needed
                rows, cap = least
            new = self.module.new_cache(rows, cap)
            self.graphs.reserve(rows)  # the graphs' shared logits buffers grow to the slots' rows at once
            if have:  # the batch's rows move with their K/V (positions [0, length)) and padding
                new.put_rows(0, self.cache)
            self._slots = new
            if have:
                self.cache = self._group(have, self.cache.length, self.cache.has_padding)
            self.graphs.release(new)  # the graphs captured on the old buffers, and with them the buffers, go
        view = self._slots.view_rows(have, have + n)
        view.valid.fill_(True)  # a previous occupant's padding
        return view

    def _room(self, rows: int, needed: int) -> int:
        """The capacity of a Python batch's cache from the graphs' pool: `rounded_capacity`, so that prompts of other
        lengths get the buffers (and the captured passes) of an earlier one, or just `needed` where that would not
        fit in the GPU's spare memory."""
        cap = rounded_capacity(needed, self.max_positions)
        spare = self.spare()
        return needed if spare is not None and self.module.cache_bytes(rows, cap) > spare else cap

    def slot_bytes(self, rows: int, capacity: int) -> int:
        """Bytes of slots for rows x capacity positions (K and V of every layer, and the padding mask), and of the
        graphs' shared buffers for as many rows (fp32 logits and self-conditioning logits)."""
        return self.module.cache_bytes(rows, capacity) + rows * self.C * self.V * (4 + self.module.dtype.itemsize)
