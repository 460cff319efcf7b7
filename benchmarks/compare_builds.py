"""Same-machine A/B timing of built trees of this repository.

    python benchmarks/compare_builds.py TREE [TREE ...] [--passes 3] [--shapes k3-tp8,tp16] [--build]
                                        [--pads 0,144,256] [--copies DIR] [--warmup-ms T] [--combine]
                                        [--routing uniform]

Runs benchmarks/bench_experts.py from each TREE in turn (with that tree's kimi_experts on
PYTHONPATH), --passes rounds, and prints per shape and B every tree's times and the change of
its fastest pass against the first tree's fastest, then each pass's HBM read (the floors'
bandwidth). Machines differ (HBM read 4.5-4.65 TB/s) and so do processes on one machine (B >= 16
moved 2-5 % between passes of one build), by more than most kernel changes, so a change is read
only beside its base, alternating, in one run. Every other pass runs the trees in reverse order:
under --warmup-ms, two runs of two trees in a fixed order, one in each order, read k3-tp8 B = 8-16
1.9-3.1 % slower for whichever tree ran second in a pass (session 49, calls 4-5); a fixed order puts
such drift on one tree alone, an alternating one on both. Run an even number of passes there.
--build first builds each tree in place (`python setup.py build_ext --inplace`). --pads builds a
copy of each tree per pad instead (KIMI_EXPERTS_PLACEMENT_PAD, setup.py), all at once (session
59's script built ten so in 26 s on the GPU machine's 16 cores; one after another ~190 s), times
every copy as a tree, and prints a second table: per tree the median over its pads of each copy's
fastest pass. --copies DIR keeps the copies there (default: a temporary folder), and a later run
reuses each copy whose tree has the same sources (common.source_digest) and pad: the rows and the
fused combine of one set of trees are built once.
Where the experts kernel's epilogue and producer code lands against its MMA loops' moved the fused
combine at k3-tp8 / TP16 B = 4-8 by up to 3.6 % with no change of logic (session 58), so a change
that grows or shrinks that code is read over several placements, not at the one it happens to get.
--warmup-ms
reaches bench_experts.py (each graph replayed that long before it is timed: sustained load), and so
do --combine (the fused combine instead of per-slot rows) and --routing (skewed ids); every tree's
bench_experts.py must know the options given.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import source_digest  # noqa: E402


def tree_names(trees: list[str]) -> list[str]:
    """Each tree's folder name, or its path where two folder names are the same."""
    names = [os.path.basename(os.path.normpath(t)) for t in trees]
    return names if len(set(names)) == len(names) else list(trees)


def build(tree: str, pad: int = 0, jobs: int = 0) -> None:
    """setup.py build_ext --inplace in tree with placement pad `pad` (and `jobs` nvcc processes,
    0: setup.py's default); its log goes to tree/build/compare_builds.log."""
    log = os.path.join(tree, "build", "compare_builds.log")  # build/ is ignored by git
    os.makedirs(os.path.dirname(log), exist_ok=True)
    env = dict(os.environ, KIMI_EXPERTS_PLACEMENT_PAD=str(pad))
    if jobs:
        env["KIMI_EXPERTS_JOBS"] = str(jobs)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"building {tree} failed: see {log}")


