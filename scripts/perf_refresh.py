#!/usr/bin/env python3
"""Rewrites the marked tables of docs/PERF.md from the megamoe tool's output files.

PERF.md holds the current numbers only. Each of its tables that a tool run can produce sits between
two markers:

    <!-- perf-table: layer/routed/deepseek-v3/ep2 -->
    ...generated: a line with the date, the machine and the command, then the table...
    <!-- /perf-table -->

This script reads the output of one or more runs, builds each table, and replaces what lies between
its markers (nothing else in the file changes). Inputs, told apart by their content:
  - `megamoe bench --json F`            -> a table per backend the rows ran on,
                                           `layer/<backend>/<preset>/ep<R>[-shared][/<config>][/layers<N>]`
  - `megamoe bench-gemm --json F`       -> table `gemm/<flush>` (several files: rounds of the same
                                           cases, folded as scripts/gemm_targets.py folds them)
  - `megamoe bench-transport --json F`  -> table `transport/<dispatch>-<combine>[-owner]` (its stdout
                                           log works too: the numbers of its two text tables)
  - `megamoe bench-link --json F`       -> table `link` (several files: one row per path and shape)

Usage:
  python3 scripts/perf_refresh.py [--perf docs/PERF.md] [--date YYYY-MM-DD] [--machine TEXT]
      [--table NAME] [--flush memset|read] [--command TEXT] [--history FILE] [--dry-run] FILE...
  python3 scripts/perf_refresh.py --list [--perf docs/PERF.md]
--table puts every input of this call into one table of that name (default: the name derived from
the input). --history FILE also appends the generated tables to a dated entry of docs/perf-history/
(created with a title, and listed in docs/perf-history/README.md, when new). A table whose markers
are missing is an error naming the markers present; nothing is written then.

Fields read (for the bench harness's JSON; a missing optional field leaves its cell empty):
  bench:      top level `tool` ("megamoe bench"), `preset`, `geometry.ep_size`, `config.*`
              (weight_format, combine_dtype, owner_reduce_in_use: non-default ones name the table),
              optional `device`, `date`; rows[]: `backend`, `resolved`, `tokens`, `median_us`,
              `min_us`, `max_us`, `tflops_per_rank`, `floor_us`, `floor_bound`, `time_over_floor`,
              `command`, optional `error`, optional `stages_us` [{`stage`, `us`}].
  bench-gemm: a list of rows (or {`rows`: [...]}, with optional `device`, `date`, `flush`): `model`,
              `fc`, `experts`, `tokens_per_expert`, `layout`, `tiles`, `us_median`, `tflops`,
              `kernel_us_median`, `weight_gbs_kernel`, optional `cublas_kernel_us`, `flush`.
  bench-transport: `tool` ("megamoe bench-transport"), `config` {`ranks`, `dispatch`, `x`,
              `combine`, `owner_reduce`}, optional `device`, `date`, `command`; rows[]: `tokens`,
              `dispatch_bytes`, `combine_bytes`, `dispatch_us` {median, min, max} (gated),
              `combine_us` {...} (gated), `nccl_dispatch_us`, `nccl_combine_us` (medians), and where
              --graph-iters ran: `graph_dispatch_only_us`, `graph_forward_us` (F, no event nodes),
              `graph_dispatch_pool_us` (DP), `graph_pool_us`.
  bench-link: `tool` ("megamoe bench-link"); rows[]: `path`, `shape`, `mib`, `r0_gbps`, `r1_gbps`,
              optional `r0_median_us`, `r1_median_us`, `time_over_floor`, `check`.
The machine comes from --machine, else the input's `device`; the date from --date, else the input's
`date`, else today.
"""
import argparse
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_targets  # noqa: E402  (the GEMM table and its targets live there)

BEGIN = re.compile(r"^<!-- perf-table: (\S+) -->\s*$")
END = "<!-- /perf-table -->"


class InputError(Exception):
    pass


