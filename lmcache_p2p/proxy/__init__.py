"""The disaggregated-serving proxy: an OpenAI-compatible router with a live instance registry.

Owns, by part (each subpackage opens with what it owns and must not do). The parts form layers:
each imports only parts below it (``scripts/check_shape.py`` fails on two parts that import each
other, and on any import circle):

* ``server``: process lifetime (one process, or the coordinator of ``--workers N``);
* ``relay/``: ``--workers N`` relay processes, their coordinator, and the one place steps become
  wire messages (``relay/link.py``);
* ``app``: the OpenAI endpoints; a generation request runs as a ``flow.client.ClientFlow``;
* ``flow/``: one request, end to end: the typed step API (``flow/steps.py``) that its ``RequestFlow``
  implements, its placement, prefill attempts, KV handover, decode session with migration, output;
* ``control``: the control socket where instances announce themselves and report KV;
* ``handover/``: the KV-ready waiters on every TP rank and ``Cancel`` for unused KV (services);
* ``http/``: request and response shapes, the tokenizer and the client's text made from token ids;
* ``observe/``: metrics, ``/stats`` and the per-request timeline;
* ``router/``: the registry of prefillers and decoders, health gating, routing modes and one class
  per policy, prefix affinity, decoder buffer credit and the admission queue for it;
* at the bottom: flags (``settings``), the HTTP port (``listener``), HTTP calls to instances
  (``upstream``) and the errors it answers with (``errors``).

Metrics: Prometheus at ``GET /metrics``; a TTFT / handover summary line in the log every
``--summary-interval-s``; and for benchmarks ``GET /stats``, a read-only JSON summary of every
sample since start or the last ``POST /stats/reset`` (which answers the window it ended):
``{"window_s", "ttft_ms", "handover_ms", "kv_wait_ms", "timeline_ms", "recent"}``, each summary
``{"count", "mean", "p50", "p99"}`` in milliseconds (null without samples; nearest-rank
percentiles). ttft = request received -> first token; handover = prefill answer received -> first
decode byte; kv_wait = prefill answer -> "KV ready" (the part of the handover spent waiting for it, unless
``--early-decode`` sent the decode before: then it runs beside the decode). ``timeline_ms`` has one summary
per phase of a disaggregated request (``observe/timeline.py``): queue, prefill, first_byte, kv_wait,
decode_start, kv_after_decode (an early decode's: decode sent -> KV ready), decode_first and decode_accept
within it at the proxy, and store, submit, transfer and its parts as the prefiller's sender reports them (``KvSent``);
``recent`` lists the last 256 requests' phases (``{"req_id", "backend", <phase>: ms | null}``); Prometheus has
them as ``lmcache_p2p_proxy_phase_seconds{phase,backend}``, and early decodes by what came first as
``lmcache_p2p_proxy_early_decodes_total{first}``.

Reading order: ``settings`` -> ``router.registry`` -> ``router.routing`` -> ``handover.waiters`` ->
``control`` -> ``http.shaping`` -> ``flow.steps`` -> ``flow.flow`` (then ``flow.placement``,
``flow.prefill``, ``flow.handover``, ``flow.decode``) -> ``flow.client`` -> ``app`` -> ``server``; then
``relay`` for ``--workers N`` (``relay.link`` -> ``relay.host`` -> ``relay.coordinator``).

Must not: import lmcache, vllm, torch or nixl (it speaks to instances only over HTTP and the
control protocol); parse addresses out of request ids (routing data travels in
``kv_transfer_params.disagg_spec``); block the event loop; wait without a deadline; configure
logging (only ``cli`` does).
"""
