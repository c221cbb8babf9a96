"""Prometheus metrics of one proxy, the rolling TTFT / handover summary it logs, and ``GET /stats``.

Each proxy owns its own ``CollectorRegistry`` (several proxies can live in one test process).
Per-instance gauges are read from the registry at scrape time, so forgotten instances vanish.
Every TTFT / handover / kv_wait sample goes to the Prometheus histogram, to the summary window
(emptied by each summary line) and to the stats window (emptied only by ``reset_stats``, i.e.
``POST /stats/reset``): exact percentiles for benchmarks, independent of the log summary.

Definitions:
  ttft      request received -> first token available (sent at once to a streaming client)
  handover  prefill answer received -> first decode byte (includes the KV wait and any retry)
  kv_wait   prefill answer received -> every rank's KV ready (0 when it was ready first), or failure
  A colocated request (one instance serves it whole, ``colocated_total``) has a TTFT (received ->
  first output of that instance) and no handover.

Per-request timeline (``observe/timeline.py`` defines the phases: queue, prefill, first_byte, kv_wait,
decode_start, kv_after_decode (an early decode's), decode_first, decode_accept at the proxy; store, submit,
transfer and its parts reported by the prefiller):
``lmcache_p2p_proxy_phase_seconds{phase,backend}`` (the pair's KV backend: ``lmcache_p2p``, ``vllm-nixl``, or
``none`` for a request one instance served; ``lmcache_p2p_proxy_backend_requests_total{backend}`` counts the
pairs' requests) and, in ``/stats``, ``timeline_ms`` (count, mean, p50, p99 per phase) and ``recent`` (the
last ``RECENT_TIMELINES`` requests, each phase in ms and its ``backend``).

Where each request's output was decoded, in ``/stats`` ``recent_decodes`` (the last ``RECENT_DECODES``
requests that decoded, colocated ones included): ``{"id": the response id the client got (without its
"cmpl-" / "chatcmpl-"), "parts": [{"instance": id, "from_token": n}, ...]}``, one part per decode
request in order; a part after the first is a stream that broke and continued on that instance, given
the first ``from_token`` output tokens as prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from lmcache_p2p.protocol import KvSent
from lmcache_p2p.proxy.router.registry import Health, Instance, InstanceState
from lmcache_p2p.proxy.observe.timeline import DecodePart, Phase, Timeline, prefiller_phases

_LATENCY_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                      5.0, 10.0, 30.0)
_PREFIX = "lmcache_p2p_proxy_"
_NO_BACKEND = "none"  # the backend label of a request one instance served
RECENT_TIMELINES = 256  # per-request timelines kept for /stats "recent"
RECENT_DECODES = 2048  # per-request decode parts kept for /stats "recent_decodes"
_PENDING_REPORTS = 4096  # prefiller reports (and recorded timelines) kept to be matched by req_id


class ProxyMetrics:
    def __init__(self, instances: Callable[[], Iterable[Instance]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(_PREFIX + "requests", "Client requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter(_PREFIX + "errors", "Failed client requests by endpoint and cause",
                              ["endpoint", "kind"], registry=r)
        self.ttft = Histogram(_PREFIX + "ttft_seconds", "Request received -> first token",
                              ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.handover = Histogram(_PREFIX + "handover_seconds", "Prefill answer -> first decode byte",
                                  buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_wait = Histogram(_PREFIX + "kv_wait_seconds", "Prefill answer -> KV ready on every rank (or failure)",
                                 buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_outcomes = Counter(_PREFIX + "kv_outcomes", "KV handovers by outcome (ready, failed, timeout)",
                                   ["outcome"], registry=r)
        self.kv_bytes = Counter(_PREFIX + "kv_bytes", "KV bytes decoders reported received", registry=r)
        self.early_decodes = Counter(_PREFIX + "early_decodes",
                                     "Decodes sent before their KV was ready (--early-decode), by what the proxy "
                                     "learnt first: kv_ready, decode_first (its first output, or it left its "
                                     "decoder), kv_failed (the decode was closed, the request failed over)",
                                     ["first"], registry=r)
        self.control_messages = Counter(_PREFIX + "control_messages", "Accepted control messages by type",
                                        ["type"], registry=r)
        self.control_rejected = Counter(_PREFIX + "control_rejected", "Rejected control messages by reason",
                                        ["reason"], registry=r)
        self.connect_failures = Counter(_PREFIX + "connect_failures",
                                        "Upstream connections that failed (refused / connect timeout) by role",
                                        ["role"], registry=r)
        self.failovers = Counter(_PREFIX + "failovers", "Calls sent to another instance after a failed connection",
                                 ["phase"], registry=r)
        self.kv_cancels = Counter(_PREFIX + "kv_cancels",
                                  "Cancel messages to decoder ranks for KV the proxy will not use, by result "
                                  "(sent, dropped, refused; deferred: kept for a forgotten decoder; "
                                  "replayed: sent again to a decoder back after being forgotten)", ["result"], registry=r)
        self.colocated = Counter(_PREFIX + "colocated",
                                 "Requests served whole by one instance, no KV transfer, by reason (see router/routing.py) "
                                 "and the serving instance's role", ["reason", "role"], registry=r)
        self.admission = Counter(_PREFIX + "admission",
                                 "Disaggregated requests by admission outcome (immediate, admitted after a wait, "
                                 "timeout, queue_full, refused)", ["outcome"], registry=r)
        self.admission_wait = Histogram(_PREFIX + "admission_wait_seconds",
                                        "Time a request waited for decoder buffer credit",
                                        buckets=_LATENCY_BUCKETS_S, registry=r)
        self.admission_waiting = Gauge(_PREFIX + "admission_waiting", "Requests waiting for decoder buffer credit",
                                       registry=r)
        self.phase = Histogram(_PREFIX + "phase_seconds", "Per-request time by phase (see proxy/observe/timeline.py) "
                               "and the pair's KV backend (none: served by one instance)",
                               ["phase", "backend"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.backend_requests = Counter(_PREFIX + "backend_requests", "Requests served by a prefiller/decoder pair, "
                                        "by the pair's KV backend (lmcache_p2p, vllm-nixl)", ["backend"], registry=r)
        r.register(_InstanceCollector(instances))
        self.reuse = ReuseMetrics(r)
        self.ttft_window = SampleWindow()
        self.handover_window = SampleWindow()
        self._stats = _StatsWindows()
        self._timelines = _TimelineBook()

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint).observe(seconds)
        self.ttft_window.add(seconds)
        self._stats.ttft.add(seconds)

    def observe_handover(self, seconds: float) -> None:
        self.handover.observe(seconds)
        self.handover_window.add(seconds)
        self._stats.handover.add(seconds)

    def observe_kv_wait(self, seconds: float) -> None:
        self.kv_wait.observe(seconds)
        self._stats.kv_wait.add(seconds)

    def record_timeline(self, timeline: Timeline) -> None:
        """A finished request's proxy stamps; its prefiller phases follow once its sender reports them."""
        entry = _Entry(timeline.req_id, timeline.tp_size, {}, timeline.backend or _NO_BACKEND)
        if timeline.backend:
            self.backend_requests.labels(timeline.backend).inc()
        self._observe_phases(entry, timeline.phases())
        self._stats.recent.append(entry)
        if timeline.req_id:
            self._timelines.recorded(entry, self._observe_prefiller)

    def record_decode(self, response_id: str, parts: list[DecodePart]) -> None:
        """Where a finished request's output was decoded (nothing when no decode was sent)."""
        if parts:
            self._stats.decodes.append({"id": response_id, "parts": [
                {"instance": p.instance_id, "from_token": p.from_token} for p in parts]})

    def report_prefiller(self, msg: KvSent) -> None:
        """A sender's ``KvSent``: its phases join the request's timeline (now, or once it is recorded)."""
        self._timelines.reported(msg, self._observe_prefiller)

    def _observe_prefiller(self, entry: _Entry, reports: list[KvSent]) -> None:
        self._observe_phases(entry, prefiller_phases(reports))

    def _observe_phases(self, entry: _Entry, phases: dict[Phase, float]) -> None:
        for phase, seconds in phases.items():
            self.phase.labels(phase.value, entry.backend).observe(seconds)
            self._stats.phases[phase].add(seconds)
            entry.phases_s[phase] = seconds

    def stats(self) -> dict[str, Any]:
        """The body of ``GET /stats``: samples since start or the last ``reset_stats``."""
        return {**self._stats.describe(), **self.reuse.describe()}

    def reset_stats(self) -> dict[str, Any]:
        """Start a new stats window; returns the one that ended (the body of ``POST /stats/reset``)."""
        ended, self._stats = self._stats, _StatsWindows()
        described = {**ended.describe(), **self.reuse.describe()}
        self.reuse.reset()
        return described

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def take_summary(self) -> str | None:
        """One log line over the samples since the last call (None when there were none)."""
        ttft, handover = self.ttft_window.take(), self.handover_window.take()
        if not ttft.count and not handover.count:
            return None
        return f"TTFT {ttft.describe_ms()} | handover {handover.describe_ms()}"


