"""The hierarchical cache's host tier: every token of a compressed layer, in its storage dtype, with key summaries
per block of positions, and the choice of which tokens to recall into the reserved slots. numpy only; the runtime
(``edgec/runtime/recall_state.py``) owns the state and calls this between steps.

The tiers (docs/kv-cache.md, "Recall"):
- the slots the graph reads: per KV head, ``capacity - R`` slots that the op fills and evicts as always, then
  ``R = recall × recall_block`` reserved slots that the runtime writes and the op never evicts (score +inf, the
  op's mark for protected) — they are replaced at the next recall;
- the host tier: every token the layer has seen, at its position, as the op stored it (same bytes and scales). It
  is inclusive — a token is copied there when it enters the slots, not when it leaves them — so no eviction has to
  be predicted or reported by the graph: whatever the op evicts (the ArgMin slot of a step, a chunk's losers, a
  pruning policy's drops) is already there. ``HostTier.add`` takes the new tokens after each call;
- summaries: per block of ``recall_block`` positions and KV head, the mean of its dequantized keys (Quest's
  per-channel min/max bound was measured too and recalled fewer of a passkey's tokens: docs/kv-cache.md);
- recall: blocks are ranked by ``q · mean`` against the last query (the highest of the KV head's query heads);
  the tokens of the best blocks that are not in the op's own slots fill the reserved ones, in block order.
  Sinks, recent-window and protected tokens that sit in the reserved slots go first, so what the op would never
  evict is never dropped by a recall either.
"""

from __future__ import annotations

import numpy as np

from edgec.kvcache.quantize import dequantize

GROWTH = 1024  # the host tier grows by at least this many positions at a time


