"""Who may connect to a service's port: a shared cluster secret, proven at connect time.

Every connection between services starts with a mutual HMAC-SHA256 challenge-response,
before any frame is read, and so before any message is decoded:

    server -> client   MAGIC, server nonce (32 random bytes)
    client -> server   client nonce (32), HMAC(secret, "client" | server nonce | client nonce)
    server -> client   HMAC(secret, "server" | client nonce | server nonce)

Both nonces are fresh per connection, so a recorded handshake proves nothing on another
one, and the secret itself never crosses the wire. The server's answer proves it to the
client too: activations go only to a service that holds the secret.

A deployment without a secret runs the same exchange with an empty key, which anyone can
answer; such a service refuses to listen beyond loopback (`check_listen`). `serve` makes a
random secret per run; compose and Kubernetes read it from a file
(`SWITCHYARD_CLUSTER_SECRET_FILE`), never from a command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from common.flags import env

MAGIC = b"SWYDAUTH"  # also the protocol's version: a change of exchange changes it
NONCE_BYTES = 32
MAC_BYTES = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
RESPONSE_BYTES = NONCE_BYTES + MAC_BYTES
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that does not answer in time is dropped
SECRET_ENV = "CLUSTER_SECRET_FILE"


class HandshakeError(ConnectionError):
    """The peer did not prove the cluster secret (or does not speak the handshake)."""


@dataclass(frozen=True)
class ClusterSecret:
    """The key every service of one deployment shares; never printed (`repr` hides it)."""

    key: bytes = field(default=b"", repr=False)

    @property
    def configured(self) -> bool:
        return bool(self.key)

    @classmethod
    def load(cls, path: str | Path | None) -> ClusterSecret:
        """The secret in the file at `path`: its bytes, surrounding whitespace stripped.
        A `path` of None or empty means no secret. Raises a ValueError for an unreadable or
        empty file."""
        if not path:
            return cls()
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cluster secret file {path}: {exc.strerror or exc}") from None
        if not key:
            raise ValueError(f"cluster secret file {path} is empty")
        return cls(key)

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32).encode())

    def write(self, path: Path) -> Path:
        """Into a new file only its owner can read."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.key)
        return path

    def mac(self, role: bytes, first: bytes, second: bytes) -> bytes:
        return hmac.new(self.key, role + first + second, hashlib.sha256).digest()


NO_SECRET = ClusterSecret()


def add_secret_flag(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument(
        "--cluster-secret-file", default=env(SECRET_ENV),
        help="file holding the secret every service of this deployment shares; connections "
             "between services prove it (default: none, and then the service listens on "
             "loopback only)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: what it resolves to now
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def check_listen(host: str, secret: ClusterSecret, flag: str = "--host") -> None:
    """Raise a ValueError where a service would listen beyond loopback with no secret."""
    if not secret.configured and not is_loopback(host):
        raise ValueError(f"{flag} {host} listens beyond loopback, so connections must prove "
                         f"a cluster secret: give one with --cluster-secret-file or "
                         f"SWITCHYARD_{SECRET_ENV} (a file of random bytes, e.g. "
                         f"`openssl rand -hex 32 > secret`)")


def challenge() -> tuple[bytes, bytes]:
    """The server's challenge: (what it sends first, its nonce)."""
    nonce = os.urandom(NONCE_BYTES)
    return MAGIC + nonce, nonce


def respond(secret: ClusterSecret, challenge_bytes: bytes) -> tuple[bytes, bytes]:
    """The client's (response, the server proof it expects back) to a challenge."""
    if challenge_bytes[:len(MAGIC)] != MAGIC:
        raise HandshakeError("the peer is not a Switchyard service (no handshake)")
    server_nonce, nonce = challenge_bytes[len(MAGIC):], os.urandom(NONCE_BYTES)
    return (nonce + secret.mac(b"client", server_nonce, nonce),
            secret.mac(b"server", nonce, server_nonce))


def verify(secret: ClusterSecret, server_nonce: bytes, response: bytes) -> bytes:
    """The server's proof for a client's response. Raises a HandshakeError if the response
    is wrong."""
    nonce, mac = response[:NONCE_BYTES], response[NONCE_BYTES:]
    if not hmac.compare_digest(mac, secret.mac(b"client", server_nonce, nonce)):
        raise HandshakeError("the peer did not prove the cluster secret")
    return secret.mac(b"server", nonce, server_nonce)


def check_proof(proof: bytes, expected: bytes) -> None:
    if not hmac.compare_digest(proof, expected):
        raise HandshakeError("the service did not prove the cluster secret")
