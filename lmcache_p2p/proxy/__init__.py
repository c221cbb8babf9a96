"""The disaggregated-serving proxy: an OpenAI-compatible router with a live instance registry.

Owns, by subpackage (each opens with what it owns and must not do):

* ``http/``: the OpenAI endpoints (``app``), request and response shapes, the tokenizer and the
  client's text made from token ids;
* ``router/``: the registry of prefillers and decoders, health gating, routing modes and one class
  per policy, prefix affinity, the admission queue for decoder buffer credit, one request's placement;
* ``handover/``: KV-ready waits on every TP rank, ``Cancel`` for unused KV, one request's handover;
* ``flow/``: one request's steps (prefill -> handover -> decode, an explicit phase), the decode
  session with migration, and the one request path both one process and relay workers drive;
* ``observe/``: metrics, ``/stats`` and the per-request timeline;
* ``relay/``: ``--workers N`` relay processes and their coordinator;
* at the top: flags (``settings``), the errors it answers with (``errors``), HTTP calls to instances
  (``upstream``), the control socket where instances announce themselves and report KV
  (``control``) and process lifetime (``server``).

Metrics: Prometheus at ``GET /metrics``; a TTFT / handover summary line in the log every
``--summary-interval-s``; and for benchmarks ``GET /stats``, a read-only JSON summary of every
sample since start or the last ``POST /stats/reset`` (which answers the window it ended):
``{"window_s", "ttft_ms", "handover_ms", "kv_wait_ms", "timeline_ms", "recent"}``, each summary
``{"count", "mean", "p50", "p99"}`` in milliseconds (null without samples; nearest-rank
percentiles). ttft = request received -> first token; handover = prefill answer received -> first
decode byte; kv_wait = the part of the handover spent waiting for "KV ready". ``timeline_ms`` has
one summary per phase of a disaggregated request (``observe/timeline.py``): queue, prefill, first_byte,
kv_wait, decode_start, decode_first at the proxy, and store, submit, transfer as the prefiller's
sender reports them (``KvSent``); ``recent`` lists the last 256 requests' phases
(``{"req_id", <phase>: ms | null}``); Prometheus has them as ``lmcache_p2p_proxy_phase_seconds{phase}``.

Reading order: ``settings`` -> ``router.registry`` -> ``router.routing`` -> ``flow.placement`` ->
``handover.waiters`` -> ``control`` -> ``http.shaping`` -> ``flow.flow`` -> ``flow.host`` -> ``http.app``
-> ``server``; then ``relay`` for ``--workers N``.

Must not: import lmcache, vllm, torch or nixl (it speaks to instances only over HTTP and the
control protocol); parse addresses out of request ids (routing data travels in
``kv_transfer_params.disagg_spec``); block the event loop; wait without a deadline; configure
logging (only ``cli`` does).
"""
