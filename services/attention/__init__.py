"""Attention service: scheduler, paged KV cache, attention, router and sampling, the engine
core.

Its modules:

- `builder`: the composition root, which checks a config and builds and wires every part.
- `engine`: the stepper: add, abort, step, append.
- `spec_decode`: speculative decoding: its flag, n-gram and MTP drafts, verification.
- `runner`: runs the model over a step: its inputs on the device, one batch or
  micro-batches, graphs, the expert seam's step protocol, logits.
- `micro_batches`: the split, and `auto`'s tuner.
- `timeline`: a pipelined step's intervals.
- `scheduler`.
- `block_manager`: block tables on every DCP rank, reference counts, the free queue.
- `prefix_cache`: spans of blocks, by the chain hash of their tokens.
- `kv_cache`: paged attention.
- `mla`: DeepSeek's latent attention over the latent cache.
- `batch`: a step's plan.
- `model`: everything but the experts.
- `weights`: the dense weights as read.
- `router`: softmax, group-limited and biased sigmoid routing.
- `sampler`.
- `grammar`: structured outputs' matchers.
- `warmup`: the readiness request's prompt and routing.
- `graphs`: CUDA-graph decode steps.
- `server`.
- `dcp_peer`: DCP ranks > 0.
"""