def fmt(v, digits=1):
    return "" if v is None else f"{v:.{digits}f}"


# ---- megamoe bench --json ------------------------------------------------------------------------

STAGE_LABELS = {"expert_pool": "pool", "fc1_swiglu": "fc1+swiglu"}


def layer_tables(doc):
    """[(default table name, info, lines)] for one `megamoe bench --json` document: one table per
    backend the rows ran on (`--backend mega,routed` gives two), named
    layer/<backend>/<preset>/ep<R>[-shared][/<config>][/layers<N>]."""
    groups = {}
    for r in doc.get("rows", []):
        groups.setdefault(r.get("resolved") or r.get("backend", "?"), []).append(r)
    out = [layer_table(doc, rows) for rows in groups.values()]
    if not out:
        raise InputError("no rows")
    return out


def layer_table(doc, rows):
    """(default table name, info, lines) for one backend's rows of a `megamoe bench --json` document."""
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        raise InputError("no row without an error")
    backend = ok[0].get("resolved") or ok[0].get("backend", "?")
    ep = doc.get("geometry", {}).get("ep_size", 1)
    shared = "--shared-gpu" in ok[0].get("command", "")
    layers = ok[0].get("layers", 1)
    cfg = doc.get("config", {})
    variant = []
    if cfg.get("weight_format", "fp8-block") != "fp8-block":
        variant.append(cfg["weight_format"])
    if cfg.get("combine_dtype", "bf16") != "bf16":
        variant.append(cfg["combine_dtype"] + "-wire")
    if cfg.get("owner_reduce_in_use") and cfg.get("combine_dtype", "bf16") == "bf16":
        variant.append("owner-reduce")
    name = f"layer/{backend}/{doc.get('preset', '?')}/ep{ep}" + ("-shared" if shared else "")
    name += ("/" + "-".join(variant) if variant else "") + (f"/layers{layers}" if layers > 1 else "")
    stages = []
    for r in ok:
        for s in r.get("stages_us", []):
            if s["stage"] not in stages and s["stage"] != "combine_send":  # empty mark of a fused combine
                stages.append(s["stage"])
    head = ["tokens/rank", "median µs (min–max)", "TFLOP/s", "floor µs (bound)", "time/floor"]
    head += [STAGE_LABELS.get(s, s) for s in stages]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:", "---", "---:", "---", "---:"] +
                                                                ["---:"] * len(stages)) + " |"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r.get('tokens', '?')} | not run: {r['error']} |" + " |" * (len(head) - 2))
            continue
        st = {s["stage"]: s["us"] for s in r.get("stages_us", [])}
        cells = [str(r["tokens"]), f"{r['median_us']:.1f} ({r['min_us']:.1f}–{r['max_us']:.1f})",
                 fmt(r.get("tflops_per_rank")), f"{fmt(r.get('floor_us'))} ({r.get('floor_bound', '?')})",
                 fmt(r.get("time_over_floor"), 2)] + [fmt(st.get(s)) for s in stages]
        lines.append("| " + " | ".join(cells) + " |")
    tokens = ",".join(str(r["tokens"]) for r in rows)
    cmd = re.sub(r"--tokens \S+", "--tokens " + tokens, ok[0].get("command", "megamoe bench"))
    return name, {"command": cmd, "device": doc.get("device"), "date": doc.get("date")}, lines


# ---- megamoe bench-gemm --json -------------------------------------------------------------------

def gemm_rows(doc):
    rows = doc.get("rows", []) if isinstance(doc, dict) else doc
    if not rows or "kernel_us_median" not in rows[0]:
        raise InputError("not bench-gemm rows (no kernel_us_median)")
    return rows


