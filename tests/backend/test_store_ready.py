"""A prefiller's stores without the engine waiting for the GPU (backend/store_ready.py, p2p.async_store).

On this machine there is no GPU: the streams, events and device copies are stand-ins that record what
was asked of them, so the tests check the order of the waits (what the GPU pass relies on), that every
chunk reaches the send service at once and in order, carrying its store's readiness (settled off the
engine's thread), or is handed back. What the service does with that readiness: test_send_service.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_p2p.backend import send_gather, sender as sender_module
from lmcache_p2p.backend.send_types import Readiness, StoreReady
from lmcache_p2p.backend.store_ready import StoreMode, StoreWatch, install_async_slot_mapping, store_mode_of
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ClosedError, ConfigError, QueueFull


# ---- the watch thread --------------------------------------------------------------------------------


def make_watch(name: str = "test-store", timeout_s: float = 10.0, max_stores: int = 64) -> StoreWatch:
    return StoreWatch(name, timeout_s=timeout_s, max_stores=max_stores)


def settled_on(readiness: StoreReady, seen: list) -> None:
    readiness.on_settled(lambda: seen.append((readiness.state, threading.current_thread().name)))


def test_readiness_settles_in_order_each_after_its_gpu_work_on_the_watch_thread():
    watch = make_watch()
    gate = threading.Event()
    seen: list = []
    try:
        first, second = watch.watch(gate.is_set), watch.watch(lambda: True)
        settled_on(first, seen)
        settled_on(second, seen)
        assert not gate.wait(0.05) and seen == []  # the second waits behind the first's GPU work
        assert first.state is second.state is Readiness.PENDING
        gate.set()
    finally:
        watch.close()
    assert seen == [(Readiness.READY, "test-store"), (Readiness.READY, "test-store")] and watch.waiting() == 0


def test_a_store_with_nothing_to_wait_for_is_ready_now():
    watch = make_watch()
    try:
        assert watch.watch(None) is None and watch.waiting() == 0
    finally:
        watch.close()


def test_failed_gpu_work_fails_its_readiness_with_the_cause_and_later_stores_still_go():
    watch = make_watch()

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access")

    failed, later = watch.watch(broken), watch.watch(lambda: True)
    watch.close()
    assert failed.state is Readiness.FAILED and "illegal memory access" in failed.problem
    assert later.state is Readiness.READY


def test_gpu_work_that_never_finishes_fails_its_store_at_the_deadline_and_later_stores_go():
    watch = make_watch(timeout_s=0.1)
    started = time.monotonic()
    hung, later = watch.watch(lambda: False), watch.watch(lambda: True)
    watch.close()
    assert time.monotonic() - started < 5.0
    assert hung.state is Readiness.FAILED and "p2p.store_ready_timeout_s" in hung.problem
    assert later.state is Readiness.READY


def test_a_store_after_close_is_refused_with_a_clear_error():
    watch = make_watch()
    watch.close()
    for done in (lambda: True, None):
        with pytest.raises(ClosedError, match="closed"):
            watch.watch(done)


def test_a_full_watch_refuses_with_the_setting_to_raise():
    watch = make_watch(max_stores=2)
    gate = threading.Event()
    try:
        watched = [watch.watch(gate.is_set), watch.watch(gate.is_set)]
        with pytest.raises(QueueFull, match=r"p2p\.store_queue_max_stores") as refused:
            watch.watch(gate.is_set)
        assert refused.value.key == "p2p.store_queue_max_stores"
        gate.set()
    finally:
        watch.close()
    assert [r.state for r in watched] == [Readiness.READY] * 2 and watch.waiting() == 0


@pytest.mark.parametrize("key", ["store_queue_max_stores", "send_queue_max_batches"])
def test_queue_bounds_are_whole_numbers_named_when_wrong(key):
    assert getattr(P2PConfig.from_mapping({"role": "sender", key: 7}), key) == 7
    for bad in (0, -1, 2.5, "many", True):
        with pytest.raises(ConfigError, match=rf"p2p\.{key}"):
            P2PConfig.from_mapping({"role": "sender", key: bad})
    with pytest.raises(ConfigError, match=r"p2p\.store_ready_timeout_s"):
        P2PConfig.from_mapping({"role": "sender", "store_ready_timeout_s": 0})


# ---- the sender hands its stores over at once, with their readiness -----------------------------------


class Submits:
    """SendService as the sender's hand-over sees it. ``broken_at``: that submit (0-based) raises an unexpected
    error, after releasing its own chunks as SendService.submit does whenever it raises."""

    def __init__(self, broken_at: int | None = None) -> None:
        self.batches: list[tuple[list[str], bool, str]] = []
        self.readiness: list[StoreReady | None] = []  # each batch's, in order
        self.nothing: list[str] = []
        self.failures: list[tuple[str, list, str]] = []
        self._broken_at = broken_at
        self._calls = 0

    def submit(self, req_id, target, chunks, last, called_s=0.0, wire_id="", queued_s=0.0, ready=None) -> None:
        self._calls += 1
        if self._calls - 1 == self._broken_at:
            for c in chunks:
                c.done()
            raise RuntimeError("an unexpected error inside submit")
        self.batches.append(([c.key for c in chunks], last, threading.current_thread().name))
        self.readiness.append(ready)

    def nothing_to_send(self, req_id) -> None:
        self.nothing.append(req_id)

    def fail_request(self, req_id, shares, reason) -> None:
        self.failures.append((req_id, shares, reason))


class Obj:
    """A MemoryObj as far as the sender reads it; counts its references. ``tensor``: default a host one."""

    def __init__(self, tensor=None) -> None:
        self.tensor = torch.zeros(2, 1, 4, 8) if tensor is None else tensor
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


def sender_with(service, watch):
    backend = object.__new__(sender_module.SenderBackend)
    backend._service, backend._arena, backend._tp_rank, backend._warned_no_spec = service, None, 0, False
    backend._layout, backend._watch, backend._connector = None, watch, None
    return backend


def vram_tensor():
    """What the sender reads of an arena page's tensor (there is no GPU here)."""
    return SimpleNamespace(is_cuda=True, device="cuda:0", nbytes=2 * 4 * 8 * 4, shape=torch.Size([2, 1, 4, 8]),
                           dtype=torch.float32)


