"""Decode context parallelism: KV sharded along the sequence across an attention group,
partial attention outputs merged by log-sum-exp.

`--dcp-size D [--dcp-interleave I]` makes each attention group D processes. Token `t` of a
sequence has its KV on rank `(t // I) % D` only (`sharding`), so each rank's paged cache
holds 1/D of every sequence and the group holds D times one rank's context: the block
manager keeps one block table per rank, and `max_model_len` is the group's. Rank 0, the
leader, is the attention service the gateway talks to: it schedules, and before every step
broadcasts the plan (`DcpPlan`: each sequence's new tokens, start position and per-rank
block tables) to its peers (`services/attention/dcp_peer.py`, `switchyard attention
--dcp-rank r`). Every rank runs the dense model on all the step's tokens (`batch`), writes
the KV of the tokens it owns, attends over its own keys (`KVCache.attend_partial`: output
and log-sum-exp per head), and the group all-gathers and merges the partials (`merge`).

Only the leader calls the experts; it broadcasts their output with a status row
(`group`), so expert services see each token once. A failed expert call (a lost expert
rank) drops the step on every rank (`StepAborted` on the peers, and on the leader, which
fails its sequences and serves on); any other failure of a leader's step leaves its peers
waiting, so the leader exits (status 3) and the group is started again whole. The
collectives are torch.distributed's (gloo on the CPU, NCCL on CUDA) in a process group of
the D ranks, so DCP works with the `local` and `rpc` backends (the `torch` backend owns the
default process group). The engine sees the group only through its attention strategy
(`strategy`: `SingleRank`, the group of one, or `DcpLeader`; each plans the step's batch,
wraps the MoE seam, closes, and says whether a failed step left peers behind).
"""
