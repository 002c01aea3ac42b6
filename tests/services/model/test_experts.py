"""`ExpertBank.forward_layer`: a local MoE layer as one compiled call gives the bits of
the parts it replaces (`ep_dispatch.local`'s layout, `forward`, combine), float32 and
W4A4, and records the same per-expert and dispatch metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ep_dispatch.local import LocalExperts
from ep_dispatch.metrics import _histogram
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.panels import MXFP4Panels, PanelWeights
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig
from services.model.experts import ExpertBank, all_experts
from tests.support import checkpoints


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sizes the W4A4 kernel's panels take (K a multiple of 128)."""
    path = tmp_path_factory.mktemp("qwen3-128")
    checkpoints.build(checkpoints.qwen3_moe_config(hidden_size=128, moe_intermediate_size=128),
                      path, seed=4)
    return path


@pytest.mark.parametrize("quantization", ["none", "w4a4"])
def test_a_layer_in_one_call_is_its_parts_bit_for_bit(ckpt: Path, quantization: str) -> None:
    assert cpu_kernels() is not None, "the CPU kernels did not build (gcc and ninja are here)"
    cfg = ModelConfig.from_dir(ckpt)
    with Checkpoint(ckpt) as checkpoint:
        bank = ExpertBank(cfg, checkpoint, all_experts(cfg), torch.float32, quantization)
    layer = cfg.moe_layer_ids[0]
    assert isinstance(bank.w_gate_up[layer], MXFP4Panels if quantization == "w4a4"
                      else PanelWeights)
    q = None if quantization == "none" else quantization
    parts = LocalExperts(cfg.num_experts, bank.forward, q)
    whole = LocalExperts(cfg.num_experts, bank.forward, q, layer_fn=bank.forward_layer)
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 5, 37):
        x = torch.randn(tokens, cfg.hidden_size, generator=g)
        scores = torch.rand(tokens, cfg.num_experts, generator=g)
        weights, ids = scores.topk(cfg.top_k, dim=-1)
        before = [_histogram(s, "local").collect()[0].samples for s in ("dispatch", "combine")]
        seen = dict(zip(bank.experts[layer], bank.metrics._layers[layer].tokens, strict=True)) \
            if layer in bank.metrics._layers else {}
        want = parts(layer, x, ids, weights)
        assert torch.equal(whole(layer, x, ids, weights), want)
        one_call = bank.forward_layer(layer, x, ids, weights)  # (not the parts: it ran)
        assert one_call is not None and torch.equal(one_call[0], want)
        # each expert's tokens counted once per call: three calls
        counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts).tolist()
        now = dict(zip(bank.experts[layer], bank.metrics._layers[layer].tokens, strict=True))
        assert [now[e] - seen.get(e, 0) for e in range(cfg.num_experts)] == \
            [3 * c for c in counts]
        after = [_histogram(s, "local").collect()[0].samples for s in ("dispatch", "combine")]
        for b, a in zip(before, after, strict=True):
            count = {s.name: s.value for s in a}
            name = next(n for n in count if n.endswith("_count"))
            assert count[name] == {s.name: s.value for s in b}[name] + 2  # parts and whole
