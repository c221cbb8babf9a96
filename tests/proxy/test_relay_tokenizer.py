"""The proxy process loads its tokenizer (found with bench/proxy_relay.py: it never did with --tokenizer DIR).

``TokenizerProvider.prefetch`` imports ``transformers`` in one thread while ``_load`` imported it
in another: the second saw a half-initialized module ("cannot import name 'AutoTokenizer'") and
the proxy ran without a tokenizer (estimated counts, text from the instances). Run in a fresh
interpreter, where ``transformers`` is not imported yet (this test process has it imported).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

_CHILD = """
import asyncio, logging, sys
logging.basicConfig(level=logging.WARNING)
from lmcache_p2p.proxy.http.tokenizer import TokenizerProvider

async def main():
    provider = TokenizerProvider(sys.argv[1], None, 1.0)
    await asyncio.wait_for(provider.load_in_background(lambda: []), 240)
    tokenizer = await provider.get([])
    print("LOADED" if tokenizer is not None else "NONE")

asyncio.run(main())
"""


def test_a_tokenizer_folder_loads_in_a_fresh_proxy_process(tokenizer_dir):
    path, _ = tokenizer_dir
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=280)
    assert done.stdout.strip().splitlines()[-1:] == ["LOADED"], done.stderr[-2000:]
