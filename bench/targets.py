"""The issue's targets, each a ratio of two figures of the same run (or a figure against a
fixed bound), evaluated to PASS, MISS, pending (the expstore figure is missing: not run or
skipped) or "no baseline" (the baseline was not run or was skipped)."""

from __future__ import annotations

import dataclasses

from bench.context import Results


@dataclasses.dataclass(frozen=True)
class Target:
    text: str
    measured: str  # metric key
    baseline: str | None  # metric key; None: compare ``measured`` with ``bound`` itself
    bound: float
    at_least: bool  # True: ratio ≥ bound; False: ratio ≤ bound

    def evaluate(self, results: Results) -> tuple[float | None, str]:
        """(ratio or value, "PASS" | "MISS" | "pending" | "no baseline")."""
        value = results.get(self.measured)
        base = results.get(self.baseline) if self.baseline else 1.0
        if value is None:
            return None, "pending"
        if base is None or base == 0:
            return None, "no baseline"
        ratio = value / base
        ok = ratio >= self.bound if self.at_least else ratio <= self.bound
        return ratio, "PASS" if ok else "MISS"

    @property
    def unit(self) -> str:
        """The measured figure's unit, from its key: ``…_ms`` or ``…_ms_1e7`` ms, ``…_pct`` %,
        else a ratio ("x")."""
        parts = self.measured.rsplit(".", 1)[-1].split("_")
        return "ms" if "ms" in parts else "%" if "pct" in parts else "x"

    @property
    def bound_text(self) -> str:
        op = "≥" if self.at_least else "≤"
        if self.baseline is None:
            unit = {"%": "%", "ms": " ms"}.get(self.unit, "x")
            return f"{op} {self.bound:g}{unit}"
        if self.bound < 1 and self.at_least:
            return f"{op} {self.bound:.0%}"
        return f"{op} {self.bound:g}x"