def gemm_table(docs, flush):
    rows = [r for d in docs for r in gemm_rows(d)]
    flush = flush or next((r["flush"] for r in rows if r.get("flush")), None) or \
        next((d.get("flush") for d in docs if isinstance(d, dict) and d.get("flush")), None) or "memset"
    cmds = sorted({r.get("command", "").split(" --experts")[0] for r in rows})
    info = {"command": "; ".join(f"{c} ... --flush {flush} --json F" for c in cmds if c),
            "device": next((d.get("device") for d in docs if isinstance(d, dict)), None),
            "date": next((d.get("date") for d in docs if isinstance(d, dict)), None)}
    return f"gemm/{flush}", info, gemm_targets.table_lines(rows)


# ---- megamoe bench-transport ---------------------------------------------------------------------

NUM = r"-?[0-9]+(?:\.[0-9]+)?"


def transport_from_text(text):
    """The rows of bench-transport's stdout (print_row / print_graph_row in transport_cmd.cpp)."""
    m = re.search(r"# bench-transport: EP(\d+), hidden=(\d+), experts=(\d+), top-(\d+), dispatch=(\S+), "
                  r"combine=(\S+?)( owner-reduced)? \(", text)
    if not m:
        raise InputError("no '# bench-transport:' header line")
    cfg = {"ranks": int(m.group(1)), "dispatch": m.group(5), "combine": m.group(6),
           "owner_reduce": bool(m.group(7))}
    rows = {}
    for line in text.splitlines():
        if not re.match(r"^\s*\d+ \|", line):
            continue
        v = [float(x) for x in re.findall(NUM, line.replace("|", " "))]
        t = int(v[0])
        r = rows.setdefault(t, {"tokens": t})
        if len(v) == 14:  # gated: T | d med min max GB/s | c med min max GB/s | d+c | nccl d GB/s | nccl c GB/s
            r["dispatch_us"] = {"median": v[1], "min": v[2], "max": v[3]}
            r["combine_us"] = {"median": v[5], "min": v[6], "max": v[7]}
            r["dispatch_bytes"] = v[4] * v[1] * 1e3
            r["combine_bytes"] = v[8] * v[5] * 1e3
            r["nccl_dispatch_us"], r["nccl_combine_us"] = v[10], v[12]
        elif len(v) == 18:  # amortised: T | d 4 | pool | c 4 | d+c | fwd/N | D/N || F DP c | cGB/s d+c
            r["graph_pool_us"] = v[5]
            r["graph_dispatch_only_us"] = v[12]
            r["graph_forward_us"], r["graph_dispatch_pool_us"] = v[13], v[14]
            if v[4] > 0:
                r.setdefault("dispatch_bytes", v[4] * v[1] * 1e3)
            if v[9] > 0:
                r.setdefault("combine_bytes", v[9] * v[6] * 1e3)
    if not rows:
        raise InputError("no result rows under the bench-transport header")
    return {"tool": "megamoe bench-transport", "config": cfg, "rows": [rows[t] for t in sorted(rows)]}


