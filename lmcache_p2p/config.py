"""The typed, validated view of lmcache_p2p's settings.

Our settings live in the LMCache YAML (``LMCACHE_CONFIG_FILE``) under ``extra_config.p2p``::

    extra_config:
      storage_plugin.p2p.module_path: lmcache_p2p.backend
      storage_plugin.p2p.class_name: ReceiverBackend
      p2p:
        role: receiver
        buffer_size: 2GB
        control_ports: [7300]

Every key is checked once, at load; a mistake raises one :class:`ConfigError` naming the key
(``p2p.buffer_size``) and what is allowed. Nothing else in the package reads raw YAML.

Addresses: ``p2p.host`` is where a receiver binds its control port and its NCCL store;
``p2p.advertise_host`` is the address peers are told to dial (in Announce and in the transport
info). It defaults to ``host``; when ``host`` is a wildcard (0.0.0.0, ::) it defaults to this
machine's resolvable address, and load fails asking for it when that is loopback or unknown.

Exposure: a receiver bound beyond loopback must set ``p2p.shared_secret`` (every control frame
is then authenticated, see protocol.Codec), or ``p2p.insecure: true`` to accept the risk.
This module imports nothing heavy (no torch, lmcache, zmq).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from lmcache_p2p.errors import ConfigError

SECTION = "p2p"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class TransportKind(str, enum.Enum):
    NIXL = "nixl"
    NCCL = "nccl"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size_bytes(key: str, value: Any) -> int:
    """Parse ``2GB``, ``512MiB``, ``1.5g`` or a plain integer into bytes.

    As in LMCache's own sizes, K/M/G/T are binary (``2GB`` == ``2GiB`` == 2 * 2**30 bytes).
    """
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size such as 2GB or 536870912, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "").lower().replace("i", "").replace("b", "")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(key, f"expected a size such as 2GB, 512MiB or 536870912, got {value!r}")
    if size <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    return size


def _enum(key: str, value: Any, enum_type: type[enum.Enum]) -> Any:
    allowed = [m.value for m in enum_type]
    if isinstance(value, str) and value.lower() in allowed:
        return enum_type(value.lower())
    raise ConfigError(key, f"must be one of {', '.join(allowed)}; got {value!r}")


def _positive_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def _port(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(key, f"must be a TCP port in 1..65535, got {value!r}")
    return value


def _ports(key: str, value: Any) -> tuple[int, ...] | int:
    """A list of ports (one per TP rank) or one base port (rank r uses base + r)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(key, "must list at least one port (one per TP rank)")
        return tuple(_port(f"{key}[{i}]", p) for i, p in enumerate(value))
    return _port(key, value)


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _device(key: str, value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"cpu|cuda(:\d+)?", value.strip().lower()):
        return value.strip().lower()
    raise ConfigError(key, f"must be one of cpu, cuda, cuda:N; got {value!r}")


# Every connecting control socket pings its peer (ZMTP heartbeats) and drops a connection whose peer
# answers nothing this long, then dials again: after a network cut the next frame goes out on a new
# connection at once, not when TCP's retransmission backoff (doubling, up to minutes) next tries.
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000
SENDER_IDLE_POLL_S = 0.05  # the sender thread's poll with nothing in flight; a write poll slower makes no sense