T = Target
TARGETS = [
    T("wide ingest vs raw Flight MB/s", "expstore_ingest.wide_mb_per_s",
      "flight_raw.wide_mb_per_s", 0.70, True),
    # Narrow ingest counts the CHECKPOINT that compresses what the puts wrote, and DuckDB's the
    # one after its insert (bench/expstore_ingest.py, bench/duckdb_bulk.py).
    T("narrow ingest vs DuckDB bulk insert rows/s, CHECKPOINT counted",
      "expstore_ingest.narrow_checkpointed_rows_per_s",
      "duckdb_bulk.narrow_whole_checkpointed_rows_per_s", 0.80, True),
    T("64 one-sample producers vs raw Flight one-row puts/s", "expstore_ingest.put1_64_per_s",
      "flight_raw.puts64_per_s", 0.80, True),
    T("claim-16 p50 vs raw Flight one-row call p50", "expstore_claims.claim16_p50_ms",
      "flight_raw.call_p50_ms", 2.0, False),
    T("claim-16 p99", "expstore_claims.claim16_p99_ms", None, 5.0, False),
    # "flat from 10^5 to 10^7 rows": the same bounds, with 10^7 ready rows in the table
    T("claim-16 p50 at 1e7 rows vs raw Flight one-row call p50",
      "expstore_scaling.claim16_p50_ms_1e7", "flight_raw.call_p50_ms", 2.0, False),
    T("claim-16 p99 at 1e7 rows", "expstore_scaling.claim16_p99_ms_1e7", None, 5.0, False),
    T("put → delivered p50", "expstore_claims.deliver_p50_ms", None, 5.0, False),
    T("narrow ingest vs Redis XADD rows/s", "expstore_ingest.narrow_checkpointed_rows_per_s",
      "redis_streams.narrow_rows_per_s", 10.0, True),
    T("narrow ingest vs Ray queue rows/s", "expstore_ingest.narrow_checkpointed_rows_per_s",
      "ray_queue.narrow_rows_per_s", 10.0, True),
    T("wide ingest vs Redis XADD MB/s", "expstore_ingest.wide_mb_per_s",
      "redis_streams.wide_mb_per_s", 2.5, True),
    T("wide ingest vs Ray queue MB/s", "expstore_ingest.wide_mb_per_s",
      "ray_queue.wide_mb_per_s", 2.5, True),
    T("claim-16 + pipelined ack p50 vs Redis XREADGROUP 16 + XACK p50",
      "expstore_claims.claim16_ackpipe_p50_ms", "redis_streams.claim16_ack_p50_ms", 1.0, False),
    T("claim-16 + ack waited durable p50 vs Redis XREADGROUP 16 + XACK p50",
      "expstore_claims.claim16_ack_p50_ms", "redis_streams.claim16_ack_p50_ms", 1.0, False),
    T("micro-batch pipeline vs sync (expstore transport)", "pipeline_sim.expstore_speedup",
      None, 1.8, True),
    # Reading by-reference values back: each figure against raw Flight do_get serving the very
    # tables the claims (or the query) returned, in as many calls (bench/expstore_reads.py).
    *[T(f"{what} vs raw Flight do_get of the same bytes", f"expstore_reads.{key}_mb_per_s",
        f"expstore_reads.raw_{key}_mb_per_s", 0.50, True)
      for key, what in (("tq_claim16", "TransferQueue rows read by claims of 16"),
                        ("tq_claim64", "TransferQueue rows read by claims of 64"),
                        ("tq_sql", "TransferQueue rows read by SELECT *"),
                        ("wide_claim16", "wide rows read by claims of 16"),
                        ("wide_claim64", "wide rows read by claims of 64"),
                        ("wide_sql", "wide rows read by SELECT *"))],
    T("TransferQueue's workload put vs TransferQueue's", "expstore_reads.tq_put_mb_per_s",
      "transferqueue.put_mb_per_s", 5.0, True),
    T("TransferQueue's workload read back (claims of 64) vs its get_meta + get_data",
      "expstore_reads.tq_claim64_mb_per_s", "transferqueue.get_mb_per_s", 5.0, True),
    # a micro-batch's fetch + settle: TransferQueue's p50 over expstore's (claim + waited ack)
    *[T(f"micro-batch of 16 {what}: TransferQueue p50 / expstore p50",
        f"transferqueue.{key}_p50_ms", f"expstore_reads.{key}_p50_ms", 4.0, True)
      for key, what in (("mb16_narrow", "narrow"), ("mb16_wide", "wide"),
                        ("mb16_narrow_group", "narrow, groups of 8"),
                        ("mb16_wide_group", "wide, groups of 8"))],
    T("micro-batch pipeline overhead vs ideal queue", "pipeline_sim.expstore_overhead_pct",
      None, 5.0, False),
    # Scale-out (bench/cluster.py): N data nodes against one node's aggregate, the same run.
    *[T(f"cluster {what}, {n} data nodes vs one node's", f"cluster.{key}_ratio_n{n}", None,
        0.7 * n, True)
      for n in (2, 4, 8) for key, what in (("ingest", "wide ingest"),
                                           ("read", "micro-batch reads"))],
    # "flat in N": the coordinator's CPU per sample with the most nodes run over one node's
    *[T(f"cluster coordinator CPU per sample {what}, {n} data nodes vs one node's",
        f"cluster.coord_cpu_us_{key}_n{n}", f"cluster.coord_cpu_us_{key}_n1", 1.25, False)
      for n in (4, 8) for key, what in (("put", "put"), ("read", "read"))],
    # "every figure ahead of TransferQueue's": its controller, N storage units, N producers and
    # N trainers on the same Ray cluster and rows, beside ours at the same N
    T("cluster wide ingest, one node, vs TransferQueue on the same Ray cluster",
      "cluster.ingest_vs_tq", None, 1.0, True),
    T("cluster micro-batch reads, one node, vs TransferQueue on the same Ray cluster",
      "cluster.read_vs_tq", None, 1.0, True),
    *[T(f"cluster {what}, {n} data nodes, vs TransferQueue with {n} storage units",
        f"cluster.{key}_vs_tq_n{n}", None, 1.0, True)
      for n in (2, 4, 8) for key, what in (("ingest", "wide ingest"),
                                           ("read", "micro-batch reads"))],
]


def evaluate(results: Results) -> list[tuple[Target, float | None, str]]:
    return [(t, *t.evaluate(results)) for t in TARGETS]