class _InstanceCollector:
    def __init__(self, instances: Callable[[], Iterable[Instance]]) -> None:
        self._instances = instances

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["instance", "role", "url"]
        requests = GaugeMetricFamily(_PREFIX + "instance_inflight_requests", "Requests in flight per instance",
                                     labels=labels)
        tokens = GaugeMetricFamily(_PREFIX + "instance_inflight_tokens", "Tokens in flight per instance",
                                   labels=labels)
        free = GaugeMetricFamily(_PREFIX + "instance_free_slots",
                                 "Decoder receive slots free (announced minus promised)", labels=labels)
        count = GaugeMetricFamily(_PREFIX + "instances", "Registered instances", labels=["role", "state"])
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for inst in self._instances():
            values = [inst.instance_id, inst.role.value, inst.http_url]
            requests.add_metric(values, inst.inflight_requests)
            tokens.add_metric(values, inst.inflight_tokens)
            if (slots := inst.free_slots()) is not None:
                free.add_metric(values, slots)
            state = _state(inst)
            counts[(inst.role.value, state)] += 1
        for role, state in counts:
            count.add_metric([role, state], counts[(role, state)])
        yield from (requests, tokens, free, count)


def _state(inst: Instance) -> str:
    """incomplete, pending (health), down (health), active or draining."""
    if not inst.complete:
        return "incomplete"
    if inst.state is InstanceState.ACTIVE and inst.health is not Health.UP:
        return inst.health.value
    return inst.state.value


