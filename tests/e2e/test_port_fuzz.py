"""Every service port of a running `switchyard serve` tree, attacked while it serves:
random bytes, truncated frames, a 4 GiB length prefix, well-formed frames of the wrong
message type and `ExpertBatch`es whose fields lie, each sent without the cluster secret
and after proving it. Every service stays up, the streams already running finish token
for token as undisturbed, and no service's RSS grows by more than 10%."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from common.auth import ClusterSecret, HandshakeError
from common.messages import (
    ExpertBatch,
    ExpertResult,
    GenerateRequest,
    InfoRequest,
    SamplingParams,
    Tensor,
    TokenDelta,
)
from common.rpc import SocketFrames, client_handshake
from switchyard.serve_process import Served
from tests.support import checkpoints
from tests.support.serving import disturbed_streams, model_id

pytestmark = pytest.mark.timeout(600)
SEED = 20261204
HIDDEN = 64  # checkpoints.qwen3_moe_config's hidden size


def frame(message: object) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return struct.pack(">I", len(payload)) + payload


def rows(n: int, nbytes: int | None = None, dtype: str = "float32") -> Tensor:
    """n rows of the test model's hidden size (64) on the wire, or `nbytes` of them."""
    return Tensor(bytes(n * HIDDEN * 4 if nbytes is None else nbytes), dtype, [n, HIDDEN])


def hostile_payloads(rng: random.Random) -> list[tuple[str, bytes]]:
    """What an attacker sends once connected (after the handshake, or instead of it).
    The batches are right but for one field: layer 0 is an MoE layer, and each of the two
    expert services holds 4 of its 8 experts."""
    good = frame(ExpertBatch(7, 0, [1, 0, 0, 0], rows(1)))
    out = [(f"random {n} bytes", rng.randbytes(n)) for n in (1, 3, 4, 17, 300, 5000)]
    out += [(f"truncated at {k}", good[:k]) for k in sorted(rng.sample(range(1, len(good)),
                                                                      6))]
    out += [
        ("a 4 GiB length prefix", b"\xff\xff\xff\xff" + rng.randbytes(64)),
        ("a length beyond the ceiling", struct.pack(">I", 300 << 20) + rng.randbytes(64)),
        ("a frame of msgpack garbage", struct.pack(">I", 9) + b"\xc1" * 9),
        ("a TokenDelta", frame(TokenDelta("x", [1, 2], "stop", 3))),
        ("an ExpertResult", frame(ExpertResult(1, error="no"))),
        ("a GenerateRequest missing fields", frame({"type": "GenerateRequest", "nope": 1})),
        ("an unknown tag", frame({"type": "Nope"})),
        ("a batch whose counts disagree with its bytes",
         frame(ExpertBatch(1, 0, [5, 5, 0, 0], rows(3)))),
        ("a batch whose shape disagrees with its bytes",
         frame(ExpertBatch(2, 0, [1000, 0, 0, 0], rows(1000, nbytes=16)))),
        ("a batch with negative counts", frame(ExpertBatch(3, 0, [-4, 5, 0, 0], rows(1)))),
        ("a batch with too few counts", frame(ExpertBatch(3, 0, [1], rows(1)))),
        ("a batch of a layer out of range",
         frame(ExpertBatch(4, 10**6, [1, 0, 0, 0], rows(1)))),
        ("a batch of a dense layer", frame(ExpertBatch(4, 1, [1, 0, 0, 0], rows(1)))),
        ("a batch of a placement never announced",
         frame(ExpertBatch(5, 0, [1, 0, 0, 0], rows(1), {}, 99))),
        ("a batch of a strange dtype",
         frame(ExpertBatch(6, 0, [1, 0, 0, 0], rows(1, dtype="complex128")))),
        ("a request with token ids out of the vocabulary",
         frame(GenerateRequest("fuzz-1", [10**9, -5], SamplingParams(max_tokens=4)))),
        ("a request with an empty prompt",
         frame(GenerateRequest("fuzz-2", [], SamplingParams(max_tokens=4)))),
        ("a request with negative max_tokens",
         frame(GenerateRequest("fuzz-3", [1, 2], SamplingParams(max_tokens=-7)))),
        ("good frames, then garbage", frame(InfoRequest()) * 3 + good + rng.randbytes(40)),
    ]
    return out