def transport_table(doc, command):
    cfg = doc.get("config", {})
    name = f"transport/{cfg.get('dispatch', '?')}-{cfg.get('combine', '?')}" + \
        ("-owner" if cfg.get("owner_reduce") else "")
    head = ["tokens/rank", "dispatch µs", "GB/s", "combine µs", "GB/s", "**d+c µs**", "pool µs",
            "gated d / c µs", "NCCL a2a d / c µs"]
    lines = ["| " + " | ".join(head) + " |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]

    def gbs(nbytes, us):
        return fmt(nbytes / (us * 1e3)) if nbytes and us else ""

    for r in doc.get("rows", []):
        d = r.get("graph_dispatch_only_us")
        c = None
        if r.get("graph_forward_us") is not None and r.get("graph_dispatch_pool_us") is not None:
            c = r["graph_forward_us"] - r["graph_dispatch_pool_us"]
        if d is None:  # no graph table: the gated medians
            d = r.get("dispatch_us", {}).get("median")
            c = r.get("combine_us", {}).get("median")
        gd, gc = r.get("dispatch_us", {}).get("median"), r.get("combine_us", {}).get("median")
        cells = [str(r["tokens"]), fmt(d), gbs(r.get("dispatch_bytes"), d), fmt(c), gbs(r.get("combine_bytes"), c),
                 f"**{fmt(d + c)}**" if d is not None and c is not None else "", fmt(r.get("graph_pool_us")),
                 f"{fmt(gd)} / {fmt(gc)}" if gd is not None else "",
                 f"{fmt(r.get('nccl_dispatch_us'))} / {fmt(r.get('nccl_combine_us'))}"
                 if r.get("nccl_dispatch_us") is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    if not command:
        tokens = ",".join(str(r["tokens"]) for r in doc.get("rows", []))
        command = doc.get("command") or (
            f"megamoe bench-transport --ranks {cfg.get('ranks', 2)} --tokens {tokens} --dispatch "
            f"{cfg.get('dispatch')} --combine {cfg.get('combine')}" + (" --owner-reduce" if cfg.get("owner_reduce") else "")
            + (f" --x {cfg['x']}" if cfg.get("x") else "") + " ...")
    note = ["", "dispatch = dispatch-only graphs, combine = forwards − (dispatch + pool), both without event "
                "nodes (the gated medians where no graph ran); GB/s = bytes rank 0 sends to its peer / time."]
    return name, {"command": command, "device": doc.get("device"), "date": doc.get("date")}, lines + note


# ---- megamoe bench-link --json -----------------------------------------------------------------

def link_table(docs):
    rows = [r for d in docs for r in d.get("rows", [])]
    if not rows:
        raise InputError("no bench-link rows")
    lines = ["| path | shape | MiB per direction | GB/s rank 0 / rank 1 | µs rank 0 / rank 1 | time/floor | check |",
             "| --- | --- | ---: | --- | --- | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['path']} | {r.get('shape', '')} | {r.get('mib', '')} | {fmt(r.get('r0_gbps'))} / "
                     f"{fmt(r.get('r1_gbps'))} | {fmt(r.get('r0_median_us'), 2)} / {fmt(r.get('r1_median_us'), 2)} | "
                     f"{fmt(r.get('time_over_floor'), 2)} | {r.get('check', '')} |")
    info = {"command": "megamoe bench-link ... --json F (both directions loaded at once; shapes: the shape column)",
            "device": next((d.get("device") for d in docs if d.get("device")), None),
            "date": next((d.get("date") for d in docs if d.get("date")), None)}
    return "link", info, lines


# ---- inputs, markers, output ---------------------------------------------------------------------

def load(path):
    text = open(path).read()
    try:
        return json.loads(text), text
    except json.JSONDecodeError:
        return None, text


def kind_of(doc, text):
    if doc is None:
        return "transport" if "# bench-transport:" in text else None
    if isinstance(doc, list) or ("rows" in doc and doc["rows"] and "kernel_us_median" in doc["rows"][0]):
        return "gemm"
    tool = doc.get("tool", "")
    if tool == "megamoe bench":
        return "layer"
    if tool == "megamoe bench-transport":
        return "transport"
    if tool == "megamoe bench-link":
        return "link"
    return None


def build_tables(args):
    """{table name: lines}, in input order."""
    gemm_docs = {}
    link_docs = []
    tables = {}
    for path in args.files:
        doc, text = load(path)
        kind = kind_of(doc, text)
        if kind is None:
            raise InputError(f"{path}: not a megamoe bench, bench-gemm, bench-transport or bench-link output")
        try:
            if kind == "gemm":
                gemm_docs.setdefault(args.table or "", []).append(doc)
                continue
            if kind == "link":
                link_docs.append(doc)
                continue
            if kind == "layer":
                for name, info, lines in layer_tables(doc):
                    tables[args.table or name] = (info, lines)
                continue
            else:
                name, info, lines = transport_table(doc if doc is not None else transport_from_text(text), args.command)
        except (InputError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}: {kind} output not understood: {e!r}")
        tables[args.table or name] = (info, lines)
    if link_docs:
        name, info, lines = link_table(link_docs)
        tables[args.table or name] = (info, lines)
    for table, docs in gemm_docs.items():
        name, info, lines = gemm_table(docs, args.flush)
        if args.command:
            info["command"] = args.command
        tables[table or name] = (info, lines)
    out = {}
    for name, (info, lines) in tables.items():
        if args.command and "command" in info:
            info["command"] = args.command
        date = args.date or info.get("date") or datetime.date.today().isoformat()
        machine = args.machine or info.get("device") or "machine not recorded (pass --machine)"
        out[name] = [f"{date}, {machine}: `{info['command']}`", ""] + lines
    return out


def marked_tables(text):
    """{name: (first line index inside, end marker index)}; raises on unbalanced markers."""
    lines = text.split("\n")
    found, open_name, start = {}, None, 0
    for i, line in enumerate(lines):
        m = BEGIN.match(line)
        if m:
            if open_name:
                raise InputError(f"line {i + 1}: table '{m.group(1)}' starts inside '{open_name}'")
            if m.group(1) in found:
                raise InputError(f"line {i + 1}: table '{m.group(1)}' is marked twice")
            open_name, start = m.group(1), i + 1
        elif line.strip() == END:
            if not open_name:
                raise InputError(f"line {i + 1}: '{END}' without a start marker")
            found[open_name] = (start, i)
            open_name = None
    if open_name:
        raise InputError(f"table '{open_name}' has no '{END}'")
    return found


def replace_tables(text, tables):
    found = marked_tables(text)
    missing = [n for n in tables if n not in found]
    if missing:
        raise InputError(f"no markers for {', '.join(missing)} (add '<!-- perf-table: NAME -->' ... '{END}' "
                         f"where the table belongs); marked now: {', '.join(sorted(found)) or 'none'}")
    lines = text.split("\n")
    for name in sorted(tables, key=lambda n: -found[n][0]):  # bottom up: indices stay valid
        start, end = found[name]
        lines[start:end] = tables[name]
    return "\n".join(lines)


def append_history(path, tables):
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write(f"# {os.path.basename(path)[:-3]}\n\nWhat changed and why: (write it here).\n")
        for name, lines in tables.items():
            f.write(f"\n## {name}\n\n" + "\n".join(lines) + "\n")
    index = os.path.join(os.path.dirname(path), "README.md")
    if new and os.path.exists(index):
        with open(index, "a") as f:
            f.write(f"- [{os.path.basename(path)}]({os.path.basename(path)}): {', '.join(tables)}\n")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--perf", default=os.path.join(here, "..", "docs", "PERF.md"))
    p.add_argument("--date")
    p.add_argument("--machine")
    p.add_argument("--table")
    p.add_argument("--flush", choices=["memset", "read"])
    p.add_argument("--command")
    p.add_argument("--history")
    p.add_argument("--dry-run", action="store_true", help="print the tables, write nothing")
    p.add_argument("--list", action="store_true", help="list the marked tables of --perf")
    p.add_argument("files", nargs="*")
    args = p.parse_args(argv)
    try:
        text = open(args.perf).read()
        if args.list:
            for name, (start, end) in marked_tables(text).items():
                print(f"{name}: lines {start + 1}-{end}")
            return 0
        if not args.files:
            p.error("no input files")
        tables = build_tables(args)
        if args.dry_run:
            for name, lines in tables.items():
                print(f"<!-- perf-table: {name} -->\n" + "\n".join(lines) + f"\n{END}\n")
            return 0
        new_text = replace_tables(text, tables)
    except InputError as e:
        print(f"perf_refresh: error: {e}", file=sys.stderr)
        return 2
    with open(args.perf, "w") as f:
        f.write(new_text)
    if args.history:
        append_history(args.history, tables)
    for name in tables:
        print(f"perf_refresh: {name} rewritten in {args.perf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