@dataclasses.dataclass(frozen=True)
class Stats:
    count: int
    mean_s: float = math.nan
    p50_s: float = math.nan
    p99_s: float = math.nan

    def to_ms(self) -> dict[str, float | int | None]:
        """JSON-friendly, in milliseconds; None where there is no sample."""
        def ms(value_s: float) -> float | None:
            return None if math.isnan(value_s) else round(value_s * 1e3, 3)

        return {"count": self.count, "mean": ms(self.mean_s), "p50": ms(self.p50_s), "p99": ms(self.p99_s)}

    def describe_ms(self) -> str:
        if not self.count:
            return "n=0"
        return (f"n={self.count} mean {self.mean_s * 1e3:.1f} ms, p50 {self.p50_s * 1e3:.1f} ms, "
                f"p99 {self.p99_s * 1e3:.1f} ms")


class SampleWindow:
    """Samples since the last ``take`` (bounded; the oldest fall out under a flood)."""

    def __init__(self, max_samples: int = 100_000) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=max_samples)

    def add(self, value_s: float) -> None:
        self._samples.append(value_s)

    def take(self) -> Stats:
        stats = self.peek()
        self._samples.clear()
        return stats

    def peek(self) -> Stats:
        """The samples' statistics, leaving them in the window."""
        samples = sorted(self._samples)
        if not samples:
            return Stats(0)
        return Stats(len(samples), sum(samples) / len(samples), _percentile(samples, 50), _percentile(samples, 99))


