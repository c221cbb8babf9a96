"""The proxy's flags, validated once into :class:`ProxySettings`.

Static instances (in addition to the ones that announce themselves on the control port)::

    --prefill URL                                   repeatable
    --decode URL[,host=H][,tp=N][,control=P][,transport=P]   repeatable

``control`` / ``transport`` are the decoder's receiver ports (``p2p.control_ports`` /
``p2p.transport_ports`` in its LMCache YAML): one base port (rank r uses base + r, as in the
YAML) or one port per TP rank joined by ``+`` (``control=7300+7310``). Defaults: host = the URL's
host, tp = 1, control = 7300, transport = 7400. Example::

    --decode http://127.0.0.1:8200,control=7300,transport=7400
    --decode http://10.0.0.5:8200,tp=2,control=7300+7301,transport=7400+7401

Instances running vLLM's own NixlConnector (``Backend.VLLM_NIXL``) cannot announce themselves; they are
registered by URL, with flags or at run time (``POST /instances/register``, an admin call)::

    --nixl-prefill http://127.0.0.1:8100 --nixl-decode http://127.0.0.1:8200

They are probed like every instance, polled for their KV cache's free blocks and liveness every
``--kv-metrics-interval-s`` (``router/kv_metrics.py``), paired only with each other, and forgotten once idle
after a drain (``POST /instances/drain``).

A static entry proves nothing about the instance's LMCache plugin, so it is never paired for
disaggregated serving: it serves requests alone (``colocated_total{reason="plugin_not_running"}``)
until its plugin announces itself (``p2p.proxy_url`` pointing at ``--control-port``) at the same
role and HTTP URL; the announced instance then replaces the static entry while it is alive.

Security: the control socket and the admin endpoints (``GET /instances``, ``POST /instances/drain``,
``POST /stats/reset``) bound beyond loopback need ``--shared-secret`` (or ``$LMCACHE_P2P_SECRET``);
``--insecure`` overrides, loudly. With a secret, admin calls carry ``Authorization: Bearer <secret>``.

Health gating: an instance, static or announced, takes traffic only once its ``GET /health``
answered 200 (probed every ``--health-probe-interval-s``, each attempt bounded by
``--health-probe-timeout-s``); after ``--max-connect-failures`` failed connections in a row it
is out of rotation until a probe succeeds again.

Admission (``router/admission.py``): a request whose KV fits no decoder buffer now waits, in a fair FIFO
of at most ``--admission-queue-max`` requests, up to ``--admission-timeout-s`` for credit; then, or
at once when the queue is full or the KV is larger than every buffer, a decoder computes its prompt
itself. The proxy answers 503 only when no instance at all is routable.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import operator
import os
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from lmcache_p2p.config import WILDCARD_HOSTS, Role, is_loopback
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.proxy.router.prefix import PrefixSettings
from lmcache_p2p.proxy.router.registry import Backend, StaticInstance
from lmcache_p2p.proxy.router.routing import Policy

SECRET_ENV = "LMCACHE_P2P_SECRET"
DEFAULT_CONTROL_PORT = 7300
DEFAULT_TRANSPORT_PORT = 7400


class KvFailurePolicy(str, enum.Enum):
    """What to do when a request's KV failed or did not arrive within --kv-timeout-s."""

    RETRY = "retry"  # prefill once more on another prefiller/decoder pair, then recompute
    RECOMPUTE = "recompute"  # send the decode anyway: the decoder recomputes the prompt
    FAIL = "fail"  # answer 502 (failed) / 504 (timeout): for tests that must see the KV path work


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    host: str = "127.0.0.1"
    port: int = 9100
    control_host: str = "127.0.0.1"
    control_port: int = 9101
    # The hosts instances dial the control socket by (their p2p.proxy_url's): frames addressed otherwise are
    # refused under a shared secret. Default: --control-host (this machine's names when it is a wildcard).
    advertise_hosts: tuple[str, ...] = ()
    shared_secret: str | None = None
    insecure: bool = False  # allow --host / --control-host beyond loopback without a shared secret
    auth_window_s: float = 30.0
    policy: Policy = Policy.PREFIX
    on_kv_failure: KvFailurePolicy = KvFailurePolicy.RETRY
    kv_timeout_s: float = 10.0
    # A KV wait this long without the KV probes the decoder's GET /health (again at this interval, each
    # probe bounded by health_probe_timeout_s): a decoder the proxy cannot reach ends the wait at once and
    # the request fails over. 0: never probe (only KvFailed, the registry and --kv-timeout-s end a wait).
    kv_probe_after_s: float = 1.0
    # An lmcache_p2p pair's decode goes out when the prefill answered, not after KvReady: the decoder holds it
    # in its scheduler until the KV arrived (p2p.router_kv_timeout_s) while the proxy still waits for the KV's
    # outcome, and closes that decode and fails over when the KV fails before the decode's first output.
    early_decode: bool = False
    chat_parsers: bool = False  # every chat decodes on its decoder's chat endpoint (flow/flow.py: instance_renders)
    instance_ttl_s: float = 10.0
    connect_timeout_s: float = 5.0
    # An upstream connection whose peer acknowledges nothing (TCP keepalive probes, data sent) this long
    # is closed: a stream on a host that fell off the network breaks now and continues elsewhere.
    dead_peer_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    decode_idle_timeout_s: float = 120.0
    graceful_shutdown_s: float = 10.0
    summary_interval_s: float = 10.0
    chars_per_token: float = 4.0
    health_probe_interval_s: float = 1.0
    health_probe_timeout_s: float = 2.0
    max_connect_failures: int = 2
    admission_timeout_s: float = 5.0
    admission_queue_max: int = 1024
    tokenizer: str = "auto"  # a folder, "auto" (the served model's folder) or "none"
    tokenizer_wait_s: float = 10.0  # longest a request waits for the tokenizer's first load
    tokenizer_load_timeout_s: float = 120.0  # longest wait for one load of it (transformers' import included)
    migration_limit: int = 2
    workers: int = 1  # relay processes on the HTTP port; 1: the proxy is one process (see relay/workers.py)
    static_instances: tuple[StaticInstance, ...] = ()
    registered_instances: tuple[StaticInstance, ...] = ()  # by URL, of a backend that cannot announce itself
    kv_metrics_interval_s: float = 1.0  # poll of a registered instance's /metrics (its KV capacity, liveness)
    prefix: PrefixSettings = PrefixSettings()  # the knobs of --policy prefix

    def __post_init__(self) -> None:
        # Accept the flags' string values when built directly (tests, launchers).
        object.__setattr__(self, "policy", Policy(self.policy))
        object.__setattr__(self, "on_kv_failure", KvFailurePolicy(self.on_kv_failure))
        if self.workers < 1:
            raise ConfigError("--workers", f"must be at least 1 (1: one process), got {self.workers}")
        for host in self.advertise_hosts:
            if host in WILDCARD_HOSTS or ":" in host or "/" in host:
                raise ConfigError("--advertise-host", f"must be a host name or IPv4 address instances dial (the "
                                                      f"host of their p2p.proxy_url), got {host!r}")
        self.check_exposure()

    def exposed_ports(self) -> list[str]:
        """The listening ports bound beyond loopback (control: ZMQ PULL; admin: the HTTP port)."""
        exposed = []
        if not is_loopback(self.control_host):
            exposed.append(f"control socket on {self.control_host}:{self.control_port} (--control-host)")
        if not is_loopback(self.host):
            exposed.append(f"HTTP/admin endpoints on {self.host}:{self.port} (--host)")
        return exposed

    def check_exposure(self) -> None:
        """Refuse to serve the registry or the admin endpoints beyond loopback without a shared secret."""
        exposed = self.exposed_ports()
        if exposed and not self.shared_secret and not self.insecure:
            raise ConfigError("--shared-secret", (
                f"{' and '.join(exposed)} would be reachable beyond loopback without a shared secret: anyone could "
                f"register a decoder (and receive prompts, KV and clients' Authorization headers) or drain "
                f"instances. Set --shared-secret (or ${SECRET_ENV}; the same as p2p.shared_secret on every "
                f"instance), bind to 127.0.0.1, or pass --insecure to accept the risk"))

    @property
    def control_name_hosts(self) -> tuple[str, ...]:
        """The hosts instances may address the control socket by, as in their ``p2p.proxy_url``:
        ``--advertise-host``, then ``--control-host`` (both loopback spellings for loopback; this
        machine's names and address for a wildcard)."""
        hosts = list(self.advertise_hosts)
        if self.control_host in WILDCARD_HOSTS:
            hosts += [socket.gethostname(), socket.getfqdn()]
            try:
                hosts.append(socket.gethostbyname(socket.gethostname()))
            except OSError:
                pass
        else:
            hosts.append(self.control_host)
            if is_loopback(self.control_host):
                hosts += ["127.0.0.1", "localhost"]
        return tuple(dict.fromkeys(hosts))

    @property
    def identity(self) -> str:
        """The proxy's name in logs of its peers when it signs as nobody else (see ControlListener.name_for)."""
        return f"proxy-{socket.gethostname()}:{self.control_port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProxySettings:
        for name in ("kv_timeout_s", "auth_window_s", "instance_ttl_s", "connect_timeout_s", "dead_peer_timeout_s",
                     "prefill_timeout_s", "decode_idle_timeout_s", "graceful_shutdown_s", "chars_per_token",
                     "health_probe_interval_s", "health_probe_timeout_s", "max_connect_failures", "kv_metrics_interval_s"):
            if getattr(args, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}", f"must be positive, got {getattr(args, name)}")
        if args.kv_probe_after_s < 0:
            raise ConfigError("--kv-probe-after-s", f"must be >= 0 (0 turns the probe off), got {args.kv_probe_after_s}")
        if args.admission_timeout_s < 0 or args.admission_queue_max < 0:
            raise ConfigError("--admission-timeout-s / --admission-queue-max",
                              f"must be >= 0 (0: never wait), got {args.admission_timeout_s} / "
                              f"{args.admission_queue_max}")
        if args.tokenizer_load_timeout_s <= 0:
            raise ConfigError("--tokenizer-load-timeout-s", f"must be positive, got {args.tokenizer_load_timeout_s}")
        if args.tokenizer_wait_s < 0:
            raise ConfigError("--tokenizer-wait-s", f"must be >= 0, got {args.tokenizer_wait_s}")
        if args.migration_limit < 0:
            raise ConfigError("--migration-limit", f"must be >= 0 (0 turns migration off), got {args.migration_limit}")
        prefix = _prefix_settings(args)
        if args.summary_interval_s < 0:
            raise ConfigError("--summary-interval-s",
                              f"must be >= 0 (0 turns the summary off), got {args.summary_interval_s}")
        return cls(
            host=args.host,
            port=args.port,
            control_host=args.control_host or args.host,
            control_port=args.control_port,
            advertise_hosts=tuple(args.advertise_host or ()),
            shared_secret=args.shared_secret or os.environ.get(SECRET_ENV) or None,
            insecure=args.insecure,
            auth_window_s=args.auth_window_s,
            policy=Policy(args.policy),
            on_kv_failure=KvFailurePolicy(args.on_kv_failure),
            kv_timeout_s=args.kv_timeout_s,
            kv_probe_after_s=args.kv_probe_after_s,
            early_decode=args.early_decode,
            chat_parsers=args.chat_parsers,
            instance_ttl_s=args.instance_ttl_s,
            connect_timeout_s=args.connect_timeout_s,
            dead_peer_timeout_s=args.dead_peer_timeout_s,
            prefill_timeout_s=args.prefill_timeout_s,
            decode_idle_timeout_s=args.decode_idle_timeout_s,
            graceful_shutdown_s=args.graceful_shutdown_s,
            summary_interval_s=args.summary_interval_s,
            chars_per_token=args.chars_per_token,
            health_probe_interval_s=args.health_probe_interval_s,
            health_probe_timeout_s=args.health_probe_timeout_s,
            max_connect_failures=args.max_connect_failures,
            admission_timeout_s=args.admission_timeout_s,
            admission_queue_max=args.admission_queue_max,
            tokenizer=args.tokenizer,
            tokenizer_wait_s=args.tokenizer_wait_s,
            tokenizer_load_timeout_s=args.tokenizer_load_timeout_s,
            migration_limit=args.migration_limit,
            workers=args.workers,
            static_instances=tuple(args.prefill or ()) + tuple(args.decode or ()),
            registered_instances=tuple(args.nixl_prefill or ()) + tuple(args.nixl_decode or ()),
            kv_metrics_interval_s=args.kv_metrics_interval_s,
            prefix=prefix,
        )


