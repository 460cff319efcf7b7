"""A stress check for races in the experts kernel: outputs must be bit-identical run to run.

    python benchmarks/race_check.py [--iters 1200] [--shape 384,3584,384,16] [--batch 64]

Builds one layer (E, H, I, top-k given by --shape), prepares it for per-slot rows and for the
combined output on one scratch, and runs both modes over four routings in an interleaved order
(uniform random, one expert in every token's first slot, every token on the same experts, one
expert in all slots of a token), --iters rounds, once with a sync after each call and once
without. Every output is poisoned first and compared bitwise with its routing's first run; a
differing call prints where it differs (rows, 256-column tiles, 16-column strips). Exits 1 when
any call differed. Session 44 found a ring stage released before one MMA warp had read it this
way: ~1 call in 1500 with every token on the same 16 experts at k3-tp8 B = 64, none with
uniform routing (benchmarks/NOTES.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_mxfp4_layer  # noqa: E402

import kimi_experts as kx  # noqa: E402

ORDER = ["one-hot", "same", "all-repeat", "random", "same", "one-hot", "same"]  # the same-experts routing most often
COMPARE_EVERY = 64  # outputs held on the GPU before they are compared


def routings(E, K, B, generator):
    rand = torch.randint(0, E, (B, K), generator=generator, dtype=torch.int32)
    return {
        "random": rand,
        "one-hot": torch.cat([torch.full((B, 1), E - 1, dtype=torch.int32), rand[:, 1:]], 1),
        "same": ((torch.arange(K) + 100) % E).to(torch.int32).repeat(B, 1),
        "all-repeat": rand[:, :1].repeat(1, K),
    }


def where(diff):
    """Rows, 256-column tiles and 16-column strips of the differing elements."""
    idx = torch.nonzero(diff)
    rows = sorted(set(idx[:, 0].tolist()))
    tiles = sorted(set((idx[:, 1] // 256).tolist()))
    strips = sorted(set(((idx[:, 1] % 256) // 16).tolist()))
    return f"{idx.shape[0]} elements; rows {rows[:8]}, tiles {tiles}, strips {strips}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=1200)
    ap.add_argument("--shape", default="384,3584,384,16", help="E,H,I,top_k")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    E, H, I, K = (int(v) for v in args.shape.split(","))
    B = args.batch
    print(f"race_check: E={E} H={H} I={I} K={K} B={B}, {args.iters} rounds, kimi_experts from {os.path.dirname(kx.__file__)}",
          flush=True)
    w = random_mxfp4_layer(torch, E, H, I, seed=5)
    layers = {"rows": kx.PersistentExperts(*w, top_k=K, hidden_scale="floor"),
              "comb": kx.PersistentExperts(*w, top_k=K, hidden_scale="floor")}
    del w
    scratch = kx.scratch(*layers.values())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, generator=g).to(torch.bfloat16).cuda()
    weights = torch.rand(B, K, generator=g).cuda()
    ids = {name: r.cuda() for name, r in routings(E, K, B, g).items()}
    outs = {"rows": torch.empty(B * K, H, dtype=torch.bfloat16, device="cuda"),
            "comb": torch.empty(B, H, dtype=torch.bfloat16, device="cuda")}
    layers["rows"].prepare(B, scratch, outs["rows"])
    layers["comb"].prepare(B, scratch, outs["comb"], combine=True)

    def call(mode, routing):
        out = outs[mode]
        out.view(torch.int16).fill_(-1)  # poison: 0xFFFF, a NaN
        layers[mode].run(x, ids[routing], weights if mode == "comb" else None)
        return out.clone()

    first = {(m, r): call(m, r) for r in ids for m in layers}
    torch.cuda.synchronize()
    for key, out in first.items():
        if (out.view(torch.int16) == -1).any():
            sys.exit(f"{key}: the first run left poisoned elements")
    failed = False
    for sync in (True, False):
        differing, held, t0 = {}, [], time.time()
        for it in range(args.iters):
            for routing in ORDER:
                for mode in layers:
                    held.append((mode, routing, it, call(mode, routing)))
                    if sync:
                        torch.cuda.synchronize()
                if len(held) >= COMPARE_EVERY or it == args.iters - 1:
                    for mode, r, i, got in held:
                        diff = got.view(torch.int16) != first[(mode, r)].view(torch.int16)
                        if diff.any():
                            differing[(mode, r)] = differing.get((mode, r), 0) + 1
                            if differing[(mode, r)] <= 3:
                                print(f"  sync={sync} round {i} {mode} {r}: {where(diff)}", flush=True)
                    held = []
        torch.cuda.synchronize()
        calls = args.iters * len(ORDER) * len(layers)
        print(f"sync={sync}: {calls} calls in {time.time() - t0:.1f} s, differing: {differing or 'none'}", flush=True)
        failed |= bool(differing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
