"""Prometheus `/metrics` of the attention and expert services.

Their series live in prometheus_client's default registry (with its process and Python
collectors) and are served from a small HTTP thread on `--metrics-port`; the gateway
scrapes and merges them (`gateway.service_metrics`), and so can any Prometheus.
"""

from __future__ import annotations

import os

from prometheus_client import start_http_server


def start_metrics_server(host: str, port: int | None) -> int | None:
    """Serve `/metrics` on host:port (0 picks a free port); returns the bound port, or
    None when no port is configured."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host)
    return server.server_port


def report_ready(ready_fd: int | None, port: int, metrics_port: int | None) -> None:
    """Tell the launcher this service is ready: `PORT [METRICS_PORT]` on one line."""
    if ready_fd is None:
        return
    line = f"{port}" if metrics_port is None else f"{port} {metrics_port}"
    os.write(ready_fd, f"{line}\n".encode())
    os.close(ready_fd)
