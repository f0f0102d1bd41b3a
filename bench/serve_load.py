"""Load on an OpenAI-compatible server (``env-engineer serve``): requests/s, latency and errors at several concurrencies.

    python bench/serve_load.py --url http://127.0.0.1:8000/v1 [--clients 1,10,50] [--requests 100] [--json out.json]
    python bench/serve_load.py --start "env-engineer serve --model M --port 8765" --url http://127.0.0.1:8765/v1

For each number of concurrent clients, ``--requests`` chat completions (a two-agent board, ``--max-tokens`` new tokens)
are sent by that many threads, each waiting for its answer before sending the next. Per level: completed requests/s,
p50 and p99 latency of the answers (200), and the count of every other outcome: HTTP status codes (429 is the server
saying it is full: backpressure, not a failure) and connection errors (resets, refusals, timeouts). With ``--start``,
the server is started first (its readiness polled on ``/v1/models``) and stopped after. A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BODY = {"model": "m", "max_tokens": 8, "temperature": 1.0, "seed": 0, "messages": [
    {"role": "system", "content": "Route every agent to its goal. Moves: U D L R W."},
    {"role": "user", "content": "  0 1 2\n0 A . b\n1 . H .\n2 B . a\nAgent 1: A (0,0) to a (2,2)\nAgent 2: B (2,0) to b (0,2)"}]}


def level(url: str, clients: int, requests: int, max_tokens: int, timeout: float, fresh: bool = False) -> dict:
    """Send ``requests`` completions from ``clients`` threads (``fresh``: a new connection for each request, as
    clients without keep-alive make); the outcome counts and latencies."""
    import httpx

    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    todo = iter(range(requests))

    def worker() -> None:
        limits = httpx.Limits(max_keepalive_connections=0) if fresh else httpx.Limits()
        with httpx.Client(timeout=timeout, limits=limits) as client:
            while True:
                with lock:
                    if next(todo, None) is None:
                        return
                start = time.perf_counter()
                try:
                    response = client.post(f"{url}/chat/completions", json={**BODY, "max_tokens": max_tokens})
                    outcome = str(response.status_code)
                except httpx.HTTPError as e:
                    outcome = f"connection error ({type(e).__name__})"
                seconds = time.perf_counter() - start
                with lock:
                    outcomes[outcome] += 1
                    if outcome == "200":
                        latencies.append(seconds)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    latencies.sort()

    def quantile(q: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {"clients": clients, "requests": requests, "fresh_connections": fresh, "seconds": wall, "ok_per_s": outcomes["200"] / wall,
            "p50_s": quantile(0.5), "p99_s": quantile(0.99), "mean_s": statistics.fmean(latencies) if latencies else None,
            "outcomes": dict(sorted(outcomes.items()))}


def burst(url: str, count: int, timeout: float) -> dict:
    """``count`` requests sent at the same instant, each on a new connection (``Connection: close``), raw sockets: what
    a listen backlog and an accept loop make of a crowd arriving at once."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps(BODY).encode()
    request = (f"POST {parts.path}/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json"
               f"\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    barrier = threading.Barrier(count)
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        try:
            with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
                sock.sendall(request)
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            outcome = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "no reply"
        except OSError as e:
            outcome = f"connection error ({type(e).__name__})"
        with lock:
            outcomes[outcome] += 1

    began = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"burst": count, "seconds": time.perf_counter() - began, "outcomes": dict(sorted(outcomes.items()))}


def wait_ready(url: str, seconds: float) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: no answer within {seconds} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--start", default=None, help="a command that starts the server (stopped at the end)")
    parser.add_argument("--clients", default="1,10,50", help="concurrent clients per level (default %(default)s)")
    parser.add_argument("--requests", type=int, default=100, help="requests per level (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request, seconds")
    parser.add_argument("--fresh-connections", action="store_true", help="a new connection for every request")
    parser.add_argument("--burst", type=int, default=0, help="also send this many requests at one instant")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    server = subprocess.Popen(shlex.split(args.start)) if args.start else None
    try:
        wait_ready(args.url, 180)
        rows = [level(args.url, int(c), args.requests, args.max_tokens, args.timeout, args.fresh_connections)
                for c in args.clients.split(",")]
        crowd = burst(args.url, args.burst, args.timeout) if args.burst else None
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(f"{'clients':>7} {'ok/s':>7} {'p50 s':>7} {'p99 s':>7}  outcomes")
    for r in rows:
        p50 = f"{r['p50_s']:.3f}" if r["p50_s"] is not None else "-"
        p99 = f"{r['p99_s']:.3f}" if r["p99_s"] is not None else "-"
        print(f"{r['clients']:>7} {r['ok_per_s']:>7.2f} {p50:>7} {p99:>7}  {r['outcomes']}")
    if crowd:
        print(f"burst of {crowd['burst']} at once: {crowd['outcomes']} in {crowd['seconds']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"levels": rows, "burst": crowd}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
