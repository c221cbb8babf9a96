"""``lmcache-p2p register``: keep an instance that cannot announce itself registered with the proxy; drain it on
SIGTERM.

vLLM's own connectors (``--connector nixl``) speak nothing to the proxy's registry, so the proxy learns such an
instance by URL (``POST /instances/register``, an admin call). Told once, a proxy that restarts forgets it; so
this command registers the instance again every ``--interval-s`` (a renewal for a proxy that knows it; a restarted
proxy knows it again within that time). Each registration carries a ``ttl_s`` (``--ttl-s``, by default three
intervals): a proxy not told again within it takes the instance out and forgets it once idle, so a pod killed
without its drain (node lost, OOM kill) leaves the proxy by itself. On SIGTERM (or SIGINT) it stops registering,
then asks the proxy to drain the instance (``POST /instances/drain``): whatever it registered last lands before that
drain, so it never brings back an instance its pod's preStop is draining. ``deploy kubernetes`` runs it as the
registration sidecar of every vLLM-connector instance pod (docs/KUBERNETES.md).

An answer that says the registration itself is wrong (400: role or URL; 401/403: no or another secret than the
proxy's) ends the command with status 2, so that the misconfiguration shows (a crash-looping sidecar); an
unreachable or failing proxy is tried again at the next interval. Every attempt writes into ``--alive-file`` the
time by which the next one is overdue, which the sidecar's probes compare with the clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from lmcache_p2p.cli.drain import error_message, admin_headers, post_drain
from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

ROLES = ("prefiller", "decoder")
TTL_INTERVALS = 3  # --ttl-s's default, in --interval-s: two registrations in a row may be lost


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from lmcache_p2p.proxy.router.instances import Backend

    p = subparsers.add_parser("register", help="keep an instance of vLLM's own connector registered with the proxy "
                                               "(a pod's sidecar); drain it on SIGTERM",
                              description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", required=True, help="the proxy's HTTP URL, e.g. http://lmcache-p2p-proxy:9100")
    p.add_argument("--role", choices=ROLES, required=True, help="the instance's role")
    p.add_argument("--url", required=True, help="the instance's HTTP URL, as the proxy dials it")
    p.add_argument("--backend", default=Backend.VLLM_NIXL.value,
                   choices=[b.value for b in Backend if not b.announces],
                   help="how the instance moves KV (default %(default)s: vLLM's NixlConnector or NixlPushConnector)")
    p.add_argument("--interval-s", type=float, default=10.0,
                   help="register again this often: a restarted proxy knows the instance again within it "
                        "(default %(default)s)")
    p.add_argument("--ttl-s", type=float, default=None,
                   help="unless registered again within this time the proxy takes the instance out and forgets it "
                        "once idle (a pod gone without its drain); more than --interval-s, or 0: never "
                        f"(default {TTL_INTERVALS} x --interval-s)")
    p.add_argument("--request-timeout-s", type=float, default=10.0,
                   help="each call to the proxy may take this long (default %(default)s)")
    p.add_argument("--alive-file", type=Path, default=None,
                   help="after every attempt, holds the UNIX time (s) by which the next one is overdue (for a probe)")
    p.set_defaults(func=run)
    return p


@dataclasses.dataclass(frozen=True)
class Registration:
    """One instance as the proxy's ``POST /instances/register`` takes it (:meth:`of` checks it as the proxy does)."""

    proxy: str  # the proxy's HTTP URL
    role: str
    url: str
    backend: str
    instance_id: str  # the id the proxy lists it under (what a drain names)
    ttl_s: float | None = None  # the proxy forgets it unless registered again within this time; None: never

    @classmethod
    def of(cls, proxy: str, role: str, url: str, backend: str, ttl_s: float | None = None) -> Registration:
        from lmcache_p2p.proxy.router.instances import registered_id
        from lmcache_p2p.proxy.settings import registration

        spec = registration(role, url, backend, url_key="--url")
        instance_id = registered_id(spec.backend, spec.role, spec.http_url)
        return cls(proxy.rstrip("/"), role, spec.http_url, backend, instance_id, ttl_s)

    @property
    def body(self) -> dict[str, str | float]:
        body: dict[str, str | float] = {"role": self.role, "url": self.url, "backend": self.backend}
        if self.ttl_s is not None:
            body["ttl_s"] = self.ttl_s
        return body


