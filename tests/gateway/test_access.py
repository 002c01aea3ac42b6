"""The gateway's access rule (`gateway.access`) checked directly; served with keys and TLS:
tests/e2e/test_access.py."""

from __future__ import annotations

from gateway.access import Access, check


def test_operator_endpoints_beyond_loopback_need_an_admin_key() -> None:
    """The rule a gateway on a pod's address applies (its listener is the only
    difference, so the rule is checked directly)."""
    open_host = Access(loopback=False)
    assert check(open_host, "/stats", None).status == 403  # type: ignore[union-attr]
    assert "--admin-api-key" in check(open_host, "/eplb", None).message  # type: ignore[union-attr]
    assert check(open_host, "/v1/models", None) is None
    assert check(Access(loopback=True), "/stats", None) is None
    keyed = Access(api_keys=(b"k",), loopback=True)
    assert check(keyed, "/stats", b"k") is None and check(keyed, "/stats", None) is not None
    admin = Access(admin_api_keys=(b"a",), loopback=False)
    assert check(admin, "/stats", b"a") is None and check(admin, "/v1/models", b"a") is None
    assert check(admin, "/v1/models", None).status == 401  # type: ignore[union-attr]
