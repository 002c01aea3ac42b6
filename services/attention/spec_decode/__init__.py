"""Speculative decoding: drafts (`ngram`, `mtp`), and their verification by the target model's
probabilities (`rejection`).

`--speculative-config`, vLLM's JSON, turns it on; `config` checks it at start-up. Before the
scheduler runs, the engine's `Speculator` appends up to k drafts to each running sequence
that is decoding and may speculate. A sequence may speculate when it has no penalties or
biases and no min_tokens still due; it may be greedy or sampled, and logprobs are allowed.
The scheduler then gives it a chunk of 1 + k tokens under the token budget, like any chunk.
The drafts of a sequence the scheduler does not run, because it was preempted or cut by the
budget, are taken back at once. Under a grammar the drafts are cut at the first one it
forbids (llguidance's `validate_tokens`), and each position is verified under the grammar's
mask after the drafts before it (`grammar.allowed_along`).

The runner computes the chunk. Its KV is written for every position, and its rows are
attended as decode rows (`dcp.batch.DECODE_ROWS_MAX`). The engine takes the target's logits
at the k + 1 positions, and `rejection.verify` accepts drafts. A greedy sequence accepts
exactly the argmax; a sampled one accepts by its own sampling distribution,
`sampler.sampling_probs`, and its generator. The engine then appends the accepted drafts and
one recovered or bonus token, up to the first that ends the sequence. The accepted drafts'
KV counts as computed. A rejected draft's KV lies beyond `num_computed_tokens` and is
overwritten by the next step, and only computed spans reach the prefix cache. Nothing else
changes: DCP, micro-batches and every backend run the chunk like any other.

A step with more running sequences than `disable_by_batch_size` drafts for none, because a
busy server is bound by throughput. The limits, 8 for n-gram and 4 for MTP, were measured
(docs/benchmarks.md). The counters are `switchyard:spec_decode_num_drafts`,
`_num_draft_tokens`, `_num_accepted_tokens` and `_num_accepted_tokens_per_pos{position}`.
The step span carries `switchyard.drafted` and `switchyard.accepted`, and the dashboard shows
the acceptance rate and mean accepted length.
"""
