"""The `deepep` backend on a CPU machine: its start-up errors (no CUDA, no `deep_ep`,
limits of DeepEP's kernels), the renumbering of experts into DeepEP's slots, and the
expert rank's row transforms, against direct loops. DeepEP itself needs NVIDIA GPUs with
NVSHMEM; it has not run here (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from ep_dispatch.deepep import Slots, packed_rows, unpack_into, weighted_by_slot
from ep_dispatch.deepep_config import (
    DeepEPSettings,
    check_deepep,
    check_slots_fit,
    check_step_budget,
)
from ep_dispatch.placement import Placement
from ep_dispatch.registry import (
    BackendSettings,
    MoESeam,
    WorldSettings,
    create_experts_client,
)
from ep_dispatch.torch_dist import World

BF16 = torch.bfloat16
NO_DEEP_EP = importlib.util.find_spec("deep_ep") is None


DEFAULT = DeepEPSettings()


def check(settings: DeepEPSettings = DEFAULT, world: int = 8, hidden: int = 7168,
          top_k: int = 8, slots: int = 32, dtype: torch.dtype = BF16) -> None:
    check_deepep(settings, world, hidden, top_k, slots, dtype)


def test_a_layout_deepep_runs_passes() -> None:
    check()
    check(DeepEPSettings(mode="normal"), world=16, hidden=128, top_k=16, slots=64)
    check(world=2, hidden=2048)
    check(DeepEPSettings(mode="low_latency"), world=3, slots=512)  # no SWITCH_RANKS there


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"hidden": 1024}, r"low-latency kernels support hidden sizes 2048, 2560, .*, 8192; "
                       r"this model's is 1024; or run --deepep-mode normal"),
    ({"hidden": 128, "settings": DeepEPSettings(mode="low_latency")}, r"this model's is 128"),
    ({"hidden": 7172, "settings": DeepEPSettings(mode="normal")}, r"not a multiple of 8"),
    ({"top_k": 10}, r"at most 9 experts; this model's top-k is 10"),
    ({"hidden": 3584}, r"this model's is 3584"),  # DeepEP PR #731, not merged
    ({"world": 3}, r"normal kernels run on \(2, 4, 8\) ranks in one node; this layout has "
                   r"3 \(attention and expert ranks together\); or run --deepep-mode "
                   r"low_latency"),
    ({"world": 12}, r"more than 8 ranks only as 8 per node; this layout has 12"),
    ({"world": 80}, r"normal kernels run on \(2, 4, 8, 16\) nodes of 8 ranks; this layout "
                    r"has 80"),
    ({"slots": 129}, r"holds 129 experts of one layer; DeepEP's normal kernels on one node "
                     r"allow 128"),
    ({"settings": DeepEPSettings(nvl_bytes=1000)}, r"--deepep-nvl-bytes must be a multiple "
                                                   r"of 128; got 1000"),
    ({"dtype": torch.float32}, r"moves bfloat16 rows; this model computes in torch.float32"),
    ({"settings": DeepEPSettings(max_tokens=600)}, r"--deepep-max-tokens must be 1..511"),
    ({"settings": DeepEPSettings(max_tokens=3), "world": 2},
     r"max-tokens x ranks to be a multiple of 4; 3 x 2"),
    ({"slots": 1025}, r"holds 1025 experts of one layer; DeepEP allows 1024"),
    ({"settings": DeepEPSettings(mode="normal"), "world": 16, "slots": 65},
     r"holds 65 experts of one layer; DeepEP's normal kernels across nodes allow 64"),
    ({"settings": DeepEPSettings(rdma_bytes=2**31), "world": 16},
     r"across nodes take an RDMA buffer below 2 GiB; this one is 2147483648 bytes"),
    ({"settings": DeepEPSettings(mode="fast")}, r"unknown --deepep-mode 'fast'"),
])
def test_what_deepep_cannot_run_is_refused_with_the_reason(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check(**kwargs)


def test_low_latency_tokens_follow_nvshmem_queue_depth(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    check(DeepEPSettings(max_tokens=511))  # (511 + 1) * 2 = 1024, NVSHMEM's default depth
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "512")
    check(DeepEPSettings(max_tokens=252))
    with pytest.raises(ValueError, match=r"must be 1..255 \(DeepEP with NVSHMEM's queue depth "
                                         r"512, NVSHMEM_QP_DEPTH\); got 256"):
        check(DeepEPSettings(max_tokens=256))


def test_the_auto_buffer_across_nodes_stays_below_2_gib() -> None:
    """`auto` sizes the RDMA buffer for both kernels; the normal ones index it with an int
    (what `_buffer` checks once DeepEP gives its size hints)."""
    from ep_dispatch.deepep_config import check_rdma_bytes

    check_rdma_bytes(DeepEPSettings(), 16, 2**31 - 2)
    check_rdma_bytes(DeepEPSettings(mode="low_latency"), 16, 2**32)  # no normal kernels
    check_rdma_bytes(DeepEPSettings(), 8, 2**32)  # one node: NVLink, no RDMA indexing
    with pytest.raises(ValueError, match=r"lower --deepep-max-tokens, or run one "
                                         r"--deepep-mode"):
        check_rdma_bytes(DeepEPSettings(), 16, 2**31 - 1)


def test_a_deep_ep_without_its_v1_buffer_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from ep_dispatch.deepep_config import import_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=None))
    with pytest.raises(ValueError, match=r"needs DeepEP's Buffer \(V1 API\), which this build "
                                         r"of deep_ep lacks"):
        import_deep_ep()


def test_low_latency_slots_must_fit_the_sms() -> None:
    check_slots_fit(DeepEPSettings(), 14 * 132, 132)
    check_slots_fit(DeepEPSettings(mode="normal"), 8 * 256, 132)
    with pytest.raises(ValueError, match=r"at most 14 x 132 SMs experts; the world's 2048 "
                                         r"expert slots"):
        check_slots_fit(DeepEPSettings(), 8 * 256, 132)


def test_low_latency_only_needs_steps_that_fit_its_buffers() -> None:
    check_step_budget(DeepEPSettings(mode="auto", max_tokens=128), 512)  # larger: normal
    check_step_budget(DeepEPSettings(mode="low_latency", max_tokens=128), 128)
    with pytest.raises(ValueError, match=r"holds 128 tokens per rank \(--deepep-max-tokens\) "
                                         r"but a step may run 512"):
        check_step_budget(DeepEPSettings(mode="low_latency", max_tokens=128), 512)


def context(hidden: int) -> tuple[MoESeam, BackendSettings]:
    return (MoESeam([0, 1], 16, hidden_size=hidden, dtype=BF16, top_k=8, device="cuda"),
            BackendSettings(world=WorldSettings(World(("127.0.0.1", 1), 1, 1, rank=0))))


@pytest.mark.skipif(not NO_DEEP_EP, reason="deep_ep is installed here")
def test_without_deep_ep_the_backend_says_what_to_install() -> None:
    with pytest.raises(ValueError, match=r"needs DeepEP \(import deep_ep failed: .*\); build "
                                         r"it from https://github.com/deepseek-ai/DeepEP .*"
                                         r"WITH_DEEPEP=1"):
        create_experts_client("deepep", *context(7168))


def test_limits_are_checked_before_deep_ep_is_needed() -> None:
    with pytest.raises(ValueError, match="this model's is 1000"):
        create_experts_client("deepep", *context(1000))
    with pytest.raises(ValueError, match="moves CUDA tensors"):
        create_experts_client("deepep", MoESeam([0], 8, device="cpu"))


@pytest.mark.parametrize(("flags", "error"), [
    ([], "the deepep dispatch backend moves CUDA tensors: run the services with --device cuda"),
    (["--device", "cuda"], "--device cuda needs an NVIDIA GPU"),
])
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_serve_refuses_deepep_without_a_gpu(flags: list[str], error: str) -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--dispatch-backend",
                          "deepep", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and error in out.stderr, out.stderr


def test_slots_put_each_expert_on_its_rank_after_the_attention_ranks() -> None:
    """2 attention ranks, 3 expert ranks, 8 experts: L = 3 slots per rank; expert e of a
    balanced placement is on expert rank e % 3 at local index e // 3."""
    placement = Placement.balanced([0, 2], 8, 3)
    slots = Slots(placement, num_attention=2, device=torch.device("cpu"))
    assert slots.per_rank == 3 and slots.num_slots == 5 * 3
    ids = torch.arange(8).repeat(4, 1)  # [4 tokens, 8 choices]
    got = slots.route(2, ids)
    want = torch.tensor([(2 + e % 3) * 3 + e // 3 for e in range(8)])
    assert torch.equal(got, want.expand(4, 8))


def test_slots_spread_replicas_over_tokens_as_the_other_backends_do() -> None:
    text = '{"num_ranks": 2, "layers": {"0": [[0, 1], [1], [0]]}}'
    placement = Placement.from_json(text, [0], 3)
    slots = Slots(placement, num_attention=1, device=torch.device("cpu"))
    # rank 0 holds experts 0, 2 (local 0, 1); rank 1 holds 0, 1 (local 0, 1); L = 2
    got = slots.route(0, torch.tensor([[0, 1], [0, 2], [0, 1]]))
    assert got.tolist() == [[1 * 2 + 0, 2 * 2 + 1],  # token 0: expert 0 on its 1st replica
                            [2 * 2 + 0, 1 * 2 + 1],  # token 1: its 2nd (rank 1)
                            [1 * 2 + 0, 2 * 2 + 1]]
    moved = slots.route(0, torch.tensor([[0, 1]]), first_replica=1)  # the next call's
    assert moved.tolist() == [[2 * 2 + 0, 2 * 2 + 1]]  # expert 0 on its 2nd replica


def test_normal_mode_rows_are_weighted_and_summed_per_row() -> None:
    """Each received row: sum over its local slots of weight * f_slot(row); choices on
    other ranks (-1) add nothing. f_slot(x) = (slot + 1) * x + slot."""
    g = torch.Generator().manual_seed(0)
    m, k, num_local, h = 9, 4, 3, 16
    x = torch.randn(m, h, generator=g)
    slots = torch.randint(-1, num_local, (m, k), generator=g)
    slots[0] = -1  # a row with nothing here
    weights = torch.rand(m, k, generator=g)
    per_slot = [int((slots == s).sum()) for s in range(num_local)]

    def fn(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        assert counts == per_slot and rows.shape[0] == sum(counts)
        slot = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        return (slot[:, None] + 1) * rows + slot[:, None]

    want = torch.zeros(m, h)
    for r in range(m):
        for c in range(k):
            s = int(slots[r, c])
            if s >= 0:
                want[r] += weights[r, c] * ((s + 1) * x[r] + s)
    got = weighted_by_slot(x, slots, weights, per_slot, fn)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_low_latency_rows_round_trip_through_the_packed_buffer() -> None:
    packed = torch.arange(3 * 5 * 2, dtype=torch.float32).view(3, 5, 2)  # [L, cap, H]
    counts = [2, 0, 4]
    rows = packed_rows(packed, counts)
    assert torch.equal(rows, torch.cat([packed[0, :2], packed[2, :4]]))
    before = packed.clone()
    unpack_into(packed, counts, -rows)
    assert torch.equal(packed[0, :2], -before[0, :2]) and torch.equal(packed[2, :4],
                                                                      -before[2, :4])
    assert torch.equal(packed[0, 2:], before[0, 2:]) and torch.equal(packed[1], before[1])
    assert packed_rows(packed, [0, 0, 0]).shape == (0, 2)



# The backend's protocol across real processes, over a CPU double of DeepEP's V1 API
# (tests/deepep_fake.py, written from DeepEP's source apart from the backend): 2 attention
# ranks and 2 expert ranks over gloo, rounds that pick the low-latency kernels, the normal
# ones and back, and an attention rank idling while the other works.
HIDDEN, NUM_EXPERTS, TOP_K, LAYERS = 2048, 8, 2, [0, 1]
SETTINGS = DeepEPSettings(mode="auto", max_tokens=16)
ROUNDS = [(5, 0), (40, 7), (0, 0), (3, 20), (16, 16)]  # tokens of attention ranks 0, 1
MODES = ["low_latency", "normal", None, "normal", "low_latency"]  # None: nobody has work


def _scale(layer: int, expert: int) -> float:
    """Expert e of a layer multiplies by a power of two: exact in bfloat16."""
    return 2.0 ** (expert % 4 - 2) * (layer + 1)


def _world(rank: int, port: int) -> World:
    import sys

    from ep_dispatch.torch_dist import join
    from tests.support import deepep_fake

    sys.modules["deep_ep"] = deepep_fake
    world = World(("127.0.0.1", port), 2, 2, rank)
    join(world, 60, "gloo")
    return world


def _expert_rank(rank: int, port: int) -> None:
    from ep_dispatch.deepep import serve_deepep

    world = _world(rank, port)
    placement = Placement.balanced(LAYERS, NUM_EXPERTS, 2)
    local = placement.local_experts(rank - 2)

    def expert_fn(layer: int, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out, start = torch.empty_like(rows), 0
        for k, count in enumerate(counts):
            out[start:start + count] = rows[start:start + count] * _scale(layer,
                                                                          local[layer][k])
            start += count
        return out

    serve_deepep(world, placement, expert_fn, HIDDEN, TOP_K, SETTINGS, torch.device("cpu"))


def _attention_rank(rank: int, port: int, results: object) -> None:
    from ep_dispatch.deepep import DeepEPExperts

    world = _world(rank, port)
    client = DeepEPExperts(world, Placement.balanced(LAYERS, NUM_EXPERTS, 2), HIDDEN, TOP_K,
                           SETTINGS, torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    modes, errors = [], []
    for counts in ROUNDS:
        tokens = counts[rank]
        if not client.begin_step(tokens):
            modes.append(None)
            continue
        modes.append(client.rank.mode)
        if not tokens:
            client.idle_step()
            continue
        for layer in LAYERS:
            x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
            ids = torch.rand(tokens, NUM_EXPERTS, generator=g).topk(TOP_K).indices
            w = torch.rand(tokens, TOP_K, generator=g).to(torch.bfloat16)
            got = client(layer, x, ids, w).float()
            scale = torch.tensor([[_scale(layer, int(e)) for e in row] for row in ids])
            want = ((w.float() * scale)[:, :, None] * x.float()[:, None]).sum(1)
            errors.append(((got - want).abs().max() / want.abs().max()).item())
    results.put((rank, modes, errors))  # type: ignore[attr-defined]


def test_deepep_protocol_across_processes_over_a_cpu_double_of_deep_ep() -> None:
    import multiprocessing as mp

    from common.ports import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    attention = [ctx.Process(target=_attention_rank, args=(r, port, results))
                 for r in range(2)]
    experts = [ctx.Process(target=_expert_rank, args=(r, port), daemon=True) for r in (2, 3)]
    procs = attention + experts
    for p in procs:
        p.start()
    try:
        got = dict((rank, (modes, errors)) for rank, modes, errors in
                   (results.get(timeout=240) for _ in attention))
        for rank in (0, 1):
            modes, errors = got[rank]
            assert modes == MODES, (rank, modes)
            # bfloat16 outputs, summed over 2 experts on different ranks: a few of its ulps
            assert errors and max(errors) < 2e-2, (rank, errors)
        for p in attention:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=30)


def _agreeing_rank(rank: int, port: int, max_tokens: int, results: object) -> None:
    from ep_dispatch.deepep import _agree
    from ep_dispatch.torch_dist import join

    join(World(("127.0.0.1", port), 1, 1, rank), 60, "gloo")
    try:
        _agree(DeepEPSettings(max_tokens=max_tokens), 2048, 8, 4, torch.device("cpu"))
        results.put((rank, None))  # type: ignore[attr-defined]
    except ValueError as exc:
        results.put((rank, str(exc)))  # type: ignore[attr-defined]


@pytest.mark.parametrize("max_tokens", [(128, 128), (128, 64)])
def test_ranks_that_would_size_deepep_differently_name_each_other(max_tokens: tuple) -> None:
    import multiprocessing as mp

    from common.ports import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_agreeing_rank, args=(r, port, max_tokens[r], results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        errors = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if max_tokens[0] == max_tokens[1]:
        assert errors == {0: None, 1: None}
    else:
        want = ("the ranks' DeepEP settings differ (give every rank the same --deepep-* "
                "flags): rank 0: mode auto, max tokens 128, NVLink bytes 0, RDMA bytes 0, "
                "hidden 2048, top-k 8, slots per rank 4; rank 1: mode auto, max tokens 64, "
                "NVLink bytes 0, RDMA bytes 0, hidden 2048, top-k 8, slots per rank 4")
        assert errors == {0: want, 1: want}