@dataclasses.dataclass(eq=False)
class _Entry:
    """One request's phases as ``/stats`` lists them (filled in as they become known)."""

    req_id: str
    tp_size: int
    phases_s: dict[Phase, float]
    backend: str

    def to_ms(self) -> dict[str, Any]:
        out: dict[str, Any] = {"req_id": self.req_id, "backend": self.backend}
        for phase in Phase:
            seconds = self.phases_s.get(phase)
            out[phase.value] = None if seconds is None else round(seconds * 1e3, 3)
        return out


class _TimelineBook:
    """Matches prefiller reports with recorded timelines by req_id, whichever comes first (bounded)."""

    def __init__(self, max_entries: int = _PENDING_REPORTS) -> None:
        self._max = max_entries
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._reports: collections.OrderedDict[str, list[KvSent]] = collections.OrderedDict()

    def recorded(self, entry: _Entry, complete: Callable[[_Entry, list[KvSent]], None]) -> None:
        _bounded_put(self._entries, entry.req_id, entry, self._max)
        self._maybe_complete(entry.req_id, complete)

    def reported(self, msg: KvSent, complete: Callable[[_Entry, list[KvSent]], None]) -> None:
        reports = self._reports.get(msg.req_id)
        if reports is None:
            reports = []
            _bounded_put(self._reports, msg.req_id, reports, self._max)
        if all(r.tp_rank != msg.tp_rank for r in reports):
            reports.append(msg)
        self._maybe_complete(msg.req_id, complete)

    def _maybe_complete(self, req_id: str, complete: Callable[[_Entry, list[KvSent]], None]) -> None:
        entry, reports = self._entries.get(req_id), self._reports.get(req_id)
        # One report per sender rank: the prefiller's TP size (its reports say it), else the decoder's.
        if entry is None or not reports or len(reports) < (reports[0].tp_size or entry.tp_size):
            return
        del self._entries[req_id], self._reports[req_id]
        complete(entry, reports)


def _bounded_put(table: collections.OrderedDict[str, Any], key: str, value: Any, max_entries: int) -> None:
    table[key] = value
    while len(table) > max_entries:
        table.popitem(last=False)


class _StatsWindows:
    """What ``GET /stats`` reports: every sample since this object was made."""

    def __init__(self) -> None:
        self.started_s = time.monotonic()
        self.ttft = SampleWindow()
        self.handover = SampleWindow()
        self.kv_wait = SampleWindow()
        self.phases = {phase: SampleWindow() for phase in Phase}
        self.recent: collections.deque[_Entry] = collections.deque(maxlen=RECENT_TIMELINES)
        self.decodes: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_DECODES)

    def describe(self) -> dict[str, Any]:
        return {"window_s": round(time.monotonic() - self.started_s, 3), "ttft_ms": self.ttft.peek().to_ms(),
                "handover_ms": self.handover.peek().to_ms(), "kv_wait_ms": self.kv_wait.peek().to_ms(),
                "timeline_ms": {phase.value: window.peek().to_ms() for phase, window in self.phases.items()},
                "recent": [entry.to_ms() for entry in self.recent], "recent_decodes": list(self.decodes)}


def _percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


# ---- prefix reuse: what each request reused, computed and moved ----------------------------------

_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_BYTE_BUCKETS = (0, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30, 1 << 32)
RECENT_REQUESTS_MAX = 4096  # per-request records kept for GET /stats (oldest fall out)


