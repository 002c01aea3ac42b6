"""GET /version: which Switchyard is answering, in the shape of vLLM's `/version`."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import common
from gateway.api.serving import json_response


class VersionResponse(msgspec.Struct):
    """GET /version."""

    version: str


@cache
def package_version() -> str:
    """The installed distribution's version.

    A source checkout run without installing it has no metadata, so this falls back to the
    package's own `__version__`.
    """
    try:
        return version("switchyard")
    except PackageNotFoundError:
        return common.__version__


async def show_version(_: Request) -> Response:
    """GET /version."""
    return json_response(VersionResponse(package_version()))
