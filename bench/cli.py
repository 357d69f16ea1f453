"""``python -m bench`` / ``expstore bench``: choose benchmarks, run them, report.

Example::

    python -m bench                         # everything, a few minutes on 2 cores
    python -m bench --quick --only flight_raw
    python -m bench --only expstore --store-uri grpc://127.0.0.1:8815
    python -m bench --write-md              # also regenerate BENCHMARKS.md's results section
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.context import Ctx, Results, Skip
from bench.util import cpu_model

REPO = Path(__file__).resolve().parent.parent
# run order: baselines first, so a partial run still has something to compare against
BENCHMARKS = ["flight_raw", "duckdb_bulk", "redis_streams", "ray_queue", "transferqueue",
              "pipeline_sim", "expstore_ingest", "expstore_claims", "expstore_reads",
              "expstore_scaling", "expstore_sql", "cluster", "gpu_train"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="benchmarks: " + ", ".join(BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="smaller sizes, about a minute in all")
    p.add_argument("--full", action="store_true",
                   help="allow 900 s (not 150) to fill the scaling table to 1e7 rows")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run only these (comma-separated or repeated; a prefix such as "
                        "'expstore' selects all that start with it)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out",
                   help="folder for results.json and the plots (default: bench/out)")
    p.add_argument("--store-uri", help="use this running expstore server instead of starting one")
    p.add_argument("--write-md", nargs="?", const=REPO / "BENCHMARKS.md", type=Path,
                   metavar="PATH", help="regenerate the results section of BENCHMARKS.md")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = p.parse_args(argv)
    if args.quick and args.full:
        p.error("--quick and --full exclude each other")
    return args


def select(only: list[str] | None) -> list[str]:
    if not only:
        return list(BENCHMARKS)
    wanted = [w.strip() for item in only for w in item.split(",") if w.strip()]
    chosen = [b for b in BENCHMARKS if any(b == w or b.startswith(w) for w in wanted)]
    unknown = [w for w in wanted if not any(b == w or b.startswith(w) for b in BENCHMARKS)]
    if unknown:
        raise SystemExit(f"unknown benchmark {', '.join(map(repr, unknown))}; "
                         f"expected one of: {', '.join(BENCHMARKS)}")
    return chosen


def _version(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((w.split("=", 1)[1] for w in out if w.startswith("v=")), None)


def environment(argv: Sequence[str]) -> dict[str, Any]:
    versions = {"python": platform.python_version()}
    for mod in ("pyarrow", "duckdb", "redis", "ray"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    server = _version(["redis-server", "--version"])
    if server:
        versions["redis-server"] = server
    try:  # the figures belong to a revision of the code: say which (dirty: uncommitted edits)
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": "python -m bench " + shlex.join(argv),
        "machine": f"{os.cpu_count()} cores ({cpu_model()}), {mem:.0f} GiB, Linux loopback",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        # other work on the machine skews every figure: say how busy it was
        "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
        "revision": rev or "unknown",
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Read when Ray is imported (environment() imports it): without it Ray 2.60 replaces
    # node_ip_address="127.0.0.1" with the machine's external address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    args = parse_args(argv)
    if args.list:
        for name in BENCHMARKS:
            print(f"{name:<18} {importlib.import_module(f'bench.{name}').TITLE}")
        return 0
    names = select(args.only)
    # before anything imports ray (environment() does, for its version): Ray reads it then
    from bench.ray_queue import loopback_env

    loopback_env()
    results = Results()
    cleanup: list[Any] = []
    failed = []
    mode = "quick" if args.quick else "full" if args.full else "default"
    meta = environment(argv)
    print(f"expstore bench ({mode}): {', '.join(names)}\n{meta['machine']}; load average "
          f"{meta['load']}", flush=True)
    try:
        for name in names:
            module = importlib.import_module(f"bench.{name}")
            print(f"\n== {name}: {module.TITLE}", flush=True)
            ctx = Ctx(name, results, args.out, quick=args.quick, full=args.full,
                      store_uri=args.store_uri, cleanup=cleanup)
            # What the run so far left behind (imported libraries, Ray's client runtime: ~150 k
            # objects, a full collection of ~75 ms here) is moved out of the collector's sight,
            # so that no benchmark pays for its predecessors' heaps: otherwise a full collection
            # lands inside one of its timings at random (the likely cause of a 101 ms stall in
            # the pipeline simulation). A long-running trainer or rollout process does the same
            # after start-up (``gc.freeze()``); each benchmark's own garbage is collected as usual.
            gc.collect()
            gc.freeze()
            t0 = time.perf_counter()
            try:
                module.run(ctx)
            except Skip as e:
                results.skipped[name] = str(e)
                print(f"  skipped: {e}", flush=True)
            except Exception as e:  # noqa: BLE001 - one broken benchmark must not stop the rest
                failed.append(name)
                results.skipped[name] = f"failed: {type(e).__name__}: {e}"
                traceback.print_exc()
            results.seconds[name] = time.perf_counter() - t0
    finally:
        for stop in reversed(cleanup):
            stop()
        # Frozen objects are never collected, not even at exit, where extension modules then
        # report theirs as leaked (DuckDB's nanobind does).
        gc.unfreeze()
    from bench import report

    report.print_summary(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, **results.to_json()},
                                                      indent=1))
    print(f"\nresults: {args.out / 'results.json'}")
    plotted: list[Path] = []
    if not args.no_plots:
        try:
            from bench import plots

            plotted = plots.write_all(results, args.out)
            for path in plotted:
                print(f"plot:    {path}")
        except ImportError as e:
            print(f"plots skipped: matplotlib is not installed ({e})")
    if args.write_md:
        # the write-up shows the plots of its own run: copied next to it, under docs/bench/
        images = args.write_md.parent / "docs" / "bench"
        if plotted:
            images.mkdir(parents=True, exist_ok=True)
        for path in plotted:
            shutil.copyfile(path, images / path.name)
        report.write_markdown(args.write_md, results, meta,
                              [images / p.name for p in plotted])
        print(f"wrote the results section of {args.write_md}")
    return 1 if failed else 0
