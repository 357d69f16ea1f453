"""The buffered ExperienceWriter: merging parts, back-pressure, stale samples, version tracking."""
from __future__ import annotations

import threading

import pytest

import store
from producers import ExperienceWriter


@pytest.fixture
def s(tmp_path):
    st = store.connect(str(tmp_path / "x.duckdb"))
    st.create_table("agent", {"prompt": "string", "reward": "float64"})
    yield st
    st.close()


def test_parts_of_one_sample_merge_and_are_durable_after_flush(s):
    with ExperienceWriter(s, "agent", batch_rows=1000, flush_interval=10) as w:
        for i in range(50):
            w.write({"sample_id": f"q{i}_0_0", "prompt": f"p{i}"})
        for i in range(50):
            w.write({"sample_id": f"q{i}_0_0", "reward": float(i)})
        w.flush(timeout=30)
        rows = s.query("SELECT prompt, reward FROM agent ORDER BY reward").to_pylist()
    assert len(rows) == 50
    assert rows[7] == {"prompt": "p7", "reward": 7.0}
    assert w.rows_written == 50


def test_stale_samples_are_handed_back_and_do_not_poison_the_writer(s):
    stale: list[str] = []
    w = ExperienceWriter(s, "agent", batch_rows=1000, flush_interval=10, track_version=False)
    w.on_stale(lambda row, err: stale.append(row["sample_id"]))
    w.write({"sample_id": "old_0_0", "prompt": "p", "reward": 1.0, "policy_version": 0})
    s.bump_version("agent", expected=0)
    w.write({"sample_id": "new_0_0", "prompt": "p", "reward": 1.0, "policy_version": 1})
    w.flush(timeout=30)
    assert stale == ["old_0_0"]
    assert [r["sample_id"] for r in w.stale_rows] == ["old_0_0"]
    assert s.query("SELECT sample_id FROM agent").to_pylist() == [{"sample_id": "new_0_0"}]
    w.write({"sample_id": "later_0_0", "prompt": "p", "reward": 2.0, "policy_version": 1})
    w.close(timeout=30)
    assert s.query("SELECT count(*) AS n FROM agent").to_pylist() == [{"n": 2}]


def test_version_tracking_stamps_new_samples_and_calls_on_bump(s):
    bumped = threading.Event()
    seen: list[tuple[int, str | None]] = []
    with ExperienceWriter(s, "agent") as w:
        w.on_bump(lambda v, uri: (seen.append((v, uri)), bumped.set()))
        s.bump_version("agent", weights_uri="file:///w/1")
        assert bumped.wait(10)
        w.write({"sample_id": "q_0_0", "prompt": "p", "reward": 0.5})
    assert seen == [(1, "file:///w/1")]
    assert s.query("SELECT policy_version FROM agent").to_pylist() == [{"policy_version": 1}]


def test_a_full_buffer_blocks_then_times_out_when_nothing_drains(s):
    w = ExperienceWriter(s, "agent", batch_rows=2, max_buffer_rows=2, flush_interval=10,
                         write_timeout=0.3, track_version=False)
    s.close()  # the sender now fails: nothing drains the buffer
    with pytest.raises((TimeoutError, store.ExpstoreError)):
        for i in range(100):
            w.write({"sample_id": f"q{i}_0_0", "prompt": "p"})
    with pytest.raises((TimeoutError, store.ExpstoreError)):
        w.close(timeout=5)


def test_a_bad_number_of_puts_in_flight_is_refused_with_the_value_named(s):
    with pytest.raises(store.InvalidArgument, match="puts_in_flight 0"):
        ExperienceWriter(s, "agent", puts_in_flight=0, track_version=False)


def test_one_put_in_flight_still_merges_parts_and_flushes(s):
    with ExperienceWriter(s, "agent", batch_rows=4, flush_interval=10, puts_in_flight=1,
                          track_version=False) as w:
        for i in range(40):
            w.write({"sample_id": f"q{i}_0_0", "prompt": f"p{i}"})
            w.write({"sample_id": f"q{i}_0_0", "reward": float(i)})
        w.flush(timeout=30)
        assert w.buffered_rows == 0 and w.in_flight_rows == 0
    rows = s.query("SELECT prompt, reward FROM agent ORDER BY reward").to_pylist()
    assert rows == [{"prompt": f"p{i}", "reward": float(i)} for i in range(40)]


