"""Helpers shared by the benchmarks: CUDA-graph replay timing, the HBM read floor, results.

Every benchmark here times work the way serving runs it: captured once in a CUDA graph and
replayed; each replay is bracketed by CUDA events on the replaying stream, and the median over
the replays is reported (host launch gaps between replays are not counted). Weight-streaming
benchmarks rotate several weight copies inside one graph so that L2 (50 MB on H100/H200)
cannot serve them, and divide by the number of copies.

The floor of a weight stream is its bytes over the HBM read bandwidth measured in the same
run by ``kimi_experts._C.probe_read`` (a plain 16-byte-load read kernel) over >= 4 GiB.

PyTorch is a benchmark dependency only; it is imported inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Callable, Iterable, Mapping, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(repo: str = _REPO) -> str:
    """The checked-out commit (with "-dirty" when the work tree has changes), or "unknown"."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_SOURCE_DIRS = ("kernels", "csrc", "kimi_experts", "benchmarks")
_SOURCE_SUFFIXES = (".c", ".h", ".cu", ".cuh", ".py")


def source_digest(repo: str = _REPO) -> str:
    """sha256 of the sources a run builds and runs: setup.py and the .c, .h, .cu, .cuh and .py
    files under kernels/, csrc/, kimi_experts/ and benchmarks/, by path relative to the repo.
    It depends on the files alone, so a result whose git metadata is stale (a tree copied onto
    another machine) can be matched to its commit: compute this in a checkout of that commit."""
    paths = ["setup.py"] if os.path.isfile(os.path.join(repo, "setup.py")) else []
    for top in _SOURCE_DIRS:
        for root, dirs, files in os.walk(os.path.join(repo, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            paths += [os.path.relpath(os.path.join(root, f), repo).replace(os.sep, "/")
                      for f in files if f.endswith(_SOURCE_SUFFIXES)]
    digest = hashlib.sha256()
    for rel in sorted(paths):
        with open(os.path.join(repo, rel), "rb") as f:
            data = f.read()
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name(torch.cuda.current_device())


def graph_replay_time_us(fn: Callable[[], object], replays: int = 100, warmup: int = 10,
                         warmup_ms: float = 0.0, board=None) -> float:
    """Median time in microseconds of one replay of a CUDA graph that captures ``fn()``.

    ``fn`` must enqueue its work on ``torch.cuda.current_stream()`` (the capture stream while
    capturing, the replay stream afterwards). It runs once eagerly first (lazy initialisation,
    library heuristics), then is captured; ``warmup`` replays precede the ``replays`` timed ones.
    ``warmup_ms`` > 0 keeps the GPU replaying the graph for that long more, right before the
    timed replays: the H200's power cap lowers the SM clock within tens of ms of a heavy load,
    so a short run of replays times a card as fresh as a run allows and a long warm-up a card
    under sustained load.
    ``board`` (a ``board.Board``) is sampled over the timed replays: ``board.reading`` after.
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    if warmup_ms > 0:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        graph.replay()
        last.record()
        last.synchronize()
        for _ in range(math.ceil(warmup_ms / max(first.elapsed_time(last), 1e-3))):
            graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    with board.window() if board else contextlib.nullcontext():
        for start, end in zip(starts, ends):
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1000.0 for start, end in zip(starts, ends)]
    del graph
    return statistics.median(times)


def probe_read(buf, stream=None) -> None:
    """Enqueue kimi_experts' read-bandwidth kernel over every byte of the CUDA tensor ``buf``."""
    import torch
    from kimi_experts import _C

    stream = torch.cuda.current_stream() if stream is None else stream
    _C.probe_read(buf, stream.cuda_stream)


def measure_hbm_read_bandwidth(nbytes: int = 4 << 30, replays: int = 20) -> float:
    """HBM read bandwidth in TB/s: probe_read over ``nbytes`` (>= 4 GiB) in a CUDA graph."""
    import torch

    if nbytes < (4 << 30):
        raise ValueError(f"nbytes: expected >= 4 GiB so that L2 cannot serve it, got {nbytes}")
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf.fill_(1)
    us = graph_replay_time_us(lambda: probe_read(buf), replays=replays, warmup=3)
    del buf
    torch.cuda.empty_cache()
    return nbytes / (us * 1e-6) / 1e12


def random_mxfp4_layer(torch, experts: int, hidden: int, inter: int, seed: int):
    """(w13, s13, w2, s2) on the GPU: random e2m1 bytes under E8M0 scales 118..121
    (values about 2^-8, realistic), straight in the standard layout."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def fp4(*size):
        return torch.randint(0, 256, size, dtype=torch.uint8, device="cuda", generator=g)

    def scales(*size):
        return torch.randint(118, 122, size, dtype=torch.uint8, device="cuda", generator=g)

    E, H, I = experts, hidden, inter
    return fp4(E, 2 * I, H // 2), scales(E, 2 * I, H // 32), fp4(E, H, I // 2), scales(E, H, I // 32)


def routed_ids(torch, generator, batch: int, top_k: int, experts: int):
    """int32 [batch, top_k] on the CPU: top_k distinct experts per token, uniformly at
    random (what a serving router produces), drawn from `generator`."""
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                        for _ in range(batch)]).to(torch.int32)


ROUTINGS = "uniform, same or zipf-S (S > 0)"


def parse_routing(text: str):
    """("uniform", 0.0), ("same", 0.0) or ("zipf", S) from --routing's text; ValueError otherwise."""
    if text in ("uniform", "same"):
        return text, 0.0
    if text.startswith("zipf-"):
        try:
            s = float(text[len("zipf-"):])
        except ValueError:
            s = float("nan")
        if s > 0 and math.isfinite(s):
            return "zipf", s
    raise ValueError(f"routing {text!r}: {ROUTINGS}")


def ids_by_routing(torch, routing: str, generator, batch: int, top_k: int, experts: int):
    """int32 [batch, top_k] on the CPU, top_k distinct experts per token, drawn from `generator`:
    uniform (routed_ids: the record's routing); zipf-S, with probability proportional to
    rank^-S over a random order of the experts (a router's skew on real text, which puts more
    than a unit's 8 tokens on the hot experts: session 45's study); same, every token on the
    same top_k experts (the worst case)."""
    kind, s = parse_routing(routing)
    if kind == "uniform":
        return routed_ids(torch, generator, batch, top_k, experts)
    order = torch.randperm(experts, generator=generator)  # which experts are hot
    if kind == "same":
        return order[:top_k].to(torch.int32).repeat(batch, 1)
    p = torch.arange(1, experts + 1, dtype=torch.float64) ** -s
    return order[torch.multinomial(p.expand(batch, experts), top_k, replacement=False,
                                   generator=generator)].to(torch.int32)


def parse_batches(parser, text: str) -> list[int]:
    """--batches' B values, comma-separated, each >= 1; the parser's error otherwise."""
    values = text.split(",")
    if not all(v.isdigit() and int(v) >= 1 for v in values):
        parser.error("--batches: B values >= 1, comma-separated")
    return [int(v) for v in values]


def refuse_study_over_record(parser, option: str, given: bool, out: str, record: str) -> None:
    """Ends the run through ``parser.error`` when a study ``option`` was given and ``out`` is the
    record's path: a study's figures must not replace the record."""
    if given and os.path.abspath(out) == record:
        parser.error(f"{option}: give --out (a study must not replace the record)")


def write_json(path: str, rows: Sequence[Mapping], command: str | None = None, **meta) -> None:
    """Write ``{"date", "git_commit", "source_digest", "command", "gpu", **meta, "rows"}`` to
    ``path``."""
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        "command": command if command is not None else " ".join([sys.executable] + sys.argv),
    }
    try:
        doc["gpu"] = gpu_name()
    except Exception:  # no torch or no GPU: the caller may still pass gpu= in meta
        pass
    doc.update(meta)
    doc["rows"] = list(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e5 else f"{value:.2f}"
    return str(value)


def print_table(rows: Iterable[Mapping], cols: Sequence[str], file=None) -> None:
    """Print ``rows`` as an aligned text table of the columns ``cols`` (missing cells: "-")."""
    rows = list(rows)
    cells = [[_cell(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    out = file or sys.stdout
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)
