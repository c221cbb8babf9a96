"""What every part of one request's flow shares: the proxy's services, the flow's settings, and the
request's own facts (its body, prompt ids, stamps, how it is served).

It owns these plain holders only. It must not decide anything (no routing, no waiting, no I/O):
the parts that do (``flow/placement.py``, ``flow/prefill.py``, ``flow/handover.py``, ``flow/output.py``, ``flow/flow.py``)
read and fill them. The flow's settings are derived from ``ProxySettings``: no default is declared
here, so each is written once (``settings.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from lmcache_p2p.proxy.router.admission import AdmissionQueue
from lmcache_p2p.proxy.handover.cancel import KvCanceller
from lmcache_p2p.proxy.errors import NoInstanceAvailable
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics, RequestReuse
from lmcache_p2p.proxy.router.prefix import PromptPrefix
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.router.routing import ColocatedReason, Router
from lmcache_p2p.proxy.settings import KvFailurePolicy, ProxySettings
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.observe.timeline import Timeline
from lmcache_p2p.proxy.http.tokenizer import TokenizerProvider
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.handover.waiters import KvWaiters


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    """The knobs of one request's flow, as ``ProxySettings`` holds them (see there for defaults)."""

    kv_timeout_s: float
    kv_probe_after_s: float  # 0: a KV wait never probes its decoder
    early_decode: bool  # an lmcache_p2p pair's decode goes out before its KV is ready (RequestFlow.settled)
    health_probe_timeout_s: float
    prefill_timeout_s: float
    decode_idle_timeout_s: float
    on_kv_failure: KvFailurePolicy
    admission_timeout_s: float
    admission_queue_max: int
    migration_limit: int  # mid-stream moves of one request's decode to another instance
    chat_parsers: bool  # every chat decode goes to the decoder's chat endpoint (RequestContext.instance_renders)
    tokenizer_wait_s: float  # longest a request waits for the tokenizer's first load

    @classmethod
    def of(cls, settings: ProxySettings) -> FlowSettings:
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(eq=False)
class Services:
    """One per proxy: what every request's flow uses."""

    registry: Registry
    router: Router
    waiters: KvWaiters
    upstream: Upstream
    canceller: KvCanceller
    metrics: ProxyMetrics
    settings: FlowSettings
    clock: Callable[[], float]
    admission: AdmissionQueue
    tokenizers: TokenizerProvider


@dataclasses.dataclass(eq=False)
class RequestContext:
    """One request's facts, filled in as its flow learns them."""

    req: ClientRequest
    headers: Mapping[str, str]
    received_s: float
    response_id: str
    timeline: Timeline
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    colocated: ColocatedReason | None = None  # set when one instance serves the whole request
    prefix: PromptPrefix | None = None  # the prompt's chunk hashes (--policy prefix)
    reuse: RequestReuse | None = None  # what the prefill and the KV handover reused and moved
    prefill_done_s: float = 0.0
    first_text_final: bool = False  # the first token's text is the prefiller's, even when empty (it detokenizes)
    # the decoder's chat endpoint renders the answer (its reasoning and tool parsers): see flow/flow.py
    instance_renders: bool = False


def nothing_routable() -> NoInstanceAvailable:
    return NoInstanceAvailable("no prefiller or decoder available: start one (p2p.proxy_url -> this proxy's control "
                               "port) or pass --prefill / --decode URL")
