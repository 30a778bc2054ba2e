"""KV-cache bookkeeping for the torch rollout engine: prefill, the decode batch, the prefix cache.

Job: run a left-padded prefill and hand back each sequence's own KV; keep the rows being
decoded as one left-padded HF `DynamicCache` that rows join (after their prefill) and leave
(when finished) between steps, so new requests do not wait for a whole batch to end
(continuous batching); remember the KV of recent prompts (exact match, LRU).
Boundary: no sampling, no requests, no threads; rows are opaque objects kept aligned with
the cache. Full-attention decoder models only (no sliding-window cache layers).
Why left padding with explicit position ids: RoPE is applied before keys are cached, so a
row's cached keys do not depend on how much padding sits to its left; padded slots are
masked out and hold zeros. Rows of different lengths can therefore be concatenated and
dropped freely, and each row computes what it would compute alone (up to float rounding).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each `[rows, kv_heads, length, head_dim]`."""

SPARE_STEPS = 32
"""Decode steps of KV room allocated ahead, so most steps write in place."""


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - t.shape[-2]
    return F.pad(t, (0, 0, pad, 0)) if pad else t


def stack_rows(rows: list[KV]) -> tuple[KV, torch.Tensor]:
    """Left-pad single-row KVs to one length; returns the stacked KV and its `[n, L]` mask."""
    length = max(kv[0][0].shape[-2] for kv in rows)
    stacked = [
        (
            torch.cat([_left_pad(kv[i][0], length) for kv in rows]),
            torch.cat([_left_pad(kv[i][1], length) for kv in rows]),
        )
        for i in range(len(rows[0]))
    ]
    device = rows[0][0][0].device
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    for r, kv in enumerate(rows):
        mask[r, length - kv[0][0].shape[-2] :] = 1
    return stacked, mask


@torch.inference_mode()
def prefill(model: Any, seqs: list[list[int]], device: torch.device) -> tuple[list[KV], torch.Tensor]:
    """Run `seqs` through `model` in one left-padded forward.

    Returns each sequence's own KV (unpadded, `[1, H, len, D]`, not views of the batch) and
    the logits at each sequence's last position, `[n, V]` float32.
    """
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, length - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[r, length - len(s) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        past_key_values=cache, use_cache=True, logits_to_keep=1,
    )
    per_row = [
        [(layer.keys[r : r + 1, :, length - len(s) :].clone(), layer.values[r : r + 1, :, length - len(s) :].clone())
         for layer in cache.layers]
        for r, s in enumerate(seqs)
    ]
    return per_row, out.logits[:, -1].float()


class _GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare capacity instead of re-concatenating every step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._fill(keys, values, spare)

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        b, h, length, d = keys.shape
        self._kbuf = keys.new_zeros(b, h, length + spare, d)
        self._vbuf = values.new_zeros(b, h, length + spare, values.shape[-1])
        self._kbuf[:, :, :length] = keys
        self._vbuf[:, :, :length] = values
        self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        length, n = self.keys.shape[-2], key_states.shape[-2]
        if length + n > self._kbuf.shape[-2]:
            self._fill(self.keys, self.values, max(length, 64))
        self._kbuf[:, :, length : length + n] = key_states
        self._vbuf[:, :, length : length + n] = value_states
        self.keys, self.values = self._kbuf[:, :, : length + n], self._vbuf[:, :, : length + n]
        return self.keys, self.values


