"""The attention service's composition root.

It checks a config, loads the model, and builds and wires every part an `Engine` steps over:
the dispatch backend's client, a DCP group, the paged KV cache, the model runner, the block
manager, the scheduler and CUDA graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.device import check_device, collective_backend
from dcp.group import DcpGroup, collective_timeout
from dcp.sharding import Sharding
from dcp.strategy import DcpLeader, SingleRank
from ep_dispatch.base import ExpertsClient
from ep_dispatch.deepep_config import check_step_budget
from ep_dispatch.placement import Placement
from ep_dispatch.registry import (
    BackendSettings,
    InProcessSettings,
    MoESeam,
    RpcSettings,
    WorldSettings,
    backend,
    create_experts_client,
)
from ep_dispatch.torch_dist import World
from services.attention.block_manager import BlockManager
from services.attention.config import AttentionConfig, check_cuda_graphs
from services.attention.engine import Engine, EngineParts
from services.attention.grammar import Grammars
from services.attention.graphs import Capture, DecodeGraphs, cuda_capture
from services.attention.kv_cache import KVCache, kv_bytes_per_block
from services.attention.model import DenseModel
from services.attention.runner import ModelRunner
from services.attention.scheduler import Scheduler
from services.attention.spec_decode.config import check_speculative
from services.attention.spec_decode.mtp import load_mtp
from services.attention.weights import WeightReader
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig, check_dense_quantization, check_quantization
from services.model.experts import ExpertBank, all_experts

log = logging.getLogger(__name__)


def build_engine(config: AttentionConfig, graph_capture: Capture | None = None) -> Engine:
    """An engine for `config`, checked first: device, graphs, quantization and backend.

    `graph_capture` is how decode steps are captured with `--cuda-graph-max-batch`. By
    default that is CUDA graphs, which need `--device cuda`. Tests pass
    `graphs.eager_capture` to run the graph path's static buffers and padding on a CPU.
    """
    device = check_device(config.device, "attention")
    check_cuda_graphs(config.cuda_graph_max_batch, config.cuda_graph_max_len,
                      "cuda" if graph_capture else config.device, config.dispatch_backend,
                      config.dcp_size)
    dtype = config.torch_dtype
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    cfg = ModelConfig.from_dir(config.model)
    quantization = check_quantization(cfg, config.quantization)
    dense = check_dense_quantization(cfg, config.dense_quantization)
    dispatch = backend(config.dispatch_backend, device, quantization)
    spec = config.speculative
    check_speculative(spec, dispatch.mtp)
    drafts_mtp = spec is not None and spec.mtp
    if dispatch.deepep_settings:
        check_step_budget(config.deepep, config.max_num_batched_tokens)
    log.info("loading %s (%d layers, %d experts) as %s%s", cfg.architecture, cfg.num_layers,
             cfg.num_experts, dtype, f", dense linears in {dense}" if dense else "")
    attention = _attention(config, cfg)
    with Checkpoint(config.model) as checkpoint:  # closed before waiting on any peer
        read = WeightReader(checkpoint, dtype, device, dense)
        model = DenseModel(cfg, read, attention.attend)
        mtp = load_mtp(read, cfg) if drafts_mtp else None
        if mtp is None:
            _skip_mtp(cfg, checkpoint)
        # `local` is the only backend that holds the experts in-process
        bank = ExpertBank(cfg, checkpoint, all_experts(cfg), dtype, quantization or "none",
                          device=device) if dispatch.in_process else None
    experts = attention.experts(_experts_client(config, cfg, dtype, quantization, bank))
    graphed = config.cuda_graph_max_batch > 0
    kv_layers = cfg.num_layers + int(drafts_mtp)  # MTP's attention is a layer of its own
    num_blocks = _num_blocks(config, cfg, dtype, graphed, kv_layers)
    # With graphs, one more block: their scratch, never handed out.
    kv = KVCache(cfg, num_blocks + int(graphed), config.block_size, dtype, device, kv_layers)
    sharding = attention.sharding
    block_manager = BlockManager(num_blocks, config.block_size, sharding,
                                 config.enable_prefix_caching)
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                        cfg.max_position_embeddings,
                        sharding.max_length(num_blocks * config.block_size))
    graphs = DecodeGraphs(
        model, kv, experts, num_blocks * config.block_size, config.cuda_graph_max_batch,
        min(config.cuda_graph_max_len, max_model_len), device,
        graph_capture or cuda_capture(torch.cuda.graph_pool_handle())) if graphed else None
    if graphs:
        graphs.capture_all()
    attention.start()  # every DCP peer loaded too
    runner = ModelRunner(config, cfg, device, model, kv, experts, attention, graphs,
                         _max_replicas(config, cfg), cfg.served_moe_layers(dispatch.mtp))
    return Engine(EngineParts(
        config=config, model_config=cfg, device=device, dtype=dtype, quantization=quantization,
        runner=runner, block_manager=block_manager,
        scheduler=Scheduler(block_manager, config.max_num_batched_tokens, config.max_num_seqs),
        grammars=Grammars(Path(config.model), cfg.vocab_size, cfg.eos_token_ids),
        max_model_len=max_model_len, mtp=mtp))


def _experts_client(config: AttentionConfig, cfg: ModelConfig, dtype: torch.dtype,
                    quantization: str | None, bank: ExpertBank | None) -> ExpertsClient:
    """The configured dispatch backend's client. `bank` holds the in-process experts of
    `local`. Each backend takes its own settings from those the flags give."""
    layers = cfg.served_moe_layers(backend(config.dispatch_backend).mtp)
    seam = MoESeam(moe_layers=layers, num_experts=cfg.num_experts,
                   hidden_size=cfg.hidden_size, top_k=cfg.top_k, dtype=dtype,
                   quantization=quantization, device=config.device,
                   placement_file=config.placement, replicas=config.expert_replicas)
    world = _world(config)
    return create_experts_client(config.dispatch_backend, seam, BackendSettings(
        in_process=InProcessSettings(bank.forward, bank.forward_on_device, bank.forward_layer)
        if bank else None,
        rpc=RpcSettings(list(config.expert_addresses), config.expert_timeout,
                        config.expert_timeout, config.secret, config.link_timeout),
        world=WorldSettings(world, config.rendezvous_timeout, config.deepep) if world
        else None))


def _max_replicas(config: AttentionConfig, cfg: ModelConfig) -> int:
    """The most expert ranks one expert is on, by the placement as the experts client
    builds it."""
    if config.placement is None:
        return config.expert_replicas
    layers = cfg.served_moe_layers(backend(config.dispatch_backend).mtp)
    return Placement.load(config.placement, layers, cfg.num_experts).max_replicas


def _skip_mtp(cfg: ModelConfig, checkpoint: Checkpoint) -> None:
    """DeepSeek's multi-token-prediction layers follow the decoder's in the checkpoint,
    from model.layers.{num_layers}.* on. Without MTP drafts, that is method "mtp" of
    `--speculative-config`, their attention weights stay unread, and one log line says so."""
    if not cfg.mtp_layers:
        return
    skipped = [name for name in checkpoint.names() if name.startswith("model.layers.")
               and int(name.split(".")[2]) >= cfg.num_layers]
    if skipped:
        log.info("skipping %d multi-token-prediction layer(s) of the checkpoint (%d tensors "
                 "from model.layers.%d.*): they draft with --speculative-config's method mtp",
                 cfg.mtp_layers, len(skipped), cfg.num_layers)


def _num_blocks(config: AttentionConfig, cfg: ModelConfig, dtype: torch.dtype,
                graphs: bool, layers: int) -> int:
    """KV blocks of `layers` layers that the budget holds for sequences. With CUDA graphs
    it is one fewer, which the graphs take."""
    num_blocks = config.kv_cache_memory // kv_bytes_per_block(cfg, config.block_size, dtype,
                                                              layers)
    num_blocks -= int(graphs)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} holds no KV block of "
                         f"{config.block_size} tokens (with CUDA graphs: beside theirs)")
    return num_blocks


def _attention(config: AttentionConfig, cfg: ModelConfig) -> SingleRank:
    """One rank's attention, or with `--dcp-size` > 1 the leader of a DCP group. The group
    meets here, so this waits for the peers."""
    if config.dcp_size == 1:
        return SingleRank(config.block_size, cfg.sliding_window)
    if config.dcp_init is None:
        raise ValueError("--dcp-size > 1 needs --dcp-init HOST:PORT for the group's rendezvous")
    if backend(config.dispatch_backend).collective:
        raise ValueError("DCP works with the local and rpc dispatch backends; the collective "
                         "backend's process group is the expert world")
    op_timeout = collective_timeout(config.expert_timeout, config.link_timeout)
    group = DcpGroup(config.dcp_init, 0, config.dcp_size, collective_backend(config.device),
                     config.rendezvous_timeout, op_timeout)
    return DcpLeader(group, Sharding(config.dcp_size, config.dcp_interleave),
                     config.block_size, cfg.sliding_window, heartbeats=op_timeout is not None)


def _world(config: AttentionConfig) -> World | None:
    if config.dist_init is None:
        return None
    return World(config.dist_init, config.attention_ranks, config.expert_ranks,
                 rank=config.attention_rank)
