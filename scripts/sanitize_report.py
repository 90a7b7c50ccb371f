#!/usr/bin/env python3
"""The summary of compute-sanitizer logs (scripts/device.sh sanitize): this project's errors only.

    python3 scripts/sanitize_report.py LOG...      (one log per tool: memcheck, racecheck, ...)

Each report of a log (a line after the "=========" prefix that starts a record, with its indented
lines) is attributed by one rule, never by count:
  - NCCL's own host-side report: a host-side report (a CUDA API error: "Program hit ...") whose
    innermost host frame outside the CUDA driver and runtime (libcuda, libcudart, libcupti, libc,
    the loader) is in libnccl. NCCL probes the system at init (peer access, multicast, cuMem
    attributes) and reports its own failed calls this way; they are listed as filtered.
  - everything else is this project's: every device-side report (memcheck's invalid accesses,
    racecheck's hazards, initcheck's uninitialised reads, synccheck's barrier errors, whichever
    kernel), and every host-side report whose innermost such frame is this project's code.
Racecheck warnings are counted apart from its errors (racecheck's own severity). A log fails when
it has one of this project's errors, when its tests failed, or when it never reached the tool's
summary (the run was cut short). Exit status: 0 when every log passes, else 1.
"""
import re
import sys

PREFIX = "========="
# The tool's own lines, not reports.
NOT_A_REPORT = re.compile(
    r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application returned|"
    r"Internal Sanitizer|No (kernels|errors)|Note: |Tool |Sanitizer )")
SUMMARY = re.compile(r"^(ERROR SUMMARY|RACECHECK SUMMARY):\s*(\d+)")
SO = re.compile(r"(\S*?/)?(lib[\w+.-]*?\.so(\.\d+)*)\b")
SYSTEM_LIBS = ("libcuda.so", "libcudart", "libcupti", "libc.so", "libstdc++", "ld-linux", "libpthread",
               "libcompute-sanitizer", "libsanitizer", "libTreeLauncherTargetInjection")


def reports(lines):
    """Yields (headline, body lines) for each report of a log."""
    head, body = None, []
    for line in lines:
        if not line.startswith(PREFIX):
            continue
        text = line[len(PREFIX):]
        stripped = text.strip()
        starts = text[:1] == " " and text[1:2] not in (" ", "") and not NOT_A_REPORT.match(stripped)
        if starts:
            if head is not None:
                yield head, body
            head, body = stripped, []
        elif not stripped or NOT_A_REPORT.match(stripped):
            if head is not None:
                yield head, body
            head, body = None, []
        elif head is not None:
            body.append(stripped)
    if head is not None:
        yield head, body


def frame_library(frame):
    """The shared object a host frame is in ('' for the executable or an unknown one)."""
    m = SO.search(frame)
    return m.group(2) if m else ""


def is_host_side(head):
    return head.startswith("Program hit") or "CUDA API call" in head or "on CUDA API" in head


def owner(head, body):
    """'nccl' for NCCL's own host-side report, else 'project'."""
    if not is_host_side(head):
        return "project"
    for line in body:
        if "Host Frame" not in line:
            continue
        lib = frame_library(line)
        if lib and any(lib.startswith(s) for s in SYSTEM_LIBS):
            continue
        return "nccl" if lib.startswith("libnccl") else "project"
    return "project"


def kind(head):
    """The report's kind without its addresses and sizes (for the per-kind counts)."""
    k = re.sub(r"\bof size \d+ bytes?", "", head)
    k = re.sub(r"0x[0-9a-fA-F]+|\b\d+\b", "#", k)
    k = re.sub(r'due to "[^"]*"', "", k)
    return " ".join(k.split())[:100]


def summarize(path):
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    project, nccl, warnings = [], [], 0
    for head, body in reports(lines):
        if head.startswith("Warning"):
            warnings += 1
            continue
        (nccl if owner(head, body) == "nccl" else project).append(head)
    tool_count = None
    for line in lines:
        if line.startswith(PREFIX):
            m = SUMMARY.match(line[len(PREFIX):].strip())
            if m:
                tool_count = int(m.group(2))
    failed_tests = [l for l in lines if l.startswith("[  FAILED  ]")]
    ok = not project and tool_count is not None and not failed_tests
    name = path.rsplit("/", 1)[-1]
    out = [f"{name}: {'clean' if ok else 'FAIL'}: {len(project)} error(s) of this project, "
           f"{len(nccl)} NCCL host-side report(s) filtered, {warnings} racecheck warning(s); "
           f"tool summary {'missing (run cut short?)' if tool_count is None else tool_count}"
           + (f"; {len(failed_tests)} FAILED test line(s)" if failed_tests else "")]
    counts = {}
    for h in project:
        counts[kind(h)] = counts.get(kind(h), 0) + 1
    for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:8]:
        out.append(f"  {n} x {k}")
    return ok, out


def main(argv):
    if not argv:
        print(__doc__.strip())
        return 2
    rc = 0
    for path in argv:
        try:
            ok, out = summarize(path)
        except OSError as e:
            ok, out = False, [f"{path}: FAIL: cannot read: {e}"]
        print("\n".join(out))
        rc |= 0 if ok else 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
