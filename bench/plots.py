"""PNG plots of a run (matplotlib, Agg): throughput, latency, the pipeline timeline, scaling.
A plot whose figures are all missing is not drawn."""

from __future__ import annotations

from pathlib import Path

from bench.context import Results
from bench.report import COMPARISON, SYSTEMS


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, results: Results, rows: list[int], log: bool) -> bool:  # type: ignore[no-untyped-def]
    drawn = False
    width = 0.8 / max(1, len(rows))
    for j, i in enumerate(rows):
        what, unit, keys = COMPARISON[i]
        xs, ys = [], []
        for k, system in enumerate(SYSTEMS):
            v = results.get(keys[system]) if system in keys else None
            if v is not None:
                xs.append(k + j * width)
                ys.append(v)
        if ys:
            drawn = True
            bars = ax.bar(xs, ys, width, label=f"{what} ({unit})")
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks([k + width * (len(rows) - 1) / 2 for k in range(len(SYSTEMS))], SYSTEMS)
    if log:
        ax.set_yscale("log")
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def throughput(results: Results, path: Path) -> bool:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    a = _bars(axes[0], results, [0], log=True)
    b = _bars(axes[1], results, [1], log=False)
    fig.suptitle("ingest throughput (same run; higher is better)")
    fig.tight_layout()
    if a or b:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return a or b


def latency(results: Results, path: Path) -> bool:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4))
    drawn = _bars(ax, results, [2, 4, 5, 6, 7], log=True)
    ax.set_ylabel("ms (log scale)")
    ax.set_title("round-trip latencies (lower is better)")
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def pipeline(results: Results, path: Path) -> bool:
    runs = [(k.split(".", 1)[1], v) for k, v in results.series.items()
            if k.startswith("pipeline_sim.") and isinstance(v, dict) and "train" in v]
    if not runs:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 1 + 0.8 * len(runs)))
    for y, (name, run) in enumerate(runs):
        ax.scatter(run["arrivals"], [y + 0.25] * len(run["arrivals"]), s=6, color="tab:blue",
                   label="sample arrives" if y == 0 else None)
        ax.broken_barh([(s, e - s) for s, e in run["train"]], (y - 0.3, 0.4), color="tab:orange",
                       label="training" if y == 0 else None)
        for b in run["bumps"]:
            ax.plot([b, b], [y - 0.35, y + 0.35], color="black", lw=1)
    ax.set_yticks(range(len(runs)), [n for n, _ in runs])
    ax.set_xlabel("seconds (paper time / 100); black: version bump")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("sync vs micro-batch pipeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def scaling(results: Results, path: Path) -> bool:
    points = results.series.get("expstore_scaling.points")
    if not points:
        return False
    plt = _plt()
    fig, (ax, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [p["rows"] for p in points]
    for key, style, label in (("p50_ms", "o-", "claim 16 p50"), ("p99_ms", "o--", "claim 16 p99"),
                              ("where_p50_ms", "D-", "claim 16 with a predicate p50"),
                              ("put_p50_ms", "s-", "one-sample put p50"),
                              ("put_p99_ms", "s--", "one-sample put p99"),
                              ("deliver_p50_ms", "^-", "put → delivered p50"),
                              ("deliver_p99_ms", "^--", "put → delivered p99")):
        if all(key in p for p in points):
            ax.plot(rows, [p[key] for p in points], style, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("rows in table")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title("latency vs table size")
    if all("ingest_rows_per_s" in p for p in points):
        ax_rate.plot(rows, [p["ingest_rows_per_s"] / 1e3 for p in points], "o-",
                     label="bulk put, narrow (k rows/s)")
    ax_rate.set_xscale("log")
    ax_rate.set_xlabel("rows in table")
    ax_rate.set_ylabel("k rows/s")
    ax_rate.set_ylim(bottom=0)
    if any(p["rss_mb"] for p in points):
        ax2 = ax_rate.twinx()
        ax2.plot(rows, [(p["rss_mb"] or 0) / 1e3 for p in points], "^:", color="gray",
                 label="server RSS (GB)")
        ax2.set_ylabel("server RSS (GB)")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right", fontsize=7)
    ax_rate.legend(loc="lower left", fontsize=7)
    ax_rate.set_title("ingest and memory vs table size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(results: Results, out_dir: Path) -> list[Path]:
    written = []
    for name, draw in (("throughput", throughput), ("latency", latency),
                       ("pipeline", pipeline), ("scaling", scaling)):
        path = out_dir / f"{name}.png"
        if draw(results, path):
            written.append(path)
    return written