@dataclasses.dataclass(frozen=True)
class P2PConfig:
    """All lmcache_p2p settings; see the module docstring for where they live."""

    role: Role
    transport: TransportKind = TransportKind.NIXL
    # Receiver: the preallocated receive buffer (and, below, where it listens). Sender: with
    # buffer_device cuda, the VRAM arena LMCache stores chunks in before they are sent (no host
    # round trip; backend/send_buffer.py); cpu keeps them in LocalCPUBackend's host memory.
    buffer_size_bytes: int = 1 << 30
    buffer_device: str = "cpu"
    # Sender with buffer_device cuda: gather each store's chunks into the arena in one pass (LMCache's
    # kernel straight into each page, the layers' view derived once per store; backend/send_gather.py)
    # instead of LMCache's per-chunk from_gpu. false: LMCache's own path.
    batched_gather: bool = True
    # Sender with buffer_device cuda: the engine never waits for a store's GPU work (backend/store_ready.py):
    # the batch goes to the sender at once (its Alloc too), its writes once its chunks are written. false: the
    # engine's thread waits, as LMCache's adapter does (its slot mapping copy synchronizes each step's forward;
    # the GPU idles while it stores).
    async_store: bool = True
    # Sender with async_store: a store whose GPU work has not finished this long after the engine queued it
    # fails (KvFailed to the proxy, its granted slots cancelled; its pages go back to the arena, rewritten only
    # after that work on the GPU) instead of holding up every later store's writes.
    store_ready_timeout_s: float = 30.0
    # Sender: stores waiting for their GPU work (async_store) and batches waiting for the sender's thread
    # (send queue) at most; one more is refused (its pages freed, the request failed) with an error naming it.
    store_queue_max_stores: int = 1024
    send_queue_max_batches: int = 4096
    # Receiver: keep chunks the engine loaded as an LRU cache in the receive buffer, so a later
    # request sharing a prefix is told not to send them again (evicted when a reservation needs room).
    buffer_cache: bool = True
    host: str = "127.0.0.1"  # bind address of the receiver's control port and NCCL store
    advertise_host: str | None = None  # what peers dial; default: host (see advertised_host())
    control_ports: tuple[int, ...] | int = 7300
    transport_ports: tuple[int, ...] | int = 7400
    # Registry: where to announce ourselves and report "KV ready"; optional.
    proxy_url: str | None = None
    http_url: str | None = None
    instance_id: str | None = None
    shared_secret: str | None = None
    insecure: bool = False  # allow binding beyond loopback without shared_secret (anyone can inject)
    auth_window_s: float = 30.0  # authenticated frames stamped further from our clock are refused
    # Deadlines and leases.
    connect_timeout_s: float = 5.0
    alloc_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    # Sender: a request whose last store batch has not arrived this long after its first fails
    # (client gone mid-prefill); its slots are cancelled on the receiver.
    request_timeout_s: float = 600.0
    # Sender: how long a failed write's chunks stay referenced until the transport confirms that
    # nothing reads them any more; past it they are never handed back to LMCache (logged leak).
    settle_timeout_s: float = 60.0
    # Sender: how often the service thread checks its writes in flight for completion. Unset: 0.1 ms
    # when chunks are in VRAM (buffer_device cuda: a 128 MiB peer copy takes ~0.4 ms, so a 1 ms poll
    # would more than double it), 1 ms with host chunks (the thread shares the engine's core and GIL
    # on vLLM-CPU, where a finer poll slows the prefill; see send_service._step).
    write_poll_interval_s: float | None = None
    # A granted slot given up before its bytes landed stays quarantined for transfer_timeout_s plus
    # this margin after its grant (a late write may still land in it); the reserve lease must be longer.
    quarantine_margin_s: float = 5.0
    reserve_lease_s: float = 60.0  # when not set: max(60, 2 * (transfer_timeout_s + quarantine_margin_s))
    ready_lease_s: float = 120.0
    heartbeat_interval_s: float = 2.0
    # Receiver: a sender silent this long (no control message, no landed write) is forgotten and
    # its transport pair torn down; it says Hello again on its next request.
    sender_idle_timeout_s: float = 600.0
    # The model's KV heads over all TP ranks (0: from the model folder's config.json, else this rank's
    # heads x TP size). Needed only when heads are replicated (fewer KV heads than TP ranks).
    kv_heads_total: int = 0
    # NCCL: writes a sender pair holds before its thread posts them; one more is refused at once (the
    # write fails, its chunks are handed back) rather than queued without end behind a stuck pair.
    nccl_max_queued_writes: int = 4096
    # NIXL: UCX backend parameters, e.g. {"ucx_error_handling_mode": "none"}.
    nixl_backend_params: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Behind a foreign router that names the decoder by its HTTP address (vllm-router, docs/ROUTERS.md): a
    # decoder's rank r control port is its HTTP port + this offset + r, on its HTTP host. Set on every instance
    # (a decoder checks its own ports against it at start); unset: only our proxy's disagg_spec routes KV.
    router_control_port_offset: int | None = None
    # Sender behind such a router: the decoders' TP size (0: the same as this prefiller's).
    router_decoder_tp_size: int = 0
    # Receiver behind such a router: how long a decode the prefiller announced waits, from its first lookup,
    # for the whole prompt's KV before the decoder computes what is missing.
    router_kv_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self.check_exposure()
        if self.write_poll_interval_s is not None and self.write_poll_interval_s > SENDER_IDLE_POLL_S:
            raise ConfigError(f"{SECTION}.write_poll_interval_s",
                              f"is {self.write_poll_interval_s:g}s; at most {SENDER_IDLE_POLL_S:g}s (a write's "
                              "completion is seen no sooner than this after it lands)")
        self.check_router_ports()
        if self.reserve_lease_s <= self.write_window_s:
            raise ConfigError(
                f"{SECTION}.reserve_lease_s",
                f"is {self.reserve_lease_s:g}s but must exceed {SECTION}.transfer_timeout_s + "
                f"{SECTION}.quarantine_margin_s ({self.transfer_timeout_s:g}s + {self.quarantine_margin_s:g}s): "
                "a granted slot's lease must outlive every write that may still land in it; raise "
                f"{SECTION}.reserve_lease_s or lower {SECTION}.transfer_timeout_s",
            )

    @property
    def write_poll_s(self) -> float:
        """``write_poll_interval_s``, or its default for ``buffer_device``."""
        if self.write_poll_interval_s is not None:
            return self.write_poll_interval_s
        return 0.0001 if self.buffer_device.startswith("cuda") else 0.001

    @property
    def write_window_s(self) -> float:
        """How long after a grant a write into that slot may still land (quarantine of a given-up slot)."""
        return self.transfer_timeout_s + self.quarantine_margin_s

    def check_router_ports(self) -> None:
        """A receiver addressed through a foreign router listens where the port relation says."""
        offset = self.router_control_port_offset
        if self.role is not Role.RECEIVER or offset is None:
            return
        key = f"{SECTION}.router_control_port_offset"
        http_port = _url_port(self.http_url)
        if http_port is None:
            raise ConfigError(key, f"is set on a receiver but {SECTION}.http_url ({self.http_url!r}) names no port: "
                                   "set http_url to this vLLM server's http://HOST:PORT so the relation can be checked")
        ranks = len(self.control_ports) if isinstance(self.control_ports, tuple) else 1
        for rank in range(ranks):
            if self.control_port(rank) != http_port + offset + rank:
                raise ConfigError(key, (
                    f"is {offset}, so a router that names this decoder by HTTP port {http_port} sends rank {rank}'s "
                    f"KV to port {http_port + offset + rank}, but {SECTION}.control_ports gives rank {rank} port "
                    f"{self.control_port(rank)}: set control_ports to {http_port + offset} (rank r: + r) or change "
                    "the offset on every instance"))

    def check_exposure(self) -> None:
        """A receiver's control port (and NCCL store) beyond loopback needs a shared secret."""
        if self.role is not Role.RECEIVER or is_loopback(self.host) or self.shared_secret:
            return
        if not self.insecure:
            raise ConfigError(f"{SECTION}.shared_secret", (
                f"p2p.host is {self.host!r} (beyond loopback) but p2p.shared_secret is not set: anyone who can reach "
                f"the control port could reserve slots, cancel requests and write KV. Set p2p.shared_secret (the same "
                f"on every instance and the proxy), bind p2p.host to 127.0.0.1, or set p2p.insecure: true to accept "
                f"the risk"))
        logger.warning("INSECURE: p2p.host is %s and p2p.shared_secret is not set (p2p.insecure: true): control "
                       "messages on this port are NOT authenticated", self.host)

    def advertised_host(self) -> str:
        """The address peers dial to reach this instance (p2p.advertise_host, else p2p.host, resolved)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in WILDCARD_HOSTS:
            return self.host
        try:
            resolved = socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise ConfigError(f"{SECTION}.advertise_host", (
                f"p2p.host is {self.host!r} (every interface), which peers cannot dial, and this machine's name "
                f"{socket.gethostname()!r} does not resolve ({exc}): set p2p.advertise_host to the address peers "
                "reach")) from exc
        if is_loopback(resolved):
            raise ConfigError(f"{SECTION}.advertise_host", (
                f"p2p.host is {self.host!r} (every interface), which peers cannot dial, and this machine's name "
                f"{socket.gethostname()!r} resolves to loopback {resolved}: set p2p.advertise_host to the address "
                "peers reach"))
        return resolved

    def default_instance_id(self, tp_rank: int = 0) -> str:
        """p2p.instance_id, else one unique across hosts: ``decoder-HOSTNAME:PORT`` / ``prefiller-HOSTNAME-PID``."""
        if self.instance_id:
            return self.instance_id
        if self.role is Role.RECEIVER:
            return f"decoder-{socket.gethostname()}:{self.control_port(0)}"
        return f"prefiller-{socket.gethostname()}-{os.getpid()}"

    def control_port(self, tp_rank: int) -> int:
        return _rank_port("p2p.control_ports", self.control_ports, tp_rank)

    def transport_port(self, tp_rank: int) -> int:
        return _rank_port("p2p.transport_ports", self.transport_ports, tp_rank)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> P2PConfig:
        """Validate the ``extra_config.p2p`` map (``${NAME}`` read from ``environ``, default os.environ)."""
        if raw is None:
            raise ConfigError(SECTION, "missing: add a `p2p:` map under extra_config (role: sender|receiver)")
        if not isinstance(raw, Mapping):
            raise ConfigError(SECTION, f"must be a map, got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        aliases = {"buffer_size": "buffer_size_bytes"}
        unknown = sorted(k for k in raw if aliases.get(k, k) not in fields)
        if unknown:
            allowed = sorted(set(fields) - {"buffer_size_bytes"} | {"buffer_size"})
            raise ConfigError(f"{SECTION}.{unknown[0]}", f"unknown key; known keys: {', '.join(allowed)}")
        if "role" not in raw:
            raise ConfigError(f"{SECTION}.role", "missing; must be one of sender, receiver")

        values: dict[str, Any] = {}
        for name, value in raw.items():
            key = f"{SECTION}.{name}"
            name = aliases.get(name, name)
            values[name] = _convert(key, name, expand_env(key, value, os.environ if environ is None else environ))
        if "reserve_lease_s" not in values:
            transfer = values.get("transfer_timeout_s", cls.transfer_timeout_s)
            margin = values.get("quarantine_margin_s", cls.quarantine_margin_s)
            values["reserve_lease_s"] = max(cls.reserve_lease_s, 2 * (transfer + margin))
        cfg = cls(**values)
        if cfg.role is Role.RECEIVER:
            cfg.advertised_host()  # fail at load, not when the first peer is told where to dial
        return cfg

    @classmethod
    def from_lmcache(cls, lmcache_config: Any) -> P2PConfig:
        """Read and validate our section of an ``LMCacheEngineConfig``."""
        extra = getattr(lmcache_config, "extra_config", None) or {}
        return cls.from_mapping(extra.get(SECTION))


def expand_env(key: str, value: Any, environ: Mapping[str, str]) -> Any:
    """``value`` with each ``${NAME}`` replaced by ``environ[NAME]`` (strings only; others as they are)."""
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(key, f"refers to ${{{name}}} but the environment variable {name} is not set")
        return environ[name]

    return _ENV_REF.sub(one, value)


def _convert(key: str, name: str, value: Any) -> Any:
    if name == "role":
        return _enum(key, value, Role)
    if name == "transport":
        return _enum(key, value, TransportKind)
    if name == "buffer_size_bytes":
        return parse_size_bytes(key, value)
    if name == "buffer_device":
        return _device(key, value)
    if name in ("control_ports", "transport_ports"):
        return _ports(key, value)
    if name.endswith("_s"):
        return _positive_float(key, value)
    if name in ("store_queue_max_stores", "send_queue_max_batches"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(key, f"must be a whole number of at least 1, got {value!r}")
        return value
    if name == "router_control_port_offset":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not -65535 < value < 65535:
            raise ConfigError(key, f"must be a whole number of ports (decoder control port - its HTTP port), "
                                   f"got {value!r}")
        return value
    if name in ("kv_heads_total", "router_decoder_tp_size"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            what = "KV heads (0: read the model's config)" if name == "kv_heads_total" else "TP ranks (0: this one's)"
            raise ConfigError(key, f"must be a whole number of {what}, got {value!r}")
        return value
    if name == "nccl_max_queued_writes":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(key, f"must be a positive whole number of writes, got {value!r}")
        return value
    if name in ("insecure", "buffer_cache", "batched_gather", "async_store"):
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if name == "advertise_host" and value is not None:
        value = _str(key, value)
        if value in WILDCARD_HOSTS:
            raise ConfigError(key, f"must be an address peers can dial, not the wildcard {value!r}")
        return value
    if name == "proxy_url":
        value = _str(key, value)
        if not re.fullmatch(r"tcp://[^:/\s]+:\d+", value):
            raise ConfigError(key, f"must look like tcp://HOST:PORT (the proxy's control address), got {value!r}")
        return value
    if name == "nixl_backend_params":
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a map of UCX backend parameters, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if value is None and name in ("http_url", "instance_id", "shared_secret", "advertise_host"):
        return None
    return _str(key, value)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; any other name counts as beyond loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _url_port(url: str | None) -> int | None:
    """The port of ``http://HOST:PORT[/...]``, or None."""
    match = re.fullmatch(r"https?://(?:\[[^\]]+\]|[^:/\s]+):(\d+)/?", url or "")
    return int(match.group(1)) if match else None


