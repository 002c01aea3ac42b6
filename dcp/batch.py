"""The flattened inputs of one model step, built once and shared by every layer. They hold
every token of the step, but only this rank's keys. A single rank is the DCP group of one
(`Sharding(1, 1)`), which holds every key."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.messages import DcpSeqPlan
from dcp.sharding import Sharding

# A chunk of at most this many tokens of a sequence whose KV is there already, its last
# token and up to 8 speculative drafts, is attended as that many decode rows. That runs the
# decode path's batched kernels instead of one prefill slice a sequence.
DECODE_ROWS_MAX = 9


@dataclass(frozen=True)
class PrefillSlice:
    """One sequence's query chunk: rows [start, start + length) attend to `kv_slots`."""

    start: int
    length: int
    kv_slots: torch.Tensor  # [L] int64 KV-cache slots of the sequence's tokens 0..L-1
    mask: torch.Tensor  # [length, L] bool, True where a query may attend to a key


@dataclass(frozen=True)
class StepBatch:
    """Inputs of one step: T new tokens of B sequences, flattened.

    Sequences with a single new token (decodes), and the short chunks of speculation's
    verify steps (`DECODE_ROWS_MAX`), are attended as one padded batch, a row each. Longer
    chunks (prefills) are attended one by one.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's KV is written
    decode_rows: torch.Tensor  # [B_d] int64 rows of decode tokens
    decode_kv_slots: torch.Tensor  # [B_d, L_max] int64 (padding points at slot 0)
    decode_mask: torch.Tensor  # [B_d, L_max] bool, True for real (and in-window) keys
    prefills: list[PrefillSlice]
    logits_rows: torch.Tensor  # [S] int64 rows whose logits are sampled (last token of a seq)
    foreign_slots: bool = False  # some slot_mapping entries are -1 (another DCP rank's)
    real_rows: torch.Tensor | None = None  # [T] int64: 0 for a CUDA graph's padding rows
    # A warm-up's rows [W] int64 and the experts they go to [W, K] int64, instead of the
    # router's choice (`Engine.add`): one step that reaches every expert rank.
    forced_routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: str) -> StepBatch:
        """The same batch with every tensor on `device`. It is built on the CPU and copied
        once."""
        if device == "cpu":
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return StepBatch(
            move(self.input_ids), move(self.positions), move(self.slot_mapping),
            move(self.decode_rows), move(self.decode_kv_slots), move(self.decode_mask),
            [PrefillSlice(p.start, p.length, move(p.kv_slots), move(p.mask))
             for p in self.prefills],
            move(self.logits_rows), self.foreign_slots,
            None if self.real_rows is None else move(self.real_rows),
            None if self.forced_routing is None else
            (move(self.forced_routing[0]), move(self.forced_routing[1])))


def window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query may attend to: causal, and within the sliding window if any.

    Args:
        q_pos: int64 query positions, broadcastable against `k_pos` (e.g. [Q, 1]).
        k_pos: int64 key positions (e.g. [1, K]).
        window: the model's sliding window in tokens, or None.

    Returns:
        bool mask of the broadcast shape (e.g. [Q, K]), True where attended.
    """
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window
    return ok




def build_rank_batch(seqs: list[DcpSeqPlan], rank: int, sharding: Sharding, block_size: int,
                     sliding_window: int | None, logits_rows: list[int]) -> StepBatch:
    """Flatten a step plan for `rank`.

    Queries are the step's new tokens, the same on every rank. Keys are the positions this
    rank holds, addressed through its block table; `slot_mapping` is -1 for new tokens
    another rank stores. `logits_rows` are passed through (only the leader samples).
    """
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, positions)
    prefills: list[PrefillSlice] = []
    for seq in seqs:
        n, start, row = len(seq.token_ids), seq.start, len(ids)
        ids.extend(seq.token_ids)
        pos = torch.arange(start, start + n)
        positions.append(pos)
        table = torch.tensor(seq.shard_tables[rank] if seq.shard_tables else [],
                             dtype=torch.int64)
        if sharding.size == 1:  # every key is held here, at its own index
            key_pos = torch.arange(start + n)  # [L]
            key_slots = _slots(table, key_pos, block_size)  # [L]
            slots.append(key_slots[start:])  # the new tokens are the last keys
        else:
            key_pos = torch.arange(start + n)
            key_pos = key_pos[sharding.owner(key_pos) == rank]  # [L_r] positions held here
            key_slots = _slots(table, sharding.local_index(key_pos), block_size)  # [L_r]
            new_slots = torch.full((n,), -1, dtype=torch.int64)
            mine = sharding.owner(pos) == rank
            new_slots[mine] = _slots(table, sharding.local_index(pos[mine]), block_size)
            slots.append(new_slots)
        if n == 1:
            decode_rows.append(row)
            decode_keys.append((key_slots, key_pos))
        elif start > 0 and n <= DECODE_ROWS_MAX:  # a verify step's chunk: its rows as
            for i in range(n):  # decodes, each over the keys up to its own position
                decode_rows.append(row + i)
                held = key_pos <= start + i
                decode_keys.append((key_slots[held], key_pos[held]))
        else:
            mask = window_ok(pos[:, None], key_pos[None, :], sliding_window)  # [n, L_r]
            prefills.append(PrefillSlice(row, n, key_slots, mask))
    pos_all = torch.cat(positions)
    dec_slots, dec_mask = _pad(decode_keys, pos_all[decode_rows], sliding_window)
    slot_mapping = torch.cat(slots)
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64), positions=pos_all,
        slot_mapping=slot_mapping, decode_rows=torch.tensor(decode_rows, dtype=torch.int64),
        decode_kv_slots=dec_slots, decode_mask=dec_mask, prefills=prefills,
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        foreign_slots=bool((slot_mapping < 0).any()))  # decided on the host, once


def _slots(table: torch.Tensor, local: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[local // block_size] * block_size + local % block_size


def _pad(keys: list[tuple[torch.Tensor, torch.Tensor]], q_pos: torch.Tensor,
         window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L_max] slots, padded with slot 0, and the mask. A rank may hold no key of a
    sequence."""
    if not keys:
        return torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.bool)
    lengths = torch.tensor([len(s) for s, _ in keys])  # [B]
    slots = torch.nn.utils.rnn.pad_sequence([s for s, _ in keys], batch_first=True)
    k_pos = torch.nn.utils.rnn.pad_sequence([p for _, p in keys], batch_first=True)
    if slots.shape[1] == 0:  # no sequence has a key on this rank: one padding column
        slots, k_pos = slots.new_zeros(len(keys), 1), k_pos.new_zeros(len(keys), 1)
    real = torch.arange(slots.shape[1])[None, :] < lengths[:, None]  # [B, L_max]
    return slots, real & window_ok(q_pos[:, None], k_pos, window)
