"""``lmcache-p2p drain``: take an instance out of the proxy's rotation before stopping it.

The proxy sends it no new work and waits for its in-flight requests; this command returns when
the proxy has forgotten it (safe to stop now) or fails after ``--timeout-s``. ``--missing-ok`` counts an
id the proxy does not list as drained: a stopping pod's hook, where the proxy may have restarted or
already forgotten it, has nothing left to wait for.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time

import httpx

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("drain", help="stop routing to an instance and wait until its work is done",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("instance", help="instance id, as GET /instances lists it (the launcher's: decoder-1, ...)")
    p.add_argument("--proxy", default="http://127.0.0.1:9100", help="the proxy's HTTP URL")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up waiting after this long")
    p.add_argument("--missing-ok", action="store_true",
                   help="an id the proxy does not list counts as drained (for a stopping pod's hook)")
    p.set_defaults(func=run)
    return p


def admin_headers(secret: str | None = None) -> dict[str, str]:
    """The proxy's admin calls' header: ``secret`` (default ``$LMCACHE_P2P_SECRET``) as a Bearer token."""
    secret = secret or os.environ.get("LMCACHE_P2P_SECRET")
    return {"authorization": f"Bearer {secret}"} if secret else {}


def post_drain(client: httpx.Client, proxy: str, instance_id: str, headers: dict[str, str]) -> httpx.Response:
    """``POST /instances/drain``: no new work for ``instance_id``; 404 when the proxy does not list it."""
    return client.post(f"{proxy}/instances/drain", json={"instance_id": instance_id}, headers=headers)


def drain(proxy: str, instance_id: str, timeout_s: float, secret: str | None = None, missing_ok: bool = False,
          client: httpx.Client | None = None) -> bool:
    """Ask the proxy to drain ``instance_id``; True once it is idle and forgotten (or, ``missing_ok``, not
    listed at all). ``secret``: the proxy's shared secret (default ``$LMCACHE_P2P_SECRET``)."""
    headers = admin_headers(secret)
    with contextlib.nullcontext(client) if client else httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        resp = post_drain(http, proxy, instance_id, headers)
        if resp.status_code == 404 and missing_ok:
            logger.info("%s is not registered with the proxy: nothing to drain", instance_id)
            return True
        if resp.status_code != 200:
            raise SystemExit(f"drain {instance_id}: {error_message(resp)}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = http.get(f"{proxy}/instances", params={"all": "1"}, headers=headers).json()
            inst = next((i for i in listed if i["instance_id"] == instance_id), None)
            if inst is None or inst["static"] and inst["inflight_requests"] == 0:
                return True
            logger.info("%s: %d request(s) still in flight", instance_id, inst["inflight_requests"])
            time.sleep(0.5)
    return False


def error_message(resp: httpx.Response) -> str:
    """The proxy's error message in ``resp`` (its OpenAI-style body), else the body as it is."""
    try:
        return str(resp.json().get("error", {}).get("message", resp.text))
    except ValueError:
        return resp.text


def run(args: argparse.Namespace) -> int:
    if drain(args.proxy.rstrip("/"), args.instance, args.timeout_s, missing_ok=args.missing_ok):
        print(f"{args.instance} is drained: safe to stop")
        return 0
    print(f"{args.instance} still has work after {args.timeout_s:.0f}s")
    return 1
