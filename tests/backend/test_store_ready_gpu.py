"""The asynchronous store path on a GPU with real LMCache (its ``VLLMPagedMemGPUConnectorV2``, 0.5.3's kernel).

The engine's thread never waits for a store's GPU work (backend/store_ready.py); what keeps the bytes right is
the order of three streams on the GPU, which these tests break on purpose by making one stream late
(``torch.cuda._sleep``) and check that an arena page still holds the KV of the step that stored it:

* the engine's stream sleeps (the forward still runs) before it writes the step's KV, the store is queued at
  once, and the next step overwrites the blocks: the gather must wait for the write, and the overwrite for
  the gather;
* the store stream is late (earlier stores still gathering) when the next step overwrites the blocks;
* LMCache's retrieve (``batched_to_gpu`` on its ``load_stream``) writes other KV into the same blocks
  while the engine's stream still runs: it must wait for the gather (``store_ready.gpu_done``, as the sender
  calls it after every store).

The page is compared with what LMCache's own ``from_gpu`` gathers from the same KV with every stream
synchronized. Run on the device machine after the bundle is installed (scripts/gpu_pass.sh's set-up):
``python3 -m pytest -q -m gpu tests/backend/test_store_ready_gpu.py``; skipped without CUDA.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 4, 1024, 16, 8, 128
TOKENS = 256  # one chunk: 16 whole blocks
LATE_CYCLES = 200_000_000  # ~0.1 s of a GPU clock: far longer than every copy and gather here
WAIT_S = 30.0


@pytest.fixture(scope="module")
def installed():
    """lmcache_p2p's gather installed on LMCache's V2 connector (the kernel resolved for this LMCache)."""
    lmcache = pytest.importorskip("lmcache")
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2

    from lmcache_p2p.backend import send_gather

    kernel = send_gather.resolve_kernel(VLLMPagedMemGPUConnectorV2)
    if isinstance(kernel, str):
        if not str(lmcache.__version__).startswith("0.5.3"):
            pytest.skip(f"lmcache {lmcache.__version__}: the one-pass gather is not installed here: {kernel}")
        pytest.fail(f"lmcache {lmcache.__version__}: its kernel was not resolved: {kernel}")
    undo = send_gather.install()
    try:
        assert send_gather.installed(), "send_gather.install() installed nothing (see its log line)"
        print(f"\nlmcache {lmcache.__version__}: gathering with {kernel.source}")
        yield VLLMPagedMemGPUConnectorV2
    finally:
        undo()


@pytest.fixture
def gathered(installed):
    """A fresh connector per test: LMCache caches the KV tensors' pointers once per device, as for an engine
    whose KV cache never moves, and each test makes its own KV cache."""
    from lmcache_p2p.backend import send_gather

    connector = installed(HEADS * HEAD, LAYERS, use_gpu=False, chunk_size=TOKENS, dtype=torch.bfloat16,
                          device="cuda")
    assert send_gather.gathers(connector)
    yield connector
    torch.cuda.synchronize()


class Step:
    """One request's blocks in a paged KV cache, a chunk page of a send arena, and the values each phase
    writes: ``first`` in [1, 2), ``second`` in [-2, -1), zeros before."""

    def __init__(self, connector) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        from lmcache_p2p.backend.send_buffer import SendArena

        gen = torch.Generator(device="cuda").manual_seed(7)
        shape = (2, BLOCKS, BLOCK, HEADS, HEAD)
        self.kv = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        self.first = [torch.rand(shape, generator=gen, device="cuda").to(torch.bfloat16) + 1 for _ in range(LAYERS)]
        self.second = [-f for f in self.first]
        self.blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(7))[:TOKENS // BLOCK]
        self.slots = (self.blocks[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1).to(torch.int64).cuda()
        chunk = torch.Size([2, LAYERS, TOKENS, HEADS * HEAD])
        self.arena = SendArena(4 * chunk.numel() * 2, "cuda", [chunk], [torch.bfloat16])
        self.page, self.expected, self.source = (self.arena.allocate([chunk], [torch.bfloat16], MemoryFormat.KV_2LTD)
                                                 for _ in range(3))
        self.connector = connector
        self.kwargs = {"kvcaches": self.kv, "slot_mapping": self.slots}
        # What LMCache's own per-chunk gather makes of the first values, every stream synchronized.
        self.write(self.first)
        torch.cuda.synchronize()
        connector.from_gpu(self.expected, 0, TOKENS, **self.kwargs)
        torch.cuda.synchronize()
        assert bool((self.expected.tensor >= 1).all()), "LMCache's gather of the first values is not all >= 1"
        self.write([torch.zeros_like(k) for k in self.kv])
        self.source.tensor.copy_(-self.expected.tensor)  # what a retrieve would load: the second values
        torch.cuda.synchronize()

    def write(self, values) -> None:
        """The step's forward writing its KV, on the current (engine's) stream."""
        for cache, value in zip(self.kv, values):
            cache.copy_(value)

    def store(self):
        """What LMCache's store and the sender do on the engine's thread, without any wait: the gather
        through the patched batched_from_gpu, then the sender's ordering of the engine's and load streams."""
        from lmcache_p2p.backend.store_ready import gpu_done

        self.connector.batched_from_gpu([self.page], [0], [TOKENS], **self.kwargs)
        return gpu_done(self.connector.store_stream, self.connector.load_stream)

    def check(self, done) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"the store's GPU work did not finish within {WAIT_S}s"
            time.sleep(0.001)
        torch.cuda.synchronize()
        page = self.page.tensor
        stale, later = int((page == 0).sum()), int((page < 0).sum())
        assert stale == 0 and later == 0, (f"the page holds {stale} values from before the step and {later} from "
                                           f"the next write, of {page.numel()}")
        assert torch.equal(page, self.expected.tensor), "the page differs from LMCache's own gather of the step"


def test_a_store_queued_before_the_forward_wrote_its_kv_gathers_that_kv_not_the_next_steps(gathered):
    step = Step(gathered)
    torch.cuda._sleep(LATE_CYCLES)  # the forward is still running ...
    step.write(step.first)  # ... and writes the step's KV only then
    done = step.store()  # queued at once: the engine's thread does not wait
    step.write(step.second)  # the next step rewrites the blocks (freed, reallocated) on the engine's stream
    step.check(done)


def test_a_late_store_stream_is_not_overtaken_by_the_next_steps_write(gathered):
    step = Step(gathered)
    step.write(step.first)
    with torch.cuda.stream(gathered.store_stream):
        torch.cuda._sleep(LATE_CYCLES)  # earlier stores still gathering
    done = step.store()
    step.write(step.second)
    step.check(done)


def test_lmcaches_retrieve_on_its_load_stream_waits_for_the_gather(gathered):
    step = Step(gathered)
    step.write(step.first)
    torch.cuda._sleep(LATE_CYCLES)  # the forward goes on after writing these layers: the gather waits for it
    done = step.store()
    # The next step's retrieve loads other KV into the same blocks (a preempted request's, freed and reused);
    # LMCache waits for its load stream on the CPU before it returns.
    gathered.batched_to_gpu([step.source], [0], [TOKENS], **step.kwargs)
    step.check(done)
    for cache in step.kv:  # the retrieve did land, after the gather
        assert bool((cache[:, step.blocks.cuda()] < 0).all()), "the retrieve's KV is not in the blocks"