def keys_of(*hashes):
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=h, dtype=torch.bfloat16)
            for h in hashes]


def spec(last: bool, ports=(7300,)):
    return SimpleNamespace(receiver_host="127.0.0.1", receiver_alloc_port=list(ports), req_id="req-1",
                           is_last_prefill=last)


def test_host_stores_reach_the_service_in_order_at_once_with_nothing_to_wait_for():
    service, watch = Submits(), make_watch("p2p-store-0")
    backend = sender_with(service, watch)
    try:
        backend.batched_submit_put_task(keys_of(1, 2), [Obj(), Obj()], transfer_spec=spec(last=False))
        backend.batched_submit_put_task(keys_of(3), [Obj()], transfer_spec=spec(last=True))
        caller = threading.current_thread().name
        assert service.batches == [(["1", "2"], False, caller), (["3"], True, caller)]
        assert service.readiness == [None, None] and watch.waiting() == 0
    finally:
        watch.close()


def test_a_store_refused_by_a_closed_watch_drops_the_references_it_took():
    service, watch = Submits(), make_watch("p2p-store-0")
    watch.close()
    backend = sender_with(service, watch)
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


@pytest.mark.parametrize("broken_at", [0, 1], ids=["first-run", "second-run"])
@pytest.mark.parametrize("with_watch", [False, True], ids=["sync-store", "async-store"])
def test_an_error_handing_a_store_over_releases_every_chunk_the_service_did_not_take(broken_at, with_watch):
    # Three runs: host chunks, VRAM chunks (the arena filled and emptied midway), host chunks again.
    service = Submits(broken_at=broken_at)
    watch = make_watch("p2p-store-0") if with_watch else None
    backend = sender_with(service, watch)
    objs = [Obj(), Obj(vram_tensor()), Obj(vram_tensor()), Obj()]
    try:
        if with_watch:
            backend.batched_submit_put_task(keys_of(1, 2, 3, 4), objs, transfer_spec=spec(last=True))
        else:
            with pytest.raises(RuntimeError, match="unexpected error inside submit"):
                backend.batched_submit_put_task(keys_of(1, 2, 3, 4), objs, transfer_spec=spec(last=True))
    finally:
        if watch is not None:
            watch.close()
    taken = {key for keys, _, _ in service.batches for key in keys}
    assert [o.refs for o, k in zip(objs, "1234")] == [2 if k in taken else 1 for k in "1234"]
    assert len(service.batches) == broken_at  # nothing after the error was submitted
    if with_watch:  # the request is failed at once rather than left to the proxy's KV timeout
        assert len(service.failures) == 1 and "unexpected error inside submit" in service.failures[0][2]


