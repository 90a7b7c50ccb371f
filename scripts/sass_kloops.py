#!/usr/bin/env python3
"""The grouped GEMM's K loop in the SASS, per kernel: its instruction count, how many of them are
wgmma (GMMA) and R2UR (a ring position that left the uniform registers shows as more R2UR), and the
kernel's STACK / LOCAL bytes (spills). A K loop is a loop (a backward branch) holding a GMMA with no
such loop inside it; a kernel may have more than one (a one-chunk loop beside the whole tile's, as
session 15's split-tail build had), printed largest first. Compare before and after a change to the
kernel's control flow.

Usage: scripts/sass_kloops.py OBJECT_OR_BINARY [...]   (runs cuobjdump -sass on each)
"""
import re
import subprocess
import sys


def kernels(path):
    out = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True, text=True).stdout
    name, body = None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
        elif name:
            i = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if i:
                body.append((int(i.group(1), 16), i.group(2)))
    if name:
        yield name, body


def resources(path):
    out = subprocess.run(["cuobjdump", "-res-usage", path], check=True, capture_output=True, text=True).stdout
    res, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if m and name:
            res[name] = m.groups()
    return res


def main():
    for path in sys.argv[1:]:
        res = resources(path)
        for name, body in kernels(path):
            if "grouped_gemm" not in name and "mega_kernel" not in name:
                continue
            addr = {a: k for k, (a, _) in enumerate(body)}
            loops = []  # (first, last) index ranges of backward-branch loops holding a GMMA
            for k, (a, ins) in enumerate(body):
                m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
                if not m:
                    continue
                target = int(m.group(1), 16)
                if target >= a or target not in addr:
                    continue
                if any("GMMA" in x for _, x in body[addr[target]:k + 1]):
                    loops.append((addr[target], k))
            # the K loops: GMMA loops with no other GMMA loop inside (a kernel may have several, e.g.
            # the split tail's one-chunk loop beside the whole tile's). ptxas may lay a K loop out
            # after its tile loop's backward branch, so a tile loop does not always enclose it by
            # address; tile loops are told apart by size (thousands of instructions, K loops hundreds).
            inner = [(f, l) for f, l in loops
                     if l - f < 1000 and not any((f2, l2) != (f, l) and f <= f2 and l2 <= l for f2, l2 in loops)]
            cfg = re.search(r"GroupedGemmConfigILi(\d+)ELi(\d+)ELb(\d)ELi(\d)ELi(\d)", name)
            label = "x".join(cfg.groups()[:2]) + (" fp8" if cfg.group(3) == "1" else " bf16") + " epi" + cfg.group(4) if cfg else name[:60]
            if "mega_kernel" in name:
                label = "mega " + label
            if cfg and cfg.group(5) != "1":
                label += " cl" + cfg.group(5)
            if re.search(r"EELb1EEEv", name):
                label += " trace"
            r = res.get(name, ("?", "?", "?"))
            if not inner:
                print(f"{label:26s} no K loop found  REG:{r[0]} STACK:{r[1]} LOCAL:{r[2]}")
                continue
            for f, l in sorted(inner, key=lambda x: -(x[1] - x[0])):
                loop = body[f:l + 1]
                gmma = sum("GMMA" in x for _, x in loop)
                r2ur = sum(x.split()[0].startswith("R2UR") or " R2UR" in x for _, x in loop)
                print(f"{label:26s} K loop {len(loop):4d} instr, {gmma:2d} GMMA, {r2ur:3d} R2UR  REG:{r[0]} STACK:{r[1]} LOCAL:{r[2]}")

if __name__ == "__main__":
    main()
