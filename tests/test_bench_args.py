"""The benchmarks' study options: refused before anything runs when they would replace a
record or make no sense (argument checks come before torch or a GPU is touched)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shapes import ROOT


def _run(script, *args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script, args, message", [
    ("bench_experts.py", ["--warmup-ms", "1000"], "--warmup-ms: give --out"),
    ("bench_experts.py", ["--rounds", "4"], "--rounds: give --out"),
    ("bench_experts.py", ["--combine", "--batches", "1"], "--batches: give --out"),  # the combined record
    ("bench_experts.py", ["--combine", "--out", str(ROOT / "benchmarks" / "results" / "experts-h200.json")],
     "--out: experts-h200.json is the rows output's record"),
    ("bench_experts.py", ["--out", str(ROOT / "benchmarks" / "results" / "experts-combined-h200.json")],
     "--out: experts-combined-h200.json is the combined output's record"),
    ("bench_experts.py", ["--rounds", "0", "--out", "x.json"], "--rounds: at least 1"),
    ("bench_experts.py", ["--warmup-ms", "-1", "--out", "x.json"], "--warmup-ms: at least 0"),
    ("bench_experts.py", ["--routing", "zipf-0.8"], "--routing: give --out"),
    ("bench_experts.py", ["--routing", "zipf", "--out", "x.json"],
     "--routing: routing 'zipf': uniform, same or zipf-S"),
    ("bench_experts.py", ["--large"], "--large: give --out"),
    ("bench_gemm.py", ["--warmup-ms", "1000"], "--warmup-ms: give --out"),
    ("bench_gemm.py", ["--no-chain"], "--no-chain: give --out"),
    ("bench_gemm.py", ["--warmup-ms", "-1", "--out", "x.json"], "--warmup-ms: at least 0"),
    ("peers.py", ["--calls", "2"], "--calls: at least 3"),
    ("peers.py", ["--batches", "0,8"], "--batches: B values >= 1"),
    ("bench_tp.py", ["--batches", "0,8", "--out", "x.json"], "--batches: B values >= 1"),
])
def test_study_options_refused(script, args, message):
    done = _run(script, *args)
    assert done.returncode == 2, (script, args, done.returncode, done.stderr)
    assert message in done.stderr, (script, args, done.stderr)