def test_an_error_reaching_one_receiver_releases_the_chunks_of_the_receivers_not_reached_yet():
    # One store, two receivers (a TP split whose pieces are the chunks themselves, as for MLA's latent).
    from lmcache_p2p.backend.send_types import Chunk, Target

    released: list[str] = []

    def chunk(key: str) -> Chunk:
        return Chunk(key, None, torch.zeros(1), lambda: released.append(key))

    sends = [(Target("127.0.0.1", 7300), [chunk("a1"), chunk("a2")], "w0"),
             (Target("127.0.0.1", 7301), [chunk("b1"), chunk("b2")], "w1")]
    service = Submits(broken_at=0)
    with pytest.raises(RuntimeError, match="unexpected error inside submit"):
        sender_module._hand_over(service, "req-1", sends, True, 0.0, 0.0)
    assert sorted(released) == ["a1", "a2", "b1", "b2"] and service.batches == []


def test_gpu_done_orders_the_engine_and_the_load_stream_after_the_store_and_never_blocks(monkeypatch):
    log: list[str] = []

    class Event:
        def __init__(self, **kwargs) -> None:
            log.append(f"event {kwargs}")

        def record(self, stream) -> None:
            log.append(f"event recorded on {stream.name}")

        def query(self) -> bool:
            log.append("queried")
            return False

        def synchronize(self) -> None:
            raise AssertionError("a blocking wait has no deadline")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("engine", log))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    from lmcache_p2p.backend.store_ready import gpu_done

    done = gpu_done(Stream("store", log), Stream("load", log))
    assert done() is False
    assert log == ["engine waits for store", "load waits for store", "event {}", "event recorded on engine", "queried"]


def vram_sender(service, watch, ready):
    backend = sender_with(service, watch)
    backend._arena = SimpleNamespace(device="cuda:0")
    backend._after_store = lambda device: ready
    return backend


def test_a_vram_store_reaches_the_service_before_its_gpu_work_is_done_carrying_its_readiness():
    gate = threading.Event()
    service, watch = Submits(), make_watch("p2p-store-0")
    objs = [Obj(vram_tensor()), Obj(vram_tensor())]
    try:
        vram_sender(service, watch, gate.is_set).batched_submit_put_task(keys_of(1, 2), objs, transfer_spec=spec(True))
        # handed over at once (the service asks for slots now), every run of the store with the same readiness
        assert service.batches == [(["1", "2"], True, threading.current_thread().name)]
        [readiness] = service.readiness
        assert not gate.wait(0.05) and readiness.state is Readiness.PENDING
        gate.set()
    finally:
        watch.close()
    assert readiness.state is Readiness.READY and [o.refs for o in objs] == [2, 2]  # the service holds them


def test_a_failed_gpu_wait_fails_the_readiness_the_service_holds_with_its_cause():
    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access")

    service, watch = Submits(), make_watch("p2p-store-0")
    objs = [Obj(vram_tensor()), Obj(vram_tensor())]
    vram_sender(service, watch, broken).batched_submit_put_task(keys_of(1, 2), objs, transfer_spec=spec(last=False))
    watch.close()
    [readiness] = service.readiness  # the service fails the request and frees its pages (test_send_service.py)
    assert readiness.state is Readiness.FAILED and "illegal memory access" in readiness.problem


