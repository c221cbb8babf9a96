"""A real LMCache engine in its own process, driven by JSON lines on stdin/stdout.

Used by the engine-level tests: one process is the prefiller (SenderBackend loaded from a YAML
through ``storage_plugins``), another the decoder (ReceiverBackend). The only stand-in is the
serving engine's KV memory: ``FlatKVConnector`` keeps one sequence's KV as a plain tensor
[2, layers, tokens, hidden] (KV_2LTD), generated from a seed so both processes know the truth.

Environment: ``P2P_ENGINE_DEVICE=cuda:N`` runs the engine as a GPU worker on that GPU (the KV
tensor lives there; LMCache then keeps chunks in pinned host memory and passes dst_device
"cuda:N" to the plugin); ``P2P_ENGINE_SHAPE=llama8b`` uses Llama-3.1-8B's KV shape (32 layers,
8 KV heads x 128: one 256-token bf16 chunk is 32 MiB) instead of the tiny default.

Tensor parallelism: ``P2P_ENGINE_TP=SIZE:RANK`` makes the engine rank RANK of a TP group of SIZE
(LMCache's world_size / worker_id); it holds that rank's KV heads of the model's
``P2P_ENGINE_KV_HEADS`` (default: the shape's), split as vLLM splits them (``kv_layout``), and every
comparison is against that rank's slice of the model's KV. ``P2P_ENGINE_MLA=1``: an MLA model (one
latent of ``MLA_WIDTH`` values per token and layer, the same on every rank). A store's ``ports``
lists the decoder's control port of each of its TP ranks.

Commands (one JSON object per line; each gets one JSON reply line):
  {"op": "store", "seed", "num_tokens", "end", "skip", "req_id", "last", "port"}
  {"op": "lookup", "seed", "num_tokens"}                 -> {"hit_tokens"}
  {"op": "wait_ready", "seed", "num_tokens", "timeout_s"} -> {"hit_tokens"}
  {"op": "retrieve", "seed", "num_tokens"}               -> {"retrieved", "equal"}
  {"op": "load", "seed", "num_tokens", "end", "vllm_hit", "req_id"} -> {"hit_tokens", "retrieved", "equal"}
      as vLLM's LMCacheConnectorV1 loads the first ``end`` tokens of the sequence: lookup with pins,
      retrieve past the tokens its own prefix cache holds (``vllm_hit``, chunk-aligned), unpin
  {"op": "slots"}                                        -> {"free", "capacity", "cached", "pinned",
                                                             "counters"} | {"sent", "failed", "pending",
                                                             "bytes_sent", "chunks_skipped"[, "arena_*"]}
  {"op": "buffer"}                                       -> {"slot_bytes", "device"} (receiver)
  {"op": "quit"}
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import msgspec
import torch

SHAPES = {"tiny": (2, 2, 32), "medium": (8, 8, 128), "llama8b": (32, 8, 128)}  # layers, KV heads, head size
LAYERS, MODEL_KV_HEADS, HEAD_SIZE = SHAPES[os.environ.get("P2P_ENGINE_SHAPE", "tiny")]
MODEL_KV_HEADS = int(os.environ.get("P2P_ENGINE_KV_HEADS") or MODEL_KV_HEADS)
MLA = os.environ.get("P2P_ENGINE_MLA") == "1"
MLA_WIDTH = 96  # the latent's values per token and layer (a real MLA model: 576)
TP_SIZE, TP_RANK = (int(x) for x in (os.environ.get("P2P_ENGINE_TP") or "1:0").split(":"))
CHUNK = 256
DEVICE = torch.device(os.environ.get("P2P_ENGINE_DEVICE") or "cpu")
KV_SIZE = 1 if MLA else 2  # K and V, or the one latent
if MLA:
    KV_HEADS, HEAD_SIZE, HEAD_LO = 1, MLA_WIDTH, 0
else:
    KV_HEADS = max(1, MODEL_KV_HEADS // TP_SIZE)
    HEAD_LO = (TP_RANK * KV_HEADS if TP_SIZE <= MODEL_KV_HEADS else TP_RANK // (TP_SIZE // MODEL_KV_HEADS))
HIDDEN = KV_HEADS * HEAD_SIZE
DTYPE = torch.bfloat16
VOCAB = 1000


def tokens_of(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def model_kv_of(seed: int, n: int) -> torch.Tensor:
    """The whole model's KV of a sequence (every head): what a TP1 instance holds."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(KV_SIZE, LAYERS, n, (1 if MLA else MODEL_KV_HEADS) * HEAD_SIZE, generator=g).to(DTYPE)