class DecodeBatch:
    """The rows being decoded: one left-padded cache, its mask, each row's next input and position.

    Invariant: a live row's cache holds its context minus the last sampled token, which is
    the row's next input; `rows` lists the caller's objects of the live rows, in batch order.
    Rows that leave are only marked dead (still computed, never reported) until a quarter of
    the slots are dead or rows join, so finishing rows do not copy the cache every step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.rows: list[Any] = []
        self._slots: list[Any | None] = []
        self._live = torch.zeros(0, dtype=torch.long, device=self.device)
        self._layers: list[_GrowingLayer] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._inputs = torch.zeros(0, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Any], kvs: list[KV], inputs: list[int]) -> None:
        """Join rows whose cache is `kvs[i]` (single-row, unpadded) and next input `inputs[i]`."""
        if not rows:
            return
        self._compact()
        kv, mask = stack_rows(kvs)
        positions = mask.sum(-1)
        if self._slots:
            length = max(self._mask.shape[1], mask.shape[1])
            kv = [
                (torch.cat([_left_pad(layer.keys, length), _left_pad(k, length)]),
                 torch.cat([_left_pad(layer.values, length), _left_pad(v, length)]))
                for layer, (k, v) in zip(self._layers, kv)
            ]
            mask = torch.cat([F.pad(self._mask, (length - self._mask.shape[1], 0)), F.pad(mask, (length - mask.shape[1], 0))])
            positions = torch.cat([self._positions, positions])
        self._layers = [_GrowingLayer(k, v, SPARE_STEPS) for k, v in kv]
        self._mask, self._positions = mask, positions
        self._inputs = torch.cat([self._inputs, torch.tensor(inputs, dtype=torch.long, device=self.device)])
        self._set_slots(self._slots + list(rows))

    def keep(self, keep: list[int]) -> None:
        """Keep only the live rows at indices `keep` (increasing) of `rows`."""
        if len(keep) == len(self.rows):
            return
        kept = set(keep)
        slots = list(self._slots)
        for i, slot in enumerate(self._live.tolist()):
            if i not in kept:
                slots[slot] = None
        self._set_slots(slots)
        if not self.rows:
            self.clear()
        elif 4 * (len(self._slots) - len(self.rows)) >= len(self._slots):
            self._compact()

    def _set_slots(self, slots: list[Any | None]) -> None:
        self._slots = slots
        self.rows = [s for s in slots if s is not None]
        self._live = torch.tensor([i for i, s in enumerate(slots) if s is not None], dtype=torch.long, device=self.device)

    def _compact(self) -> None:
        """Drop dead slots and the all-padding columns at the left."""
        if len(self.rows) == len(self._slots):
            return
        idx = self._live
        mask = self._mask[idx]
        start = int((mask.sum(0) > 0).nonzero()[0])
        self._layers = [
            _GrowingLayer(layer.keys[idx, :, start:], layer.values[idx, :, start:], SPARE_STEPS) for layer in self._layers
        ]
        self._mask = mask[:, start:]
        self._positions = self._positions[idx]
        self._inputs = self._inputs[idx]
        self._set_slots(self.rows)

    @torch.inference_mode()
    def forward(self, model: Any) -> torch.Tensor:
        """Feed each row's next input; returns the logits for the token after it, `[live, V]` float32."""
        self._mask = F.pad(self._mask, (0, 1), value=1)
        cache = DynamicCache()
        cache.layers = list(self._layers)
        out = model(
            input_ids=self._inputs.unsqueeze(1), attention_mask=self._mask,
            position_ids=self._positions.unsqueeze(1), past_key_values=cache, use_cache=True,
        )
        self._positions = self._positions + 1
        logits = out.logits[:, -1].float()
        return logits if len(self.rows) == len(self._slots) else logits[self._live]

    def set_inputs(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the live rows become their next inputs."""
        self._inputs[self._live] = tokens.to(self.device, torch.long)


class PrefixCache:
    """Exact-prompt LRU: prompt ids -> (KV after prefill, logits at the last prompt position).

    `hits` / `misses` count lookups; `clear()` after a weight update, since stored KV was
    computed with the old weights.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[KV, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: tuple[int, ...]) -> tuple[KV, torch.Tensor] | None:
        entry = self._entries.get(prompt)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(prompt)
        return entry

    def put(self, prompt: tuple[int, ...], kv: KV, logits: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._entries[prompt] = (kv, logits)
        self._entries.move_to_end(prompt)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