def _rank_port(key: str, ports: tuple[int, ...] | int, tp_rank: int) -> int:
    if isinstance(ports, int):
        return ports + tp_rank
    if tp_rank >= len(ports):
        raise ConfigError(key, f"lists {len(ports)} port(s) but TP rank {tp_rank} needs one: list one port per TP rank")
    return ports[tp_rank]


def check_lmcache_settings(lmcache_config: Any, role: Role | None = None) -> None:
    """Reject LMCache settings under which the plugin cannot work (FACTS.md, storage plugins)."""
    if getattr(lmcache_config, "enable_pd", False):
        raise ConfigError("enable_pd", "must be false: lmcache_p2p replaces LMCache's PD backend")
    if not getattr(lmcache_config, "save_unfull_chunk", True):
        raise ConfigError("save_unfull_chunk", "must be true, or a prompt's partial last chunk is never sent")
    if role is Role.RECEIVER and getattr(lmcache_config, "local_cpu", False):
        # LMCache writes every chunk a non-CPU backend returned back into LocalCPUBackend's cache,
        # keeping a reference: each loaded chunk's receive slot would stay taken until LMCache evicts it.
        raise ConfigError("local_cpu", "must be false on a decoder (receiver): LMCache would keep every received "
                                       "chunk in its CPU cache, holding its receive-buffer slot, until the buffer "
                                       "fills; the receive buffer's own cache (p2p.buffer_cache) keeps loaded chunks")
