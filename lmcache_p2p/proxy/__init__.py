"""The disaggregated-serving proxy: an OpenAI-compatible router with a live instance registry.

Owns: the HTTP endpoints clients call (``app.py``), one request's prefill -> wait for KV ->
decode orchestration (``flow.py``), the request and response shapes of the OpenAI API
(``shaping.py``, ``responses.py``), the registry of prefillers and decoders (``registry.py``),
health gating of instances (``health.py``), routing policies and colocated serving
(``routing.py``), the queue where requests wait for decoder buffer credit (``admission.py``), the control socket
where instances announce themselves and report "KV ready" (``control.py``, ``waiters.py``), the
Cancel sent to decoders for KV the proxy will not use (``cancel.py``), upstream HTTP calls
(``upstream.py``), metrics (``metrics.py``) and the per-request timeline (``timeline.py``), flags (``settings.py``), the errors it answers with
(``errors.py``) and process lifetime (``server.py``).

Metrics: Prometheus at ``GET /metrics``; a TTFT / handover summary line in the log every
``--summary-interval-s``; and for benchmarks ``GET /stats``, a read-only JSON summary of every
sample since start or the last ``POST /stats/reset`` (which answers the window it ended):
``{"window_s", "ttft_ms", "handover_ms", "kv_wait_ms", "timeline_ms", "recent"}``, each summary
``{"count", "mean", "p50", "p99"}`` in milliseconds (null without samples; nearest-rank
percentiles). ttft = request received -> first token; handover = prefill answer received -> first
decode byte; kv_wait = the part of the handover spent waiting for "KV ready". ``timeline_ms`` has
one summary per phase of a disaggregated request (``timeline.py``): queue, prefill, first_byte,
kv_wait, decode_start, decode_first at the proxy, and store, submit, transfer as the prefiller's
sender reports them (``KvSent``); ``recent`` lists the last 256 requests' phases
(``{"req_id", <phase>: ms | null}``); Prometheus has them as ``lmcache_p2p_proxy_phase_seconds{phase}``.

Reading order: ``settings`` -> ``registry`` -> ``health`` -> ``routing`` -> ``admission`` -> ``waiters`` -> ``control``
-> ``cancel`` -> ``shaping`` -> ``responses`` -> ``flow`` -> ``app`` -> ``server``.

Must not: import lmcache, vllm, torch or nixl (it speaks to instances only over HTTP and the
control protocol); parse addresses out of request ids (routing data travels in
``kv_transfer_params.disagg_spec``); block the event loop; wait without a deadline; configure
logging (only ``cli`` does).
"""
