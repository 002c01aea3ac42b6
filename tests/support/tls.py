"""A throwaway certificate authority for HTTPS tests, made with the `openssl` command:
a CA, a server certificate for 127.0.0.1 and a client certificate, each signed by it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the CA's certificate: what a client verifies the server with
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _signed(out: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> None:
    key, csr, ext = out / f"{name}.key", out / f"{name}.csr", out / f"{name}.ext"
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN=switchyard test {name}")
    ext.write_text(extensions)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(out / f"{name}.pem"), "-days", "1",
             "-extfile", str(ext))


def make_ca(out: Path) -> Certificates:
    ca, ca_key = out / "ca.pem", out / "ca.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", "/CN=switchyard test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _signed(out, "server", ca, ca_key, "subjectAltName=IP:127.0.0.1\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    _signed(out, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return Certificates(ca, out / "server.pem", out / "server.key", out / "client.pem",
                  out / "client.key")
