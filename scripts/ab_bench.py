"""A/B of two revisions on this machine: ``python -m bench`` run for each, alternated.

    python scripts/ab_bench.py OLD NEW [--rounds 3] [--only expstore_ingest,expstore_claims]
                               [--quick]

Each revision is checked out once into a detached worktree under ``--work`` (default
/tmp/expstore-ab); the benchmarks then run old, new, old, new, … so that drift on a shared
machine lands on both sides alike. Prints, per figure, the median of each side and new / old,
and writes the rows as JSON beside the worktrees. "Within noise" is judged against the spread
of one side's own runs, printed beside each median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, work: Path) -> Path:
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", rev], text=True).strip()
    path = work / sha[:12]
    if not path.exists():
        subprocess.check_call(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path),
                               sha], stdout=subprocess.DEVNULL)
    return path


def run_once(tree: Path, out: Path, only: str, quick: bool) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "bench", "--only", only, "--out", str(out), "--no-plots"]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.check_call(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["metrics"]


def spread(values: list[float]) -> str:
    return f"{min(values):.4g}–{max(values):.4g}" if len(values) > 1 else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="expstore_ingest,expstore_claims")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/expstore-ab"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {"old": worktree(args.old, args.work), "new": worktree(args.new, args.work)}
    runs: dict[str, list[dict[str, dict]]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for side in ("old", "new"):
            out = args.work / f"{side}-{i}"
            runs[side].append(run_once(trees[side], out, args.only, args.quick))
            print(f"round {i + 1}/{args.rounds}: {side} done", file=sys.stderr)
    keys = sorted(set(runs["old"][0]) & set(runs["new"][0]))
    rows = []
    print(f"{'figure':<52} {'unit':<8} {'old median (range)':>26} {'new median (range)':>26} "
          f"{'new/old':>8}")
    for key in keys:
        old = [r[key]["value"] for r in runs["old"] if key in r]
        new = [r[key]["value"] for r in runs["new"] if key in r]
        unit = runs["old"][0][key].get("unit", "")
        mo, mn = statistics.median(old), statistics.median(new)
        ratio = mn / mo if mo else float("nan")
        rows.append({"figure": key, "unit": unit, "old": old, "new": new, "ratio": ratio})
        print(f"{key:<52} {unit:<8} {mo:>12.4g} ({spread(old):>11}) {mn:>12.4g} "
              f"({spread(new):>11}) {ratio:>8.3f}")
    (args.work / "ab.json").write_text(json.dumps(
        {"old": args.old, "new": args.new, "rounds": args.rounds, "only": args.only,
         "quick": args.quick, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
