"""The test/bench clusters' port ranges stay out of the kernel's ephemeral range and are free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import cluster
from cluster import claim, ephemeral_low, free_base_port, free_port


def test_the_base_port_is_below_the_ephemeral_range_and_its_ports_are_free():
    low = ephemeral_low()
    for _ in range(20):
        base = free_base_port()
        assert cluster.LOWEST_BASE_PORT <= base and base + 400 < low
        for port in (base, base + 1, base + 10, base + 30, base + 50, base + 79):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # raises if taken


def test_two_picks_differ_so_concurrent_clusters_do_not_collide():
    assert len({free_base_port() for _ in range(10)}) > 1


def test_ephemeral_low_reads_the_kernel_range_and_falls_back(tmp_path: Path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_low(ranges) == 40000
    assert ephemeral_low(tmp_path / "missing") == 32768
    ranges.write_text("garbage")
    assert ephemeral_low(ranges) == 32768


def test_rank_retrievals_and_lookups_parse_lmcaches_own_lines(tmp_path) -> None:
    from cluster import lookups_by_request, rank_retrievals

    log = tmp_path / "decoder-0.log"
    log.write_text(  # as a TP2 vLLM-CPU decoder logged them (LMCache's format, colours included)
        "\x1b[32;20m[2026-12-02 07:49:33,739] LMCache INFO:\x1b[0m Reqid: cmpl-a0-0-b5, Total tokens 53, Inference Engine "
        "computed tokens: 0, LMCache hit tokens: 52, need to load: 52 \x1b[3m(vllm_v1_adapter.py:1476)\x1b[0m\n"
        "\x1b[32;20m[2026-12-02 07:49:33,750] LMCache INFO:\x1b[0m [req_id=cmpl-a0-0-b5] Retrieved 52 out of 52 required "
        "tokens (from 52 total tokens). size: 0.0000 gb, cost 3.8201 ms, throughput: 0.0032 GB/s;\n"
        "\x1b[32;20m[2026-12-02 07:49:33,752] LMCache INFO:\x1b[0m [req_id=cmpl-a0-0-b5] Retrieved 52 out of 52 required "
        "tokens (from 52 total tokens). size: 0.0000 gb, cost 4.2921 ms, throughput: 0.0029 GB/s;\n")
    assert rank_retrievals(log) == {"cmpl-a0-0-b5": [52, 52]}
    assert lookups_by_request(log) == {"cmpl-a0-0-b5": (53, 52)}


def test_a_port_handed_out_but_not_yet_bound_is_not_handed_out_again(monkeypatch):
    """A vLLM server binds its port only after its start-up: a deployment spawned beside it must not take it."""
    first = free_port()
    real = random.Random.randrange
    picks = []

    def pick(self, low, high):  # the first candidate range starts at the port handed out above
        picks.append(low)
        return first if len(picks) == 1 else real(self, low, high)

    monkeypatch.setattr(random.Random, "randrange", pick)
    base = free_base_port()
    assert len(picks) > 1 and not base <= first < base + 80
    assert not claim([first])
