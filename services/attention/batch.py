"""The flattened inputs of one model step, built once and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.attention.scheduler import ScheduledSeq


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

    Sequences with a single new token (decodes) are attended as one padded batch; longer
    chunks (prefills) one by one.
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
        """The same batch with every tensor on `device` (built on the CPU, copied once)."""
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


def _kv_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table, dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots[:length]  # [length]


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


def build_batch(
    scheduled: list[ScheduledSeq], block_size: int, sliding_window: int | None,
    all_logits: bool = False,
) -> StepBatch:
    """Flatten the scheduled chunks; rows of the last token of each finished chunk sample.

    With `all_logits`, every row is a logits row (prompt scoring).
    """
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    decode_rows: list[int] = []
    decode_slots: list[torch.Tensor] = []
    prefills: list[PrefillSlice] = []
    logits_rows: list[int] = []
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        start, row = seq.num_computed_tokens, len(ids)
        ids.extend(seq.token_ids[start:start + n])
        pos = torch.arange(start, start + n)
        positions.append(pos)
        kv_slots = _kv_slots(seq.block_table, start + n, block_size)
        if n == 1:
            decode_rows.append(row)
            decode_slots.append(kv_slots)
        else:
            mask = window_ok(pos[:, None], torch.arange(start + n)[None, :], sliding_window)
            prefills.append(PrefillSlice(row, n, kv_slots, mask))
        if all_logits:
            logits_rows.extend(range(row, row + n))
        elif start + n == seq.num_tokens:
            logits_rows.append(row + n - 1)
    pos_all = torch.cat(positions)
    slot_mapping = torch.cat([
        _kv_slots(s.seq.block_table, s.seq.num_computed_tokens + s.num_new_tokens, block_size)
        [s.seq.num_computed_tokens:] for s in scheduled
    ])
    dec_slots, dec_mask = _pad_decodes(decode_slots, pos_all[decode_rows], sliding_window)
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=pos_all,
        slot_mapping=slot_mapping,
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64),
        decode_kv_slots=dec_slots,
        decode_mask=dec_mask,
        prefills=prefills,
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
    )


def _pad_decodes(
    slots: list[torch.Tensor], q_pos: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not slots:
        return torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.bool)
    lengths = torch.tensor([len(s) for s in slots])
    padded = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)  # [B_d, L_max]
    k_pos = torch.arange(padded.shape[1])[None, :]
    mask = (k_pos < lengths[:, None]) & window_ok(q_pos[:, None], k_pos, window)
    return padded, mask
