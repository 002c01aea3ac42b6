"""`switchyard probe TARGET`: a healthcheck for containers and scripts.

An `http://` URL must answer 200; a `HOST:PORT` must be a Switchyard attention or expert
service that answers an `InfoRequest`. Exits 0 if so, or 1 with the reason if not.
"""

from __future__ import annotations

import argparse
import sys

import anyio
import httpx

from common.auth import NO_SECRET, ClusterSecret, add_secret_flag
from common.messages import EngineInfo, ExpertInfo, InfoRequest
from common.rpc import connect, parse_address


async def _rpc_info(host: str, port: int, timeout: float, secret: ClusterSecret) -> object:
    with anyio.fail_after(timeout):
        conn = await connect(host, port, timeout=timeout, secret=secret)
        try:
            await conn.send(InfoRequest())
            return await conn.receive()
        finally:
            await conn.aclose()


def probe(target: str, timeout: float, secret: ClusterSecret = NO_SECRET) -> str | None:
    """None if `target` is healthy, else why not (a service proves `secret`)."""
    try:
        if target.startswith(("http://", "https://")):
            status = httpx.get(target, timeout=timeout).status_code
            return None if status == 200 else f"{target} answered {status}"
        info = anyio.run(_rpc_info, *parse_address(target), timeout, secret)
        return None if isinstance(info, EngineInfo | ExpertInfo) else \
            f"{target} answered {type(info).__name__}"
    except TimeoutError:
        return f"{target}: no answer within {timeout:g}s"
    except (OSError, ValueError, httpx.HTTPError, anyio.EndOfStream) as exc:
        return f"{target}: {type(exc).__name__}: {exc}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="switchyard probe", description=__doc__)
    ap.add_argument("target", help="http://HOST:PORT/PATH or HOST:PORT")
    ap.add_argument("--timeout", type=float, default=5.0)
    add_secret_flag(ap)
    args = ap.parse_args(argv)
    try:
        secret = ClusterSecret.load(args.cluster_secret_file)
    except ValueError as exc:
        ap.error(str(exc))
    error = probe(args.target, args.timeout, secret)
    if error:
        print(f"switchyard probe: {error}", file=sys.stderr)
        return 1
    return 0
