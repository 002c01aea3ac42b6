"""Who may call the gateway: API keys for the client endpoints, and an admin key for the
operator endpoints. The check is a pure ASGI middleware in front of every route.

- `/health` and `/metrics` stay open, as vLLM leaves them, because probes and Prometheus
  call them.
- The dashboard's page and its static files are open because they hold no data. The
  dashboard's data is not open.
- Operator endpoints (`/eplb*`, `/stats`, the dashboards' `/data`) need an admin key where
  one is configured. Without an admin key they answer only while the gateway listens on
  loopback, and then they need a client key if any is configured. Beyond loopback they
  answer 403, with a message that says how to enable them.
- Everything else (`/v1/*`, `/tokenize`, `/detokenize`, ...) needs a client key or an
  admin key, where any key is configured.

Keys are compared in constant time, and never written to a log, a span or an error body.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError

OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/expert"})
OPEN_PREFIXES = ("/dashboard/static/",)
ADMIN_PATHS = frozenset({"/stats", "/dashboard/data", "/dashboard/expert/data", "/eplb"})
ADMIN_PREFIXES = ("/eplb/",)


@dataclass(frozen=True)
class Access:
    """The keys the gateway accepts, and whether it listens on loopback. `repr` hides the keys."""

    api_keys: tuple[bytes, ...] = field(default=(), repr=False)
    admin_api_keys: tuple[bytes, ...] = field(default=(), repr=False)
    loopback: bool = True


def _matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether `given` is one of `keys`, comparing against every key in constant time."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def bearer(scope: Scope) -> bytes | None:
    """The request's `Authorization: Bearer <key>`, if it has one."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, key = value.partition(b" ")
            return key.strip() if scheme.lower() == b"bearer" else None
    return None


def check(access: Access, path: str, key: bytes | None) -> GatewayError | None:
    """Return the error that refuses a request for `path` with `key`, or None if it may go on."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return None
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES):
        if access.admin_api_keys:
            if key is not None and _matches(key, access.admin_api_keys):
                return None
            if key is not None and _matches(key, access.api_keys):
                return GatewayError(403, "This endpoint needs the admin API key "
                                         "(--admin-api-key), not a client key.")
            return _unauthorized("the admin API key")
        if not access.loopback:
            return GatewayError(403, "Operator endpoints answer beyond loopback only with "
                                     "an admin API key: start the gateway with "
                                     "--admin-api-key (or SWITCHYARD_ADMIN_API_KEY).")
    if not access.api_keys and not access.admin_api_keys:
        return None
    if key is not None and _matches(key, access.api_keys + access.admin_api_keys):
        return None
    return _unauthorized("an API key")


def _unauthorized(what: str) -> GatewayError:
    return GatewayError(401, f"Missing or incorrect API key: send {what} as "
                             f"'Authorization: Bearer <key>'.",
                        headers={"WWW-Authenticate": "Bearer"})


class KeyAuth:
    """The ASGI middleware that applies `check` to every HTTP request."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = check(self.access, scope["path"], bearer(scope))
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
