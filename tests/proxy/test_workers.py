"""``--workers N``: relay worker processes serve the HTTP port; the coordinator (this process, in these
tests) keeps the registry, routing and load. Same clients' bytes as one process; no leaked load."""

from __future__ import annotations

import pytest

from .conftest import make_cluster
from .fakes import MODEL, PROMPT
from .test_flow import assert_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_smoke():
    async with make_cluster(workers=2) as c:
        r = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8})
        print(r.status_code, r.text)
        ev = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
                                                "stream_options": {"include_usage": True}})
        print(ev)
        print((await c.client.get("/stats")).text[:300])
        assert_idle(c)
        assert len(c.proxy.coordinator) == 0