def test_a_store_whose_gpu_work_outlives_store_ready_timeout_fails_its_readiness_naming_the_key():
    service, watch = Submits(), make_watch("p2p-store-0", timeout_s=0.1)
    vram_sender(service, watch, lambda: False).batched_submit_put_task(keys_of(1), [Obj(vram_tensor())],
                                                                       transfer_spec=spec(True))
    watch.close()
    [readiness] = service.readiness
    assert readiness.state is Readiness.FAILED and "p2p.store_ready_timeout_s" in readiness.problem


def test_a_store_refused_by_a_full_watch_frees_its_pages_and_fails_the_request_without_raising():
    gate = threading.Event()
    service, watch = Submits(), make_watch("p2p-store-0", max_stores=1)
    backend = vram_sender(service, watch, gate.is_set)
    first, second = [Obj(vram_tensor())], [Obj(vram_tensor())]
    try:
        backend.batched_submit_put_task(keys_of(1), first, transfer_spec=spec(last=False))
        backend.batched_submit_put_task(keys_of(2), second, transfer_spec=spec(last=True))  # the engine goes on
        assert second[0].refs == 1
        [(req_id, _, reason)] = service.failures
        assert req_id == "req-1" and "p2p.store_queue_max_stores" in reason
        gate.set()
    finally:
        watch.close()
    assert [keys for keys, _, _ in service.batches] == [["1"]]


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"cpu waits for {self.name}")


def connector_in(mode: StoreMode | None, log: list):
    connector = SimpleNamespace(store_stream=Stream("store", log), load_stream=Stream("load", log))
    if mode is not None:
        connector._lmcache_p2p_store_mode = mode
    return connector


@pytest.mark.parametrize("mode", [StoreMode.WAIT_FREE, StoreMode.HANDOFF])
def test_vram_chunks_wait_on_the_gpu_with_a_watch_and_on_the_engines_thread_without(monkeypatch, mode):
    log: list[str] = []
    monkeypatch.setattr(sender_module, "gpu_done", lambda store, load: log.append(
        f"event after {store.name}, {load.name} ordered after it") or (lambda: log.append("watch checks") or True))
    watch = make_watch("p2p-store-0")
    backend = sender_with(Submits(), watch)
    backend._connector = connector_in(mode, log)
    assert backend._after_store("cuda:0")() is True  # the returned check runs on the watch thread
    assert log == ["event after store, load ordered after it", "watch checks"]
    watch.close()
    log.clear()
    backend._watch = None
    assert backend._after_store("cuda:0") is None and log == ["cpu waits for store"]


@pytest.mark.parametrize("mode", [StoreMode.SYNC, None], ids=["another-kv-writer", "never-decided"])
def test_a_store_in_sync_mode_waits_on_the_engines_thread_even_with_a_watch(monkeypatch, mode):
    log: list[str] = []
    monkeypatch.setattr(sender_module, "gpu_done", lambda store, load: pytest.fail("no watch in SYNC mode"))
    watch = make_watch("p2p-store-0")
    backend = sender_with(Submits(), watch)
    backend._connector = connector_in(mode, log)
    try:
        assert backend._after_store("cuda:0") is None and log == ["cpu waits for store"]
    finally:
        watch.close()


def test_async_store_is_on_by_default_and_must_be_a_bool():
    from lmcache_p2p.errors import ConfigError

    assert P2PConfig.from_mapping({"role": "sender"}).async_store is True
    assert P2PConfig.from_mapping({"role": "sender", "async_store": False}).async_store is False
    with pytest.raises(ConfigError, match=r"p2p\.async_store"):
        P2PConfig.from_mapping({"role": "sender", "async_store": "yes"})


# ---- LMCache's wait_for_save finds the slot mappings on the GPU (only for a connector gathered through us) ----


class V2Like:
    """LMCache's VLLMPagedMemGPUConnectorV2 as far as the choice of mode reads it (send_gather.install patches
    a fresh subclass of it per test)."""

    def from_gpu(self, obj, start, end, **kwargs) -> None: ...

    def initialize_kvcaches_ptr(self, **kwargs) -> None: ...

    def _initialize_pointers(self, kvcaches) -> None: ...

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None: ...


