"""A prefiller's stores without the engine waiting for the GPU (backend/store_ready.py, p2p.async_store).

On this machine there is no GPU: the streams, events and device copies are stand-ins that record what
was asked of them, so the tests check the order of the waits (what the GPU pass relies on) and that
every chunk reaches the send service, in order, off the engine's thread, or is handed back.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from lmcache_p2p.backend import send_gather, sender as sender_module
from lmcache_p2p.backend.store_ready import StoreHandoff, install_async_slot_mapping
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ClosedError


# ---- the hand-off thread ----------------------------------------------------------------------------


def test_hand_overs_run_in_order_each_after_its_gpu_work_and_never_on_the_callers_thread():
    handoff = StoreHandoff("test-store")
    gate = threading.Event()
    ran: list[tuple[str, str]] = []
    try:
        handoff.submit(gate.wait, lambda: ran.append(("first", threading.current_thread().name)), lambda: None)
        handoff.submit(None, lambda: ran.append(("second", threading.current_thread().name)), lambda: None)
        assert not gate.wait(0.05) and ran == []  # the second waits behind the first's GPU work
        gate.set()
    finally:
        handoff.close()
    assert ran == [("first", "test-store"), ("second", "test-store")]


def test_failed_gpu_work_hands_its_chunks_back_and_later_stores_still_go():
    handoff = StoreHandoff("test-store")
    released, ran = [], []

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    handoff.submit(broken, lambda: ran.append("broken"), lambda: released.append("broken"))
    handoff.submit(None, lambda: ran.append("next"), lambda: released.append("next"))
    handoff.close()
    assert released == ["broken"] and ran == ["next"]


def test_a_store_after_close_is_handed_back_with_a_clear_error():
    handoff = StoreHandoff("test-store")
    handoff.close()
    released = []
    with pytest.raises(ClosedError, match="closed"):
        handoff.submit(None, lambda: None, lambda: released.append(True))
    assert released == [True]


# ---- the sender hands its stores over through it ------------------------------------------------------


class Submits:
    def __init__(self) -> None:
        self.batches: list[tuple[list[str], bool, str]] = []
        self.nothing: list[str] = []

    def submit(self, req_id, target, chunks, last, called_s=0.0, wire_id="", queued_s=0.0) -> None:
        self.batches.append(([c.key for c in chunks], last, threading.current_thread().name))

    def nothing_to_send(self, req_id) -> None:
        self.nothing.append(req_id)


class Obj:
    """A MemoryObj as far as the sender reads it; counts its references."""

    def __init__(self) -> None:
        self.tensor = torch.zeros(2, 1, 4, 8)
        self.refs = 1

    def ref_count_up(self) -> None:
        self.refs += 1

    def ref_count_down(self) -> None:
        self.refs -= 1

    def get_shape(self):
        return self.tensor.shape

    def get_dtype(self):
        return self.tensor.dtype

    def get_memory_format(self):
        from lmcache.v1.memory_management import MemoryFormat

        return MemoryFormat.KV_2LTD


def sender_with(service, handoff):
    backend = object.__new__(sender_module.SenderBackend)
    backend._service, backend._arena, backend._tp_rank, backend._warned_no_spec = service, None, 0, False
    backend._layout, backend._handoff, backend._store_stream = None, handoff, None
    return backend


def keys_of(*hashes):
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=h, dtype=torch.bfloat16)
            for h in hashes]


def spec(last: bool, ports=(7300,)):
    return SimpleNamespace(receiver_host="127.0.0.1", receiver_alloc_port=list(ports), req_id="req-1",
                           is_last_prefill=last)


def test_a_senders_stores_reach_the_service_in_order_on_the_hand_off_thread():
    service, handoff = Submits(), StoreHandoff("p2p-store-0")
    backend = sender_with(service, handoff)
    backend.batched_submit_put_task(keys_of(1, 2), [Obj(), Obj()], transfer_spec=spec(last=False))
    backend.batched_submit_put_task(keys_of(3), [Obj()], transfer_spec=spec(last=True))
    handoff.close()
    assert service.batches == [(["1", "2"], False, "p2p-store-0"), (["3"], True, "p2p-store-0")]


def test_a_store_refused_by_a_closed_hand_off_drops_the_references_it_took():
    service, handoff = Submits(), StoreHandoff("p2p-store-0")
    handoff.close()
    backend = sender_with(service, handoff)
    objs = [Obj(), Obj()]
    with pytest.raises(ClosedError):
        backend.batched_submit_put_task(keys_of(1, 2), objs, transfer_spec=spec(last=True))
    assert [o.refs for o in objs] == [1, 1] and service.batches == []


def test_a_bad_spec_for_a_later_decoder_rank_takes_no_reference_at_all():
    from lmcache_p2p import kv_layout

    backend = sender_with(Submits(), None)
    backend._layout = kv_layout.KvLayout(total_heads=2, tp_size=1)  # its rank feeds both ranks of a TP 2 decoder
    objs = [Obj()]
    bad = SimpleNamespace(receiver_host="127.0.0.1", receiver_alloc_port=[7300, "x"], req_id="req-1",
                          is_last_prefill=True)
    backend.batched_submit_put_task(keys_of(1), objs, transfer_spec=bad)
    assert objs[0].refs == 1 and backend._service.batches == []


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"cpu waits for {self.name}")


def test_vram_chunks_wait_on_the_gpu_with_a_hand_off_and_on_the_engines_thread_without(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(sender_module, "gpu_done", lambda stream: log.append(f"event after {stream.name}") or
                        (lambda: log.append("hand-off waits for the event")))
    handoff = StoreHandoff("p2p-store-0")
    backend = sender_with(Submits(), handoff)
    backend._store_stream = Stream("store", log)
    assert backend._after_store("cuda:0")() is None  # the returned wait runs on the hand-off thread
    assert log == ["event after store", "hand-off waits for the event"]
    handoff.close()
    log.clear()
    backend._handoff = None
    assert backend._after_store("cuda:0") is None and log == ["cpu waits for store"]


def test_async_store_is_on_by_default_and_must_be_a_bool():
    from lmcache_p2p.errors import ConfigError

    assert P2PConfig.from_mapping({"role": "sender"}).async_store is True
    assert P2PConfig.from_mapping({"role": "sender", "async_store": False}).async_store is False
    with pytest.raises(ConfigError, match=r"p2p\.async_store"):
        P2PConfig.from_mapping({"role": "sender", "async_store": "yes"})


# ---- LMCache's wait_for_save finds the slot mappings on the GPU ----------------------------------------


def adapter_class(seen: list):
    class Adapter:
        """LMCacheConnectorV1Impl as far as wait_for_save's slot mappings go."""

        kv_role = "kv_producer"
        use_layerwise = False
        lmcache_engine = object()

        def __init__(self, device, requests) -> None:
            self.device = device
            metadata = SimpleNamespace(requests=requests)
            self._parent = SimpleNamespace(_get_connector_metadata=lambda: metadata)

        def wait_for_save(self) -> None:
            seen.extend(r.slot_mapping.device.type for r in self._parent._get_connector_metadata().requests)

    return Adapter