@dataclasses.dataclass(frozen=True)
class RequestReuse:
    """One request's reuse as the proxy learnt it; None: not known (an old peer, a flag not set).

    ``cached_tokens``: prompt tokens the prefiller did not compute (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``);
    ``kv_bytes``: KV bytes moved to the decoder (KvReady ``bytes_received`` when the decoder reports
    it, else ``nbytes``: everything moved); ``chunks_held``: chunks the decoder already held (KvReady);
    ``decoder_hit_tokens``: the prompt tokens of those held chunks; ``kv_moved_tokens``: prompt tokens
    whose KV the prefiller sent for this request; ``decoder_kv_tokens``: prompt tokens whose KV was
    ready on the decoder before it ran (moved + held: what its LMCache lookup can hit).
    """

    response_id: str
    prompt_tokens: int
    prefiller: str | None = None
    decoder: str | None = None
    cached_tokens: int | None = None
    kv_bytes: int | None = None
    chunks_held: int | None = None
    decoder_hit_tokens: int | None = None
    kv_moved_tokens: int | None = None
    decoder_kv_tokens: int | None = None

    @property
    def prefill_tokens_computed(self) -> int | None:
        if self.cached_tokens is None:
            return None
        return max(self.prompt_tokens - self.cached_tokens, 0)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prefill_tokens_computed": self.prefill_tokens_computed}


class ReuseMetrics:
    """Prefix hit tokens per instance, prefill tokens computed and KV bytes moved per request, and the
    ``prefix`` policy's decisions; in Prometheus and in ``GET /stats`` (``reuse`` and ``requests``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hit_tokens = Counter(_PREFIX + "prefix_hit_tokens",
                                  "Prompt tokens an instance did not compute or receive: a prefiller's cached tokens "
                                  "(usage.prompt_tokens_details), a decoder's chunks already held (KvReady) x chunk "
                                  "tokens", ["instance", "role"], registry=r)
        self.prefill_computed = Histogram(_PREFIX + "prefill_tokens_computed",
                                          "Prompt tokens a prefiller computed per request (prompt - cached); only "
                                          "when the prefiller reports cached tokens", buckets=_TOKEN_BUCKETS,
                                          registry=r)
        self.kv_moved = Histogram(_PREFIX + "kv_bytes_per_request", "KV bytes moved to the decoder per request",
                                  buckets=_BYTE_BUCKETS, registry=r)
        self.routed = Counter(_PREFIX + "prefix_routed",
                              "--policy prefix choices by role and decision (match, no_match, imbalanced, no_prefix)",
                              ["role", "decision"], registry=r)
        self._recent: collections.deque[RequestReuse] = collections.deque(maxlen=RECENT_REQUESTS_MAX)
        self._hits: collections.Counter[str] = collections.Counter()
        self._decisions: collections.Counter[str] = collections.Counter()

    def observe_decision(self, role: str, decision: str) -> None:
        self.routed.labels(role, decision).inc()
        self._decisions[f"{role}:{decision}"] += 1

    def observe_request(self, reuse: RequestReuse) -> None:
        if reuse.prefiller is not None and reuse.cached_tokens is not None:
            self.hit_tokens.labels(reuse.prefiller, "sender").inc(reuse.cached_tokens)
            self._hits[reuse.prefiller] += reuse.cached_tokens
        if reuse.decoder is not None and reuse.decoder_hit_tokens is not None:
            self.hit_tokens.labels(reuse.decoder, "receiver").inc(reuse.decoder_hit_tokens)
            self._hits[reuse.decoder] += reuse.decoder_hit_tokens
        if (computed := reuse.prefill_tokens_computed) is not None:
            self.prefill_computed.observe(computed)
        if reuse.kv_bytes is not None:
            self.kv_moved.observe(reuse.kv_bytes)
        self._recent.append(reuse)

    def reset(self) -> None:
        self._recent.clear()
        self._hits.clear()
        self._decisions.clear()

    def describe(self) -> dict[str, Any]:
        records = list(self._recent)
        computed = [c for r in records if (c := r.prefill_tokens_computed) is not None]
        moved = [r.kv_bytes for r in records if r.kv_bytes is not None]
        return {
            "reuse": {"requests": len(records), "prefill_tokens_computed": _totals(computed),
                      "kv_bytes_per_request": _totals(moved), "prefix_hit_tokens": dict(self._hits),
                      "prefix_decisions": dict(self._decisions)},
            "requests": [r.to_json() for r in records],
        }


def _totals(values: list[int]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "sum": 0, "mean": None}
    return {"count": len(values), "sum": sum(values), "mean": round(sum(values) / len(values), 3)}
