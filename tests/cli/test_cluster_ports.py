"""The test/bench clusters' port ranges stay out of the kernel's ephemeral range and are free."""

from __future__ import annotations

import socket
from pathlib import Path

import cluster
from cluster import ephemeral_low, free_base_port


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