def padded_copies(order: list[tuple[str, str]], pads: list[int], root: str) -> list[tuple[str, str]]:
    """(copy, "name@pad") for every (tree, name) in order and pad: tree's sources (no git data,
    builds or results) copied to root/INDEX@PAD and built there, all at once, each with at least
    4 nvcc processes (oversubscribed: session 59's script built ten copies so in 26 s on 16 cores). A copy
    whose stamp says it was built from the same sources with the same pad is kept as it is."""
    copies, todo = [], []
    for i, (tree, name) in enumerate(order):
        digest = source_digest(tree)
        for pad in pads:
            dst = os.path.join(root, f"{i}@{pad}")
            stamp, text = os.path.join(dst, "build", "compare_builds.stamp"), f"{digest} pad {pad}"
            if not (os.path.isfile(stamp) and Path(stamp).read_text() == text):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(tree, dst, ignore=shutil.ignore_patterns(".git", ".dev", "build", "results", "*.so"))
                todo.append((dst, pad, stamp, text))
                print(f"building {name} with placement pad {pad} in {dst}", file=sys.stderr, flush=True)
            copies.append((dst, f"{name}@{pad}"))
    jobs = max(4, (os.cpu_count() or 1) // max(1, len(todo)))
    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        builds = [pool.submit(build, dst, pad, jobs) for dst, pad, _, _ in todo]
        for (_, _, stamp, text), built in zip(todo, builds):
            built.result()  # a failed build's exit stops the run here, its copy left without a stamp
            with open(stamp, "w") as f:  # so that a failed copy is rebuilt next time
                f.write(text)
    return copies


def bench(tree: str, shapes: str, batches: str | None, out: str, warmup_ms: float = 0.0, combine: bool = False,
          routing: str = "uniform") -> dict:
    """One bench_experts.py run of tree: its JSON (rows, the run's HBM read)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, "benchmarks/bench_experts.py", "--shapes", shapes, "--out", out]
    if batches:
        cmd += ["--batches", batches]
    if warmup_ms > 0:
        cmd += ["--warmup-ms", str(warmup_ms)]
    if combine:
        cmd += ["--combine"]
    if routing != "uniform":
        cmd += ["--routing", routing]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def compare_table(times: dict, names: list[str]) -> list[str]:
    """times[(shape, B)][name]: us of each pass. One line per (shape, B): every pass per
    tree, and each later tree's fastest against names[0]'s fastest, in %."""
    lines = ["shape B | " + " | ".join(names)]
    for key in sorted(times):
        base = min(times[key][names[0]])
        cells = []
        for i, name in enumerate(names):
            us = times[key].get(name, [])
            cell = "/".join(f"{t:.2f}" for t in us)
            if i and us:
                cell += f" ({100 * (min(us) / base - 1):+.1f} %)"
            cells.append(cell)
        lines.append(f"{key[0]} {key[1]} | " + " | ".join(cells))
    return lines


def placement_table(times: dict, names: list[str], pads: list[int]) -> list[str]:
    """times[(shape, B)][f"{name}@{pad}"]: us of each pass. Per (shape, B) and tree: the median
    over the pads of each copy's fastest pass, and each later tree's against names[0]'s, in %."""
    lines = [f"shape B | median over pads {','.join(map(str, pads))}: " + " | ".join(names)]
    for key in sorted(times):
        medians = [statistics.median(min(times[key][f"{n}@{p}"]) for p in pads)
                   if all(f"{n}@{p}" in times[key] for p in pads) else None for n in names]
        cells = []
        for i, m in enumerate(medians):
            cell = "?" if m is None else f"{m:.2f}"
            if i and m is not None and medians[0] is not None:
                cell += f" ({100 * (m / medians[0] - 1):+.1f} %)"
            cells.append(cell)
        lines.append(f"{key[0]} {key[1]} | " + " | ".join(cells))
    return lines


def hbm_line(hbm: dict, names: list[str]) -> str:
    """hbm[name]: each pass's HBM read in TB/s (None where a tree's JSON has none): the
    floors of its rows are the weight bytes over these."""
    cells = ["/".join("?" if v is None else f"{v:.2f}" for v in hbm.get(name, [])) for name in names]
    return "HBM read TB/s, each pass | " + " | ".join(cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", help="checkouts of this repository, the base first")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--shapes", default="k3-tp8,tp16")
    ap.add_argument("--batches", help="only these B (bench_experts.py --batches)")
    ap.add_argument("--build", action="store_true", help="build each tree in place first")
    ap.add_argument("--pads", help="comma-separated placement pads: a built copy of each tree per pad")
    ap.add_argument("--copies", help="with --pads: keep the copies in this folder, reusing those still current")
    ap.add_argument("--warmup-ms", type=float, default=0.0, help="bench_experts.py --warmup-ms")
    ap.add_argument("--combine", action="store_true", help="bench_experts.py --combine")
    ap.add_argument("--routing", default="uniform", help="bench_experts.py --routing")
    args = ap.parse_args()
    names = tree_names(args.trees)
    try:
        pads = [int(v) for v in args.pads.split(",")] if args.pads else []
    except ValueError:
        ap.error(f"--pads takes comma-separated instruction counts, not {args.pads!r}")
    if any(pad < 0 for pad in pads):
        ap.error("--pads: a pad is a count of instructions, 0 or more")
    if args.copies and not pads:
        ap.error("--copies keeps the copies that --pads builds")
    if args.build and not pads:
        for tree in args.trees:
            print(f"building {tree}", file=sys.stderr, flush=True)
            build(tree)
    times: dict = {}
    hbm: dict = {}
    order = list(zip(args.trees, names))
    with tempfile.TemporaryDirectory() as tmp:
        if pads:
            root = args.copies or os.path.join(tmp, "copies")
            os.makedirs(root, exist_ok=True)
            order = padded_copies(order, pads, root)
        for p in range(args.passes):
            for tree, name in order if p % 2 == 0 else order[::-1]:
                print(f"pass {p + 1}/{args.passes}: {name}", file=sys.stderr, flush=True)
                run = bench(tree, args.shapes, args.batches, os.path.join(tmp, "rows.json"), args.warmup_ms,
                            args.combine, args.routing)
                hbm.setdefault(name, []).append(run.get("hbm_read_TBps"))
                for row in run["rows"]:
                    times.setdefault((row["shape"], row["B"]), {}).setdefault(name, []).append(row["us"])
    labels = [label for _, label in order]
    lines = compare_table(times, labels) + [hbm_line(hbm, labels)]
    print("\n".join(lines + (placement_table(times, names, pads) if pads else [])))


if __name__ == "__main__":
    main()