class V3Like:
    """LMCache's VLLMPagedMemGPUConnectorV3 (``use_gpu_connector_v3: true``): its own batched_from_gpu, which
    gathers on its store stream without waiting for the engine's stream; never patched."""

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None: ...


def adapter_class(seen: list):
    class Adapter:
        """LMCacheConnectorV1Impl as far as wait_for_save's slot mappings go."""

        kv_role = "kv_producer"
        use_layerwise = False

        def __init__(self, device, requests, connector=None, kv_connector="LMCacheConnectorV1") -> None:
            self.device = device
            self.lmcache_engine = SimpleNamespace(gpu_connector=connector)
            self._vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector=kv_connector))
            metadata = SimpleNamespace(requests=requests)
            self._parent = SimpleNamespace(_get_connector_metadata=lambda: metadata)

        def wait_for_save(self) -> None:
            seen.extend(r.slot_mapping.device.type for r in self._parent._get_connector_metadata().requests)

    return Adapter


def moved(slots, device):
    assert str(device) == "cuda" and slots.device.type == "cpu"
    return slots.to("meta")  # stands in for the pinned, non-blocking copy to the GPU


@pytest.fixture
def gathered():
    """A V2-like connector class whose batched_from_gpu send_gather installed (the kernel stood in)."""
    cls = type("GatheredV2", (V2Like,), {"batched_from_gpu": V2Like.batched_from_gpu})
    undo = send_gather.install(cls, transfer=lambda *args: None)
    yield cls
    undo()


def test_wait_for_save_sees_every_slot_mapping_on_the_device_already(gathered):
    seen: list[str] = []
    cls = adapter_class(seen)
    undo = install_async_slot_mapping(cls, to_device=moved)
    try:
        assert install_async_slot_mapping(cls, to_device=moved)() is None  # installed once
        requests = [SimpleNamespace(slot_mapping=torch.arange(4)), SimpleNamespace(slot_mapping=torch.arange(3))]
        connector = gathered()
        cls("cuda", requests, connector).wait_for_save()
        assert seen == ["meta", "meta"] and store_mode_of(connector) is StoreMode.WAIT_FREE
        seen.clear()
        cls("cpu", [SimpleNamespace(slot_mapping=torch.arange(4))], gathered()).wait_for_save()  # a CPU engine
        consumer = cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))], gathered())
        consumer.kv_role = "kv_consumer"
        consumer.wait_for_save()
        layerwise = cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))], gathered())
        layerwise.use_layerwise = True
        layerwise.wait_for_save()
        assert seen == ["cpu", "cpu", "cpu"]
    finally:
        undo()
    seen.clear()
    cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))], gathered()).wait_for_save()
    assert seen == ["cpu"]  # undone: LMCache's own method again


@pytest.mark.parametrize("connector_cls, kv_connector, mode", [
    (V3Like, "LMCacheConnectorV1", StoreMode.HANDOFF),  # use_gpu_connector_v3: LMCache's wait stays
    (V2Like, "LMCacheConnectorV1", StoreMode.HANDOFF),  # the gather not installed (another kernel)
    ("gathered", "MultiConnector", StoreMode.SYNC),  # another KV connector writes KV on streams we cannot order
], ids=["v3", "v2-not-gathered", "multi-connector"])
def test_a_connector_not_gathered_through_us_keeps_lmcaches_wait_for_the_forward(
        gathered, connector_cls, kv_connector, mode):
    seen: list[str] = []
    cls = adapter_class(seen)
    connector = (gathered if connector_cls == "gathered" else connector_cls)()
    assert send_gather.gathers(connector) is (connector_cls == "gathered")
    undo = install_async_slot_mapping(cls, to_device=moved)
    try:
        cls("cuda", [SimpleNamespace(slot_mapping=torch.arange(4))], connector, kv_connector).wait_for_save()
    finally:
        undo()
    assert seen == ["cpu"]  # the slot mapping stays on the host: LMCache's pageable copy waits for the forward
    assert store_mode_of(connector) is mode


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

