"""An expert rank's computation in this process (`ExpertServer.compute`): batches of one
layer share one grouped GEMM, and a bad batch or a failed computation costs only its
callers."""

from __future__ import annotations

import pytest
import torch


def test_expert_server_coalesces_batches_of_one_layer(qwen3_ckpt: tuple) -> None:
    from common.messages import ExpertBatch
    from ep_dispatch.wire import from_wire, to_wire
    from services.expert.config import ExpertConfig
    from services.expert.server import ExpertServer

    server = ExpertServer(ExpertConfig(model=qwen3_ckpt[0], rank=0, num_ranks=1))
    g = torch.Generator().manual_seed(3)
    hidden = server.bank.hidden_size

    def batch(call_id: int, counts: list[int]) -> ExpertBatch:
        return ExpertBatch(call_id, 0, counts, to_wire(torch.randn(sum(counts), hidden,
                                                                   generator=g)))

    a, b = batch(1, [2, 0, 1, 3, 0, 0, 1, 2]), batch(2, [0, 4, 1, 0, 0, 2, 0, 1])
    bad = ExpertBatch(3, 0, [1, 2], a.x)  # wrong number of experts
    calls: list[list[int]] = []
    forward = server.bank.forward

    def counted(layer: int, x: torch.Tensor, counts: list[int], *rest: object
                ) -> torch.Tensor:
        calls.append(list(counts))
        return forward(layer, x, counts, *rest)  # type: ignore[arg-type]

    server.bank.forward = counted  # type: ignore[method-assign]
    together = server.compute([a, bad, b])
    server.bank.forward = forward  # type: ignore[method-assign]
    assert calls == [[2, 4, 2, 3, 0, 2, 1, 3]]  # one grouped GEMM: a's and b's rows per expert
    assert together[1].error and "does not match" in together[1].error
    for merged, single in zip([together[0], together[2]],
                              [server.compute([a])[0], server.compute([b])[0]], strict=True):
        assert merged.call_id == single.call_id
        assert torch.allclose(from_wire(merged.y), from_wire(single.y), atol=1e-6)

    def out_of_memory(*args: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    real, server.bank.forward = server.bank.forward, out_of_memory  # type: ignore[method-assign]
    failed = server.compute([a, bad, b])  # answers every batch, raises nothing
    assert [r.call_id for r in failed] == [1, 3, 2] and all(r.y is None for r in failed)
    oom = "expert computation failed: OutOfMemoryError: CUDA out of memory (a stand-in)"
    assert (failed[0].error, failed[2].error) == (oom, oom)
    assert "does not match" in (failed[1].error or "")
    server.bank.forward = real  # type: ignore[method-assign]
    assert server.compute([a])[0].y is not None  # and it serves the next batch


def test_expert_server_answers_odd_batches_alone(qwen3_ckpt: tuple) -> None:
    """Negative counts that sum right are refused for their caller only; an empty batch
    under a trace context is answered (its tracing used to raise out of the service)."""
    from common.messages import ExpertBatch
    from ep_dispatch.wire import from_wire, to_wire
    from services.expert.config import ExpertConfig
    from services.expert.server import ExpertServer

    server = ExpertServer(ExpertConfig(model=qwen3_ckpt[0], rank=0, num_ranks=1))
    x = torch.randn(2, server.bank.hidden_size)
    good = ExpertBatch(1, 0, [1, 0, 0, 0, 0, 0, 0, 1], to_wire(x))
    negative = ExpertBatch(2, 0, [-1, 0, 0, 0, 0, 0, 0, 3], to_wire(x))
    results = server.compute([good, negative])
    assert results[0].error is None and results[0].y is not None
    assert torch.allclose(from_wire(results[0].y), from_wire(server.compute([good])[0].y))
    assert "does not match" in (results[1].error or "")
    traceparent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    empty = ExpertBatch(3, 0, [0] * 8, to_wire(x[:0]), traceparent)
    [answer] = server.compute([empty])
    assert answer.error is None and answer.y is not None and from_wire(answer.y).shape == (0, 64)


@pytest.mark.parametrize(("ckpt", "quantization"), [("qwen3_ckpt", "none"),
                                                    ("mixtral_ckpt", "w4a4")])
def test_a_rebalanced_placement_loads_beside_the_served_one(
        request: pytest.FixtureRequest, ckpt: str, quantization: str) -> None:
    """`prepare` loads rank 0's share of a new placement version beside version 0: a
    layer whose experts stay shares its tensors, a moved one computes as a bank loaded
    afresh with that share (W4A4 weights with their scales); both versions answer until
    `release` frees the one no connection uses; bad or stale placements are answered
    with their error and change nothing."""
    from common.messages import ExpertBatch, PlacementUpdate
    from ep_dispatch.placement import Placement
    from ep_dispatch.wire import from_wire, to_wire
    from services.expert.config import ExpertConfig
    from services.expert.server import ExpertServer
    from services.model.checkpoint import Checkpoint
    from services.model.experts import ExpertBank

    path = request.getfixturevalue(ckpt)[0]
    server = ExpertServer(ExpertConfig(model=path, rank=0, num_ranks=2,
                                       quantization=quantization))
    cfg = server.model_config
    first, last = cfg.moe_layer_ids[0], cfg.moe_layer_ids[-1]
    old = server.bank
    assert old.experts[first] == list(range(0, cfg.num_experts, 2))
    balanced = Placement.balanced(cfg.moe_layer_ids, cfg.num_experts, 2).replicas
    moved = tuple((0, 1) if e in (1, 5) else (1,) if e in (0, 4) else ranks
                  for e, ranks in enumerate(balanced[first]))  # 1, 5 added; 0, 4 gone
    placement = Placement(2, cfg.num_experts, {**balanced, first: moved})
    ready = server.prepare(PlacementUpdate(1, placement.to_json()))
    assert ready.error is None and ready.load_s > 0
    share = sorted(set(old.experts[first]) - {0, 4} | {1, 5})
    assert ready.experts == {**old.experts, first: share}
    assert server.info().shares == {0: old.experts, 1: ready.experts}
    new = server.versions[1]
    assert new.w_down[last] is old.w_down[last]  # kept, not read again
    checkpoint = Checkpoint(path)
    fresh = ExpertBank(cfg, checkpoint, ready.experts, torch.float32, quantization)
    checkpoint.close()
    g = torch.Generator().manual_seed(5)
    counts = [3, 1, 0, 2][:len(share)]
    rows = torch.randn(sum(counts), cfg.hidden_size, generator=g)
    if fresh.quantization:
        from moe_kernels.mxfp4 import quantize
        rows = quantize(rows).to_rows()
    batch = ExpertBatch(7, first, counts, to_wire(rows), version=1)
    [got] = server.compute([batch])
    want = fresh.forward(first, rows, counts)
    assert got.error is None and torch.equal(from_wire(got.y), want)
    [v0] = server.compute([ExpertBatch(8, first, counts, to_wire(rows))])
    assert v0.error is None and not torch.equal(from_wire(v0.y), want)  # its own experts
    assert "not a placement" in (server.prepare(PlacementUpdate(2, "{}")).error or "")
    assert server.prepare(PlacementUpdate(1, "{}")).error is None  # held: answered at once
    server.release({0, 1})
    assert sorted(server.versions) == [0, 1]
    server.release({1})
    assert sorted(server.versions) == [1]
    [gone] = server.compute([ExpertBatch(9, first, counts, to_wire(rows))])
    assert "placement version 0 is not held here" in (gone.error or "")
    stale = server.prepare(PlacementUpdate(0, placement.to_json()))
    assert "older than the newest" in (stale.error or "") and sorted(server.versions) == [1]