def kv_of(seed: int, n: int) -> torch.Tensor:
    """This rank's KV of a sequence: its heads' slice of the model's."""
    kv = model_kv_of(seed, n)
    return kv if MLA else kv[..., HEAD_LO * HEAD_SIZE:(HEAD_LO + KV_HEADS) * HEAD_SIZE].contiguous()


def settle() -> None:
    """A real GPU connector returns once its copies landed; so does this one."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def disagg_spec_class():
    try:
        from lmcache.integration.vllm.vllm_v1_adapter import DisaggSpec  # imports vLLM

        return DisaggSpec
    except ImportError:  # no vLLM here (the GPU machine): the same fields; LMCache passes it through as is

        @dataclasses.dataclass
        class DisaggSpec:
            req_id: str
            receiver_id: str
            receiver_host: str
            receiver_init_port: list[int]
            receiver_alloc_port: list[int]
            is_last_prefill: bool = False

        return DisaggSpec


def make_connector(kv_shape):
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class FlatKVConnector(GPUConnectorInterface):
        """Moves KV between one flat [2, L, T, H] tensor and LMCache chunks (KV_2LTD)."""

        def __init__(self) -> None:
            self.kv = torch.zeros(KV_SIZE, LAYERS, 0, HIDDEN, dtype=DTYPE, device=DEVICE)

        def from_gpu(self, memory_obj, start, end, **kwargs):
            memory_obj.tensor.copy_(self.kv[:, :, start:end])
            settle()

        def to_gpu(self, memory_obj, start, end, **kwargs):
            self.kv[:, :, start:end].copy_(memory_obj.tensor)
            settle()

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(obj, s, e)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(obj, s, e)

        def get_shape(self, num_tokens):
            return torch.Size([KV_SIZE, LAYERS, num_tokens, HIDDEN])

    return FlatKVConnector()


def build_engine(name: str):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_file(os.environ["LMCACHE_CONFIG_FILE"])
    kv_shape = (LAYERS, KV_SIZE, CHUNK, KV_HEADS, HEAD_SIZE)
    model = os.environ.get("ENGINE_PROC_MODEL_NAME", "tiny")  # another name: another KV fingerprint
    metadata = LMCacheMetadata(model_name=model, world_size=TP_SIZE, local_world_size=TP_SIZE, worker_id=TP_RANK,
                               local_worker_id=TP_RANK, kv_dtype=DTYPE, kv_shape=kv_shape, use_mla=MLA,
                               role="worker")
    connector = make_connector(kv_shape)
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector,
                                                lambda t, r: None, lambda o, r: o)
    engine.post_init()
    return engine, connector


def main() -> None:
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = sys.argv[1]
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)  # as vLLM's worker does before LMCache starts
    engine, connector = build_engine(name)
    backend = engine.storage_manager.storage_backends.get("p2p")
    import lmcache

    reply({"ok": backend is not None, "backend": str(backend), "lmcache": getattr(lmcache, "__version__", "?")})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        reply(handle(cmd, engine, connector, backend))
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(name)
    reply({"ok": True, "closed": True})


def handle(cmd: dict, engine, connector, backend) -> dict:
    op = cmd["op"]
    if op == "store":
        DisaggSpec = disagg_spec_class()
        tokens = tokens_of(cmd["seed"], cmd["num_tokens"])[: cmd["end"]]
        connector.kv = kv_of(cmd["seed"], cmd["num_tokens"])[:, :, : cmd["end"]].contiguous().to(DEVICE)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: cmd.get("skip", 0)] = False
        spec = DisaggSpec(req_id=cmd["req_id"], receiver_id="r", receiver_host="127.0.0.1",
                          receiver_init_port=[p + 100 for p in cmd.get("ports", [cmd.get("port")])],
                          receiver_alloc_port=list(cmd.get("ports", [cmd.get("port")])),
                          is_last_prefill=cmd["last"])
        started = time.monotonic()
        engine.store(tokens, mask=mask, transfer_spec=spec if cmd.get("spec", True) else None)
        return {"ok": True, "started": started, "returned": time.monotonic()} if cmd.get("stamp") else {"ok": True}
    if op in ("lookup", "wait_ready"):
        tokens = tokens_of(cmd["seed"], cmd["num_tokens"])[: cmd.get("end", cmd["num_tokens"])]
        deadline = time.monotonic() + cmd.get("timeout_s", 0)
        while True:
            hit = engine.lookup(tokens)
            if op == "lookup" or hit == len(tokens) or time.monotonic() > deadline:
                return {"hit_tokens": hit, "at": time.monotonic()} if cmd.get("stamp") else {"hit_tokens": hit}
            time.sleep(0.0005 if cmd.get("stamp") else 0.01)
    if op == "retrieve":
        n = cmd["num_tokens"]
        tokens = tokens_of(cmd["seed"], n)
        connector.kv = torch.zeros(KV_SIZE, LAYERS, n, HIDDEN, dtype=DTYPE, device=DEVICE)
        ret = engine.retrieve(tokens)
        retrieved = int(ret.sum())
        expected = kv_of(cmd["seed"], n)
        equal = bool(torch.equal(connector.kv[:, :, :retrieved].cpu(), expected[:, :, :retrieved]))
        return {"retrieved": retrieved, "equal": equal}
    if op == "load":
        return load_like_vllm(cmd, engine, connector)
    if op == "slots":
        if hasattr(backend, "free_slots"):
            svc = backend._svc()
            pool = svc._pool
            out = {"free": backend.free_slots, "capacity": pool.num_slots}
            if cmd.get("detail"):
                out.update(cached=pool.cached_slots, pinned=sum(1 for s in range(pool.num_slots) if pool.pins(s)),
                           counters=dataclasses.asdict(svc.counters), rejected=svc.rejected_frames(),
                           slot_bytes=backend._slot_bytes, receiver_id=svc.receiver_id,
                           fingerprint=msgspec.to_builtins(svc.fingerprint))
            return out
        stats = backend.service.stats()
        out = {"sent": stats.requests_done, "failed": stats.requests_failed,
               "pending": backend.service.pending_requests(), "bytes_sent": stats.bytes_sent,
               "chunks_skipped": stats.chunks_skipped}
        if backend.arena is not None:  # p2p.buffer_device cuda on the sender
            out.update(arena_pages=backend.arena.pages, arena_free=backend.arena.free_pages(),
                       arena_spilled=backend.arena.spilled, arena_device=str(backend.arena.buffer.device))
        return out
    if op == "buffer":
        return {"slot_bytes": backend._slot_bytes, "device": str(backend._buffer.device)}
    return {"error": f"unknown op {op}"}


def load_like_vllm(cmd: dict, engine, connector) -> dict:
    """What LMCacheConnectorV1 does for a request on a consumer: lookup with pins from token 0, then
    retrieve the tokens past vLLM's own (chunk-aligned) prefix hit, then release the lookup pins."""
    n, end, req_id = cmd["num_tokens"], cmd.get("end", cmd["num_tokens"]), cmd["req_id"]
    tokens = tokens_of(cmd["seed"], n)[:end]
    hit = engine.lookup(tokens, lookup_id=req_id, pin=True)
    masked = cmd.get("vllm_hit", 0) // CHUNK * CHUNK
    mask = torch.ones(hit, dtype=torch.bool)
    mask[:masked] = False
    connector.kv = torch.zeros(KV_SIZE, LAYERS, end, HIDDEN, dtype=DTYPE, device=DEVICE)
    started = time.monotonic()
    ret = engine.retrieve(tokens[:hit], mask, req_id=req_id) if hit > masked else torch.zeros(0, dtype=torch.bool)
    retrieve_s = time.monotonic() - started
    engine.lookup_unpin(req_id)
    retrieved = int(ret.sum())
    expected = kv_of(cmd["seed"], n)[:, :, masked:masked + retrieved]
    equal = bool(torch.equal(connector.kv[:, :, masked:masked + retrieved].cpu(), expected))
    out = {"hit_tokens": hit, "retrieved": retrieved, "equal": equal}
    return {**out, "retrieve_s": retrieve_s} if cmd.get("stamp") else out


def reply(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
