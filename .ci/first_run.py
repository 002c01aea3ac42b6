"""CI: what a new user runs first, exactly as README.md writes it, in a fresh venv.

Reads the README's commands instead of copying them, so the README cannot drift from what
is tested:
- the serve command: the first line of the first bash block that starts `scripts/serve`;
- the curl and the Python snippet under "## Ask it something", each with the answer its
  own comment promises (`# ... "content":"579"} ...`, `print(...)  # -37`).

`scripts/serve` runs with SWITCHYARD_VENV pointing at a new, empty venv (so with no extras
and nothing the test suite installed); the Python snippet runs in a second new venv that
holds only `openai`, as its comment says. Standard library only: this runs before any venv
of the project exists. Exits non-zero, with what differed, on any failure.

usage: python3 .ci/first_run.py [--keep DIR]   (DIR: where the venvs go; default a temp dir)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_TIMEOUT_S = 900  # a fresh venv installs torch and the dependencies first
REQUEST_TIMEOUT_S = 120


def code_blocks(markdown: str) -> list[tuple[str, str, str]]:
    """Every fenced block as (language, body, the section heading it sits under)."""
    blocks, heading = [], ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    pos = 0
    for match in fence.finditer(markdown):
        for line in markdown[pos:match.start()].splitlines():
            if line.startswith("## "):
                heading = line[3:].strip()
        blocks.append((match.group(1), match.group(2), heading))
        pos = match.end()
    return blocks


def readme_snippets(readme: str) -> tuple[str, str, str, str, str]:
    """(serve command, curl snippet, its promised content, Python snippet, its output)."""
    blocks = code_blocks(readme)
    serve = next(line for lang, body, _ in blocks if lang == "bash"
                 for line in body.splitlines() if line.startswith("scripts/serve"))
    ask = [(lang, body) for lang, body, heading in blocks if heading == "Ask it something"]
    curl = next(body for lang, body in ask if lang == "bash" and body.startswith("curl"))
    python = next(body for lang, body in ask if lang == "python")
    content = re.search(r'#.*"content":"([^"]*)"', curl)
    printed = re.search(r"^print\(.*\)\s*#\s*(.+)$", python, re.M)
    if content is None or printed is None:
        raise SystemExit("README.md: the curl or Python snippet no longer says its answer")
    return serve, curl, content.group(1), python, printed.group(1).strip()


def wait_serving(proc: subprocess.Popen, timeout: float) -> str:
    """The base URL `serve` prints once serving; its output is echoed as it comes."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not selector.select(max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"serve exited with status {proc.wait()} before serving")
        print(f"  serve: {line}", end="", flush=True)
        if found := re.search(r"is serving .* at (http://\S+)/v1", line):
            return found.group(1)
    raise SystemExit(f"serve did not print its URL within {timeout:.0f}s")


def check(name: str, command: list[str], want: str, exact: bool, env: dict[str, str]) -> None:
    out = subprocess.run(command, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S,
                         env=env, cwd=ROOT)
    got = out.stdout.strip()
    ok = out.returncode == 0 and (got == want if exact else want in got)
    print(f"{name}: {'ok' if ok else 'FAILED'} (status {out.returncode})\n  output: {got}"
          + (f"\n  stderr: {out.stderr.strip()[-2000:]}" if not ok else ""), flush=True)
    if not ok:
        raise SystemExit(f"{name}: expected {'exactly ' if exact else ''}{want!r}")


PACKAGES = ("switchyard", "gateway", "services", "ep_dispatch", "dcp", "moe_kernels")
# What modules of the base install may import only where their feature is used, each
# named by the error: the `gpu` extra's CuPy, DeepEP (built from source), and the Triton
# that CUDA builds of torch bring.
OPTIONAL = {"cupy", "deep_ep", "triton"}
IMPORT_ALL = """
import importlib, sys
missing = []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] not in sys.argv[1].split(","):
            missing.append(f"{name}: {exc}")
print("\\n".join(missing))
sys.exit(1 if missing else 0)
"""


def check_imports(python: Path) -> None:
    """Every module of the base install imports in the base venv (deptry reads imports;
    this runs them), but for a missing optional package (`OPTIONAL`)."""
    modules = sorted(".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(
        ".__init__") for package in PACKAGES for f in (ROOT / package).rglob("*.py")
        if f.name != "__main__.py")  # (which would run)
    out = subprocess.run([str(python), "-c", IMPORT_ALL, ",".join(OPTIONAL), *modules],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"modules of the base install that do not import in it:\n"
                         f"{out.stdout}{out.stderr[-2000:]}")
    print(f"imports: all {len(modules)} modules of the base install import", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="put the venvs here and keep them")
    args = parser.parse_args()
    serve_cmd, curl, content, python, printed = readme_snippets(
        (ROOT / "README.md").read_text())
    work = args.keep or Path(tempfile.mkdtemp(prefix="switchyard-first-run-"))
    server_venv, client_venv = work / "serve-venv", work / "client-venv"
    for venv in (server_venv, client_venv):
        if venv.exists() and not args.keep:
            raise SystemExit(f"{venv} exists")
    print(f"first run: `{serve_cmd}` with SWITCHYARD_VENV={server_venv}", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    proc = subprocess.Popen(["bash", "-c", serve_cmd], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env={**env, "SWITCHYARD_VENV":
                                                         str(server_venv)},
                            start_new_session=True)
    try:
        url = wait_serving(proc, SERVE_TIMEOUT_S)
        if not url.startswith("http://127.0.0.1:8000"):
            raise SystemExit(f"the README's snippets ask 127.0.0.1:8000; serve is at {url}")
        check("README curl", ["bash", "-c", curl], f'"content":"{content}"', False, env)
        subprocess.run([sys.executable, "-m", "venv", str(client_venv)], check=True)
        subprocess.run([str(client_venv / "bin/python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", "openai"], check=True)
        check("README Python snippet", [str(client_venv / "bin/python"), "-c", python],
              printed, True, env)
        check_imports(server_venv / "bin/python")
    finally:
        with contextlib.suppress(ProcessLookupError):  # (serve may have exited already)
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print("first run: ok", flush=True)


if __name__ == "__main__":
    main()
