"""``lmcache-p2p drain``: take an instance out of the proxy's rotation before stopping it.

The proxy sends it no new work and waits for its in-flight requests; this command returns when
the proxy has forgotten it (safe to stop now) or fails after ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import httpx

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("drain", help="stop routing to an instance and wait until its work is done",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("instance", help="instance id, as GET /instances lists it (the launcher's: decoder-1, ...)")
    p.add_argument("--proxy", default="http://127.0.0.1:9100", help="the proxy's HTTP URL")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up waiting after this long")
    p.set_defaults(func=run)
    return p


def drain(proxy: str, instance_id: str, timeout_s: float, secret: str | None = None) -> bool:
    """Ask the proxy to drain ``instance_id``; True once it is idle and forgotten.

    ``secret``: the proxy's shared secret (default ``$LMCACHE_P2P_SECRET``), sent as a Bearer token.
    """
    secret = secret or os.environ.get("LMCACHE_P2P_SECRET")
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    resp = httpx.post(f"{proxy}/instances/drain", json={"instance_id": instance_id}, headers=headers, timeout=10)
    if resp.status_code != 200:
        raise SystemExit(f"drain {instance_id}: {resp.json().get('error', {}).get('message', resp.text)}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = httpx.get(f"{proxy}/instances", params={"all": "1"}, headers=headers, timeout=10).json()
        inst = next((i for i in listed if i["instance_id"] == instance_id), None)
        if inst is None or inst["static"] and inst["inflight_requests"] == 0:
            return True
        logger.info("%s: %d request(s) still in flight", instance_id, inst["inflight_requests"])
        time.sleep(0.5)
    return False


def run(args: argparse.Namespace) -> int:
    if drain(args.proxy.rstrip("/"), args.instance, args.timeout_s):
        print(f"{args.instance} is drained: safe to stop")
        return 0
    print(f"{args.instance} still has work after {args.timeout_s:.0f}s")
    return 1
