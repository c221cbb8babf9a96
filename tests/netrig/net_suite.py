"""Run PD across rig hosts: the deployment, its workload and references, the network scenarios.

    with rig.inside(CLIENT):
        with open_deployment(rig, model, log_dir, prefill=1, decode=2, transport="nixl") as dep:
            row = dep.run_named("decoder_cut_mid_stream")     # a fault_scenarios.Row

Used by ``test_multihost.py`` (CI short form), ``test_multihost_long.py`` and ``bench/multihost.py``.
The deployment is the fault suite's (``tests/faults/fault_suite.SPEC``: chunked prefill at 512
tokens, 8-slot decoder buffers, short leases, instance TTL 6 s) on rig hosts; the scenarios are in
``net_scenarios.py``. References are a plain vLLM instance's greedy outputs with the same flags
(``fault_cluster.reference_outputs``, cached by weights, flags and prompts under
``models/.fault-reference``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import mh_cluster  # noqa: F401 (puts tests/faults on sys.path)
from fault_cluster import BESIDE_REFERENCE, ClusterSpec
from fault_scenarios import Row, Suite, SuiteConfig
from fault_client import make_prompts
from fault_suite import SPEC, attach_references, build_workload, prompt_vocab
from mh_cluster import HostSpec, MultiHostCluster
from rig import NetRig, _run

logger = logging.getLogger(__name__)

LISTEN = "0A"
STREAM_TOKENS = 200


@dataclasses.dataclass
class Deployment:
    rig: NetRig
    cluster: MultiHostCluster
    suite: Suite
    rows: dict[str, Row] = dataclasses.field(default_factory=dict)
    recovery_s: dict[str, float | None] = dataclasses.field(default_factory=dict)

    def run_named(self, name: str) -> Row:
        from net_scenarios import BY_NAME

        self.cluster.last_recovery = None
        row = self.suite.run(BY_NAME[name])
        self.rows[name] = row
        self.recovery_s[name] = self.cluster.last_recovery
        return row

    def planned_listeners(self) -> dict[str, list[int]]:
        """The ports of ours each host must listen on, on its own address."""
        args = self.cluster.args
        out = {"proxy": [args.proxy_port, args.proxy_control_port]}
        for name, inst in self.cluster.instances.items():
            out[name] = [inst.http_port]
            if inst.role == "decoder":
                out[name].append(inst.control_port)
                if args.transport == "nccl":
                    out[name].append(inst.transport_port)
        return out


def spec_for(prefill: int, decode: int) -> ClusterSpec:
    return dataclasses.replace(SPEC, prefill=prefill, decode=decode)


@contextlib.contextmanager
def open_deployment(rig: NetRig, model: Path, log_dir: Path, *, prefill: int, decode: int, transport: str,
                    long: bool = False, references: bool = True) -> Iterator[Deployment]:
    """Build the workload (and its references), start XpYd on the rig, yield it; stop it at the end.
    Call inside the client host (``rig.inside(CLIENT)``)."""
    model = Path(model).resolve()
    w = build_workload(model, with_model_b=False, models_dir=model.parent)
    # Streams to cut: 200 output tokens (the fault suite's 1200-token streams, decoded in batches,
    # leave a plain one-at-a-time instance's output on this CPU; see RELIABILITY.md).
    w.stream = make_prompts(prompt_vocab(model), 8, 100, 300, STREAM_TOKENS, seed=4)
    w.fresh = make_prompts(prompt_vocab(model), 64 if long else 16, 700, 1000, 16, seed=9)  # 8 per scenario's tail

    def answer() -> None:  # a plain instance on the client host's loopback (or read from the cache)
        if references:
            attach_references(w, model, log_dir / "reference", model.parent / ".fault-reference")

    spec = spec_for(prefill, decode)
    cluster = MultiHostCluster(rig, model, log_dir / "cluster", spec, HostSpec(transport=transport))
    try:
        cluster.start(beside=answer, beside_instances=BESIDE_REFERENCE)
        # Settle for longer than the receivers' write window (transfer_timeout_s + quarantine_margin_s, 15 s):
        # an Alloc that a cut link delivers late is granted, cancelled, and its slots stay quarantined for
        # that window from the grant, by design; ready KV nobody loads (ready_lease_s, 30 s) still shows.
        settle_s = SPEC.receiver_p2p["transfer_timeout_s"] + SPEC.receiver_p2p["quarantine_margin_s"] + 5
        yield Deployment(rig, cluster, Suite(cluster, w, SuiteConfig(long=long, settle_s=settle_s)))
    finally:
        cluster.stop()


def kv_loads_in(row: Row) -> dict[str, tuple[int, int]]:
    """(lookups, lookups that loaded KV) per decoder, from a scenario's notes ("decoder-0: 8 lookups, 8 loaded KV")."""
    return {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"(decoder-\d+): (\d+) lookups, (\d+) loaded KV", row.notes)}


def registry_view(dep: Deployment) -> dict[str, dict]:
    return {i["instance_id"]: i for i in dep.cluster.instances_info()}


def bound_listeners(rig: NetRig, host: str) -> dict[int, str]:
    """Port -> bound IPv4 address of every TCP socket listening in ``host``'s namespace."""
    out: dict[int, str] = {}
    text = _run(["ip", "netns", "exec", rig.ns(host), "cat", "/proc/net/tcp"])
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == LISTEN:
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)[::-1]
            out[int(hex_port, 16)] = ".".join(str(b) for b in raw)
    return out


def wait_routable_s(cluster: MultiHostCluster, name: str, timeout_s: float) -> float | None:
    """Seconds until ``name`` is routable in the proxy again (None: not within ``timeout_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if any(i["instance_id"] == name and i["routable"] for i in cluster.instances_info()):
            return round(time.monotonic() - start, 2)
        time.sleep(0.2)
    return None
