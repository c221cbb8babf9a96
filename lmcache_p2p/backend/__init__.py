"""The LMCache storage plugin: ``SenderBackend`` (prefiller) and ``ReceiverBackend`` (decoder).

Name one of them in the LMCache YAML::

    storage_plugins: [p2p]
    extra_config:
      storage_plugin.p2p.module_path: lmcache_p2p.backend
      storage_plugin.p2p.class_name: SenderBackend     # or ReceiverBackend
      p2p: {role: sender, ...}

``sender.py`` / ``receiver.py`` adapt LMCache's StoragePluginInterface (the only code here that
imports lmcache) to ``send_service.py`` / ``receive_service.py``, which own the thread and sockets
(opened by ``start()``) and compose the logic:

    sender:   send_peers.py (sessions with receivers), send_pipeline.py (Alloc -> Grant per batch),
              send_writes.py (writes held until their store's GPU work is done, in flight, chunks handed
              back once settled), send_types.py; store_ready.py (the store's GPU work, watched off the
              engine's thread)
    receiver: control_port.py (its socket and senders), grant_table.py (requests and their slots),
              chunk_index.py (READY chunks and lookup pins), write_guard.py (two-sided writes)

``common.py`` holds what both roles share (config, transport, ``chunk_key``). This package never
parses request ids: where KV goes comes from the request's DisaggSpec (``transfer_spec``).
"""

from lmcache_p2p.backend.receiver import ReceiverBackend
from lmcache_p2p.backend.sender import SenderBackend

__all__ = ["ReceiverBackend", "SenderBackend"]
