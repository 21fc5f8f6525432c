"""``python -m ringzero.evaluate CKPT_OR_HF_DIR --data FILE --seq-len T``: a model's loss on a token file.

What it is
    The first number a user asks for after a fine-tune. FILE's tokens
    (interop/token_files.py: llm.c's header with uint16 or uint32 ids, or
    nanoGPT's bare uint16) are cut from the start into consecutive,
    non-overlapping windows of T tokens; a partial last window is dropped and
    ``--batches N`` keeps the first N x ``--batch`` windows. Each window is
    scored as transformers scores ``model(input_ids=w, labels=w)``: tokens
    1..T-1 predicted from their prefix, so a window of T tokens gives T-1
    predictions::

        loss       = sum over windows of (T-1) x mean CE of the window / (windows x (T-1))
        perplexity = exp(loss)
        tokens     = windows x (T-1)   (the predictions scored)

    The model is a ringzero checkpoint (any rank count and stage it was saved
    at; ``--weights master`` the fp32 master, the default, or ``params`` the
    run's storage dtype) or a Hugging Face folder (config.json + safetensors),
    read whole into one process (tools/sample.py's loaders). Under mpirun each
    rank scores windows rank, rank + N, ... and the sums meet in one
    Allreduce: the same windows at any world size (the float64 sum's order
    aside). ``--json OUT`` writes {"loss", "perplexity", "tokens", "windows"}
    from rank 0, beside itself and renamed.

What it is not
    No sharded evaluation (each rank holds the whole model: 4 B x Ψ), no
    sliding window with a stride (transformers' perplexity guide's other
    recipe), no text input (encode it first: ``python -m ringzero.data encode``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys

import numpy as np


class EvalError(ValueError):
    """Bad input to the evaluator: one line, exit 2."""


def windows(ids: np.ndarray, T: int, limit: int | None = None) -> int:
    """How many whole windows of T tokens ids holds, capped at limit."""
    n = ids.size // T
    return n if limit is None else min(n, limit)


def score(model, P, ids: np.ndarray, T: int, n_win: int, batch: int, rank: int = 0, size: int = 1) -> float:
    """Sum over this rank's windows (w = rank, rank + size, ... < n_win) of (T-1) x the window's mean
    next-token loss, in float64. Windows go through the model ``batch`` at a time: x (b, T-1), y (b, T-1)."""
    from ringzero.comm.backend import to_host
    mine = np.arange(rank, n_win, size)
    total = 0.0
    for a in range(0, mine.size, batch):
        w = mine[a:a + batch]
        blk = np.stack([np.asarray(ids[i * T:(i + 1) * T], np.int64) for i in w])     # (b, T)
        x, y = blk[:, :-1], blk[:, 1:]                                                # (b, T-1) each
        model.check_tokens(x, y)
        loss = float(to_host(model.loss(P, x, y)))        # the mean over b x (T-1) predictions
        total += loss * w.size * (T - 1)
    return total


def _world():
    """(comm or None, rank, size): MPI only under a launcher, so that one process needs none."""
    if not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")):
        return None, 0, 1
    from mpi4py import MPI
    return MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def write_json(path: str, result: dict):
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_parser():
    ap = argparse.ArgumentParser(
        prog="python -m ringzero.evaluate",
        description="Mean next-token loss and perplexity of a ringzero checkpoint or a Hugging Face folder over "
                    "a token file, cut into consecutive windows of --seq-len tokens (as transformers with "
                    "labels = input_ids). One process, or under mpirun.",
        epilog="Example: python -m ringzero.evaluate ck --data val.bin --seq-len 128 --batches 50 --json eval.json")
    ap.add_argument("model", metavar="CKPT_OR_HF_DIR",
                    help="a step-NNNNNN checkpoint, a save directory (its latest) or a Hugging Face folder")
    ap.add_argument("--data", required=True, help="a token file (data encode's .bin, or nanoGPT's uint16)")
    ap.add_argument("--seq-len", type=int, required=True, help="T: tokens per window (T-1 predictions each)")
    ap.add_argument("--batches", type=int, default=None, help="score at most this many batches (default: all)")
    ap.add_argument("--batch", type=int, default=4, help="windows per forward (default 4); no effect on the result")
    ap.add_argument("--weights", choices=("master", "params"), default="master",
                    help="a ringzero checkpoint's fp32 master (default) or the run's storage-dtype params")
    ap.add_argument("--json", default=None, metavar="OUT", help='also write {"loss", "perplexity", "tokens", '
                                                                '"windows"} to OUT')
    return ap


def check_args(a, context: int, vocab: int, ids: np.ndarray):
    """Every check that needs the model and the data. Raises EvalError."""
    if a.seq_len < 2:
        raise EvalError(f"--seq-len must be >= 2 (a window of T tokens scores T-1), got {a.seq_len}")
    if a.seq_len > context:
        raise EvalError(f"--seq-len must be <= the model's context: expected <= {context}, got {a.seq_len}")
    if ids.size < a.seq_len:
        raise EvalError(f"--data {a.data!r} holds {ids.size:,} tokens: expected at least one window of "
                        f"--seq-len {a.seq_len}")
    top = max((int(ids[i:i + (1 << 22)].max()) for i in range(0, ids.size, 1 << 22)), default=0)
    if top >= vocab:
        raise EvalError(f"--data {a.data!r} holds token {top}: expected ids < the model's vocabulary {vocab:,} "
                        f"(HINT: encode with the model's own tokenizer.json)")


def load(a):
    """(model, P, what, context, vocab) of the CKPT_OR_HF_DIR argument, and the data's ids."""
    from ringzero.interop.token_files import TokenFileError, open_tokens
    from ringzero.runtime import checkpoint as ck
    from ringzero.tools.sample import SampleError, load_any
    if a.batch < 1 or (a.batches is not None and a.batches < 1):
        raise EvalError(f"--batch and --batches must be >= 1, got --batch {a.batch}, --batches {a.batches}")
    if not os.path.exists(a.model):
        raise EvalError(f"{a.model!r} does not exist: expected a checkpoint directory (step-NNNNNN), a save "
                        f"directory or a Hugging Face folder")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        raise EvalError(f"--json {a.json!r}: folder {os.path.dirname(os.path.abspath(a.json))!r} does not exist")
    try:
        ids = open_tokens(a.data)
    except TokenFileError as e:
        raise EvalError(f"--data: {e}") from None
    try:
        model, P, _, path, what = load_any(a.model, a.weights)
    except (SampleError, ck.CheckpointError, OSError) as e:
        raise EvalError(ck.error_line(e)) from None
    c = model.cfg
    check_args(a, c.block_size, model.n_tokens, ids)
    return model, P, f"{path}: {type(model).__name__} {c.n_layer}L {c.n_embd}C, {what}", ids


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    comm, rank, size = _world()
    try:
        model, P, what, ids = load(a)
    except EvalError as e:
        if rank == 0:          # every rank checked the same inputs: one line, from rank 0
            print(f"ringzero.evaluate: error: {e}", file=sys.stderr)
        return 2
    T = a.seq_len
    n_win = windows(ids, T, None if a.batches is None else a.batches * a.batch)
    part = np.array([score(model, P, ids, T, n_win, a.batch, rank, size)], np.float64)
    if comm is not None:
        from mpi4py import MPI
        total = np.zeros(1, np.float64)
        comm.Allreduce(part, total, op=MPI.SUM)
    else:
        total = part
    tokens = n_win * (T - 1)
    loss = float(total[0]) / tokens
    result = {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "windows": n_win}
    if rank == 0:
        print(f"ringzero.evaluate: {what}", file=sys.stderr)
        print(f"loss {loss:.6f}  perplexity {result['perplexity']:.4f}  ({n_win:,} windows of {T} tokens: "
              f"{tokens:,} predictions, {a.data}{f', {size} ranks' if size > 1 else ''})")
        if a.json:
            write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
