"""The benchmark write-up: BENCHMARKS.md's generated section, its targets and its plots."""
from __future__ import annotations

from pathlib import Path

from bench.context import Metric, Results
from bench.report import MD_BEGIN, MD_END, SUMMARY_BEGIN, SUMMARY_END, write_markdown

META = {"date": "2026-11-21 00:00 UTC", "revision": "abc1234", "command": "python -m bench",
        "machine": "2 cores", "versions": "pyarrow 26", "load": "0.1 / 0.1 / 0.1"}


def _results(**figures: float) -> Results:
    results = Results()
    for key, value in figures.items():
        bench, name = key.split("__")
        full = f"{bench}.{name}"
        results.metrics[full] = Metric(full, value, "ms", name)
    return results


def test_the_section_is_replaced_in_place_with_targets_and_linked_plots(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\n{SUMMARY_BEGIN}\nold targets\n{SUMMARY_END}\n\n"
                  f"hand-written text\n\n{MD_BEGIN}\nold figures\n{MD_END}\n\n## After\n")
    plot = tmp_path / "docs" / "bench" / "latency.png"
    results = _results(expstore_claims__claim16_p50_ms=0.6, flight_raw__call_p50_ms=0.4,
                       expstore_claims__deliver_p50_ms=7.0)
    write_markdown(md, results, META, [plot])
    text = md.read_text()
    assert "hand-written text" in text and "## After" in text and "old figures" not in text
    assert "old targets" not in text
    assert text.count(MD_BEGIN) == text.count(MD_END) == 1
    assert text.count(SUMMARY_BEGIN) == text.count(SUMMARY_END) == 1
    # The targets come first (the reader's first screen), the figures after the prose.
    assert text.index("### Targets") < text.index("hand-written text") < text.index("### All")
    assert "![latency](docs/bench/latency.png)" in text
    lines = text.splitlines()
    claim = next(line for line in lines if line.startswith("| claim-16 p50 vs raw"))
    assert "1.50x" in claim and "PASS" in claim  # 0.6 / 0.4 against ≤ 2x
    deliver = next(line for line in lines if line.startswith("| put → delivered p50 |"))
    assert "MISS" in deliver  # 7 ms against ≤ 5 ms
    missing = next(line for line in lines if line.startswith("| wide ingest vs raw Flight"))
    assert "pending" in missing


def test_without_markers_the_section_is_appended(tmp_path: Path):
    md = tmp_path / "B.md"
    md.write_text("# B\n")
    write_markdown(md, _results(flight_raw__call_p50_ms=0.4), META)
    text = md.read_text()
    assert text.startswith("# B\n") and MD_BEGIN in text and "### Plots" not in text
    assert SUMMARY_BEGIN in text and text.index(SUMMARY_BEGIN) < text.index(MD_BEGIN)


def test_a_value_just_short_of_its_bound_does_not_round_onto_it():
    from bench.report import target_rows
    rows = {r[0]: r for r in target_rows(_results(
        pipeline_sim__expstore_speedup=1.7967,            # ≥ 1.8x: a miss, not "1.80x"
        expstore_ingest__wide_mb_per_s=696.7, flight_raw__wide_mb_per_s=1000.0,   # ≥ 70 %
        expstore_claims__claim16_p50_ms=0.8004, flight_raw__call_p50_ms=0.4,      # ≤ 2x
        expstore_ingest__narrow_checkpointed_rows_per_s=100.0,
        duckdb_bulk__narrow_whole_checkpointed_rows_per_s=1000.0))}
    assert rows["micro-batch pipeline vs sync (expstore transport)"][1:] == ["1.797x", "≥ 1.8x",
                                                                             "MISS"]
    assert rows["wide ingest vs raw Flight MB/s"][1:] == ["69.7%", "≥ 70%", "MISS"]
    assert rows["claim-16 p50 vs raw Flight one-row call p50"][1:] == ["2.001x", "≤ 2x", "MISS"]
    assert rows["narrow ingest vs DuckDB bulk insert rows/s, CHECKPOINT counted"][1] == "10%"   # far off: as before


def test_a_latency_target_at_a_table_size_is_shown_in_ms():
    from bench.targets import Target
    t = Target("claim-16 p99 at 1e7 rows", "expstore_scaling.claim16_p99_ms_1e7", None, 5.0, False)
    assert (t.unit, t.bound_text) == ("ms", "≤ 5 ms")
    assert Target("overhead", "pipeline_sim.expstore_overhead_pct", None, 5.0, False).bound_text \
        == "≤ 5%"
