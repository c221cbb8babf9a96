"""A transport peer process (``tests/transport/transport_peer.serve``) inside a rig host: the spawned
process moves into the host's network namespace before it builds its transport."""

from __future__ import annotations

import sys
from pathlib import Path

TRANSPORT_TESTS = str(Path(__file__).resolve().parents[1] / "transport")


def serve_in(netns_path: str, *args: object) -> None:
    from rig import _setns

    _setns(netns_path)
    if TRANSPORT_TESTS not in sys.path:
        sys.path.insert(0, TRANSPORT_TESTS)
    import transport_peer

    transport_peer.serve(*args)
