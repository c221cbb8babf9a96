"""A row records where each stream was decoded and where it was cut (no processes: a fake cluster)."""

from __future__ import annotations

from fault_client import Kind, Outcome, Prompt
from fault_scenarios import Result, Row, Suite, SuiteConfig, Workload


class FakeCluster:
    def __init__(self, decodes: dict[str, list[dict]]) -> None:
        self._decodes = decodes

    def decodes(self, response_ids, timeout_s):
        return {rid: self._decodes[rid.removeprefix("cmpl-")] for rid in response_ids
                if rid.removeprefix("cmpl-") in self._decodes}


def part(instance: str, from_token: int) -> dict:
    return {"instance": instance, "from_token": from_token}


def test_each_stream_names_its_parts_its_cuts_and_where_it_left_the_reference():
    moved, stayed = Prompt((1, 2), 4, {"a": (5, 6, 7, 8)}), Prompt((3, 4), 4, {"a": (9, 9, 9, 9)})
    w = Workload(short=[], mid=[], long=[], stream=[moved, stayed])
    cluster = FakeCluster({"x": [part("decoder-1", 1), part("decoder-0", 2)], "y": [part("decoder-0", 1)]})
    outcomes = [Outcome(moved, Kind.OK, (5, 6, 0, 8), response_id="cmpl-x"),
                Outcome(stayed, Kind.OK, (9, 9, 9, 9), response_id="cmpl-y")]
    suite = Suite(cluster, w, SuiteConfig())
    row = Row("s")
    suite._record_streams(row, Result(outcomes, every_stream=True))
    assert row.moved_streams == 1
    assert row.streams == [
        {"prompt": "stream[0]", "outcome": "ok", "tokens": 4, "parts": [part("decoder-1", 1), part("decoder-0", 2)],
         "cuts": [2], "first_difference": 2, "reference_equal_before_cuts": [True]},
        {"prompt": "stream[1]", "outcome": "ok", "tokens": 4, "parts": [part("decoder-0", 1)], "cuts": [],
         "first_difference": None, "reference_equal_before_cuts": []},
    ]
    only_moved = Row("s")
    suite._record_streams(only_moved, Result(outcomes))
    assert [s["prompt"] for s in only_moved.streams] == ["stream[0]"]
