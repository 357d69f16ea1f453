"""``python -m expstore``: the ``expstore`` console script (same commands, same options)."""
from __future__ import annotations

from expstore.cli import main

if __name__ == "__main__":
    main(prog_name="python -m expstore")