def test_write_without_sample_id_is_refused(s):
    with ExperienceWriter(s, "agent", track_version=False) as w:
        with pytest.raises(store.InvalidArgument, match="sample_id"):
            w.write({"prompt": "p"})


@pytest.mark.parametrize("bad, named", [
    ("hello", "got str 'hello'"),
    (42, "got int 42"),
    ([{"sample_id": "q1_0_0"}, "row"], "a sample to write is str 'row'"),
    ({"sample_id": "bad", "reward": 1.0}, "sample_id 'bad' is malformed"),
    ([{"sample_id": "q1_0_0"}, {"sample_id": "q1_00_0"}], "leading zero"),
])
def test_a_bad_sample_is_refused_at_its_write_and_the_good_ones_are_stored(s, bad, named):
    """Before, a malformed sample id was buffered and failed the put that carried it, good
    samples written before it with it; a str or int failed with a bare ValueError/TypeError."""
    with ExperienceWriter(s, "agent", track_version=False) as w:
        w.write([{"sample_id": f"g{i}_0_0", "prompt": "p", "reward": 1.0} for i in range(5)])
        with pytest.raises(store.InvalidArgument) as raised:
            w.write(bad)
        assert named in str(raised.value)
        w.write({"sample_id": "h_0_0", "prompt": "p", "reward": 2.0})
    stored = s.query("SELECT sample_id FROM agent ORDER BY 1").column(0).to_pylist()
    assert stored == [f"g{i}_0_0" for i in range(5)] + ["h_0_0"]  # none of the bad call's rows


def test_a_write_after_close_is_refused_not_dropped(s):
    w = ExperienceWriter(s, "agent", track_version=False)
    w.close()
    with pytest.raises(store.StoreClosed, match="'agent' is closed"):
        w.write({"sample_id": "late_0_0", "prompt": "p", "reward": 1.0})


@pytest.mark.parametrize("bad", [{"reward": "high"}, {"rewrd": 1.0}])
def test_a_sample_the_table_refuses_is_named_and_its_puts_good_samples_are_stored(s, bad):
    """Before, one sample whose value does not fit the table (or names no column) failed the
    whole put: the good samples sent with it were dropped, and the error named no sample."""
    w = ExperienceWriter(s, "agent", track_version=False, batch_rows=100)
    w.write([{"sample_id": f"g{i}_0_0", "prompt": "p", "reward": 1.0} for i in range(5)])
    w.write({"sample_id": "bad_0_0", "prompt": "p", **bad})
    with pytest.raises(store.SchemaMismatch) as raised:
        w.close()
    assert "'bad_0_0'" in str(raised.value) and "other 5 samples were stored" in str(raised.value)
    stored = s.query("SELECT sample_id FROM agent ORDER BY 1").column(0).to_pylist()
    assert stored == [f"g{i}_0_0" for i in range(5)]


def test_a_writer_that_gives_up_on_a_stopped_server_says_what_was_not_stored(tmp_path):
    """Before, close() raised gRPC's bare "failed to connect to all addresses", naming neither
    the table nor the samples lost."""
    import reliability_helpers as rh

    srv = rh.ServerProcess(tmp_path / "x.duckdb").start()
    try:
        with store.connect(srv.uri) as s:
            s.create_table("agent", {"prompt": "string", "reward": "float64"})
        w = ExperienceWriter(srv.uri, "agent", track_version=False, max_retries=1, backoff=0.01)
        w.write({"sample_id": "a_0_0", "prompt": "p", "reward": 1.0})
        w.flush(timeout=30)
    finally:
        srv.kill()
    w.write([{"sample_id": f"b{i}_0_0", "prompt": "p", "reward": 1.0} for i in range(3)])
    with pytest.raises(store.Unavailable) as raised:
        w.close(timeout=60)
    message = str(raised.value)
    assert "writer of 'agent' gave up after 1 retries: 3 samples" in message, message
    assert "'b0_0_0'" in message and "not stored" in message