def _prefix_settings(args: argparse.Namespace) -> PrefixSettings:
    if not 0.0 <= args.prefix_cache_threshold <= 1.0:
        raise ConfigError("--prefix-cache-threshold", f"must be in 0..1, got {args.prefix_cache_threshold}")
    if args.prefix_balance_abs < 0 or args.prefix_balance_rel < 1.0:
        raise ConfigError("--prefix-balance-abs / --prefix-balance-rel",
                          f"must be >= 0 / >= 1.0, got {args.prefix_balance_abs} / {args.prefix_balance_rel}")
    if args.prefix_index_chunks <= 0:
        raise ConfigError("--prefix-index-chunks", f"must be positive, got {args.prefix_index_chunks}")
    if args.prefix_hash_seed < 0 or args.prefix_hash_seed > 4294967295:
        raise ConfigError("--prefix-hash-seed", f"must be a PYTHONHASHSEED value (0..4294967295), got "
                                                f"{args.prefix_hash_seed}")
    return PrefixSettings(cache_threshold=args.prefix_cache_threshold, balance_abs_requests=args.prefix_balance_abs,
                          balance_rel=args.prefix_balance_rel, index_chunks=args.prefix_index_chunks,
                          hash_seed=args.prefix_hash_seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``lmcache-p2p proxy`` (:data:`_FLAGS`), their defaults taken from :class:`ProxySettings`."""
    defaults = ProxySettings()
    group = parser.add_argument_group("proxy")
    for flag in _FLAGS:
        group.add_argument(flag.name, help=flag.help, **flag.options(defaults))


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One flag: its default (and type, or choices for an enum) comes from the ``ProxySettings`` field
    named by ``field`` (dotted for a nested one); ``options`` are argparse's, for flags without one."""

    name: str
    field: str | None
    help: str
    options_: dict[str, Any] = dataclasses.field(default_factory=dict)

    def options(self, defaults: ProxySettings) -> dict[str, Any]:
        if self.field is None:
            return dict(self.options_)
        value = operator.attrgetter(self.field)(defaults)
        if isinstance(value, bool):
            return {"action": argparse.BooleanOptionalAction, "default": value, **self.options_}
        if isinstance(value, enum.Enum):
            return {"choices": [m.value for m in type(value)], "default": value.value, **self.options_}
        typed = {} if isinstance(value, str) else {"type": type(value)}
        return {**typed, "default": value, **self.options_}


def parse_prefill_flag(value: str) -> StaticInstance:
    return StaticInstance(role=Role.SENDER, http_url=_url("--prefill", value.strip()))


def parse_decode_flag(value: str) -> StaticInstance:
    url, *options = [part.strip() for part in value.split(",")]
    url = _url("--decode", url)
    opts: dict[str, str] = {}
    for option in options:
        key, sep, val = option.partition("=")
        if not sep or key not in ("host", "tp", "control", "transport"):
            raise ConfigError("--decode", f"unknown option {option!r}; known: host=H, tp=N, control=P, transport=P")
        opts[key] = val
    tp_size = _positive_int("--decode tp", opts.get("tp", "1"))
    control = _rank_ports("--decode control", opts.get("control", str(DEFAULT_CONTROL_PORT)), tp_size, "tp" in opts)
    transport = _rank_ports("--decode transport", opts.get("transport", str(DEFAULT_TRANSPORT_PORT)),
                            len(control), True)
    return StaticInstance(
        role=Role.RECEIVER,
        http_url=url,
        control_host=opts.get("host") or urlsplit(url).hostname or "127.0.0.1",
        control_ports=control,
        transport_ports=transport,
    )


def registration(role: str, url: str, backend: str = Backend.VLLM_NIXL.value, url_key: str = "url") -> StaticInstance:
    """An instance registered by URL (a flag, ``POST /instances/register``): ``role`` prefiller / decoder (or
    sender / receiver), of a backend that cannot announce itself."""
    roles = {"prefiller": Role.SENDER, "sender": Role.SENDER, "decoder": Role.RECEIVER, "receiver": Role.RECEIVER}
    if role not in roles:
        raise ConfigError("role", f"must be prefiller or decoder, got {role!r}")
    try:
        kind = Backend(backend)
    except ValueError:
        raise ConfigError("backend", f"must be {Backend.VLLM_NIXL.value}, got {backend!r}") from None
    if kind.announces:
        raise ConfigError("backend", f"{kind.value} instances register themselves: point their p2p.proxy_url at "
                                     "this proxy's --control-port")
    return StaticInstance(role=roles[role], http_url=_url(url_key, url), backend=kind)


def registration_ttl(value: object) -> float | None:
    """The ``ttl_s`` of a registration by URL (``POST /instances/register``): a positive number of seconds, or
    None (absent) for one that never expires."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError("ttl_s", f"must be a positive number of seconds (or left out: never expires), got {value!r}")
    return float(value)


def _rank_ports(key: str, value: str, tp_size: int, tp_given: bool) -> tuple[int, ...]:
    ports = tuple(_port(key, p) for p in value.split("+"))
    if len(ports) == 1:
        return tuple(ports[0] + rank for rank in range(tp_size))
    if tp_given and len(ports) != tp_size:
        raise ConfigError(key, f"lists {len(ports)} ports but tp={tp_size}: give one port per TP rank or one base port")
    return ports


def _port(key: str, value: str) -> int:
    port = _positive_int(key, value)
    if port > 65535:
        raise ConfigError(key, f"must be a TCP port in 1..65535, got {value!r}")
    return port


def _positive_int(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(key, f"must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")
    return number


def _url(key: str, value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"must be an http(s) URL such as http://127.0.0.1:8200, got {value!r}")
    return value.rstrip("/")


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        try:
            return parse(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__
    return convert


_PREFIX = "--policy prefix: "
_FLAGS: tuple[_Flag, ...] = (
    _Flag("--host", "host", "HTTP bind address (default %(default)s)"),
    _Flag("--port", "port", "HTTP port (default %(default)s)"),
    _Flag("--control-host", None, "control socket bind address (default: --host)", {"default": None}),
    _Flag("--control-port", "control_port",
          "control socket (ZMQ PULL) port; instances' p2p.proxy_url points here (default %(default)s)"),
    _Flag("--advertise-host", None,
          "a host instances dial the control socket by, as in their p2p.proxy_url (repeatable; default: "
          "--control-host, or this machine's names for a wildcard); under a shared secret frames addressed to "
          "another name are refused", {"action": "append", "default": None, "metavar": "HOST"}),
    _Flag("--shared-secret", None,
          f"authenticate every control message, and admin HTTP calls as 'Authorization: Bearer <secret>' "
          f"(default: ${SECRET_ENV}, else none; required beyond loopback)", {"default": None}),
    _Flag("--insecure", None,
          "serve the control socket / admin endpoints beyond loopback WITHOUT a shared secret (anyone who "
          "reaches them can register instances and drain them)", {"action": "store_true"}),
    _Flag("--auth-window-s", "auth_window_s",
          "refuse authenticated control frames stamped further than this from our clock, and replays within it "
          "(default %(default)s)"),
    _Flag("--prefill", None, "a static prefiller's HTTP URL (repeatable)",
          {"action": "append", "type": _flag_type(parse_prefill_flag), "metavar": "URL"}),
    _Flag("--decode", None, "a static decoder (repeatable); ports: one base port or one per TP rank joined by +",
          {"action": "append", "type": _flag_type(parse_decode_flag),
           "metavar": "URL[,host=H][,tp=N][,control=P][,transport=P]"}),
    _Flag("--nixl-prefill", None, "a prefiller running vLLM's NixlConnector, by HTTP URL (repeatable)",
          {"action": "append", "type": _flag_type(lambda v: registration("prefiller", v.strip(), url_key="--nixl-prefill")),
           "metavar": "URL"}),
    _Flag("--nixl-decode", None, "a decoder running vLLM's NixlConnector, by HTTP URL (repeatable)",
          {"action": "append", "type": _flag_type(lambda v: registration("decoder", v.strip(), url_key="--nixl-decode")),
           "metavar": "URL"}),
    _Flag("--kv-metrics-interval-s", "kv_metrics_interval_s",
          "poll the /metrics of instances registered by URL (NixlConnector) this often, for their free KV blocks "
          "(admission) and liveness (default %(default)s)"),
    _Flag("--policy", "policy", "routing policy (default %(default)s)"),
    _Flag("--prefix-cache-threshold", "prefix.cache_threshold",
          _PREFIX + "when load is balanced, the instance holding the longest cached prefix of the prompt wins if "
          "that prefix is at least this share of the prompt; else least loaded (default %(default)s)"),
    _Flag("--prefix-balance-abs", "prefix.balance_abs_requests",
          _PREFIX + "load is imbalanced (least loaded wins, whatever is cached) when the most and least loaded "
          "candidates' in-flight requests differ by more than this ... (default %(default)s)"),
    _Flag("--prefix-balance-rel", "prefix.balance_rel",
          "... and the most loaded has more than this times the least loaded's (default %(default)s)"),
    _Flag("--prefix-index-chunks", "prefix.index_chunks",
          _PREFIX + "chunk hashes the proxy remembers per instance, least recently sent forgotten first "
          "(default %(default)s)"),
    _Flag("--prefix-hash-seed", "prefix.hash_seed",
          "the instances' PYTHONHASHSEED, which LMCache's chunk hashes depend on (the launcher sets 0; "
          "default %(default)s)"),
    _Flag("--on-kv-failure", "on_kv_failure",
          "on KV failure/timeout: retry once elsewhere then recompute, recompute, or fail (default %(default)s)"),
    _Flag("--kv-timeout-s", "kv_timeout_s",
          "longest wait for KV ready after the prefill answered (default %(default)s)"),
    _Flag("--kv-probe-after-s", "kv_probe_after_s",
          "probe the decoder's GET /health when its KV is not ready this long after the prefill answered, and "
          "again at this interval: a decoder that does not answer ends the wait and the request fails over "
          "(0: never; default %(default)s)"),
    _Flag("--chat-parsers", "chat_parsers",
          "the instances run vLLM with --reasoning-parser: every chat decodes on its decoder's chat endpoint, whose "
          "parsers make the answer (a chat with tools, tool_choice not 'none', always does); such a decode is not "
          "continued elsewhere once it has output (default %(default)s)"),
    _Flag("--early-decode", "early_decode",
          "send an lmcache_p2p pair's decode as soon as the prefill answered, before its KV is ready: the decoder "
          "holds it until the KV arrived (its p2p.router_kv_timeout_s bounds that) while its HTTP intake overlaps "
          "the transfer's end; a KV that fails before the decode's first output closes that decode and "
          "--on-kv-failure applies as without it (default %(default)s)"),
    _Flag("--instance-ttl-s", "instance_ttl_s",
          "forget an instance after this long without a heartbeat (default %(default)s)"),
    _Flag("--connect-timeout-s", "connect_timeout_s", "connect timeout of every upstream call (default %(default)s)"),
    _Flag("--dead-peer-timeout-s", "dead_peer_timeout_s",
          "close an upstream connection whose peer acknowledges nothing (TCP keepalive probes, data sent) for this "
          "long: a stream on a host that fell off the network continues elsewhere, without waiting for "
          "--decode-idle-timeout-s (default %(default)s)"),
    _Flag("--prefill-timeout-s", "prefill_timeout_s",
          "deadline of one prefill / tokenize / models call (default %(default)s)"),
    _Flag("--decode-idle-timeout-s", "decode_idle_timeout_s",
          "longest silence of a decode stream (default %(default)s)"),
    _Flag("--graceful-shutdown-s", "graceful_shutdown_s",
          "on shutdown, let in-flight requests finish this long, then cancel (default %(default)s)"),
    _Flag("--summary-interval-s", "summary_interval_s",
          "log a TTFT / handover summary this often; 0 = never (default %(default)s)"),
    _Flag("--chars-per-token", "chars_per_token",
          "prompt-length estimate for routing before tokenization (default %(default)s)"),
    _Flag("--health-probe-interval-s", "health_probe_interval_s",
          "probe GET /health of an instance that is not (or no longer) routable this often (default %(default)s)"),
    _Flag("--health-probe-timeout-s", "health_probe_timeout_s", "deadline of one health probe (default %(default)s)"),
    _Flag("--max-connect-failures", "max_connect_failures",
          "take an instance out of rotation after this many failed connections in a row, until GET /health "
          "answers 200 again (default %(default)s)"),
    _Flag("--admission-timeout-s", "admission_timeout_s",
          "longest wait of a request for decoder buffer credit; then a decoder computes its prompt itself, no KV "
          "transfer (default %(default)s)"),
    _Flag("--admission-queue-max", "admission_queue_max",
          "most requests waiting for buffer credit at once; one more is computed by a decoder at once "
          "(default %(default)s)"),
    _Flag("--tokenizer", "tokenizer",
          "the model's tokenizer folder, for exact prompt token counts and output text made from token ids (every "
          "prompt's KV used); 'auto': the folder the instances serve when it exists here; 'none': counts are "
          "estimates and text comes from the instances (default %(default)s)"),
    _Flag("--tokenizer-wait-s", "tokenizer_wait_s",
          "longest a request waits for the tokenizer while it first loads (the proxy loads it as soon as an "
          "instance registers); a request that gives up goes with estimated counts and the instances' text "
          "(default %(default)s)"),
    _Flag("--tokenizer-load-timeout-s", "tokenizer_load_timeout_s",
          "longest wait for one load of the tokenizer (the import of transformers included), in the proxy and in "
          "each relay worker; past it the proxy goes without (and tries again) and a relay worker answers 503. "
          "Also the longest the proxy and each relay worker wait at start, before serving, for that import "
          "(default %(default)s)"),
    _Flag("--migration-limit", "migration_limit",
          "times one request's decode stream may move to another instance when its decoder fails mid-stream; "
          "0 = never (default %(default)s)"),
    _Flag("--workers", "workers",
          "relay processes serving the HTTP port: each streams its clients' decodes, while one coordinator "
          "process keeps the registry, routing, admission and KV waits; 1 = one process (default %(default)s)"),
)
