"""Speculative decoding: drafts (`ngram`, `mtp`), and their verification by the target model's
probabilities (`rejection`).

`--speculative-config` (vLLM's JSON, `config`, checked at start-up) turns it on. Before the
scheduler runs, the engine's `Speculator` appends up to k drafts to each running sequence
that may speculate (no penalties or biases, no min_tokens still due; greedy or sampled,
logprobs allowed) and is decoding, so the scheduler gives it a chunk of 1 + k tokens under
the token budget like any chunk; the drafts of a sequence it does not run (preempted, or cut
by the budget) are taken back at once. Under a grammar the drafts are cut at the first it
forbids (llguidance's `validate_tokens`), and each position is verified under the grammar's
mask after the drafts before it (`grammar.allowed_along`).

The runner computes the chunk (its KV written for every position, its rows attended as
decode rows: `dcp.batch.DECODE_ROWS_MAX`), and the engine takes the target's logits at the k
+ 1 positions: `rejection.verify` accepts drafts (greedy: exactly the argmax; sampled: by
the sequence's own sampling distribution, `sampler.sampling_probs`, and its generator), then
appends the accepted drafts and one recovered or bonus token, up to the first that ends the
sequence. The accepted drafts' KV counts as computed; a rejected draft's KV lies beyond
`num_computed_tokens` and is overwritten by the next step, and only computed spans reach the
prefix cache. Nothing else changes: DCP, micro-batches and every backend run the chunk as
any other.

A step of more running sequences than `disable_by_batch_size` (8 for n-gram, 4 for MTP,
measured: docs/benchmarks.md) drafts for none: a busy server is bound by throughput.
Counters: `switchyard:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`
and `_num_accepted_tokens_per_pos{position}`; the step span's `switchyard.drafted` and
`switchyard.accepted`; the dashboard's acceptance rate and mean accepted length.
"""
