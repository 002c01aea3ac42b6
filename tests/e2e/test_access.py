"""Who may talk to the gateway, through real `switchyard serve` processes and the official
`openai` client: API keys, the admin key, open probes, CORS, and HTTPS with a CA of the
test's own (server certificates, and client certificates)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from switchyard.serve_process import Served
from tests.support.tls import Certificates, make_ca

pytestmark = pytest.mark.timeout(300)
KEYS = ("sk-client-one-8f3a", "sk-client-two-77c1")
ADMIN = "sk-admin-0d9e"
ORIGIN = "https://app.example"
README_QUESTION = [{"role": "user", "content": "What is 123 + 456?"}]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = [f for k in KEYS for f in ("--api-key", k)]
    with Served([*flags, "--admin-api-key", ADMIN, "--allowed-origins", ORIGIN,
                 "--dispatch-backend", "local"]) as s:
        yield s


def client(url: str, key: str, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60,
                         **kw)  # type: ignore[arg-type]


def ask(c: openai.OpenAI) -> str:
    reply = c.chat.completions.create(model=c.models.list().data[0].id, temperature=0,
                                      max_tokens=8, messages=README_QUESTION)
    return reply.choices[0].message.content or ""


def test_each_key_is_served_and_a_wrong_one_is_refused(served: Served) -> None:
    answers = {ask(client(served.url, key)) for key in (*KEYS, ADMIN)}
    assert len(answers) == 1  # every key gets the same greedy answer
    with pytest.raises(openai.AuthenticationError) as wrong:
        ask(client(served.url, "sk-wrong"))
    assert wrong.value.status_code == 401
    assert "sk-wrong" not in str(wrong.value.body)


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
    ("GET", "/openapi.json")])
def test_client_endpoints_answer_401_without_a_key(served: Served, method: str,
                                                   path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS[0]}):
        r = httpx.request(method, served.url + path, headers=headers, json={}, timeout=10)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["code"] == 401 and "API key" in error["message"]
        assert "sk-wrong" not in r.text and KEYS[0] not in r.text


def test_probes_stay_open(served: Served) -> None:
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{served.url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "switchyard:num_requests_running" in metrics.text


@pytest.mark.parametrize("method,path", [("GET", "/stats"), ("GET", "/eplb"),
                                         ("GET", "/dashboard/data"),
                                         ("POST", "/eplb/rebalance")])
def test_operator_endpoints_need_the_admin_key(served: Served, method: str, path: str) -> None:
    def call(key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, served.url + path, headers=headers, timeout=30)

    assert call(None).status_code == 401
    refused = call(KEYS[0])
    assert refused.status_code == 403 and "admin API key" in refused.json()["error"]["message"]
    answered = call(ADMIN)
    # (a rebalance needs --enable-eplb: a 400 that says so, past the key check)
    assert answered.status_code == (400 if path == "/eplb/rebalance" else 200), answered.text


def test_the_dashboard_page_opens_without_a_key(served: Served) -> None:
    page = httpx.get(f"{served.url}/dashboard", timeout=10)
    assert page.status_code == 200 and "dashboard/static/dashboard.js" in page.text


def test_cors_preflight_from_an_allowed_origin_and_from_another(served: Served) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{served.url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = preflight("https://elsewhere.example")
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers
    # A real request from the allowed origin carries the header; its key still counts.
    r = httpx.get(f"{served.url}/v1/models", timeout=10, headers={
        "Origin": ORIGIN, "Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_keys_never_reach_the_logs(served: Served) -> None:
    ask(client(served.url, KEYS[0]))
    with pytest.raises(openai.AuthenticationError):
        ask(client(served.url, "sk-wrong"))
    log = served.stderr()
    assert not any(k in log for k in (*KEYS, ADMIN, "sk-wrong"))


def trusting(certs: Certificates) -> ssl.SSLContext:
    """A client's TLS context that trusts the test CA (and no other)."""
    return ssl.create_default_context(cafile=certs.ca)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_ca(tmp_path_factory.mktemp("tls"))


def test_the_readme_request_over_https(certs: Certificates) -> None:
    with Served(["--ssl-keyfile", str(certs.server_key), "--ssl-certfile",
                 str(certs.server_cert), "--dispatch-backend", "local"]) as served:
        assert served.url.startswith("https://")
        verified = ask(client(served.url, "none",
                              http_client=httpx.Client(verify=trusting(certs))))
        assert verified  # the client verified the server against the CA
        with pytest.raises(openai.APIConnectionError) as refused:
            ask(client(served.url, "none"))  # the system's CAs do not know ours
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value.__cause__)


def test_client_certificates_are_required_with_ssl_ca_certs(certs: Certificates) -> None:
    with Served(["--ssl-keyfile", str(certs.server_key), "--ssl-certfile",
                 str(certs.server_cert), "--ssl-ca-certs", str(certs.ca),
                 "--dispatch-backend", "local"]) as served:
        context = trusting(certs)
        context.load_cert_chain(certs.client_cert, certs.client_key)
        with_cert = httpx.Client(verify=context)
        assert ask(client(served.url, "none", http_client=with_cert))
        without = httpx.Client(verify=trusting(certs))
        with pytest.raises(openai.APIConnectionError):
            ask(client(served.url, "none", http_client=without))
        assert ssl.CERT_REQUIRED == 2  # what --ssl-ca-certs implies (docs/api.md)


def test_bad_tls_flags_are_refused_before_anything_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "switchyard", "serve", *flags],
                              capture_output=True, text=True, timeout=120)

    alone = serve("--ssl-keyfile", str(tmp_path / "k.pem"))
    assert alone.returncode == 2 and "go together" in alone.stderr
    missing = serve("--ssl-keyfile", str(tmp_path / "k"), "--ssl-certfile", str(tmp_path / "c"))
    assert missing.returncode == 2 and "is not a file" in missing.stderr
