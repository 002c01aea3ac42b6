"""Prometheus `/metrics` of the attention and expert services.

Their series live in prometheus_client's default registry, with its process and Python
collectors, and are served from a small HTTP thread on `--metrics-port`. The gateway
scrapes and merges them (`gateway.observability.service_metrics`), and so can any Prometheus.

A service reports its metrics port with its service port on the ready pipe (`report_ready`),
and exports its role and place as
`switchyard:service_start_time_seconds{role,index,member}`, by which the dashboard tells the
services apart and sees them restart.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# What the gateway's dashboard names a service by, and its uptime from.
_STARTED = Gauge("switchyard:service_start_time_seconds",
                 "When this service started (Unix seconds), by its role and place: an "
                 "attention group's index and DCP rank (member), or an expert rank's index.",
                 ["role", "index", "member"])


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per scrape
        pass


def classic_text(app: Callable) -> Callable:
    """`app`, answering in the classic text format whatever the scraper asks.

    Prometheus 2 asks for OpenMetrics with `escaping=underscores`, under which
    prometheus_client writes `switchyard:expert_tokens_total` as
    `switchyard_expert_tokens_total`. The text format keeps every name as it is, for every
    Prometheus.
    """
    def wrapped(environ: dict, start_response: Callable) -> Iterable[bytes]:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    return wrapped


def start_metrics_server(host: str, port: int | None, role: str, index: int,
                         member: int = 0) -> int | None:
    """Serve `/metrics` on host:port, where port 0 picks a free port, on a daemon thread,
    with this service's role, place and start time. Returns the bound port, or None when no
    port is configured."""
    if port is None:
        return None
    _STARTED.labels(role, str(index), str(member)).set(time.time())
    server = make_server(host, port, classic_text(make_wsgi_app()), ThreadingWSGIServer,
                         handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True,
                     name="metrics-server").start()
    return server.server_port


def report_ready(ready_fd: int | None, port: int, metrics_port: int | None) -> None:
    """Tell the launcher this service is ready: `PORT [METRICS_PORT]` on one line."""
    if ready_fd is None:
        return
    line = f"{port}" if metrics_port is None else f"{port} {metrics_port}"
    os.write(ready_fd, f"{line}\n".encode())
    os.close(ready_fd)