def block_scores(query: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """query [Hq, D], mean [Hkv, blocks, D] (each block's mean key) → [Hkv, blocks]: q · mean key, the highest over
    the query heads that read the KV head."""
    kv_heads = mean.shape[0]
    grouped = query.reshape(kv_heads, -1, query.shape[-1]).astype(np.float32)  # [Hkv, G, D]
    # einsum's own loop, not BLAS: a product this small gains nothing from BLAS threads, which stall on a busy machine
    return np.einsum("hgd,hbd->hgb", grouped, mean).max(axis=1)


def choose(score: np.ndarray, candidate: np.ndarray, forced: np.ndarray, block: int, slots: int) -> np.ndarray:
    """The positions to recall, [Hkv, slots] (-1 = nothing): the candidate tokens ([Hkv, N] bool: in the host
    tier, not in the op's slots) of the blocks with the highest ``score`` [Hkv, blocks], best block first;
    ``forced`` candidates (never to be dropped) first of all."""
    kv_heads, length = candidate.shape
    blocks = score.shape[1]
    padded = np.zeros((kv_heads, blocks * block), bool)
    padded[:, :length] = candidate
    counts = padded.reshape(kv_heads, blocks, block).sum(-1)
    urgent = np.zeros((kv_heads, blocks * block), bool)
    urgent[:, :length] = forced & candidate
    key = np.where(counts > 0, score, -np.inf)
    key = np.where(urgent.reshape(kv_heads, blocks, block).any(-1), np.inf, key)
    order = np.argsort(-key, axis=-1, kind="stable")
    # enough of the best blocks to fill the slots on every head
    taken = np.cumsum(np.take_along_axis(counts, order, -1), axis=-1)
    needed = int(np.minimum((taken < slots).sum(-1) + 1, blocks).max()) if blocks else 0
    tokens = (order[:, :needed, None] * block + np.arange(block)).reshape(kv_heads, -1)  # [Hkv, needed·block]
    rows = np.arange(kv_heads)[:, None]
    valid = padded[rows, tokens]
    rank = np.where(valid, np.where(urgent[rows, tokens], 0, 1), 2)
    picked = np.take_along_axis(tokens, np.argsort(rank, axis=-1, kind="stable"), -1)[:, :slots]
    picked_valid = np.take_along_axis(valid, np.argsort(rank, axis=-1, kind="stable"), -1)[:, :slots]
    chosen = np.full((kv_heads, slots), -1, np.int64)
    chosen[:, : picked.shape[1]] = np.where(picked_valid, picked, -1)
    return chosen


class HostTier:
    """Every token one compressed layer has seen, by position: its stored k, v (and scales) per KV head, whether
    it is there (``present``), whether it was protected, and the mean key of each block."""

    def __init__(self, num_kv_heads: int, head_dim: int, compression, stored: dict[str, tuple[tuple, type]]) -> None:
        """``stored``: state name → (trailing shape, numpy dtype) of the tensors kept (k, v, k_scale, v_scale).
        Rows are KV heads (the runtime stacks every compressed layer's)."""
        self.heads, self.dim, self.compression = num_kv_heads, head_dim, compression
        self.block = compression.recall_block
        self._layout = stored
        self.clear()

    def clear(self) -> None:
        self.length = 0  # positions [0, length) have room
        self.arrays = {name: np.zeros((self.heads, 0, *shape), dtype) for name, (shape, dtype) in self._layout.items()}
        self.present = np.zeros((self.heads, 0), bool)
        self.protected = np.zeros((self.heads, 0), bool)
        self.mean = np.zeros((self.heads, 0, self.dim), np.float32)

    @property
    def blocks(self) -> int:
        return self.mean.shape[1]

    def nbytes(self) -> int:
        """Host bytes held: the stored tokens, their flags and the summaries."""
        held = sum(array.nbytes for array in self.arrays.values()) + self.present.nbytes + self.protected.nbytes
        return held + self.mean.nbytes

    def _grow(self, positions: int) -> None:
        if positions <= self.present.shape[1]:
            return
        room = -(-max(positions, 2 * self.present.shape[1], GROWTH) // self.block) * self.block

        def grown(array: np.ndarray, size: int) -> np.ndarray:
            bigger = np.zeros((array.shape[0], size, *array.shape[2:]), array.dtype)
            bigger[:, : array.shape[1]] = array
            return bigger

        self.arrays = {name: grown(array, room) for name, array in self.arrays.items()}
        self.present, self.protected = grown(self.present, room), grown(self.protected, room)
        self.mean = grown(self.mean, room // self.block)

    def add(self, heads: np.ndarray, positions: np.ndarray, values: dict[str, np.ndarray], protected) -> None:
        """Tokens entering the slots: ``heads``/``positions`` [n] (one entry per head and token), ``values``
        by state name [n, ...] in the storage dtype, ``protected`` [n] bool (or a bool for all)."""
        if len(positions) == 0:
            return
        self._grow(int(positions.max()) + 1)
        for name, array in self.arrays.items():
            array[heads, positions] = values[name]
        self.present[heads, positions] = True
        self.protected[heads, positions] = protected
        self.length = max(self.length, int(positions.max()) + 1)
        self._summarize(np.unique(positions // self.block))

    def _summarize(self, blocks: np.ndarray) -> None:
        """Recompute the mean key of ``blocks`` from the stored keys (a block with no token: 0, never chosen)."""
        compression = self.compression
        for first in range(0, len(blocks), 256):  # bounded temporaries for a long prompt
            chosen = blocks[first : first + 256]
            index = (chosen[:, None] * self.block + np.arange(self.block)).reshape(-1)
            scale = self.arrays["k_scale"][:, index] if "k_scale" in self.arrays else None
            keys = dequantize(self.arrays["k"][:, index], scale, compression.dtype, compression.group)
            keys = keys.reshape(self.heads, len(chosen), self.block, self.dim)
            present = self.present[:, index].reshape(self.heads, len(chosen), self.block, 1)
            count = present.sum(axis=2)
            self.mean[:, chosen] = np.where(present, keys, 0).sum(axis=2) / np.maximum(count, 1)

    def recall(
        self, query: np.ndarray, resident: np.ndarray, newest: int, slots: int, lowest: np.ndarray | None = None
    ) -> np.ndarray:
        """Positions to place in the reserved slots, [Hkv, slots] (-1 = none): ``query`` [Hq, D] is the layer's
        last query, ``resident`` [Hkv, M] the positions in the op's own slots (-1 = empty); ``lowest`` [Hkv]: the
        lowest position the next query can see on each row (a sliding-window layer masks older ones)."""
        length = self.length
        candidate = self.present[:, :length].copy()
        if lowest is not None:
            candidate &= np.arange(length) >= lowest[:, None]
        heads, columns = np.nonzero((resident >= 0) & (resident < length))
        candidate[heads, resident[heads, columns]] = False
        compression = self.compression
        position = np.arange(length)
        forced = self.protected[:, :length] | (position < compression.sink) | (position > newest - compression.window)
        blocks = -(-length // self.block)
        first = np.zeros(self.heads, np.int64) if lowest is None else np.clip(lowest // self.block, 0, blocks)
        grouped = query.reshape(self.heads, -1, query.shape[-1])
        score = np.full((self.heads, blocks), -np.inf, np.float32)
        for start in np.unique(first):  # rows that see the same blocks (a sliding window's last ones) together
            rows = first == start
            score[rows, start:] = block_scores(
                grouped[rows].reshape(-1, query.shape[-1]), self.mean[rows, start:blocks]
            )
        return choose(score, candidate, forced, self.block, slots)
