"""Publishing trainer weights and loading them into rollout backends.

A trainer publishes a state dict after each optimizer step and hands the returned URI to
``bump_version(weights_uri=...)``; the store records it next to the new policy version, and the
rollout side loads it with :func:`load_state_dict` before tagging new samples with that version.

Files are written atomically (temporary file, fsync, rename), so a backend that learns the URI from
the store never reads a half-written file, and a trainer killed mid-save leaves no file at the
published name.

Example:
    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> uri = publish_state_dict({"w": torch.ones(2)}, d, step=3)
    >>> uri.endswith("policy-step00000003.pt")
    True
    >>> load_state_dict(uri)["w"].tolist()
    [1.0, 1.0]
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

__all__ = ["publish_state_dict", "load_state_dict", "uri_to_path", "path_to_uri", "prune_published"]


def path_to_uri(path: str | os.PathLike[str]) -> str:
    """Return the ``file://`` URI of a local path (made absolute)."""
    return Path(path).resolve().as_uri()


def uri_to_path(uri: str) -> Path:
    """Return the local path a weights URI names.

    Accepts ``file://`` URIs and plain paths. Other schemes are refused rather than guessed at: a
    backend that cannot read ``s3://`` should say so, not load nothing.

    Raises:
        ValueError: the URI has a scheme other than ``file``.
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme else uri)
    # A Windows drive letter parses as a one-letter scheme; treat it as a path.
    if len(parsed.scheme) == 1:
        return Path(uri)
    raise ValueError(f"weights URI {uri!r} has scheme {parsed.scheme!r}; expected a file:// URI or a path")


def publish_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    weights_dir: str | os.PathLike[str],
    step: int,
    *,
    name: str = "policy",
) -> str:
    """Save ``state_dict`` as ``<weights_dir>/<name>-step<step>.pt`` atomically; return its URI.

    Tensors are detached and moved to the CPU first, so the file loads on a machine without the
    trainer's devices.

    Args:
        state_dict: parameter name to tensor.
        weights_dir: directory to publish into (created if missing).
        step: the trainer's optimizer step; it makes the name unique within one run.
        name: file name prefix, e.g. the agent's table name in a multi-agent run.

    Returns:
        The absolute ``file://`` URI of the published file.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    out_dir = Path(weights_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{name}-step{step:08d}.pt"
    cpu_state = {k: _for_saving(v) for k, v in state_dict.items()}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(cpu_state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    # fsync the directory so the rename itself survives a crash.
    dir_fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path_to_uri(final)


def _for_saving(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, holding only its own elements.

    A device tensor's copy to the host is already new; a host tensor is saved as it is (no
    snapshot needed: ``torch.save`` has written it before the publish returns), unless it is a
    view, whose whole storage ``torch.save`` would write. Copying every host tensor as well would add
    a second copy of the whole state to every publish, for nothing.
    """
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone()


def load_state_dict(uri: str, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a state dict published by :func:`publish_state_dict` (tensors only, no pickled code)."""
    path = uri_to_path(uri)
    if not path.is_file():
        raise FileNotFoundError(f"no published weights at {uri!r} (looked for {path})")
    loaded = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(loaded, dict):
        raise ValueError(f"weights at {uri!r} hold a {type(loaded).__name__}, expected a state dict")
    return loaded


def prune_published(weights_dir: str | os.PathLike[str], keep_last: int, *, name: str = "policy") -> list[Path]:
    """Delete all but the ``keep_last`` newest published files of ``name``; return the deleted paths.

    Rollout backends may still be loading a recent file, so keep at least two in a live run.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    files = sorted(Path(weights_dir).glob(f"{name}-step*.pt"))
    doomed = files[:-keep_last]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed
