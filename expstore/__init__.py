"""expstore: a storage-centric experience database for RL training of LLM agents.

The package facade: ``expstore.connect`` opens the same store interface embedded (a DuckDB file)
or remote (``grpc://host:port``); the command line is :mod:`expstore.cli` (``expstore --help``).

>>> import expstore
>>> s = expstore.connect("./expstore.duckdb")         # doctest: +SKIP
>>> s = expstore.connect("grpc://127.0.0.1:8815")     # doctest: +SKIP
"""
from __future__ import annotations

from store import connect
from store.errors import ExpstoreError

__version__ = "0.1.0"

__all__ = ["connect", "ExpstoreError", "__version__"]