def attack(port: int, payload: bytes, secret: ClusterSecret | None) -> None:
    """Send `payload` on a new connection (after proving `secret`, if given), read what
    comes back for a moment, and close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if secret is not None:
            client_handshake(sock, secret, time.monotonic() + 5)
        # The service may answer, wait or close (a reset, mid-send): each is fine here.
        with contextlib.suppress(TimeoutError, OSError):
            sock.sendall(payload)
            sock.settimeout(0.2)
            while sock.recv(65536):  # drain its answers until it closes or goes quiet
                continue


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def service_ports(served: Served) -> dict[str, tuple[int, int]]:
    """Each msgspec service: (pid, the port its command line gave it)."""
    out = {}
    for name, pid in served.services().items():
        if name == "gateway":
            continue
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        out[name] = (pid, int(args[len(args) - 1 - args[::-1].index("--port") + 1]))
    return out


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClusterSecret, Path]:
    key = ClusterSecret.generate()
    return key, key.write(tmp_path_factory.mktemp("secret") / "cluster-secret")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           secret: tuple[ClusterSecret, Path]) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("fuzzed")
    checkpoints.build(checkpoints.qwen3_moe_config(max_position_embeddings=2048), path, seed=5)
    with Served(["--model", str(path), "--expert-services", "2"],
                env={"SWITCHYARD_CLUSTER_SECRET_FILE": str(secret[1])}) as s:
        yield s


def test_every_port_survives_hostile_frames_while_serving(
        served: Served, secret: tuple[ClusterSecret, Path]) -> None:
    model = model_id(served)
    rng = random.Random(SEED)
    ps = [[rng.randrange(1, 200) for _ in range(12)] for _ in range(3)]
    body = {"max_tokens": 700, "temperature": 0, "ignore_eos": True}
    ports = service_ports(served)
    assert len(ports) == 3, ports  # the attention service and two expert services
    undisturbed = disturbed_streams(served.url, model, ps, body, None)
    before = {name: rss_kib(pid) for name, (pid, _) in ports.items()}
    sent = []

    def fuzz() -> None:
        for name, (_, port) in ports.items():
            for what, payload in hostile_payloads(rng):
                attack(port, payload, None)  # no handshake: the payload answers the challenge
                with pytest.raises(HandshakeError):  # a wrong secret: refused at the handshake
                    attack(port, payload, ClusterSecret.generate())
                attack(port, payload, secret[0])  # proven: the payload reaches the frames
                sent.append((name, what))

    outs = disturbed_streams(served.url, model, ps, body, fuzz)
    assert len(sent) == 3 * len(hostile_payloads(random.Random(0)))
    for out, want in zip(outs, undisturbed, strict=True):
        assert out["status"] == 200 and "error" not in out, out.get("error")
        assert out["tokens"] == want["tokens"]  # token by token as undisturbed
    for name, (pid, _) in ports.items():
        grown = rss_kib(pid) / before[name]
        assert grown <= 1.10, f"{name}: RSS grew {grown:.2f}x under the fuzzing"
    assert all(served.children_alive()), served.stderr()[-3000:]
    # Still serving whole new requests after it all.
    again = disturbed_streams(served.url, model, ps[:1], body, None)
    assert again[0]["tokens"] == undisturbed[0]["tokens"]


def test_a_wrong_secret_is_refused_before_any_frame_is_read(
        served: Served, secret: tuple[ClusterSecret, Path]) -> None:
    """Fails if the handshake is skipped: a well-formed `InfoRequest` sent straight away
    (or after a wrong proof) would be answered."""
    for name, (_, port) in service_ports(served).items():
        deadline = time.monotonic() + 10
        with pytest.raises(HandshakeError):
            SocketFrames.connect("127.0.0.1", port, deadline, False, ClusterSecret.generate())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            # No handshake: well-formed frames where its answer belongs (exactly as long,
            # so that the service, closing, leaves nothing unread and no reset comes).
            frames = frame(InfoRequest()) * 8
            assert len(frames) > 64 + len(frame(InfoRequest()))
            sock.sendall(frames[:64])
            sock.settimeout(5)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            # All it ever sends is its challenge; the connection is then closed.
            assert received.startswith(b"SWYDAUTH") and len(received) == 40, (name, received)
        conn = SocketFrames.connect("127.0.0.1", port, deadline, False, secret[0])
        try:
            conn.send(InfoRequest(), deadline)
            assert type(conn.receive(deadline)).__name__ in ("EngineInfo", "ExpertInfo")
        finally:
            conn.close()


def test_nothing_is_left_running_after_the_fuzzing(served: Served) -> None:
    stats = httpx.get(f"{served.url}/stats", timeout=10).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    log = served.stderr()
    assert "rejecting batch" in log and "sent a bad frame" in log  # the frames got there
