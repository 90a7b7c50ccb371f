"""Plots of the megamoe tool's JSON (embedded in the tool at build time; `megamoe plot` runs it).

  python3 plot.py IN.json OUT.png

- `megamoe bench --json`: median µs and time/floor against tokens per rank (log x), one line per
  backend (and knob set).
- `megamoe tune --json`: per backend, each candidate's time at each bucket (log x, log y), the
  heuristic's line and the accepted configuration's line, the winner of each bucket marked.
Exit codes: 0 written, 2 bad input, 3 matplotlib missing (its import error on stderr).
"""
import json
import sys


def load_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except Exception as e:  # ImportError, or a broken install
        sys.stderr.write("matplotlib is not importable: %s\n" % e)
        sys.exit(3)


def series_label(row):
    label = row.get("backend", "?")
    if row.get("resolved") and row["resolved"] != label:
        label += "->" + row["resolved"]
    if row.get("knob_set"):
        label += " [" + row["knob_set"] + "]"
    return label


def plot_bench(doc, plt, out):
    rows = [r for r in doc.get("rows", []) if "median_us" in r]
    if not rows:
        sys.stderr.write("no measured rows in the bench JSON\n")
        sys.exit(2)
    series = {}
    for r in rows:
        series.setdefault(series_label(r), []).append(r)
    fig, (ax_us, ax_floor) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, rs in series.items():
        rs.sort(key=lambda r: r["tokens"])
        t = [r["tokens"] for r in rs]
        ax_us.plot(t, [r["median_us"] for r in rs], marker="o", label=label)
        ax_floor.plot(t, [r.get("time_over_floor", 0) for r in rs], marker="o", label=label)
    geometry = doc.get("geometry", {})
    title = "%s, EP%s" % (doc.get("preset", "?"), geometry.get("ep_size", "?"))
    for ax, what in ((ax_us, "median µs per forward"), (ax_floor, "time / floor")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_us.set_yscale("log")
    ax_floor.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle("megamoe bench: " + title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_tune(doc, plt, out):
    per_backend = {}
    for bucket in doc.get("buckets", []):
        for b in bucket.get("backends", []):
            if "stages" in b:
                per_backend.setdefault(b["backend"], []).append((bucket["tokens"], b))
    if not per_backend:
        sys.stderr.write("no tuned bucket in the tune JSON\n")
        sys.exit(2)
    fig, axes = plt.subplots(1, len(per_backend), figsize=(7 * len(per_backend), 5), squeeze=False)
    for ax, (backend, buckets) in zip(axes[0], sorted(per_backend.items())):
        buckets.sort(key=lambda x: x[0])
        xs, ys = [], []
        for tokens, b in buckets:
            for stage in b["stages"]:
                for c in stage["candidates"]:
                    if c["us"] >= 0:
                        xs.append(tokens)
                        ys.append(c["us"])
        ax.scatter(xs, ys, s=12, color="tab:grey", alpha=0.5, label="candidates")
        t = [tokens for tokens, _ in buckets]
        ax.plot(t, [b["heuristic_us"] for _, b in buckets], color="tab:blue", marker="o", label="heuristic")
        ax.plot(t, [b["accepted_us"] for _, b in buckets], color="tab:red", marker="*", markersize=12,
                label="accepted (winner)")
        for tokens, b in buckets:
            ax.annotate(b["accepted"]["label"], (tokens, b["accepted_us"]), textcoords="offset points",
                        xytext=(4, -12), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank (bucket)")
        ax.set_ylabel("µs per forward (slowest rank's median)")
        ax.set_title(backend)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    geometry = doc.get("geometry", {})
    fig.suptitle("megamoe tune: %s, EP%s, %s" % (doc.get("preset") or "explicit dims", geometry.get("ep_size", "?"),
                                                 doc.get("device", "?")))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    if len(sys.argv) != 3:
        sys.stderr.write("usage: plot.py IN.json OUT.png\n")
        sys.exit(2)
    try:
        doc = json.load(open(sys.argv[1]))
    except (OSError, ValueError) as e:
        sys.stderr.write("cannot read %s: %s\n" % (sys.argv[1], e))
        sys.exit(2)
    plt = load_pyplot()
    tool = doc.get("tool") if isinstance(doc, dict) else None
    if tool == "megamoe bench":
        plot_bench(doc, plt, sys.argv[2])
    elif tool == "megamoe tune":
        plot_tune(doc, plt, sys.argv[2])
    else:
        sys.stderr.write("%s is neither megamoe bench's nor megamoe tune's JSON (tool=%r)\n" % (sys.argv[1], tool))
        sys.exit(2)


if __name__ == "__main__":
    main()
