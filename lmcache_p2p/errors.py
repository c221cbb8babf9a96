"""The one error hierarchy of lmcache_p2p.

    P2PError
    ├── ConfigError              a setting is missing, malformed or out of range (names the key)
    ├── ProtocolError            a control frame that cannot be trusted or understood
    │   ├── AuthError            the shared-secret tag is missing or wrong
    │   │   ├── ReplayError      an authentic frame whose nonce was already seen (a replay)
    │   │   ├── StaleFrameError  an authentic frame whose timestamp is outside the window
    │   │   └── MisaddressedError an authentic frame addressed to another peer
    │   ├── OversizedError       a frame larger than protocol.MAX_MESSAGE_BYTES
    │   └── VersionError         the peer speaks another protocol version
    ├── TransportError           moving bytes failed
    │   ├── PeerUnreachable      connecting to a peer failed
    │   └── TransportTimeout     a transfer or a wait passed its deadline
    ├── BufferFull               the receive buffer cannot hold what was asked for (a refusal)
    ├── QueueFull                a bounded queue inside the process is full (names the setting)
    ├── RequestFailed            a request's KV transfer ended without success (refused, cancelled, peer died)
    ├── ClosedError              the component was closed and cannot be used any more
    ├── LaunchError              ``lmcache-p2p launch`` cannot start or keep the deployment (cli/)
    │   ├── StartupError         a port is taken, or a child exited / did not answer as itself in time
    │   ├── GpuPlanError         the GPU plan cannot work (names the flag to change)
    │   └── SupervisionError     the launcher must stop (names the child, its exit code and its log)
    │       ├── ChildExitedError   a child exited under ``--on-exit stop``
    │       └── RestartLimitError  a child exited more often than ``--max-restarts`` allows
    └── ProxyError               the proxy's errors, drawn in ``lmcache_p2p.proxy.errors``

Third-party exceptions (NIXL, ZMQ, torch.distributed) are mapped at the edge with
``raise ... from exc`` so callers only ever handle these types.

"""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error raised by lmcache_p2p."""


class ConfigError(P2PError, ValueError):
    """A configuration value is missing, malformed or out of range."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class ProtocolError(P2PError):
    """A control frame is malformed, unknown or otherwise not acceptable."""


class AuthError(ProtocolError):
    """A control frame's authentication tag is missing or does not match."""


class ReplayError(AuthError):
    """An authentic control frame whose nonce was already accepted: a replay."""


class StaleFrameError(AuthError):
    """An authentic control frame stamped outside the accepted time window."""


class MisaddressedError(AuthError):
    """An authentic control frame whose signed recipient is another peer (replayed from elsewhere)."""


class OversizedError(ProtocolError):
    """A control frame larger than the configured limit."""


class VersionError(ProtocolError):
    """The peer speaks a different protocol version."""


class TransportError(P2PError):
    """A data transfer failed."""


class PeerUnreachable(TransportError):
    """A peer could not be connected to."""


class TransportTimeout(TransportError, TimeoutError):
    """A transfer or a wait on the transport passed its deadline."""


class QueueFull(P2PError):
    """A bounded queue inside this process holds its maximum; what was offered was refused and released."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


class BufferFull(P2PError):
    """The receive buffer has no room for a reservation; nothing was reserved."""

    def __init__(self, message: str, *, needed_slots: int, free_slots: int, capacity_slots: int) -> None:
        self.needed_slots = needed_slots
        self.free_slots = free_slots
        self.capacity_slots = capacity_slots
        super().__init__(message)


class RequestFailed(P2PError):
    """A request's KV transfer ended without success."""


class ClosedError(P2PError):
    """The component has been closed."""


class LaunchError(P2PError, RuntimeError):
    """The launcher cannot start or keep the deployment."""


class StartupError(LaunchError):
    """A port is taken, or a child exited or did not answer as itself in time; names the port or log."""


class GpuPlanError(LaunchError):
    """The GPU plan cannot work; the message names what was seen, the limit and the flag to change."""


class SupervisionError(LaunchError):
    """The launcher must stop: the message names the child, its exit code and its log."""


class ChildExitedError(SupervisionError):
    """A child exited under ``--on-exit stop``."""


class RestartLimitError(SupervisionError):
    """A child exited more often than ``--max-restarts`` within ``--restart-window-s``."""
