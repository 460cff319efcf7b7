"""Which mbarrier arrives in a SASS dump are issued while shared-memory loads before them may
still be outstanding: for each SYNCS.ARRIVE, the LDS instructions issued before it (in
straight-line order within a function) whose scoreboard no instruction between them waited on.
A study tool (session 44): the experts kernel's MMA warps release a ring stage with such an
arrive, and ptxas issues it right behind the stage's loads without waiting for their data.

    nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -cubin \\
         -o /tmp/experts.cubin kernels/experts.cu
    cuobjdump -sass /tmp/experts.cubin > /tmp/experts.sass
    python3 benchmarks/release_scan.py /tmp/experts.sass

Prints, per kernel, how many arrives have which kinds of loads outstanding ("none": every
earlier load's data is in). The scan ignores branches, so a load on another path can show as
outstanding; read the SASS around a reported arrive before trusting it.
"""
from __future__ import annotations

import collections
import re
import sys

INSTRUCTION = re.compile(r"\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16})")
WORD = re.compile(r"(0x[0-9a-f]{16})")
NO_SCOREBOARD = 7


def control(second_word: int) -> tuple[int, int]:
    """(write scoreboard, wait mask) of an sm_90 instruction from its second 64-bit word."""
    bits = second_word >> 41
    return (bits >> 5) & 7, (bits >> 11) & 63


def opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def scan(lines: list[str]) -> dict[str, collections.Counter]:
    kernels: dict[str, collections.Counter] = {}
    counts = collections.Counter()
    outstanding: dict[int, str] = {}  # scoreboard -> the load's opcode
    for i, line in enumerate(lines):
        if "Function :" in line:
            counts = kernels.setdefault(line.split("Function :")[1].strip(), collections.Counter())
            outstanding = {}
            continue
        m = INSTRUCTION.search(line)
        second = WORD.search(lines[i + 1]) if m and i + 1 < len(lines) else None
        if not second:
            continue
        write, wait = control(int(second.group(1), 16))
        for sb in [sb for sb in outstanding if wait >> sb & 1]:
            del outstanding[sb]
        op = opcode(m.group(1))
        if op.startswith("SYNCS.ARRIVE"):
            counts["+".join(sorted(set(outstanding.values()))) or "none"] += 1
        if write != NO_SCOREBOARD:
            if op.startswith("LDS"):
                outstanding[write] = op
            else:
                outstanding.pop(write, None)  # the scoreboard now tracks another instruction
    return kernels


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SASS_DUMP")
    with open(sys.argv[1]) as f:
        kernels = scan(f.read().split("\n"))
    for name, counts in kernels.items():
        print(name)
        for kinds, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d} arrives, outstanding: {kinds}")


if __name__ == "__main__":
    main()
