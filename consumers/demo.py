"""``expstore demo``: the whole FlexMARL pipeline on this machine, in one command.

It opens the embedded store (``./expstore.duckdb`` unless ``--db``), serves it over Arrow Flight
in-process on a free loopback port, and runs the reference multi-agent workflow
(:mod:`producers.workflow`: planner → solver → verifier) through the server: tiny CPU language
models roll out with injected long-tail latencies, and each agent's torch trainer
(:mod:`consumers.trainer`) consumes its own table in group-aware micro-batches, takes one
optimizer step per global batch, publishes weights and bumps its version, which the rollouts
reload before the next round. A progress line shows each agent's version and rows ready /
processing / consumed; the summary says how much training the micro-batch pipeline hid behind
rollouts, against a synchronous run that waits for the whole batch. See docs/demo.md.

Every run makes fresh tables (``demo<N>_planner`` …), so running it again on the same file works
and keeps earlier runs for SQL, e.g. ``expstore query "SELECT …  FROM demo1_verifier"``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, TextIO

__all__ = ["DemoConfig", "main", "run_demo", "union_seconds", "overlap_seconds"]


@dataclass(frozen=True)
class DemoConfig:
    rounds: int = 6
    queries_per_round: int = 8
    n: int = 2
    max_new_tokens: int = 10
    latency_median: float = 0.25
    latency_sigma: float = 0.7
    slow_fraction: float = 0.08
    slow_factor: float = 6.0
    lr: float = 0.02
    d_model: int = 64
    n_layers: int = 4
    seed: int = 0


QUICK = DemoConfig(rounds=2, queries_per_round=4, max_new_tokens=8, latency_median=0.08,
                   slow_factor=5.0, d_model=32, n_layers=2)


# -- interval arithmetic for the summary ------------------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval."""
    return sum(e - s for s, e in _union(intervals))


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds covered by both an interval of ``a`` and one of ``b``."""
    ua, ub = _union(a), _union(b)
    total, j = 0.0, 0
    for s, e in ua:
        while j < len(ub) and ub[j][1] <= s:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            total += min(e, ub[k][1]) - max(s, ub[k][0])
            k += 1
    return total


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- progress ----------------------------------------------------------------------------------------
class _Progress(threading.Thread):
    """A refreshing line on a terminal, plain lines otherwise."""

    def __init__(self, s: Any, tables: dict[str, str], out: TextIO, interval: float,
                 started: float, written: list[int]) -> None:
        super().__init__(name="expstore-demo-progress", daemon=True)
        self.s, self.tables, self.out, self.started, self.written = s, tables, out, started, written
        self.tty = out.isatty()
        self.interval = interval if interval > 0 else (0.25 if self.tty else 1.0)
        self.done = threading.Event()

    def line(self) -> str:
        parts = []
        for agent, table in self.tables.items():
            st = self.s.stats(table)[table]
            parts.append(f"{agent} v{st['version']} {st['ready']}/{st['processing']}/"
                         f"{st['consumed']}")
        elapsed = time.monotonic() - self.started
        rate = self.written[0] / elapsed if elapsed > 0 else 0.0
        return f"{elapsed:5.1f}s | " + " | ".join(parts) + f" | {rate:5.1f} samples/s"

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.emit()

    def emit(self, final: bool = False) -> None:
        try:
            text = self.line()
        except Exception:  # noqa: BLE001 - progress must never break the run
            return
        if self.tty:
            width = max(20, os.get_terminal_size(self.out.fileno()).columns - 1) \
                if hasattr(self.out, "fileno") else 100
            self.out.write("\r\x1b[2K" + text[:width] + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        self.emit(final=True)


# -- the run -----------------------------------------------------------------------------------------
def _torch_device(name: str) -> Any:
    """``name`` as a torch device, refused clearly if this machine has no such device."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e}); expected cpu or cuda[:N]") from e
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name!r}: torch sees no CUDA device here (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name!r}: torch sees {count} CUDA device(s), 0..{count - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]")
    return device


def _next_prefix(tables: list[str]) -> tuple[str, int]:
    runs = [int(m.group(1)) for t in tables if (m := re.match(r"^demo(\d+)_", t))]
    run = max(runs, default=0) + 1
    return f"demo{run}_", run


