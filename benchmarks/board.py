"""The GPU board's power state while a figure is timed, read from NVML (the driver's
libnvidia-ml, through ctypes: no Python package needed).

Why: on an H200 a stream of random weights at the HBM rate draws the board's whole 700 W by
itself (session 52), so at B >= 8 the power cap lowers the SM clock within tens of ms, and a
timed figure depends on how far into the cap its replays ran. Every record row therefore
carries what the board did while it was timed: the median instantaneous board power, the
median SM clock, and the share of samples in which the driver reported the software power cap
(or a hardware slowdown) among its clock event reasons. NVML refreshes power and clock about
every 100 ms (nvidia-smi at 50 ms sees each value twice), so a window shorter than that reads
the state the run had brought the board to, not the window's own draw.

    board = Board.open()              # None without NVML or a matching device
    with board.window():              # around the timed replays, synchronize included
        ...
    row.update(board.reading)         # board_W, sm_MHz, power_capped, board_samples
"""
from __future__ import annotations

import ctypes
import statistics
import threading

_NVML_SUCCESS = 0
_NVML_CLOCK_SM = 1
_NVML_FI_DEV_POWER_INSTANT = 186  # the board's power now, in mW (nvml.h)
_NVML_VALUE_TYPE_UINT = 1
_SW_POWER_CAP, _HW_SLOWDOWN = 0x4, 0x8  # clock event reasons
_SAMPLE_S = 0.002


class _Value(ctypes.Union):
    _fields_ = [("d", ctypes.c_double), ("ui", ctypes.c_uint), ("ull", ctypes.c_ulonglong)]


class _FieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", _Value)]


class Board:
    """NVML's view of one GPU; ``reading`` holds the last window's figures (None where NVML
    gave none)."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.reading: dict = {}

    @classmethod
    def open(cls, device: int | None = None) -> "Board | None":
        """The board of CUDA device ``device`` (the current one by default), matched by its PCI
        bus id; None when NVML or the device cannot be had."""
        import torch

        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != _NVML_SUCCESS:
                return None
            props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
            bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0".encode()
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) != _NVML_SUCCESS:
                return None
            return cls(nvml, handle)
        except (OSError, AttributeError):
            return None

    def _sample(self):
        """(board W or None, SM MHz or None, capped) now."""
        field = _FieldValue(fieldId=_NVML_FI_DEV_POWER_INSTANT)
        watts = None
        if (self._nvml.nvmlDeviceGetFieldValues(self._handle, 1, ctypes.byref(field)) == _NVML_SUCCESS
                and field.nvmlReturn == _NVML_SUCCESS):
            mw = field.value.ui if field.valueType == _NVML_VALUE_TYPE_UINT else field.value.ull
            watts = mw / 1000.0
        clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        mhz = clock.value if self._nvml.nvmlDeviceGetClockInfo(
            self._handle, _NVML_CLOCK_SM, ctypes.byref(clock)) == _NVML_SUCCESS else None
        capped = (self._reasons(self._handle, ctypes.byref(reasons)) == _NVML_SUCCESS
                  and bool(reasons.value & (_SW_POWER_CAP | _HW_SLOWDOWN)))
        return watts, mhz, capped

    def window(self) -> "_Window":
        """A context that samples the board every ~2 ms on a thread while it is open."""
        return _Window(self)


class _Window:
    def __init__(self, board: Board):
        self._board, self._samples, self._stop = board, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:
            self._samples.append(self._board._sample())
            if self._stop.wait(_SAMPLE_S):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        watts = [w for w, _, _ in self._samples if w is not None]
        mhz = [m for _, m, _ in self._samples if m is not None]
        self._board.reading = dict(
            board_W=statistics.median(watts) if watts else None,
            sm_MHz=statistics.median(mhz) if mhz else None,
            power_capped=sum(c for _, _, c in self._samples) / len(self._samples),
            board_samples=len(self._samples))
        return False
