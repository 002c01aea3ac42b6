"""Clients that keep a server busy until told to stop, and say how each request ended:
for tests that disturb a deployment under load from another network namespace.

    python -m tests.support.load_clients URL MODEL PROMPTS_JSON [--clients 8]
        [--max-tokens 12]

Each of `--clients` threads sends greedy completions (token-id prompts, taken in turn)
one after another. For each answer a line: `ok I` (prompt I answered) or `fail I STATUS
BODY`; when stdin has a line (or closes), the clients finish the requests they are in
and the last line is `result JSON`: every request's prompt index and token ids, or its
status and error body."""

from __future__ import annotations

import argparse
import json
import sys
import threading

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("prompts", help="a JSON list of token-id lists")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    prompts: list[list[int]] = json.loads(args.prompts)
    stop, lock, results = threading.Event(), threading.Lock(), []

    def report(line: str, result: dict) -> None:
        with lock:
            results.append(result)
            print(line, flush=True)

    def client(k: int) -> None:
        with httpx.Client(base_url=args.url, timeout=args.timeout) as c:
            i = k
            while not stop.is_set():
                p = i % len(prompts)
                try:
                    r = c.post("/v1/completions", json={
                        "model": args.model, "prompt": prompts[p], "temperature": 0,
                        "max_tokens": args.max_tokens, "ignore_eos": True,
                        "return_token_ids": True})
                    status, body = r.status_code, r.text
                except httpx.HTTPError as exc:  # no answer at all: a failure too
                    status, body = 0, repr(exc)
                if status == 200:
                    report(f"ok {p}", {"prompt": p, "tokens":
                                       json.loads(body)["choices"][0]["token_ids"]})
                else:
                    report(f"fail {p} {status} {body[:300]!r}",
                           {"prompt": p, "status": status, "error": body})
                i += args.clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    sys.stdin.readline()
    stop.set()
    for t in threads:
        t.join()
    print("result " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
