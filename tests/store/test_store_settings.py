"""The store's settings: one frozen object, checked when made, set through connect()."""
from __future__ import annotations

import dataclasses

import pytest

import store
from store.errors import InvalidArgument
from store.settings import StoreSettings


def test_settings_are_frozen_and_options_set_fields(open_store):
    s = open_store(cache_limit="1MB", checkpoint_idle_seconds=5.0)
    assert s.settings.cache_limit == "1MB" and s.settings.cache_bytes == 10**6
    assert s.settings.checkpoint_idle_seconds == 5.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.settings.max_group_ops = 1  # type: ignore[misc]


def test_settings_object_and_options_combine(open_store):
    base = StoreSettings(max_live_rows=10, query_timeout=3.0)
    s = open_store(settings=base, query_timeout=4.0)
    assert (s.settings.max_live_rows, s.settings.query_timeout) == (10, 4.0)


@pytest.mark.parametrize("options, named", [
    ({"cach_limit": "1GB"}, "cach_limit"),
    ({"max_live_rows": 0}, "max_live_rows"),
    ({"max_live_rows": True}, "max_live_rows"),
    ({"cache_limit": "lots"}, "lots"),
    ({"materialize_delay": -1.0}, "materialize_delay"),
    ({"max_group_ops": "many"}, "max_group_ops"),
    ({"query_timeout": 0}, "query_timeout"),
    ({"memory_limit": "lots"}, "'lots'"),
    ({"memory_limit": "1000"}, "'1000'"),
])
def test_a_bad_setting_is_refused_naming_it_and_nothing_is_opened(tmp_path, options, named):
    path = tmp_path / "x.duckdb"
    with pytest.raises(InvalidArgument, match=named):
        store.connect(str(path), **options)
    assert not path.exists()


def test_options_as_text_become_typed_settings():
    parsed = StoreSettings.parse_options([
        "query_timeout=2.5", "max_group_ops=64", "blob_direct_io=off", "max_live_rows=none",
        "blob_segment_bytes=1_048_576", "cache_limit=64MiB", "memory_limit=2GB"])
    assert parsed == {"query_timeout": 2.5, "max_group_ops": 64, "blob_direct_io": False,
                      "max_live_rows": None, "blob_segment_bytes": 1 << 20,
                      "cache_limit": "64MiB", "memory_limit": "2GB"}
    assert StoreSettings().with_options(**parsed).cache_bytes == 64 << 20


@pytest.mark.parametrize("pair, named", [
    ("query_timeout", "NAME=VALUE"),
    ("no_such_knob=1", "no_such_knob"),
    ("blob_direct_io=sometimes", "expected on or off"),
    ("merged_put_rows=1.5", "expected a whole number"),
    ("query_timeout=soon", "expected a number"),
])
def test_an_option_text_that_names_no_setting_or_no_value_is_refused(pair, named):
    with pytest.raises(InvalidArgument, match=named):
        StoreSettings.parse_options([pair])


def test_blob_settings_reach_the_blob_store(open_store, tmp_path):
    s = open_store(blob_segment_bytes=4096, blob_direct_io=False, blob_recent_bytes=0)
    assert s.blobs.segment_bytes == 4096 and s.blobs.recent_bytes == 0
    assert not s.blobs.direct_io  # the decision the setting makes
    s.create_table("t", {"blob": "binary"}, storage={"blob": "ref"})
    for i in range(3):
        s.put("t", {"sample_id": [f"q{i}_0_0"], "blob": [bytes([i]) * 8192]})
    assert len(s.blobs.segments()) >= 3  # each 8 KiB chunk fills a 4 KiB segment by itself
    claim = s.claim("t", 3)
    assert sorted(claim.data.column("blob").to_pylist()) == [bytes([i]) * 8192 for i in range(3)]
    with pytest.raises(InvalidArgument, match="blob_direct_io"):
        store.connect(str(tmp_path / "y.duckdb"), blob_direct_io="no")
