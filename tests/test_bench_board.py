"""benchmarks/board.py: what a record row says of the board while it was timed (the NVML reading's
summary), checked with a stand-in for NVML's samples; and the NVML field-value struct's size."""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import time

from shapes import ROOT

_spec = importlib.util.spec_from_file_location("bench_board", ROOT / "benchmarks" / "board.py")
board = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(board)


class _Samples(board.Board):
    """A Board whose samples come from a list, in turn (no NVML)."""

    def __init__(self, samples):
        self._cycle = itertools.cycle(samples)
        self.reading = {}

    def _sample(self):
        return next(self._cycle)


def test_window_summarizes_its_samples():
    b = _Samples([(700.0, 1650, True), (500.0, 1980, False), (690.0, 1700, True), (None, None, False)])
    with b.window():
        time.sleep(0.05)  # ~25 samples at 2 ms
    r = b.reading
    assert r["board_samples"] >= 4
    assert r["board_W"] in (500.0, 690.0, 700.0)  # a median of the readings, None ones left out
    assert r["sm_MHz"] in (1650, 1700, 1980)
    assert 0.3 <= r["power_capped"] <= 0.7  # half the samples were capped


def test_window_without_readings_says_none():
    b = _Samples([(None, None, False)])
    with b.window():
        pass
    assert b.reading["board_W"] is None and b.reading["sm_MHz"] is None
    assert b.reading["power_capped"] == 0.0 and b.reading["board_samples"] >= 1


def test_field_value_matches_nvml_h():
    # nvmlFieldValue_t: two uint, two long long, two enums, an 8-byte union
    assert ctypes.sizeof(board._FieldValue) == 40
    assert board._FieldValue.value.offset == 32
