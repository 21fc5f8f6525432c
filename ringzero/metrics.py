"""The trainer's metrics file: the record format, the writer and the reader.

What it is
    One JSON object per line (JSONL), written by rank 0 of ``ringzero.train``
    and read by ``ringzero.explain``, ``ringzero.plot`` and the benchmarks::

        {"step": 0, "loss": 5.61, "lr": 0.0001, "loss_scale": 65536.0,
         "grad_norm": 3.2, "tokens_per_s": 41000.0, "step_time_s": 0.05,
         "bytes_sent": 1234560, "skipped": false}                  one per step
        ...
        {"summary": true, "params": 843648, "world_size": 8, ...}  the last line

    ``STEP_KEYS`` and ``SUMMARY_KEYS`` name the fields every record of each
    kind carries. ``MetricsWriter(path)`` writes them (a line per call, in
    order, each flushed to the file as it is written); ``read_metrics(path)`` returns (step records, summary or None).

What it is not
    No MPI and no engine: the trainer decides what goes in a record and which
    rank writes. Tools read this module, never the trainer.
"""
from __future__ import annotations

import json

STEP_KEYS = ("step", "loss", "lr", "loss_scale", "grad_norm", "tokens_per_s", "step_time_s",
             "bytes_sent", "skipped")
SUMMARY_KEYS = ("summary", "params", "params_padded", "world_size", "stage", "precision", "grad_accum",
                "ranks_per_node", "memory", "traffic", "train_loss", "eval_loss",
                "unigram_entropy", "tokens_per_s", "activation_peak_bytes")


class MetricsWriter:
    """Appends records to a fresh JSONL file; use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        self._fh = open(path, "w")

    def step(self, **record):
        """One step record: ``STEP_KEYS`` (extra keys are kept)."""
        self._write(record)

    def summary(self, record: dict):
        """The closing record; ``"summary": true`` is added first."""
        self._write({"summary": True, **{k: v for k, v in record.items() if k != "summary"}})

    def _write(self, record: dict):
        # flushed per line: `tail -f` and a crash both see every step written so far (issue 51, item 4)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self):
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str) -> tuple:
    """(step records in file order, the summary record or None) of a metrics
    file. Raises ValueError naming the line of anything that is not JSON, or
    if there is no step record."""
    steps, summ = [], None
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
            if d.get("summary"):
                summ = d
            elif "step" in d and "loss" in d:
                steps.append(d)
    if not steps:
        raise ValueError(f"{path}: no step lines with 'step' and 'loss'")
    return steps, summ