class Refused(Exception):
    """The proxy answered that the registration itself is wrong: trying again cannot help."""


def register_once(client: httpx.Client, reg: Registration, headers: dict[str, str]) -> bool:
    """One registration: True once the proxy holds it, False when it could not be reached or failed (retry);
    raises :class:`Refused` for an answer that says the call is wrong."""
    try:
        resp = client.post(f"{reg.proxy}/instances/register", json=reg.body, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("registering %s with %s: %s (again in the next interval)", reg.url, reg.proxy, exc)
        return False
    if resp.status_code == 200:
        return True
    if 400 <= resp.status_code < 500:
        hint = " (the secret comes from $LMCACHE_P2P_SECRET: the proxy's --shared-secret)" \
            if resp.status_code in (401, 403) else ""
        raise Refused(f"the proxy at {reg.proxy} refused the registration of {reg.url} ({resp.status_code}): "
                      f"{error_message(resp)}{hint}")
    logger.warning("registering %s with %s: status %d (again in the next interval)", reg.url, reg.proxy,
                   resp.status_code)
    return False


def keep_registered(client: httpx.Client, reg: Registration, stop: threading.Event, interval_s: float,
                    headers: dict[str, str], alive_file: Path | None = None, alive_for_s: float = 0.0) -> None:
    """Register ``reg`` every ``interval_s`` until ``stop`` is set, then drain it once (raises :class:`Refused`).
    After each attempt ``alive_file`` holds the UNIX time (s) by which the next one is overdue: now + ``alive_for_s``."""
    held = False
    while not stop.is_set():
        now_held = register_once(client, reg, headers)
        if now_held and not held:
            logger.info("%s registered with the proxy at %s as %s", reg.url, reg.proxy, reg.instance_id)
        held = now_held
        if alive_file is not None:
            _write_alive(alive_file, math.ceil(time.time() + alive_for_s))
        stop.wait(interval_s)
    drain_once(client, reg, headers)


def _write_alive(path: Path, until_s: int) -> None:
    """Replace the file whole: a probe reading it meanwhile sees the old time or the new, never an empty file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(f"{until_s}\n")
    os.replace(partial, path)


def drain_once(client: httpx.Client, reg: Registration, headers: dict[str, str]) -> None:
    """Ask the proxy to drain the instance, without waiting (its pod's preStop waits); not listed is fine."""
    try:
        resp = post_drain(client, reg.proxy, reg.instance_id, headers)
    except httpx.HTTPError as exc:
        logger.warning("draining %s at %s: %s", reg.instance_id, reg.proxy, exc)
        return
    if resp.status_code not in (200, 404):
        logger.warning("draining %s at %s: %s", reg.instance_id, reg.proxy, error_message(resp))
    else:
        logger.info("%s: stopped registering; drain asked (%d)", reg.instance_id, resp.status_code)


def check(args: argparse.Namespace) -> Registration:
    """The flags as a registration; refuses, naming the flag, what the proxy would refuse."""
    for flag, value in (("--interval-s", args.interval_s), ("--request-timeout-s", args.request_timeout_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(flag, f"must be > 0, got {value}")
    ttl_s = TTL_INTERVALS * args.interval_s if args.ttl_s is None else args.ttl_s
    if ttl_s != 0 and not (math.isfinite(ttl_s) and ttl_s > args.interval_s):
        raise ConfigError("--ttl-s", f"must be more than --interval-s ({args.interval_s:g}): the proxy would forget "
                                     f"the instance between two registrations; or 0 (never expires), got {ttl_s:g}")
    return Registration.of(args.proxy, args.role, args.url, args.backend, ttl_s or None)


def run(args: argparse.Namespace) -> int:
    try:
        reg = check(args)
    except ConfigError as exc:
        print(f"lmcache-p2p register: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with httpx.Client(timeout=args.request_timeout_s) as client:
        try:
            # an attempt takes up to the request timeout, then waits the interval: twice that is overdue
            keep_registered(client, reg, stop, args.interval_s, admin_headers(), args.alive_file,
                            alive_for_s=2 * (args.interval_s + args.request_timeout_s))
        except Refused as exc:
            print(f"lmcache-p2p register: error: {exc}", file=sys.stderr)
            return 2
    return 0