def run_demo(db: str = "./expstore.duckdb", *, port: int = 0, config: DemoConfig = DemoConfig(),
             out: TextIO | None = None, progress_interval: float = 0.0,
             deadline: float = 300.0, device: str = "cpu") -> dict[str, Any]:
    """Run the demo and return its summary (see docs/demo.md for the fields).

    ``device`` is where the models roll out and train (``"cuda"`` for the first GPU).

    Raises:
        InvalidArgument: ``port`` is in use (or cannot be listened on), checked before anything
            starts, as ``expstore serve`` checks it.
    """
    import pyarrow as pa
    import torch

    from flight_server.listening import check_can_listen

    check_can_listen("127.0.0.1", port)
    torch_device = _torch_device(device)

    from consumers.torch_collate import collate
    from consumers.trainer import TorchTrainer, TrainerThread, grpo_loss
    from flight_server.client import RemoteStore
    from flight_server.server import ExpstoreFlightServer
    from producers.rollout.tiny_lm import TinyLMBackend, TinyLMConfig, build_tiny_lm
    from producers.workflow import LatencyModel, MultiAgentWorkflow, reference_agents

    out = out or sys.stdout
    cfg = config
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several tiny models at once: one thread each beats contention
    try:
        server = ExpstoreFlightServer(db, host="127.0.0.1", port=port)
    except pa.ArrowException as e:  # the port was taken after the check above
        torch.set_num_threads(threads)
        raise OSError(f"the Flight server could not listen on 127.0.0.1:{port} ({e}); "
                      "is the port in use? --port 0 picks a free one") from e
    serving = threading.Thread(target=server.serve, name="expstore-demo-server", daemon=True)
    serving.start()
    try:
        with RemoteStore(server.location) as s:
            prefix, run = _next_prefix(s.list_tables())
            agents = reference_agents()
            queries = [(f"q{i}", f"{(7 * i) % 50}+{(3 * i) % 40}=?")
                       for i in range(cfg.rounds * cfg.queries_per_round)]
            latency = LatencyModel(cfg.latency_median, cfg.latency_sigma, cfg.slow_fraction,
                                   cfg.slow_factor, seed=cfg.seed)
            wf = MultiAgentWorkflow(s, agents, n=cfg.n, max_new_tokens=cfg.max_new_tokens,
                                    latency=latency, table_prefix=prefix,
                                    version_timeout=deadline)
            wf.create_tables()
            sizes = wf.batch_sizes(cfg.queries_per_round)
            weights_dir = f"{os.path.abspath(db)}.weights/demo{run}"
            out.write(f"expstore demo run {run}: {len(agents)} agents "
                      f"({' → '.join(a.name for a in agents)}), {cfg.rounds} rounds x "
                      f"{cfg.queries_per_round} queries, n={cfg.n}, models on {torch_device}\n"
                      f"  store {db}, served at {server.location}, tables {prefix}*\n"
                      f"  progress: elapsed | agent version ready/processing/consumed | rate\n")
            out.flush()
            model_config = TinyLMConfig(d_model=cfg.d_model, n_layers=cfg.n_layers)
            trainers: dict[str, TrainerThread] = {}
            for i, agent in enumerate(agents):
                table = wf.tables[agent.name]
                micro, global_batch, group = sizes[table]
                model = build_tiny_lm(seed=cfg.seed + i, config=model_config).to(torch_device)
                trainer = TorchTrainer(model, torch.optim.Adam(model.parameters(), lr=cfg.lr),
                                       grpo_loss, weights_dir, name=table, keep_last=2,
                                       collate_fn=partial(collate, group_size=group))
                sub = s.subscribe(table, micro, global_batch, group_by="input_id",
                                  group_size=group, consumer=f"demo-trainer-{agent.name}")
                trainers[agent.name] = TrainerThread(trainer, sub, max_steps=cfg.rounds,
                                                     idle_timeout=deadline)
            backends = {a.name: TinyLMBackend(build_tiny_lm(seed=cfg.seed + i, config=model_config),
                                              seed=cfg.seed + i, device=torch_device)
                        for i, a in enumerate(agents)}
            written = [0]
            lock = threading.Lock()

            def count(_table: str, _sample: Any) -> None:
                with lock:
                    written[0] += 1

            started = time.monotonic()
            progress = _Progress(s, {a.name: wf.tables[a.name] for a in agents}, out,
                                 progress_interval, started, written)
            for t in trainers.values():
                t.start()
            progress.start()
            try:
                result = wf.run(queries, cfg.queries_per_round, backends, on_sample=count)
                for t in trainers.values():
                    t.join(timeout=max(1.0, deadline - (time.monotonic() - started)))
            finally:
                for t in trainers.values():
                    t.stop()
                progress.stop()
            for name, t in trainers.items():
                if t.error is not None:
                    raise t.error
                if t.is_alive() or len(t.steps) < cfg.rounds:
                    raise TimeoutError(f"the {name} trainer finished {len(t.steps)} of "
                                       f"{cfg.rounds} steps within {deadline} s")
            finished = max([result.finished] + [t.trainer.busy[-1][1] for t in trainers.values()])
            summary = _summary(cfg, run, db, server.location, prefix, wf, result, trainers,
                               started, finished, s)
            summary["device"] = str(torch_device)
    finally:
        server.close()
        serving.join(timeout=30)
        torch.set_num_threads(threads)
    return summary


