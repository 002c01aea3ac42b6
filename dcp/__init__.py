"""Decode context parallelism: KV sharded along the sequence across an attention group,
partial attention outputs merged by log-sum-exp.

`--dcp-size D [--dcp-interleave I]` makes each attention group D processes. Token `t` of a
sequence has its KV on rank `(t // I) % D` only (`sharding`). So each rank's paged cache
holds 1/D of every sequence, and the group holds D times one rank's context. The block
manager keeps one block table per rank, and `max_model_len` is the group's. Rank 0, the
leader, is the attention service the gateway talks to. It schedules, and before every step
broadcasts the plan to its peers (`services/attention/dcp_peer.py`, `switchyard attention
--dcp-rank r`). The plan (`DcpPlan`) holds each sequence's new tokens, start position and
per-rank block tables. Every rank runs the dense model on all the step's tokens (`batch`),
writes the KV of the tokens it owns, and attends over its own keys
(`KVCache.attend_partial`), giving an output and a log-sum-exp per head. The group then
all-gathers and merges the partials (`merge`).

Only the leader calls the experts. It broadcasts their output with a status row (`group`),
so expert services see each token once. A failed expert call, from a lost expert rank,
drops the step on every rank: the peers and the leader raise `StepAborted`, and the leader
fails its sequences and serves on. Any other failure of a leader's step leaves its peers
waiting, so the leader exits with status 3 and the group is started again whole. The
collectives are torch.distributed's, gloo on the CPU and NCCL on CUDA, in a process group of
the D ranks. So DCP works with the `local` and `rpc` backends; the `torch` backend owns the
default process group. The engine sees the group only through its attention strategy
(`strategy`): `SingleRank`, the group of one, or `DcpLeader`. Each plans the step's batch,
wraps the MoE seam, closes, and says whether a failed step left peers behind.
"""
