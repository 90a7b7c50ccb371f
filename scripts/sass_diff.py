#!/usr/bin/env python3
"""Compares the machine code (SASS) of every GPU kernel in two builds.

What it is for: proving that a change to GPU code that should not change what runs (a refactor,
a header split, a renamed struct) leaves every kernel's instructions as they were, on a machine
without a GPU. Identical SASS cannot run differently; a kernel whose SASS changed is listed with
its instruction counts, to be measured on the device.

Usage: scripts/sass_diff.py BUILD_A BUILD_B [--objects GLOB] [--by-body] [--show N]
  BUILD_A, BUILD_B: CMake build folders (e.g. a worktree of the old commit and the current tree),
  compared object by object (every *.cu.o under CMakeFiles/, matched by relative path).
  --by-body: compare the kernels of all objects together, wherever they live (code moved between
  files or targets), and match a kernel whose name exists on one side only (a renamed type in its
  signature) to one of the other side with the same instructions.
  Instruction addresses and encodings are ignored; opcodes, operands and their order are compared.
Exit status: 0 when every kernel present in both builds is identical (--by-body: and every kernel
of either build has its instructions in the other), 1 otherwise.

Needs cuobjdump and nvdisasm on PATH (CUDA toolkit; where the toolkit lacks them, the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry them: unzip each and put its bin/ on PATH).
"""
import argparse
import collections
import difflib
import pathlib
import re
import subprocess
import sys


def kernels(obj):
    out = subprocess.run(["cuobjdump", "-sass", str(obj)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"sass_diff: cuobjdump failed on {obj}: {out.stderr.strip()}")
    found, cur = collections.OrderedDict(), None
    for line in out.stdout.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            # anonymous namespaces are mangled with a hash of the source path: drop it
            cur = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_\w*?_cu_[0-9a-f]{8}", "_GLOBAL__N_", m.group(1))
            found[cur] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*(/\*.*\*/)?\s*$", line)
        if cur is not None and m and m.group(1):
            found[cur].append(re.sub(r"\s+", " ", m.group(1)))
    return found


def by_body(a_objs, b_objs, show):
    """Kernels of all objects of each side, matched by name, then by instructions."""
    def collect(objs):
        found = {}
        for rel in sorted(objs):
            for name, body in kernels(objs[rel]).items():
                found.setdefault(name, body)  # a template instantiated in several objects: one copy
        return found

    ka, kb = collect(a_objs), collect(b_objs)
    same = changed = 0
    for name in sorted(set(ka) & set(kb)):
        if ka[name] == kb[name]:
            same += 1
        else:
            changed += 1
            print(f"CHANGED {name[:160]} ({len(ka[name])} -> {len(kb[name])} instructions)")
            for i, d in enumerate(difflib.unified_diff(ka[name], kb[name], lineterm="", n=0)):
                if i >= show:
                    break
                print("   ", d)
    only_a = {n: tuple(ka[n]) for n in set(ka) - set(kb)}
    only_b = {n: tuple(kb[n]) for n in set(kb) - set(ka)}
    b_by_body = collections.defaultdict(list)
    for n, body in only_b.items():
        b_by_body[body].append(n)
    renamed, missing = 0, 0
    for n in sorted(only_a):
        if b_by_body.get(only_a[n]):
            other = b_by_body[only_a[n]].pop()
            renamed += 1
            print(f"renamed, same instructions: {n[:120]}\n                        -> {other[:120]}")
        else:
            missing += 1
            print(f"only in A: {n[:160]}")
    added = sum(len(v) for v in b_by_body.values())
    for body, names in b_by_body.items():
        for n in names:
            print(f"only in B: {n[:160]}")
    print(f"sass_diff --by-body: {len(ka)} kernels in A, {len(kb)} in B; {same} identical by name, "
          f"{renamed} renamed with identical instructions, {changed} changed, {missing} only in A, {added} only in B")
    return 0 if changed == 0 and missing == 0 and added == 0 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_a")
    ap.add_argument("build_b")
    ap.add_argument("--objects", default="CMakeFiles/**/*.cu.o")
    ap.add_argument("--by-body", action="store_true", help="match kernels across objects, and renamed ones by body")
    ap.add_argument("--show", type=int, default=0, help="print the first N differing lines per kernel")
    args = ap.parse_args()
    a_root, b_root = pathlib.Path(args.build_a), pathlib.Path(args.build_b)
    a_objs = {p.relative_to(a_root): p for p in a_root.glob(args.objects)}
    b_objs = {p.relative_to(b_root): p for p in b_root.glob(args.objects)}
    if args.by_body:
        return by_body(a_objs, b_objs, args.show)
    same = changed = 0
    for rel in sorted(set(a_objs) | set(b_objs)):
        if rel not in a_objs or rel not in b_objs:
            print(f"only in {'A' if rel in a_objs else 'B'}: {rel}")
            continue
        ka, kb = kernels(a_objs[rel]), kernels(b_objs[rel])
        for name in sorted(set(ka) | set(kb)):
            if name not in ka or name not in kb:
                print(f"{rel}: kernel only in {'A' if name in ka else 'B'}: {name[:160]}")
                changed += 1
            elif ka[name] == kb[name]:
                same += 1
            else:
                changed += 1
                print(f"{rel}: CHANGED {name[:160]} ({len(ka[name])} -> {len(kb[name])} instructions)")
                if args.show:
                    diff = difflib.unified_diff(ka[name], kb[name], lineterm="", n=0)
                    for i, d in enumerate(diff):
                        if i >= args.show:
                            break
                        print("   ", d)
    print(f"sass_diff: {same} kernels identical, {changed} changed or missing")
    return 0 if changed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
