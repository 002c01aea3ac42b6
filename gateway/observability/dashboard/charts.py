"""The dashboard's time series, defined once: the page draws them from the gateway's own
ticks (`recorder`), and `switchyard observability` writes the same quantities as
Prometheus recording rules and a Grafana dashboard over `/metrics`.

A line's `key` names its value in a tick's point; its `promql` is the same quantity
over Prometheus' scrapes, computed over `RANGE` as the page computes it over one tick.
A `per` line has one series per value of that label (the page's keys are `key:VALUE`).
"""

from __future__ import annotations

from dataclasses import dataclass

RANGE = "1m"  # what the recording rules' rates and quantiles look back over


@dataclass(frozen=True)
class Line:
    key: str
    legend: str
    promql: str
    per: str | None = None  # a label: one series per value


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    unit: str  # "tokens/s", "s", "requests", "fraction"
    lines: tuple[Line, ...]


def _quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return (f"histogram_quantile({q}, sum by ({labels}) "
            f"(rate(switchyard:{histogram}_bucket[{RANGE}])))")


_RANK_ROWS = f"sum by (layer, rank) (rate(switchyard:expert_tokens_total[{RANGE}]))"

CHARTS = (
    Chart("throughput", "Output tokens/s", "tokens/s", (
        Line("output_tokens_per_s", "output",
             f"sum(rate(switchyard:generation_tokens_total[{RANGE}]))"),)),
    Chart("ttft", "Time to first token", "s", (
        Line("ttft_p50_s", "p50", _quantile(0.5, "time_to_first_token_seconds")),
        Line("ttft_p99_s", "p99", _quantile(0.99, "time_to_first_token_seconds")))),
    Chart("tpot", "Time per output token", "s", (
        Line("tpot_p50_s", "p50", _quantile(0.5, "inter_token_latency_seconds")),
        Line("tpot_p99_s", "p99", _quantile(0.99, "inter_token_latency_seconds")))),
    Chart("requests", "Requests", "requests", (
        Line("running", "running", "sum(switchyard:num_requests_running)"),
        Line("waiting", "waiting", "sum(switchyard:num_requests_waiting)"))),
    Chart("kv", "KV-cache usage", "fraction", (
        Line("kv_usage", "used", "max(switchyard:kv_cache_usage_perc)"),)),
    Chart("ranks", "Expert ranks' share of the rows", "fraction", (
        Line("rank_share", "rank {{rank}}",
             f"sum by (rank) (rate(switchyard:expert_tokens_total[{RANGE}])) / ignoring(rank)"
             f" group_left sum(rate(switchyard:expert_tokens_total[{RANGE}]))", per="rank"),
        Line("balancedness", "balancedness",
             f"sum(avg by (layer) ({_RANK_ROWS})) / sum(max by (layer) ({_RANK_ROWS}))"))),
    Chart("stages", "Dispatch and combine p99", "s", (
        Line("dispatch_p99_s", "dispatch", _quantile(0.99, "dispatch_seconds")),
        Line("combine_p99_s", "combine", _quantile(0.99, "combine_seconds")))),
)


def record_name(line: Line) -> str:
    """The recording rule's name for a line, in Prometheus' level:metric:operations form
    (the range where the line has one)."""
    return f"switchyard:{line.key}" + (f":{RANGE}" if f"[{RANGE}]" in line.promql else "")
