"""Where a kernel's warps stall, by SASS basic block, from an Nsight Compute report.

    ncu --clock-control none --cache-control none -k regex:experts_kernel --launch-skip 60 \
        --launch-count 1 --section SourceCounters --section WarpStateStats -o rep PROGRAM ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 benchmarks/ncu_blocks.py rep.csv --cycles-per-instruction C [--top 30] [--by no_inst]

C is the details page's "Warp Cycles Per Executed Instruction". A block runs from a branch
target or the instruction after a branch to the next branch, exit, call or return. Per block:
its warp-stall samples (share of the kernel's), how often a warp ran it, its top stall reasons
and, since samples x (warp cycles per sample) are warp cycles, the cycles one warp spent in it
per run. Code that runs once per tile or per phase shows what a cold instruction cache costs
there (stall_no_inst).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from dataclasses import dataclass, field

_BLOCK_END = re.compile(r"\b(BRA|BRX|JMP|EXIT|RET|CALL)\b")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*(0x[0-9a-f]+)")  # the last address: BRA.DIV UR4, 0x..., BRA !P6, 0x...


@dataclass
class Instruction:
    address: int
    sass: str
    samples: int
    executed: int
    stalls: dict


@dataclass
class Block:
    instructions: list = field(default_factory=list)

    @property
    def address(self) -> int:
        return self.instructions[0].address

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    @property
    def runs(self) -> int:
        return max(i.executed for i in self.instructions)

    def stalls(self) -> collections.Counter:
        total = collections.Counter()
        for i in self.instructions:
            total.update(i.stalls)
        return total


def read_source_csv(lines) -> list[Instruction]:
    """The instructions of ncu's source page (CSV, SASS): the header row is the one that
    starts with "Address"; stall columns are `stall_*` (not their "(Not Issued)" twins)."""
    rows = list(csv.reader(lines))
    start = next(k for k, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[start]
    col = {name: k for k, name in enumerate(header)}
    stall_cols = [(name[len("stall_"):], k) for name, k in col.items()
                  if name.startswith("stall_") and "(Not Issued)" not in name]
    out = []
    for row in rows[start + 1:]:
        if len(row) < len(header) or not row[0].startswith("0x"):
            continue
        count = lambda k: int(row[k] or 0)  # noqa: E731 (columns such as "Address Space" are not numbers)
        out.append(Instruction(int(row[0], 16), row[col["Source"]].strip(), count(col["# Samples"]),
                               count(col["Instructions Executed"]),
                               {reason: count(k) for reason, k in stall_cols}))
    return out


def basic_blocks(instructions: list[Instruction]) -> list[Block]:
    targets = {int(m.group(1), 16) for i in instructions for m in [_BRANCH_TARGET.search(i.sass)] if m}
    blocks, current = [], Block()
    for i in instructions:
        if i.address in targets and current.instructions:
            blocks.append(current)
            current = Block()
        current.instructions.append(i)
        if _BLOCK_END.search(i.sass):
            blocks.append(current)
            current = Block()
    if current.instructions:
        blocks.append(current)
    return blocks


def report(instructions: list[Instruction], cycles_per_instruction: float, top: int, by: str) -> list[str]:
    total_samples = sum(i.samples for i in instructions) or 1
    warp_cycles = sum(i.executed for i in instructions) * cycles_per_instruction
    per_sample = warp_cycles / total_samples
    kernel = collections.Counter()
    for i in instructions:
        kernel.update(i.stalls)
    lines = [f"samples {total_samples}, warp cycles per sample {per_sample:.0f}; kernel: " +
             " ".join(f"{k}={100 * v / total_samples:.1f}%" for k, v in kernel.most_common(8)),
             f"blocks by {by} (offset from the first instruction, instructions, runs by a warp, samples; "
             f"per run: one warp's cycles in the block{'' if by == 'samples' else ', of them ' + by}; "
             "top stall reasons as % of the block's samples | its last instruction)"]
    key = (lambda b: b.samples) if by == "samples" else (lambda b: b.stalls()[by])
    base = instructions[0].address
    for b in sorted(basic_blocks(instructions), key=key, reverse=True)[:top]:
        stalls, runs = b.stalls(), max(b.runs, 1)
        per_run = f"{b.samples * per_sample / runs:6.0f}"
        if by != "samples":
            per_run += f" {stalls[by] * per_sample / runs:6.0f}"
        reasons = " ".join(f"{k}={100 * v / max(b.samples, 1):.0f}" for k, v in stalls.most_common(3))
        lines.append(f"+{b.address - base:06x} n={len(b.instructions):4d} runs={b.runs:7d} "
                     f"samples={b.samples:6d} ({100 * b.samples / total_samples:4.1f}%) per run {per_run} "
                     f"{reasons} | {b.instructions[-1].sass[:48]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    ap.add_argument("--cycles-per-instruction", type=float, required=True,
                    help="the details page's Warp Cycles Per Executed Instruction")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by", default="no_inst", help="a stall reason (no_inst, long_sb, ...) or 'samples'")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        instructions = read_source_csv(f)
    if not instructions:
        sys.exit(f"{args.csv}: no SASS rows (was it exported with --print-source sass?)")
    print("\n".join(report(instructions, args.cycles_per_instruction, args.top, args.by)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
