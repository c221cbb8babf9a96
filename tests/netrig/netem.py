"""A userspace network emulator on a TUN device: added delay, packet loss and pair partitions.

Run inside the rig's router namespace (``tests/netrig/rig.py`` starts it there)::

    ip netns exec <router> python netem.py --tun tun0

The router sends every packet it forwards to the TUN device while the rig wants impairment (policy
routing: ``ip rule iif <host link> lookup <table>``, the table's default route is the TUN device).
This process reads each IPv4 packet, decides its fate and writes it back to the TUN device, where
the router's kernel forwards it on by its main table to the destination host's link.

Why userspace: this machine's kernel has no netem qdisc (``tc`` knows pfifo and tbf only) and
no iptables binary. What it models and what it does not:

- delay: every packet is held ``delay_ms`` before it goes on (one crossing of the router, so a
  round trip between two hosts gets ``2 * delay_ms``). Constant, no jitter, FIFO (no reordering).
- loss: each packet is dropped with probability ``loss`` (independent, Bernoulli), at IP level, so
  TCP sees real loss: retransmissions, RTO stalls (Linux: 200 ms minimum), shrunken windows.
- partition: packets whose (source, destination) addresses are in ``block`` are dropped silently,
  as a firewall that drops would; the other direction is blocked only when listed too.
- not modelled: bandwidth limits (the rig can put ``tc tbf`` on a link), jitter, reordering,
  duplication, corruption, MTU problems. The emulator's own per-packet cost (a few tens of
  microseconds on an idle core; more when the machine's cores are busy) adds to every packet
  routed through it, with or without ``delay_ms``: compare runs that both go through it.

Control: one JSON object per line on stdin, each answered by one line ``ok <n>`` on stdout once it
applies: ``{"delay_ms": 10, "loss": 0.01, "block": [["198.18.1.2", "198.18.2.2"]], "seed": 1}``;
keys left out keep their value. EOF on stdin ends the process. Counters (``{"stats": true}``)
answer as one JSON line: packets passed, dropped by loss, dropped by block.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import socket
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET_BYTES = 65536


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Emulator:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.delay_s = 0.0
        self.loss = 0.0
        self.block: set[tuple[bytes, bytes]] = set()
        self.rng = random.Random(0)
        self.heap: list[tuple[float, int, bytes]] = []
        self.seq = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.counts = {"passed": 0, "lost": 0, "blocked": 0}

    def apply(self, cmd: dict) -> None:
        with self.cond:
            if "delay_ms" in cmd:
                self.delay_s = float(cmd["delay_ms"]) / 1000.0
            if "loss" in cmd:
                self.loss = float(cmd["loss"])
            if "block" in cmd:
                self.block = {(socket.inet_aton(a), socket.inet_aton(b)) for a, b in cmd["block"]}
            if "seed" in cmd:
                self.rng.seed(int(cmd["seed"]))

    def read_loop(self) -> None:
        while not self.stopped:
            try:
                pkt = os.read(self.fd, MAX_PACKET_BYTES)
            except OSError:
                return
            if len(pkt) < 20 or pkt[0] >> 4 != 4:
                continue  # IPv4 only (the rig has no IPv6 addresses)
            with self.cond:
                if (pkt[12:16], pkt[16:20]) in self.block:
                    self.counts["blocked"] += 1
                    continue
                if self.loss and self.rng.random() < self.loss:
                    self.counts["lost"] += 1
                    continue
                self.counts["passed"] += 1
                if self.delay_s <= 0 and not self.heap:
                    self._write(pkt)
                    continue
                self.seq += 1
                heapq.heappush(self.heap, (time.monotonic() + self.delay_s, self.seq, pkt))
                self.cond.notify()

    def write_loop(self) -> None:
        with self.cond:
            while not self.stopped:
                if not self.heap:
                    self.cond.wait(0.5)
                    continue
                due = self.heap[0][0] - time.monotonic()
                if due > 0:
                    self.cond.wait(due)
                    continue
                _, _, pkt = heapq.heappop(self.heap)
                self._write(pkt)

    def _write(self, pkt: bytes) -> None:
        try:
            os.write(self.fd, pkt)
        except OSError:
            pass  # the kernel refused it (no route any more): a dropped packet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tun", required=True, help="the TUN device to create and serve")
    args = p.parse_args()
    emu = Emulator(open_tun(args.tun))
    for target in (emu.read_loop, emu.write_loop):
        threading.Thread(target=target, name=target.__name__, daemon=True).start()
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("stats"):
            with emu.cond:
                print(json.dumps(emu.counts), flush=True)
            continue
        emu.apply(cmd)
        n += 1
        print(f"ok {n}", flush=True)
    emu.stopped = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
