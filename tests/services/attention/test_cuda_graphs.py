"""Decode graphs (`services/attention/graphs.py`): the padded static-buffer step gives what
the eager step gives. On a CPU the captured step is re-run eagerly (`eager_capture`), which is
what a CUDA graph replay does with the same buffers; the CUDA capture itself runs in
`benchmarks/gpu_check.py`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ep_dispatch.local import LocalExperts
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.graphs import DecodeGraphs, eager_capture, next_power_of_2
from services.model.checkpoint import Checkpoint
from services.model.experts import ExpertBank, all_experts
from tests.support.engines import greedy, prompts, run_to_completion


def config(path: object, **kw: object) -> AttentionConfig:
    return AttentionConfig(**{"model": path, "max_num_batched_tokens": 64,
                              "kv_cache_memory": 1 << 22, **kw})  # type: ignore[arg-type]


def test_graph_steps_generate_what_eager_steps_generate(ckpt: tuple) -> None:
    """Six requests arriving over time: decode steps of 1-6 sequences, padded to 1, 2, 4 rows
    (more than 4: eager), and keys padded to powers of two up to 64 (longer: eager)."""
    path, _ = ckpt
    graphed = build_engine(config(path, cuda_graph_max_batch=4, cuda_graph_max_len=64),
                     graph_capture=eager_capture)
    eager = build_engine(config(path))
    lengths = (3, 9, 30, 17, 5, 12)
    arrivals = {2 * i: [greedy(f"r{i}", p, 24)] for i, p in enumerate(prompts(3, lengths))}
    want = run_to_completion(eager, arrivals)
    assert run_to_completion(graphed, arrivals) == want
    assert graphed.runner.graphs is not None
    assert sorted(graphed.runner.graphs.graphs) == [(1, 64), (2, 64), (4, 64)]  # at start-up
    assert set(graphed.runner.graphs.replays) == {(1, 64), (2, 64), (4, 64)}  # each one used
    # padding rows are not routed tokens: the routing counts are the same
    assert torch.equal(graphed.runner.model.expert_load, eager.runner.model.expert_load)


def test_graph_forward_matches_the_model_row_for_row(qwen3_ckpt: tuple) -> None:
    """One decode step of 3 sequences through a (4, 32) graph vs the eager forward."""
    path, _ = qwen3_ckpt
    engine = build_engine(config(path, cuda_graph_max_batch=8, cuda_graph_max_len=32),
                    graph_capture=eager_capture)
    for i, p in enumerate(prompts(4, (7, 19, 12))):
        engine.add(greedy(f"r{i}", p, 4))
    engine.step()  # the prefills
    batch = engine.runner.batch(engine.scheduler.schedule())
    assert engine.runner.graphs is not None and engine.runner.graphs.fits(batch)
    want = engine.runner.model.forward(batch, engine.runner.kv, engine.runner.experts)  # [3, H]
    got = engine.runner.graphs.forward(batch)
    assert got.shape == want.shape == (3, engine.model_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert engine.runner.graphs.replays == {(4, 32): 1}
    # the scratch slot lies past every block the block manager hands out
    bm = engine.block_manager
    assert engine.runner.kv.k[0].shape[0] == (bm.num_blocks + 1) * bm.block_size
    assert engine.runner.graphs.scratch == bm.num_blocks * bm.block_size


def test_what_a_graph_cannot_run_runs_eagerly(qwen3_ckpt: tuple) -> None:
    """Prefills, and decodes of more rows or keys than any graph: not one replay, and the
    tokens of an engine without graphs."""
    path, _ = qwen3_ckpt
    engine = build_engine(config(path, cuda_graph_max_batch=2, cuda_graph_max_len=16),
                    graph_capture=eager_capture)
    ps = prompts(5, (5, 6, 20))
    for i, p in enumerate(ps):
        engine.add(greedy(f"r{i}", p, 2))
    prefill = engine.runner.batch(engine.scheduler.schedule())
    assert prefill.prefills and not engine.runner.graphs.fits(prefill)
    engine.step()
    decode = engine.runner.batch(engine.scheduler.schedule())  # 3 sequences > 2, and 21 keys > 16
    assert not decode.prefills and not engine.runner.graphs.fits(decode)

    arrivals = {0: [greedy(f"r{i}", p, 6) for i, p in enumerate(ps)]}
    graphed = build_engine(config(path, cuda_graph_max_batch=2, cuda_graph_max_len=16),
                     graph_capture=eager_capture)
    assert run_to_completion(graphed, arrivals) == run_to_completion(build_engine(config(path)),
                                                                     arrivals)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.replays == {}


def test_local_experts_on_device_counts_equal_the_host_path(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    engine = build_engine(config(path))
    cfg = engine.model_config
    bank = ExpertBank(cfg, Checkpoint(path), all_experts(cfg), torch.float32)
    local = LocalExperts(cfg.num_experts, bank.forward, device_fn=bank.forward_on_device)
    g = torch.Generator().manual_seed(0)
    layer = cfg.moe_layer_ids[0]
    for tokens in (1, 5, 33):
        x = torch.randn(tokens, cfg.hidden_size, generator=g)
        ids = torch.rand(tokens, cfg.num_experts, generator=g).topk(cfg.top_k).indices
        w = torch.rand(tokens, cfg.top_k, generator=g)
        torch.testing.assert_close(local.on_device(layer, x, ids, w), local(layer, x, ids, w),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="cannot run on device-side counts"):
        LocalExperts(cfg.num_experts, bank.forward).on_device(layer, x, ids, w)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"cuda_graph_max_batch": 8}, "--cuda-graph-max-batch needs --device cuda"),
    ({"cuda_graph_max_batch": -1}, "must be >= 0"),
    ({"cuda_graph_max_batch": 8, "cuda_graph_max_len": 0}, "--cuda-graph-max-len >= 1"),
])
def test_graph_flags_where_they_cannot_run_are_errors(qwen3_ckpt: tuple, overrides: dict,
                                                      match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_engine(config(qwen3_ckpt[0], **overrides))


def test_graphs_need_in_process_experts(qwen3_ckpt: tuple) -> None:
    with pytest.raises(ValueError, match="needs --dispatch-backend local and no DCP"):
        build_engine(config(qwen3_ckpt[0], cuda_graph_max_batch=8, dispatch_backend="rpc",
                      expert_addresses=(("127.0.0.1", 1),)), graph_capture=eager_capture)


def test_serve_refuses_graphs_on_a_cpu_before_starting_anything() -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard", "serve",
                          "--cuda-graph-max-batch", "8"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "switchyard serve: --cuda-graph-max-batch needs --device cuda" in out.stderr


def test_sizes_round_up_to_powers_of_two() -> None:
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 63, 64, 65)] == \
        [1, 2, 4, 4, 8, 64, 64, 128]


def test_graph_sizes_start_at_128_keys_largest_first(qwen3_ckpt: tuple) -> None:
    engine = build_engine(config(qwen3_ckpt[0]))
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv, runner.experts, 0, max_batch=5, max_len=1000,
                          device=torch.device("cpu"), capture=eager_capture)
    assert graphs.sizes() == [(b, k) for b in (8, 4, 2, 1) for k in (1024, 512, 256, 128)]


def test_a_step_that_cannot_be_captured_is_a_clear_start_up_error(qwen3_ckpt: tuple) -> None:
    def refuse(fn: object) -> None:
        raise RuntimeError("called a synchronizing CUDA operation\nmore detail")

    with pytest.raises(ValueError, match=r"a decode step of 2 sequences and 16 keys cannot be "
                                         r"captured here \(called a synchronizing CUDA "
                                         r"operation\); run without it"):
        build_engine(config(qwen3_ckpt[0], cuda_graph_max_batch=2, cuda_graph_max_len=16),
               graph_capture=refuse)  # type: ignore[arg-type]
