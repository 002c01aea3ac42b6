"""A DCP peer, rank > 0 of an attention group. It has no scheduler and no connections; it
runs each step its leader plans, over its share of the KV cache, until told to stop."""

from __future__ import annotations

import logging
from itertools import accumulate, pairwise

import torch

from common.device import check_device, collective_backend
from common.metrics import report_ready, start_metrics_server
from dcp.batch import build_rank_batch
from dcp.group import DcpGroup, GroupExperts, StepAborted, collective_timeout
from dcp.sharding import Sharding
from services.attention.config import AttentionConfig
from services.attention.kv_cache import KVCache, kv_bytes_per_block
from services.attention.model import DenseModel
from services.attention.spec_decode.mtp import load_mtp, mtp_block
from services.attention.weights import WeightReader
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig, check_dense_quantization

log = logging.getLogger("switchyard.dcp")


def run_peer(config: AttentionConfig) -> None:
    if config.dcp_init is None:
        raise ValueError("a DCP peer needs --dcp-init HOST:PORT (its leader's rendezvous)")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    cfg, dtype = ModelConfig.from_dir(config.model), config.torch_dtype
    checkpoint = Checkpoint(config.model)
    device = check_device(config.device, "attention")
    group = DcpGroup(config.dcp_init, config.dcp_rank, config.dcp_size,
                     collective_backend(device), config.rendezvous_timeout,
                     collective_timeout(config.expert_timeout, config.link_timeout))
    read = WeightReader(checkpoint, dtype, device,
                        check_dense_quantization(cfg, config.dense_quantization))
    model = DenseModel(cfg, read, group.attend)
    drafts_mtp = config.speculative is not None and config.speculative.mtp
    mtp = load_mtp(read, cfg) if drafts_mtp else None
    checkpoint.close()
    layers = cfg.num_layers + int(drafts_mtp)  # as in the leader's cache (`builder`)
    num_blocks = config.kv_cache_memory // kv_bytes_per_block(cfg, config.block_size, dtype,
                                                              layers)
    kv = KVCache(cfg, num_blocks, config.block_size, dtype, device, layers)
    sharding, experts = Sharding(config.dcp_size, config.dcp_interleave), GroupExperts(group,
                                                                                      None)
    # /metrics only once loaded and joined: it is what a deployment's healthcheck asks.
    start_metrics_server(config.host, config.metrics_port, "attention", config.attention_rank,
                         config.dcp_rank)
    log.info("DCP rank %d/%d ready: %d KV blocks", config.dcp_rank, config.dcp_size,
             num_blocks)
    report_ready(config.ready_fd, 0, None)
    # the last step's hidden states and the last MTP pass's output, as the leader's
    hidden = passed = torch.empty(0)
    try:
        while not (plan := group.receive_plan()).stop:
            if plan.heartbeat:
                group.answer_heartbeat()
                continue
            cuts = list(accumulate(plan.micro_batches or [len(plan.seqs)], initial=0))
            batches = [build_rank_batch(plan.seqs[a:b], config.dcp_rank, sharding,
                                        config.block_size, cfg.sliding_window, []).to(device)
                       for a, b in pairwise(cuts)]
            try:  # the leader's split keeps the group's collectives in order
                if plan.mtp_source:
                    if mtp is None:  # the group's ranks share one configuration
                        raise RuntimeError("the leader drafts with MTP; this peer was "
                                           "started without --speculative-config mtp")
                    source = hidden if plan.mtp_source == "step" else passed
                    rows = torch.tensor(plan.mtp_rows, dtype=torch.int64, device=device)
                    passed = mtp_block(model, mtp, batches[0], source[rows], kv, experts)
                elif len(batches) == 1:
                    hidden = model.forward(batches[0], kv, experts)
                else:
                    hidden = torch.cat(model.forward_pipelined(batches, kv, experts.start))
            except StepAborted as exc:  # the leader fails the step's sequences
                log.warning("step dropped: %s", exc)
    finally:
        group.close()
