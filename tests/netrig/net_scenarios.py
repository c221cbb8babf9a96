"""Network faults between rig hosts, as fault-suite scenarios (``fault_scenarios.Scenario``).

Each one runs a client load through the proxy while it changes the network, then gives the link
back and measures how long the proxy takes to route to the victim again (``cluster.recovery``,
seconds from the link's return until the victim is routable; None when it never was within
``RECOVERY_TIMEOUT_S``). The suite judges every row as the fault suite does: every request ends
within its deadline (success or a clean error), no slot is held after the load settles, every
success equals the plain instance's greedy output, the deployment serves again.

The victim is the last decoder (``decoder-0`` in 1P1D, ``decoder-1`` in 1P2D); mid-transfer, the decoder
with requests in flight. Faults:

- ``decoder_cut_mid_transfer`` / ``decoder_cut_mid_stream``: the victim's host loses its link
  right after the prefiller stored a long prompt's first chunks (KV on its way) / while streams it
  decodes are mid-way; the link stays down ``CUT_HOLD_S`` (beyond the proxy's instance TTL), then
  comes back.
- ``requests_into_a_cut_decoder``: the victim's host loses its link for ``INTO_CUT_HOLD_S`` (below the
  KV timeout), and requests are sent meanwhile: routed to it until the proxy learns it is down, each must
  be served without waiting out ``--kv-timeout-s`` (its prefiller continues: its prefix cache holds the
  prompt); the row's notes give the slowest (``into_cut_slowest_s``).
- ``partition_proxy_decoder``: the proxy and the victim cannot reach each other (both directions
  dropped) while the prefiller still reaches it; ``partition_prefiller_decoder``: the reverse.
- ``packet_loss_1pct``: 1 % of the packets between any two hosts dropped (TCP retransmits).
- ``rtt_20ms``: 20 ms added to every round trip between hosts.
- ``decoder_host_restart_same_address``: the victim's host goes down (link cut, its vLLM killed),
  comes back with the same address and its vLLM starts again; a load runs meanwhile.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import mh_cluster  # noqa: F401 (puts tests/faults on sys.path)
from fault_scenarios import FAULT_WAIT_S, Result, Scenario, Suite, cycle
from net_suite import wait_routable_s

CUT_HOLD_S = 15.0  # beyond the suite's instance TTL (6 s) plus a heartbeat
PARTITION_HOLD_S = 20.0
RECOVERY_TIMEOUT_S = 120.0
TAIL_CHUNKS = 4  # a tail prompt's KV (net_suite's fresh prompts: at most 1000 tokens, 256 per chunk)
INTO_CUT_HOLD_S = 8.0
KV_TIMEOUT_S = 10.0  # the proxy's --kv-timeout-s (its default; the suite's deployment keeps it)
ROOM_TIMEOUT_S = 30.0  # beyond the suite's write window (transfer_timeout_s + quarantine_margin_s, 15 s)


def victim(s: Suite) -> str:
    return s.c.names("decoder")[-1]


def _back_and_timed(s: Suite, name: str, give_back: Callable[[], None]) -> None:
    """Give the network back, then time how long until the proxy routes to ``name`` again."""
    give_back()
    s.c.recovery[name] = s.c.last_recovery = wait_routable_s(s.c, name, RECOVERY_TIMEOUT_S)


def _tail(s: Suite, name: str) -> tuple[list, int, int]:
    """After a fault: a short load of prompts no instance has seen (the prefix router would send prompts
    seen during the fault to the instances that served them); (outcomes, lookups on ``name``, of them
    with KV loaded)."""
    offset = len(s.c.lookups(name))
    prompts, s.w.fresh = s.w.fresh[:8], s.w.fresh[8:]
    outcomes = s.load(prompts if len(prompts) == 8 else cycle(s.w.mid, 8), 4)
    kv = s.kv_hits_since(name, offset)
    return outcomes, kv.lookups, kv.loaded


def _room_s(s: Suite, name: str) -> float | None:
    """Seconds until ``name`` announces room for a tail prompt (TAIL_CHUNKS free slots); None past ROOM_TIMEOUT_S.
    Slots granted to KV that a cut stopped stay quarantined for the receiver's write window: by design, a late
    write must not land in a slot given to another request, so the returning decoder has no room until then."""
    start = time.monotonic()
    while time.monotonic() - start < ROOM_TIMEOUT_S:
        free, capacity = s.c.decoder_slots().get(name, (0, 0))
        if free >= min(TAIL_CHUNKS, capacity) > 0:
            return round(time.monotonic() - start, 2)
        time.sleep(0.25)
    return None


def _finish(s: Suite, name: str, outcomes: list, notes: list[str]) -> Result:
    recovery = s.c.recovery.get(name)
    room = _room_s(s, name) if recovery is not None else None
    tail, lookups, loaded = _tail(s, name)
    notes.append(f"{name} routable {recovery}s after the network came back, room for a prompt {room}s after that; "
                 f"then {lookups} lookups on it, {loaded} loaded KV")
    return Result(outcomes + tail, recovered=recovery is not None and loaded > 0, notes=notes)


def across_hosts(s: Suite) -> Result:
    """No fault: mid and long prompts, 4 in flight, every decoder's KV loads counted."""
    decoders = s.c.names("decoder")
    offsets = {d: len(s.c.lookups(d)) for d in decoders}
    outcomes = s.load(cycle([*s.w.mid, *s.w.long], s.cfg.n(8, 24)), 4)
    notes = []
    for d in decoders:
        kv = s.kv_hits_since(d, offsets[d])
        notes.append(f"{d}: {kv.lookups} lookups, {kv.loaded} loaded KV")
    return Result(outcomes, notes=notes)


