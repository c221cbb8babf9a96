"""LMCACHE_P2P_VLLM_SPIN_S caps the busy loop of vLLM's shared-memory queue readers."""

from __future__ import annotations

import pytest
import zmq

from lmcache_p2p.vllm_plugin import spin


@pytest.fixture
def restore_spin_condition():
    from vllm.distributed.device_communicators import shm_broadcast

    original = shm_broadcast.SpinCondition.__init__, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS
    yield shm_broadcast.SpinCondition
    shm_broadcast.SpinCondition.__init__, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = original


def reader(cls, tmp_path, **kwargs):
    return cls(is_reader=True, context=zmq.Context.instance(), notify_address=f"ipc://{tmp_path}/notify", **kwargs)


def test_cap_applies_when_vllm_passes_no_value_and_twice_keeps_one_wrapper(restore_spin_condition, tmp_path):
    cls = restore_spin_condition
    assert reader(cls, tmp_path).busy_loop_s == 1  # vLLM's default
    assert spin.cap_busy_loop(0.005)
    assert reader(cls, tmp_path).busy_loop_s == 0.005
    assert reader(cls, tmp_path, busy_loop_s=0.5).busy_loop_s == 0.5  # an explicit value wins
    assert spin.cap_busy_loop(0.002)  # re-applied: wraps vLLM's own __init__, not the first wrapper
    assert reader(cls, tmp_path).busy_loop_s == 0.002
    assert cls.__init__.__wrapped__.__qualname__ == "SpinCondition.__init__"


def test_a_lost_ping_costs_at_most_the_spin(restore_spin_condition):
    """An idle reader rechecks the queue every few ms instead of vLLM's 5 s (a ping can be lost)."""
    from vllm.distributed.device_communicators import shm_broadcast

    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    spin.cap_busy_loop(0.005)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5
    assert shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(None, False).timeout_ms() == 5  # what a reader waits
    spin.cap_busy_loop(0.0)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 1


@pytest.mark.parametrize(("raw", "want"), [("", None), ("0.005", 0.005), (" 0 ", 0.0)])
def test_env_values(raw, want):
    assert spin.spin_from_env({spin.ENV: raw}) == want
    assert spin.spin_from_env({}) is None


@pytest.mark.parametrize("raw", ["fast", "-1", "nan"])
def test_bad_env_value_names_the_variable(raw):
    with pytest.raises(ValueError, match=spin.ENV):
        spin.spin_from_env({spin.ENV: raw})


def test_launcher_sets_it_on_cpu_only_and_keeps_an_operator_value(monkeypatch):
    from lmcache_p2p.cli.vllm_env import vllm_env

    monkeypatch.delenv(spin.ENV, raising=False)
    assert vllm_env(cpu_core=0)[spin.ENV] == "0.005"
    assert spin.ENV not in vllm_env(gpu=0)
    monkeypatch.setenv(spin.ENV, "1")
    assert vllm_env(cpu_core=0)[spin.ENV] == "1"