def moved(slots, device):
    assert str(device) == "cuda" and slots.device.type == "cpu"
    return slots.to("meta")  # stands in for the pinned, non-blocking copy to the GPU


def test_wait_for_save_sees_every_slot_mapping_on_the_device_already():
    seen: list[str] = []
    cls = adapter_class(seen)
    undo = install_async_slot_mapping(cls, to_device=moved)
    try:
        assert install_async_slot_mapping(cls, to_device=moved)() is None  # installed once
        requests = [SimpleNamespace(slot_mapping=torch.arange(4)), SimpleNamespace(slot_mapping=torch.arange(3))]
        cls("cuda", requests).wait_for_save()
        assert seen == ["meta", "meta"]
        seen.clear()
        cls("cpu", [SimpleNamespace(slot_mapping=torch.arange(4))]).wait_for_save()  # a CPU engine: as it was
        consumer = cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))])
        consumer.kv_role = "kv_consumer"
        consumer.wait_for_save()
        layerwise = cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))])
        layerwise.use_layerwise = True
        layerwise.wait_for_save()
        assert seen == ["cpu", "cpu", "cpu"]
    finally:
        undo()
    seen.clear()
    cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))]).wait_for_save()
    assert seen == ["cpu"]  # undone: LMCache's own method again


# ---- the gather is ordered after the forward, and the engine after the gather -------------------------


class Connector:
    use_mla = False

    def __init__(self, log: list) -> None:
        self.store_stream = Stream("store", log)
        self.kvcaches = None
        self.log = log

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        self.kvcaches = kwargs["kvcaches"]

    def _initialize_pointers(self, kvcaches) -> str:
        return "pointers"

    def from_gpu(self, obj, start, end, **kwargs) -> None:
        self.log.append("from_gpu")


@pytest.mark.parametrize("fails", [False, True], ids=["gathered", "kernel-raised"])
def test_the_store_stream_waits_for_the_engine_and_the_engine_for_the_store(monkeypatch, fails):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("engine", log))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def kernel(connector, dst, pointers, slots) -> None:
        if fails:
            raise RuntimeError("kernel failed")
        log.append("gather")

    objs = [SimpleNamespace(tensor=torch.zeros(1)), SimpleNamespace(tensor=torch.zeros(1)),
            SimpleNamespace(tensor=torch.ones(1))]
    on_device = lambda tensor: not bool(tensor.sum())  # noqa: E731 - the last chunk spilled to host memory
    call = lambda: send_gather.gather_store(Connector(log), objs, [0, 4, 8], [4, 8, 10],  # noqa: E731
                                            {"kvcaches": [], "slot_mapping": torch.arange(10)}, kernel, on_device)
    if fails:
        with pytest.raises(RuntimeError):
            call()
        assert log == ["store waits for engine", "engine waits for store"]
    else:
        call()
        assert log == ["store waits for engine", "gather", "gather", "from_gpu", "engine waits for store"]