def _summary(cfg: DemoConfig, run: int, db: str, location: str, prefix: str, wf: Any,
             result: Any, trainers: dict[str, Any], started: float, finished: float,
             s: Any) -> dict[str, Any]:
    rollouts = [(a, b) for _, a, b in result.rollouts]
    busy = [iv for t in trainers.values() for iv in t.trainer.busy]
    rollout_s = union_seconds(rollouts)
    train_s = union_seconds(busy)
    hidden = overlap_seconds(busy, rollouts)
    wall = finished - started
    sync = rollout_s + train_s
    agents = {}
    for name, t in trainers.items():
        table = wf.tables[name]
        st = s.stats(table)[table]
        agents[name] = {
            "table": table, "version": st["version"], "steps": len(t.steps),
            "samples": result.samples[table], "consumed": st["consumed"],
            "train_seconds": round(t.trainer.busy_seconds, 3),
            "hidden_seconds": round(overlap_seconds(t.trainer.busy, rollouts), 3),
        }
        rewards = s.query(f'SELECT policy_version AS v, avg(reward) AS r FROM "{table}" '
                          "GROUP BY 1 ORDER BY 1").to_pylist()
        agents[name]["reward_first_round"] = round(rewards[0]["r"], 4)
        agents[name]["reward_last_round"] = round(rewards[-1]["r"], 4)
    latencies = [b - a for a, b in rollouts]
    query_times = [b - a for a, b in result.queries.values()]
    slowest = max(result.queries, key=lambda q: result.queries[q][1] - result.queries[q][0])
    total = sum(result.samples.values())
    return {
        "run": run, "db": db, "location": location, "tables": prefix + "*",
        "rounds": cfg.rounds, "queries": cfg.rounds * cfg.queries_per_round, "n": cfg.n,
        "samples": total, "samples_per_second": round(total / wall, 2) if wall else 0.0,
        "agents": agents,
        "rollout_latency_p50": round(_percentile(latencies, 0.5), 3),
        "rollout_latency_p95": round(_percentile(latencies, 0.95), 3),
        "rollout_latency_max": round(max(latencies, default=0.0), 3),
        "query_seconds_median": round(_percentile(query_times, 0.5), 3),
        "slowest_query": slowest,
        "slowest_query_seconds": round(max(query_times, default=0.0), 3),
        "rollout_seconds": round(rollout_s, 3), "train_seconds": round(train_s, 3),
        "hidden_train_seconds": round(hidden, 3),
        "hidden_fraction": round(hidden / train_s, 3) if train_s else 0.0,
        "wall_seconds": round(wall, 3), "sync_estimate_seconds": round(sync, 3),
        "saved_seconds": round(sync - wall, 3),
        "saved_fraction": round((sync - wall) / sync, 3) if sync else 0.0,
    }


