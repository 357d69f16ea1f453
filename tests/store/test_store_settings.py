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
])
def test_a_bad_setting_is_refused_naming_it_and_nothing_is_opened(tmp_path, options, named):
    path = tmp_path / "x.duckdb"
    with pytest.raises(InvalidArgument, match=named):
        store.connect(str(path), **options)
    assert not path.exists()
