"""The proxy with deliberately wrong stream continuations: proof that the fault suite sees one.

    python tests/faults/broken_proxy.py MODE proxy --port ...     (the arguments of lmcache_p2p.cli.main)

MODE ``drop``: a stream that broke continues from prompt + output so far without its last token;
``duplicate``: with its last token twice. The remaining ``max_tokens`` stay right, so the client gets
a full-length output that is wrong from the cut on (nothing else changes: the first decode, prompt +
first token, is left as it is). Test-only: the product has no such setting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

MODES = ("drop", "duplicate")


def broken(decode_body: Callable[..., dict[str, Any]], mode: str) -> Callable[..., dict[str, Any]]:
    """``decode_body`` whose continuations (more than the first token already out) are wrong by ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")

    def body(req: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], **kwargs: Any) -> dict[str, Any]:
        out = decode_body(req, prompt_ids, output_ids, **kwargs)
        if len(output_ids) >= 2:
            context = [*prompt_ids, *output_ids]
            out["prompt"] = context[:-1] if mode == "drop" else [*context, output_ids[-1]]
        return out

    return body


def main(argv: Sequence[str]) -> int:
    from lmcache_p2p.cli.main import main as proxy_main
    from lmcache_p2p.proxy.flow import flow

    flow.decode_body = broken(flow.decode_body, argv[0])
    return proxy_main(list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