def _cut_during(s: Suite, prompts: list, concurrency: int, moment: Callable[[dict], bool], what: str,
                busiest: bool = False) -> Result:
    """Cut the victim's link at ``moment``; ``busiest``: the victim is then the decoder with the most
    requests in flight (the one the KV is on its way to), not the last one."""
    chosen = {"name": victim(s)}
    notes: list[str] = []

    def fault(progress: dict) -> None:
        ok = s.wait_until(lambda: moment(progress), timeout_s=FAULT_WAIT_S, poll_s=0.01)
        if busiest:
            chosen["name"] = max(s.c.names("decoder"), key=s.c.inflight)
        name = chosen["name"]
        s.c.rig.cut(name)
        tokens = sorted(len(ids) for ids in list(progress.values()))
        notes.append(f"cut {name}'s link {what}; tokens per open stream then: {tokens}"
                     + ("" if ok else " (moment not reached)"))
        time.sleep(CUT_HOLD_S)
        _back_and_timed(s, name, lambda: s.c.rig.restore(name))

    outcomes = s.load(prompts, concurrency, fault)
    return _finish(s, chosen["name"], outcomes, notes)


def decoder_cut_mid_transfer(s: Suite) -> Result:
    prefiller = s.c.names("prefiller")[0]
    stores_before = s.c.kv_stores(prefiller)
    return _cut_during(s, cycle(s.w.long, s.cfg.n(4, 8)), 2,
                       lambda _p: s.c.kv_stores(prefiller) > stores_before,
                       "after the prefiller's first store step of a long prompt", busiest=True)


def decoder_cut_mid_stream(s: Suite) -> Result:
    name = victim(s)
    loads_before = s.c.kv_loads(name)

    def streaming(progress: dict) -> bool:
        started = sum(1 for ids in list(progress.values()) if len(ids) >= 8)
        return s.c.kv_loads(name) > loads_before and started >= 1

    return _cut_during(s, cycle(s.w.stream, s.cfg.n(3, 6)), s.cfg.n(3, 6), streaming,
                       "while it streams")


