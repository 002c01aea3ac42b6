"""One DCP rank's step inputs: every token of the step, but only this rank's keys."""

from __future__ import annotations

import torch

from dcp.sharding import Sharding
from services.attention.batch import PrefillSlice, StepBatch, window_ok
from switchyard.messages import DcpSeqPlan


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
        key_pos = torch.arange(start + n)
        key_pos = key_pos[sharding.owner(key_pos) == rank]  # [L_r] global positions held here
        table = torch.tensor(seq.shard_tables[rank] if seq.shard_tables else [],
                             dtype=torch.int64)
        key_slots = _slots(table, sharding.local_index(key_pos), block_size)  # [L_r]
        new_slots = torch.full((n,), -1, dtype=torch.int64)
        mine = sharding.owner(pos) == rank
        new_slots[mine] = _slots(table, sharding.local_index(pos[mine]), block_size)
        slots.append(new_slots)
        if n == 1:
            decode_rows.append(row)
            decode_keys.append((key_slots, key_pos))
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
    """[B, L_max] slots (padding: slot 0) and mask; a rank may hold no key of a sequence."""
    width = max([1, *(len(s) for s, _ in keys)])
    slots = torch.zeros(len(keys), width, dtype=torch.int64)
    mask = torch.zeros(len(keys), width, dtype=torch.bool)
    for b, (s, p) in enumerate(keys):
        slots[b, :len(s)] = s
        mask[b, :len(s)] = window_ok(q_pos[b], p, window)
    return slots, mask