def format_summary(d: dict[str, Any]) -> str:
    """The summary as a newcomer reads it."""
    names = list(d["agents"])
    a = d["agents"]
    col = "".join(f"{n:>12}" for n in names)

    def row(label: str, key: str, fmt: str = "{}") -> str:
        return f"  {label:<22}" + "".join(f"{fmt.format(a[n][key]):>12}" for n in names)

    lines = [
        "",
        f"Done: {d['samples']} samples from {d['queries']} queries in {d['wall_seconds']:.1f} s "
        f"({d['samples_per_second']:.1f} samples/s, models on {d['device']}).",
        "",
        f"  {'per agent':<22}{col}",
        row("samples written", "samples"),
        row("samples trained", "consumed"),
        row("policy version", "version"),
        row("training (s)", "train_seconds", "{:.2f}"),
        row("  of it during rollouts", "hidden_seconds", "{:.2f}"),
        row("mean reward, round 1", "reward_first_round", "{:.3f}"),
        row(f"mean reward, round {d['rounds']}", "reward_last_round", "{:.3f}"),
        "",
        f"Long tail: rollout latency p50 {d['rollout_latency_p50']:.2f} s, "
        f"p95 {d['rollout_latency_p95']:.2f} s, max {d['rollout_latency_max']:.2f} s; "
        f"slowest query {d['slowest_query']} took {d['slowest_query_seconds']:.1f} s "
        f"(median {d['query_seconds_median']:.1f} s).",
        "",
        "Micro-batch pipeline vs waiting for the whole batch:",
        f"  rollouts in flight          {d['rollout_seconds']:7.1f} s",
        f"  trainers busy               {d['train_seconds']:7.1f} s",
        f"  training hidden in rollouts {d['hidden_train_seconds']:7.1f} s  "
        f"({100 * d['hidden_fraction']:.0f}% of training ran while rollouts were still going)",
        f"  synchronous estimate        {d['sync_estimate_seconds']:7.1f} s  "
        "(all rollouts, then all training)",
        f"  this run (pipelined)        {d['wall_seconds']:7.1f} s  "
        f"saved {d['saved_seconds']:.1f} s ({100 * d['saved_fraction']:.0f}%)",
        "",
        f"Every global batch was one optimizer step and one version bump per agent; the data "
        f"stays in {d['db']} (tables {d['tables']}), e.g.:",
        f"  expstore query --db {d['db']} \"SELECT policy_version, avg(reward) FROM "
        f"{d['tables'][:-1]}verifier GROUP BY 1 ORDER BY 1\"",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``expstore demo [--db PATH] [--port N] [--quick] [--json] …``."""
    p = argparse.ArgumentParser(
        prog="expstore demo",
        description="Run the multi-agent FlexMARL pipeline (rollouts, Flight server, trainers) "
                    "on this machine and explain what the micro-batch pipeline saved.")
    p.add_argument("--db", default="./expstore.duckdb", help="the DuckDB file (default %(default)s)")
    p.add_argument("--port", type=int, default=0, help="Flight port on 127.0.0.1 (default: a free one)")
    p.add_argument("--quick", action="store_true", help="a ~10 s run (2 rounds x 4 queries)")
    p.add_argument("--rounds", type=int, help="global batches (one version per agent each)")
    p.add_argument("--queries", type=int, help="queries per round")
    p.add_argument("--n", type=int, help="samples per prompt (the GRPO group size)")
    p.add_argument("--latency", type=float, help="median injected rollout latency, seconds")
    p.add_argument("--seed", type=int, help="seed of models and latencies")
    p.add_argument("--device", default="cpu",
                   help="where the models roll out and train: cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--progress-interval", type=float, default=0.0,
                   help="seconds between progress updates (default 0.25 on a terminal, else 1)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else DemoConfig()
    overrides = {k: v for k, v in (("rounds", args.rounds), ("queries_per_round", args.queries),
                                   ("n", args.n), ("latency_median", args.latency),
                                   ("seed", args.seed)) if v is not None}
    if overrides:
        from dataclasses import replace
        cfg = replace(cfg, **overrides)
    if cfg.rounds < 1 or cfg.queries_per_round < 1 or cfg.n < 2:
        p.error("--rounds and --queries must be >= 1 and --n >= 2")
    try:
        _torch_device(args.device)
    except ValueError as e:
        p.error(str(e))
    from store.errors import ExpstoreError
    try:
        summary = run_demo(args.db, port=args.port, config=cfg,
                           out=sys.stderr if args.json else sys.stdout,
                           progress_interval=args.progress_interval, device=args.device)
    except (ExpstoreError, OSError, TimeoutError) as e:
        print(f"expstore demo: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        sys.stdout.write(format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
