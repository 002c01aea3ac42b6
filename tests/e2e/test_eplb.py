"""Expert placement balanced by measured load (DeepSeek's EPLB), end to end."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import httpx
import pytest

from ep_dispatch.placement import Placement
from services.model.config import ModelConfig
from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.serving import concurrent_greedy

pytestmark = pytest.mark.timeout(300)


def test_a_placement_balanced_by_measured_load_serves_the_same_tokens(
        deepseek_v3_ckpt: tuple, tmp_path: Path) -> None:
    """Serve, measure the routing load from the running server's /stats, let EPLB place
    the experts with 2 redundant copies a layer over 2 expert services (`switchyard
    placement --load URL`), and serve with that placement: transformers' tokens still."""
    from switchyard.cli import main

    path, model = deepseek_v3_ckpt
    ps = prompts(seed=33, lengths=(30, 11, 19))
    want = [reference_greedy(model, p, 12) for p in ps]
    with Served(["--model", str(path), "--expert-services", "2"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        assert concurrent_greedy(served.url, name, ps, max_tokens=12) == want
        out = tmp_path / "placement.json"
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["placement", "--model", str(path), "--expert-services", "2",
                         "--load", served.url, "--num-redundant-experts", "2", "--json"]) == 0
        out.write_text(printed.getvalue())
    cfg = ModelConfig.from_dir(path)
    placement = Placement.load(out, cfg.moe_layer_ids, cfg.num_experts)
    for copies in placement.replicas.values():
        assert sum(len(c) for c in copies) == cfg.num_experts + 2
        assert [sum(r == rank for c in copies for r in c) for rank in (0, 1)] == [5, 5]
    with Served(["--model", str(path), "--expert-services", "2", "--placement", str(out)]
                ) as served:
        assert concurrent_greedy(served.url, name, ps, max_tokens=12) == want
