"""``env-engineer prefect-ready``: wait until a Prefect server answers, so that a script (or the block in docs/guide/prefect.md) that
starts ``prefect server start &`` can go on with ``work-pool create`` and ``deploy`` instead of failing with a
connection error while the server is still starting (10-20 s on a small machine)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def wait_ready(api_url: str, timeout_s: float = 120.0, interval_s: float = 0.5) -> float:
    """Poll ``api_url``/health until it answers 200; returns the seconds waited. Raises ``TimeoutError`` naming the
    address after ``timeout_s``."""
    import httpx

    url = api_url.rstrip("/") + "/health"
    start = time.perf_counter()
    last = "no answer"
    while time.perf_counter() - start < timeout_s:
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return time.perf_counter() - start
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(interval_s)
    raise TimeoutError(f"{url}: no Prefect server answered within {timeout_s:.0f} s (last: {last}); is "
                       "`prefect server start` running, and does PREFECT_API_URL point to it?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("PREFECT_API_URL") or "http://127.0.0.1:4200/api",
                        help="the server's API address (default: $PREFECT_API_URL, else %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait at most (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print(f"error: --timeout {args.timeout}: must be positive", file=sys.stderr)
        return 2
    try:
        waited = wait_ready(args.url, args.timeout)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Prefect server ready at {args.url} (waited {waited:.1f} s)")
    return 0
