"""A CPU test double of DeepEP's V1 Python API (`deep_ep.Buffer`) over torch.distributed (gloo),
written from deepseek-ai/DeepEP's source apart from this project's backend: deep_ep/buffer.py
@dcfd954 (this signature; deep_ep/buffers/legacy.py@189df34 keeps it), deep_ep/utils.py@0fdf4f0,
csrc/deep_ep.cpp@011d766 (host checks), csrc/config.hpp@030cdf0, csrc/kernels/configs.cuh@10e8a3b,
csrc/kernels/intranode.cu@031a5c4, csrc/kernels/internode_ll.cu@005dcc9, kernels/launch.cuh
@2bd56ae, tests/test_intranode.py@031a5c4 and tests/test_low_latency.py@058d696. Each collective
of the real Buffer is one tagged, numbered `all_gather_object` here: ranks at different calls
raise. Not here: FP8 inputs, internode normal kernels (> 8 ranks), LogFMT, zero-copy combine."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
NVL_PEERS, RDMA_PEERS, MAX_LOCAL_EXPERTS, ALIGN = 8, 20, 1024, 128  # configs.cuh
SWITCH_RANKS = (2, 4, 8)  # launch.cuh: rank counts of the intranode kernels
SWITCH_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)  # launch.cuh: low-latency hiddens
LL_MAX_TOPK, QP_DEPTH, INT_MAX = 9, 1024, 2**31 - 1  # internode_ll.cu kNumMaxTopK; buffer.py
# buffer.py get_dispatch_config / get_combine_config: (nvl send, nvl recv, rdma send) chunks
DISPATCH = {2: (24, 256, 6), 4: (6, 256, 6), 8: (6, 256, 6), 16: (36, 288, 20), 24: (8, 288, 32),
            32: (32, 288, 32), 64: (20, 288, 28), 128: (20, 560, 32), 144: (32, 720, 12),
            160: (28, 720, 12)}
COMBINE = {2: (10, 256, 6), 4: (9, 256, 6), 8: (4, 256, 6), 16: (4, 288, 12), 24: (1, 288, 8),
           32: (1, 288, 8), 64: (1, 288, 20), 128: (1, 560, 12), 144: (2, 720, 8),
           160: (2, 720, 8)}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Config:
    """config.hpp `Config` with deep_ep.cpp's pybind defaults; hints: its size formulas."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = nvl_send = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = nvl_recv = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = recv = _align(num_max_rdma_chunked_recv_tokens,
                                                              max(send, 1))
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and 0 < send <= recv // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        assert num_ranks < NVL_PEERS or num_ranks % NVL_PEERS == 0
        rdma, nvl, ch = max(num_ranks // NVL_PEERS, 1), min(num_ranks, NVL_PEERS), self.num_sms // 2
        slot = hidden_bytes + 8 + 128 * (8 + 4 + 4)  # data, source meta, 128 top-k and scales
        return _align(ch * nvl * ((2 * rdma + 3) * 4 + self.num_max_nvl_chunked_recv_tokens
                                  * slot), ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NVL_PEERS:
            return 0
        assert num_ranks % NVL_PEERS == 0 and self.num_sms % 2 == 0
        slot = hidden_bytes + 8 + 128 * (8 + 4 + 4) + 16
        n = self.num_sms // 2 * num_ranks // NVL_PEERS * 2 * (
            (NVL_PEERS * 2 + 2) * 4 + self.num_max_rdma_chunked_recv_tokens * slot)
        return _align(n + 1048576, ALIGN)


class EventOverlap:
    """deep_ep/utils.py: holds an event only when `async_finish` was set (CPU work is done)."""

    def __init__(self, event: object = None, extra_tensors: Any = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(True if async_finish else None)


def _ll_bytes(num_max: int, hidden: int, num_experts: int) -> int:
    """config.hpp `LowLatencyLayout.total_bytes`: two send, receive and signalling buffers."""
    scales = hidden // 128
    dispatch_msg, combine_msg = 16 + max(hidden * 2, hidden + scales * 4), scales * 4 + hidden * 2
    send = max(num_max * dispatch_msg, num_experts * num_max * combine_msg)
    return 2 * (send + num_experts * num_max * max(dispatch_msg, combine_msg)
                + _align(num_experts * 4, ALIGN))


def _channels(mask: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """intranode.cu: token t is in channel t // ceil(T / channels) (get_channel_task_range);
    `channel_prefix_matrix` [ranks, channels] counts tokens per rank up to a channel inclusive,
    `send_head` [T, ranks] is a token's slot in its channel's queue to a rank, else -1."""
    m = mask.to(torch.int64)
    chan = torch.arange(m.size(0)) // max(-(-m.size(0) // channels), 1)
    counts = torch.zeros(channels, m.size(1), dtype=torch.int64).index_add_(0, chan, m)
    prefix = counts.cumsum(0)
    slot = m.cumsum(0) - m - (prefix - counts)[chan]
    return prefix.T.contiguous().int(), torch.where(mask, slot, -1).int()


class Buffer:
    """deep_ep/buffer.py `Buffer`: intranode normal kernels and low-latency kernels."""

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False) -> None:
        """Collective (buffer.py all-gathers device ids and IPC handles); deep_ep.cpp's checks."""
        self.rank, self.group_size, self.group = group.rank(), group.size(), group
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.num_qps_per_rank, n = num_qps_per_rank, self.group_size
        assert num_nvl_bytes % ALIGN == 0 and (num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0)
        assert num_rdma_bytes % ALIGN == 0 and (low_latency_mode or num_rdma_bytes <= INT_MAX)
        assert 0 <= self.rank < n and (n <= NVL_PEERS * RDMA_PEERS or low_latency_mode)
        assert n < NVL_PEERS or n % NVL_PEERS == 0
        assert num_rdma_bytes == 0 or n > NVL_PEERS or low_latency_mode
        assert num_qps_per_rank > 0 or not (low_latency_mode or n > NVL_PEERS)
        self._seq, self._destroyed = 0, False
        self._exchange("init", None)

    def _exchange(self, tag: str, payload: Any) -> list[Any]:
        """One collective: all ranks' payloads, once all ranks are seen at the same call."""
        assert not self._destroyed, "the buffer was destroyed"
        self._seq += 1
        out: list[Any] = [None] * self.group_size
        dist.all_gather_object(out, (tag, self._seq, payload), group=self.group)
        if any(o[:2] != (tag, self._seq) for o in out):
            raise RuntimeError(f"DeepEP fake: ranks at different calls: {[o[:2] for o in out]}")
        return [o[2] for o in out]

    def destroy(self) -> None:
        """buffer.py asserts `explicitly_destroy`; deep_ep.cpp destroy() barriers the ranks."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self.num_nvl_bytes or self.num_rdma_bytes:
            self._exchange("destroy", None)
        self._destroyed = True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return _event(True)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        n = _ll_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return (n + ALIGN) // ALIGN * ALIGN  # config.hpp: rounded past the next 128 bytes

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in DISPATCH, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *DISPATCH[num_ranks], 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in COMBINE, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *COMBINE[num_ranks], 128)

    def _normal(self, x: Any, config: Config, prev: object, async_: bool, on_comm: bool) -> None:
        if self.group_size > NVL_PEERS or isinstance(x, tuple):
            raise NotImplementedError("DeepEP fake: internode normal kernels or FP8 data")
        assert self.group_size in SWITCH_RANKS and config.num_sms % 2 == 0, "Unsupported ranks"
        assert not on_comm or (prev is not None and async_), "allocate_on_comm_stream"
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16  # SWITCH_TYPES
        assert x.size(1) * x.element_size() % 16 == 0

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """deep_ep.cpp get_dispatch_layout, local: tokens per rank (once per rank hosting any of
        its experts, expert e on rank e // (num_experts / ranks)), (token, expert) pairs per
        expert, is_token_in_rank [tokens, ranks]; -1 ids select nothing (test_intranode.py)."""
        assert not self._destroyed and topk_idx.dim() == 2 and topk_idx.is_contiguous()
        assert topk_idx.dtype == torch.int64 and num_experts > 0
        assert num_experts % self.group_size == 0
        assert not allocate_on_comm_stream or (previous_event is not None and async_finish)
        assert topk_idx.numel() == 0 or int(topk_idx.max()) < num_experts
        valid, owner = topk_idx >= 0, topk_idx // (num_experts // self.group_size)
        in_rank = torch.stack([(valid & (owner == r)).any(1) for r in range(self.group_size)], 1)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, _event(async_finish)

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 handle: tuple | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None,
            tuple | None, EventOverlap]:
        """buffer.py dispatch -> deep_ep.cpp intranode_dispatch -> intranode.cu, collective: a
        rank receives once each token routed to it, by source rank then source token; top-k ids
        become local ids or -1, weights zeroed at -1; the list sums the sources'
        `num_tokens_per_expert`, aligned up to `expert_alignment`, and is empty when
        `num_worst_tokens` pads the rows (ids -1). With a handle: no top-k, returns x only."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self._normal(x, config, previous_event, async_finish, allocate_on_comm_stream)
        assert isinstance(x, torch.Tensor)
        n, me, channels = self.group_size, self.rank, config.num_sms // 2
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            is_token_in_rank, num_experts, rows = handle[4], 0, handle[3].size(0)
        else:
            assert num_tokens_per_rank is not None and num_tokens_per_expert is not None
            assert num_tokens_per_rank.dtype == num_tokens_per_expert.dtype == torch.int32
            assert num_tokens_per_rank.shape == (n,) and num_tokens_per_expert.dim() == 1
            num_experts, rows = num_tokens_per_expert.size(0), num_worst_tokens
            assert num_experts % n == 0 and num_experts // n <= MAX_LOCAL_EXPERTS
        assert is_token_in_rank is not None and is_token_in_rank.dtype == torch.bool
        assert is_token_in_rank.is_contiguous() and is_token_in_rank.shape == (x.size(0), n)
        k = 0 if topk_idx is None else topk_idx.size(1)
        if topk_idx is not None or topk_weights is not None:
            assert topk_idx is not None and topk_weights is not None and num_experts > 0
            assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
            assert topk_idx.is_contiguous() and topk_weights.is_contiguous()
            assert topk_idx.shape == topk_weights.shape == (x.size(0), k)
        assert num_worst_tokens == 0 or handle is not None or topk_idx is not None
        assert n * n * 4 + channels * n * (16 + config.num_max_nvl_chunked_recv_tokens * (
            x.size(1) * 2 + 4 + k * 12)) <= self.num_nvl_bytes, "num_nvl_bytes too small"
        mine = (x, is_token_in_rank, topk_idx, topk_weights, num_tokens_per_rank,
                num_tokens_per_expert)
        parts = self._exchange("dispatch", [t if t is None else t.clone() for t in mine])
        local = num_experts // n
        xs, srcs, ids, ws, recv_channels = [], [], [], [], []
        for xr, mask, idx, w, per_rank, _ in parts:
            assert (idx is None) == (topk_idx is None), "ranks disagree on sending top-k"
            assert per_rank is None or torch.equal(per_rank, mask.sum(0).int()), \
                "num_tokens_per_rank disagrees with is_token_in_rank"
            sel = mask[:, me].nonzero().flatten()
            xs.append(xr[sel])
            srcs.append(sel.int())
            prefix = _channels(mask, channels)[0][me]
            recv_channels.append(torch.cat([prefix.new_zeros(1), prefix[:-1]]))
            if idx is not None:
                ok = (idx[sel] >= me * local) & (idx[sel] < (me + 1) * local)
                ids.append(torch.where(ok, idx[sel] - me * local, -1))
                ws.append(torch.where(ok, w[sel], 0.0))
        got = sum(len(s) for s in srcs)
        assert rows == 0 or rows >= got, "num_worst_tokens is below the tokens received"
        pad = max(rows - got, 0)
        recv_x = torch.cat([*xs, x.new_zeros(pad, x.size(1))])
        if handle is not None:
            return recv_x, None, None, None, None, _event(async_finish)
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx = torch.cat([*ids, topk_idx.new_full((pad, k), -1)])
            recv_w = torch.cat([*ws, torch.zeros(pad, k)])
        per_expert = torch.stack([p[5].view(n, local)[me] for p in parts]).sum(0).tolist()
        counts = [] if num_worst_tokens else [_align(c, expert_alignment) for c in per_expert]
        channel_prefix, send_head = _channels(is_token_in_rank, channels)
        handle = (torch.stack([p[4] for p in parts]).cumsum(0).int(), channel_prefix,
                  torch.stack(recv_channels).int(),
                  torch.cat([*srcs, torch.full((pad,), -1, dtype=torch.int32)]),
                  is_token_in_rank, send_head)
        return recv_x, recv_idx, recv_w, counts, handle, _event(async_finish)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple[
            torch.Tensor, torch.Tensor | None, EventOverlap]:
        """buffer.py combine -> deep_ep.cpp intranode_combine -> intranode.cu, collective: a
        token becomes the float32 sum, without weights, of the rows received for it (plus the
        biases), cast to bf16 [tokens, hidden]; received top-k weights are summed likewise."""
        config = self.get_combine_config(self.group_size) if config is None else config
        self._normal(x, config, previous_event, async_finish, allocate_on_comm_stream)
        rank_prefix, _, _, src_idx, _, send_head = handle
        assert src_idx.size(0) == x.size(0) and send_head.size(1) == self.group_size
        w = topk_weights
        k = 0 if w is None else w.size(1)
        assert w is None or (w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous()
                             and w.size(0) == x.size(0))
        assert self.group_size * config.num_sms // 2 * (8 + config.num_max_nvl_chunked_recv_tokens
                                                        * (x.size(1) * 2 + 4 + k * 4)
                                                        ) <= self.num_nvl_bytes
        ends = rank_prefix[:, self.rank].tolist()
        parts = self._exchange("combine", [
            (x[s:e].clone(), src_idx[s:e].long(), None if w is None else w[s:e].clone())
            for s, e in zip([0, *ends[:-1]], ends, strict=True)])
        out = torch.zeros(send_head.size(0), x.size(1))
        out_w = None if w is None else torch.zeros(send_head.size(0), k)
        for b in (bias,) if isinstance(bias, torch.Tensor) else (bias or ()):
            assert b.dtype == x.dtype and b.is_contiguous() and b.shape == out.shape
            out += b.float()
        for rows, idx, rows_w in (p[self.rank] for p in parts):
            out.index_add_(0, idx, rows.float())
            if out_w is not None:
                out_w.index_add_(0, idx, rows_w)
        return out.to(x.dtype), out_w, _event(async_finish)

    def _ll(self, num_max: int, hidden: int, num_experts: int, async_: bool, hook: bool) -> int:
        assert self.low_latency_mode and num_experts % self.group_size == 0
        assert hidden % 128 == 0 and hidden in SWITCH_HIDDEN, f"Unsupported hidden {hidden}"
        assert _ll_bytes(num_max, hidden, num_experts) <= self.num_rdma_bytes
        assert (num_max + 1) * 2 <= QP_DEPTH and not (async_ and hook)
        assert self.group_size * num_max % 4 == 0, "TMA requires a multiple of 4 tokens"
        return num_experts // self.group_size

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """internode_ll.cu clean_low_latency_buffer barriers all ranks: collective."""
        assert self.low_latency_mode
        assert _ll_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts) \
            <= self.num_rdma_bytes
        self._exchange("clean_low_latency_buffer", None)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple[
            torch.Tensor, torch.Tensor, tuple, EventOverlap, Callable[[], None] | None]:
        """deep_ep.cpp low_latency_dispatch -> internode_ll.cu, collective: local expert e's
        rows [0, count[e]) are one per (token, k) routed to it, in blocks by source rank (here
        ascending; in DeepEP, as atomics fall), source tokens ascending; the handle keeps their
        source ids and per-rank (begin << 32 | count). Rows past the count are NaN (DeepEP's
        are stale). With `return_recv_hook` the rows arrive when the hook is called."""
        num_max, stats = num_max_dispatch_tokens_per_rank, cumulative_local_expert_recv_stats
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64
        assert x.size(0) == topk_idx.size(0) <= num_max and topk_idx.size(1) <= LL_MAX_TOPK
        local = self._ll(num_max, x.size(1), num_experts, async_finish, return_recv_hook)
        assert self.num_qps_per_rank >= local, "internode_ll.cu: a QP per local expert"
        assert stats is None or (stats.dtype == torch.int32 and stats.shape == (local,))
        if use_fp8:
            raise NotImplementedError("DeepEP fake: FP8 low-latency dispatch")
        parts = self._exchange("low_latency_dispatch", (num_max, x.clone(), topk_idx.clone()))
        assert all(p[0] == num_max for p in parts), "num_max_dispatch_tokens_per_rank differs"
        slots = self.group_size * num_max
        recv_x = torch.full((local, slots, x.size(1)), float("nan"), dtype=torch.bfloat16)
        src_info = torch.zeros(local, slots, dtype=torch.int32)
        layout_range = torch.zeros(local, self.group_size, dtype=torch.int64)
        count = torch.zeros(local, dtype=torch.int32)

        def receive() -> None:
            for e in range(local):
                begin = 0
                for r, (_, xr, idx) in enumerate(parts):
                    tokens = (idx == self.rank * local + e).nonzero()[:, 0]
                    recv_x[e, begin:begin + len(tokens)] = xr[tokens]
                    src_info[e, begin:begin + len(tokens)] = tokens.int()
                    layout_range[e, r] = (begin << 32) | len(tokens)
                    begin += len(tokens)
                count[e] = begin
            if stats is not None:
                stats.add_(count)

        if not return_recv_hook:
            receive()
        handle = (src_info, layout_range, num_max, x.size(1), num_experts)
        return (recv_x, count, handle, _event(async_finish),
                receive if return_recv_hook else None)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple[
            torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """deep_ep.cpp low_latency_combine -> internode_ll.cu, collective: experts send back
        only rows within the handle's per-rank counts; token t becomes the float32 sum over k
        with topk_idx[t, k] >= 0 of topk_weights[t, k] times the row that expert returned for
        t, cast to bf16 [tokens, hidden] (into `out` if given)."""
        src_info, layout_range, num_max, hidden, num_experts = handle
        n, tokens = self.group_size, topk_idx.size(0)
        local = self._ll(num_max, hidden, num_experts, async_finish, return_recv_hook)
        assert x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert x.shape == (local, n * num_max, hidden) and layout_range.shape == (local, n)
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        assert topk_idx.shape == topk_weights.shape and tokens <= num_max
        assert out is None or (out.is_contiguous() and out.dtype == x.dtype
                               and out.shape == (tokens, hidden))
        if use_logfmt or zero_copy:
            raise NotImplementedError("DeepEP fake: LogFMT or zero-copy combine")
        sends = []
        for r in range(n):
            for e in range(local):
                begin, cnt = int(layout_range[e, r]) >> 32, int(layout_range[e, r]) & (2**32 - 1)
                sends.append((r, (self.rank * local + e) * num_max
                              + src_info[e, begin:begin + cnt].long(),
                              x[e, begin:begin + cnt].clone()))
        parts = self._exchange("low_latency_combine", sends)
        combined = out if out is not None else torch.empty(tokens, hidden, dtype=x.dtype)

        def receive() -> None:
            got = [(key, rows) for p in parts for r, key, rows in p if r == self.rank]
            keys, order = torch.cat([g[0] for g in got] + [torch.zeros(0).long()]).sort()
            rows = torch.cat([g[1] for g in got] + [x.new_zeros(0, hidden)]).float()
            valid = topk_idx >= 0
            want = topk_idx.clamp(min=0) * num_max + torch.arange(tokens)[:, None]
            pos = torch.searchsorted(keys, want).clamp(max=max(len(keys) - 1, 0))
            assert not valid.any() or bool((keys[pos] == want)[valid].all()), \
                "an expert did not return a token it was sent"
            picked = rows[order[pos]] if len(keys) else torch.zeros(*want.shape, hidden)
            terms = torch.where(valid[..., None], picked * topk_weights[..., None], 0.0)
            combined.copy_(terms.sum(1).to(combined.dtype))

        if not return_recv_hook:
            receive()
        return combined, _event(async_finish), receive if return_recv_hook else None
