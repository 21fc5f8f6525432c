"""The trainer's start-up checks that only one rank can make, before the engine's first collective.

What it is
    ``check_rank`` (the device this rank sees; the ``RINGZERO_FAULT_DATA`` test
    hook for a --data this rank cannot read), ``make_offload_dir`` (mkdir -p of
    --offload-dir on each node) and ``open_metrics`` (rank 0's JSONL file, opened
    only after every other check passed). Each raises ConfigError, one line,
    which train.py hands to ``exits.agree`` so every rank stops alike.

What it is not
    Not the flag checks (config.py: no MPI, no data), not the memory check
    (memcheck.py), not the ends after a failure (exits.py). train.py decides
    when each of these runs.
"""
from __future__ import annotations

import os

from ringzero.app.config import Config, ConfigError

FAULT_DATA_ENV = "RINGZERO_FAULT_DATA"      # tests: "rank:N" = rank N cannot read --data


def check_rank(cfg: Config, rank: int):
    """The device check and the --data test hook, on one rank. Raises ConfigError."""
    if cfg.device == "cuda":
        from ringzero.comm.backend import xp_for
        try:
            xp_for("cuda")
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"--device cuda: {e} (hint: --device cpu, or run where CuPy sees a GPU)") from None
    if cfg.data and os.environ.get(FAULT_DATA_ENV) == f"rank:{rank}":
        import errno
        e = PermissionError(errno.EACCES, os.strerror(errno.EACCES), cfg.data)
        raise ConfigError(f"--data: cannot read on this rank: {e} ({FAULT_DATA_ENV})")


def make_offload_dir(cfg: Config):
    """--offload-dir made where it is missing (mkdir -p on each node, as DeepSpeed makes its swap folder)."""
    if not (cfg.offload and cfg.offload_dir):
        return
    from ringzero.runtime.offload import OffloadError, make_dir
    try:
        make_dir(cfg.offload_dir)
    except OffloadError as e:
        raise ConfigError(str(e)) from None


def open_metrics(cfg: Config, rank: int):
    """Rank 0's MetricsWriter for --metrics (None elsewhere, or without --metrics). Raises ConfigError."""
    from ringzero.metrics import MetricsWriter
    if not (cfg.metrics and rank == 0):
        return None
    try:
        return MetricsWriter(cfg.metrics)
    except OSError as e:
        raise ConfigError(f"--metrics {cfg.metrics!r}: cannot write: {e.strerror or e}") from None
