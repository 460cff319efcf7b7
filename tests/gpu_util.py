"""Helpers for the GPU tests (imported only by them; nothing here touches CUDA at import)."""

from __future__ import annotations

import os
import sys
import threading

import torch

HANG_SECONDS = 120


def sync_or_die(what: str, seconds: float = HANG_SECONDS) -> None:
    """torch.cuda.synchronize(), but a GPU hang ends the process with a message instead
    of blocking CI until its time runs out (a hung kernel cannot be killed from here)."""
    done = threading.Event()
    err: list = []

    def wait():
        try:
            torch.cuda.synchronize()
        except BaseException as e:  # re-raised in the test thread
            err.append(e)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    if not done.wait(seconds):
        sys.stderr.write(f"\nFATAL: GPU did not finish within {seconds} s: {what}\n")
        sys.stderr.flush()
        os._exit(3)
    if err:
        raise err[0]


def to_cuda(tensors):
    return tuple(t.cuda() for t in tensors)