def requests_into_a_cut_decoder(s: Suite) -> Result:
    """The victim's link is cut, then requests are sent while it stays down; each must end well before the
    KV timeout (the handover cannot happen: the proxy fails over as soon as it knows)."""
    name = victim(s)
    s.c.rig.cut(name)
    cut_s = time.monotonic()

    def back(_progress: dict) -> None:
        time.sleep(max(0.0, cut_s + INTO_CUT_HOLD_S - time.monotonic()))
        _back_and_timed(s, name, lambda: s.c.rig.restore(name))

    try:
        outcomes = s.load(cycle(s.w.mid, 4), 4, back)
    finally:
        s.c.rig.restore(name)  # idempotent: back() gave the link back unless the load failed first
    into = [o.elapsed_s for o in outcomes if o.started_s < cut_s + INTO_CUT_HOLD_S]
    notes = [f"{name}'s link cut {INTO_CUT_HOLD_S:.0f} s; sent into the cut: {len(into)} requests, "
             f"slowest {max(into, default=0.0):.2f} s (--kv-timeout-s {KV_TIMEOUT_S:.0f} s)"]
    return _finish(s, name, outcomes, notes)


def into_cut_slowest_s(notes: str) -> float | None:
    """The slowest request sent into the cut, from ``requests_into_a_cut_decoder``'s notes."""
    m = re.search(r"sent into the cut: \d+ requests, slowest ([\d.]+) s", notes)
    return float(m.group(1)) if m else None


def _partitioned(a: str) -> Callable[[Suite], Result]:
    def run(s: Suite) -> Result:
        name = victim(s)
        other = a if a != "prefiller" else s.c.names("prefiller")[0]
        notes = [f"{other} <-/-> {name} for {PARTITION_HOLD_S:.0f}s; every other pair connected"]

        def fault(_progress: dict) -> None:
            s.c.rig.partition(other, name)
            time.sleep(PARTITION_HOLD_S)
            _back_and_timed(s, name, s.c.rig.heal)

        outcomes = s.load(cycle(s.w.mid, s.cfg.n(8, 16)), 4, fault)
        return _finish(s, name, outcomes, notes)

    run.__doc__ = f"{a} and the victim decoder cannot reach each other; every other pair can."
    return run


def _impaired(delay_ms: float = 0.0, loss: float = 0.0) -> Callable[[Suite], Result]:
    def run(s: Suite) -> Result:
        name = victim(s)
        s.c.rig.impair(delay_ms=delay_ms, loss=loss, block=[])
        try:
            outcomes = s.load(cycle([*s.w.mid, *s.w.stream[:2]], s.cfg.n(10, 20)), 4)
            counts = s.c.rig.emulator_counts()
        finally:
            _back_and_timed(s, name, s.c.rig.heal)
        notes = [f"one-way delay {delay_ms} ms per router crossing, loss {loss:.1%}; emulator {counts}"]
        return _finish(s, name, outcomes, notes)

    return run


def decoder_host_restart_same_address(s: Suite) -> Result:
    """The victim's host goes down (link cut, its vLLM killed), comes back with the same address and
    its vLLM starts again, while a load runs."""
    name = victim(s)
    notes: list[str] = []

    def fault(_progress: dict) -> None:
        time.sleep(1.0)
        s.c.rig.cut(name)
        s.c.kill(name)
        time.sleep(3.0)

        def back() -> None:
            s.c.rig.restore(name)
            s.c.restart(name)

        _back_and_timed(s, name, back)  # includes its vLLM's start-up
        notes.append(f"{name}'s host down 3 s (link cut, vLLM killed), then back on {s.c.host_of(name)}")

    outcomes = s.load(cycle(s.w.mid, s.cfg.n(8, 16)), 4, fault)
    s.c.wait_up([name], s.cfg.restart_timeout_s)
    return _finish(s, name, outcomes, notes)


ALL = [
    Scenario("across_hosts", across_hosts, all_succeed=True),
    Scenario("decoder_cut_mid_transfer", decoder_cut_mid_transfer),
    Scenario("decoder_cut_mid_stream", decoder_cut_mid_stream),
    Scenario("requests_into_a_cut_decoder", requests_into_a_cut_decoder),
    Scenario("partition_proxy_decoder", _partitioned("proxy")),
    Scenario("partition_prefiller_decoder", _partitioned("prefiller")),
    Scenario("packet_loss_1pct", _impaired(loss=0.01), all_succeed=True),
    Scenario("rtt_20ms", _impaired(delay_ms=10.0), all_succeed=True),
    Scenario("decoder_host_restart_same_address", decoder_host_restart_same_address),
]
BY_NAME = {s.name: s for s in ALL}
