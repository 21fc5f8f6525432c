"""The main job: ``mpirun -n 8 python -m mpi4py -m ringzero.train`` trains a GPT.

What it is
    A byte-level GPT trained on the standard library's source (or ``--data``)
    by the sharding runtime at any ZeRO stage, with a tqdm bar, held-out
    evaluation, the memory and traffic accounting of the running stage, a
    JSONL metrics file (ringzero/metrics.py) and a text sample at the end.
    Only rank 0 prints. ``run`` reads as its four parts (the reports are reports.py)::

        start_report   model, data, Ψ, and model state per rank: measured vs formula
        train_loop     the steps: lr schedule, engine.step, metrics, checkpoints, evals
        end_report     held-out loss vs the unigram entropy, throughput, traffic
        summarize      the closing metrics record

What it is not
    The runtime (runtime/) or the model (nn/gpt.py): this file wires data,
    schedule, logging and reports around them. The settings, their flags and
    their checks are config.py's; the checks one rank alone can make are
    startup.py's, and the ends after a failure exits.py's.

Bad flags or config values exit with one line and code 2 on every rank,
before any communication and before any file is written; bad input only a
rank can see is agreed first (exits.py). SIGTERM, SIGINT and SIGUSR1 stop the
run at the next step boundary, after a checkpoint (preempt.py).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from ringzero.app.config import (  # noqa: F401
    Config,
    ConfigError,
    build_parser,
    lr_at,
    model_config,
    parse_config,
    validate,
)
from ringzero.app.exits import agree, fail, leave, newest_note, out_of_memory, under_mpi
from ringzero.app.policies import offload_policy, zeropp_policy
from ringzero.app.reports import end_report, start_report, summarize
from ringzero.app.startup import check_rank, make_offload_dir, open_metrics
from ringzero.metrics import read_metrics  # noqa: F401  (its old home; tools import ringzero.metrics)
from ringzero.sizes import parse_size


# ---------------------------------------------------------------------- run
def prepare(cfg: Config, n: int, rank: int | None = None):
    """Every input check that needs the data or the sizes; no MPI. Raises ConfigError.
    Returns (corpus, model, budget, source): source is the --init-from checkpoint
    (interop/hf_import.py), opened and checked (rank: this rank's share of its head check), or None."""
    from ringzero.app.data import load_corpus
    from ringzero.nn import families
    from ringzero.nn.gpt import vocab_for
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.zero import MemoryBudgetError, check_budget
    if cfg.device == "cuda":           # before mpirun: not N ranks failing alike later
        from ringzero.comm.backend import cupy_missing_reason, cupy_or_none
        if cupy_or_none() is None:
            raise ConfigError(f"--device cuda: expected CuPy with a visible GPU, got {cupy_missing_reason()}; "
                              "HINT: pip install cupy-cuda12x on the GPU machine, or use --device cpu")
    src = None
    try:
        if cfg.init_from:       # the shapes and the vocabulary are the imported model's
            from ringzero.interop.hf_import import for_training
            src, gcfg = for_training(cfg, n, rank)
            # ids < vocab_size; --steps 0 (a conversion) needs no data, but checks any it is given
            corpus = load_corpus(cfg.data, cfg.seq_len, vocab=gcfg.n_tokens) if cfg.data or cfg.steps else None
        else:
            corpus = load_corpus(cfg.data or None, cfg.seq_len)
            # the vocabulary from the data: 256 for bytes, else the largest id + 1 rounded up to 64
            gcfg = model_config(cfg, vocab_for(corpus.vocab - 1, byte_level=corpus.byte_level))
    except (ValueError, OSError) as e:      # HFConfigError is a ValueError
        if src is not None:
            src.close()
        raise ConfigError(str(e)) from None
    model = families.build(gcfg, checkpoint=cfg.activation_checkpointing)     # a GPT or a Llama
    model.hf_config = src.hf if src is not None else None      # an export's config.json starts from it
    hybrid = StagePolicy.of(cfg.stage).hybrid
    if hybrid and cfg.ranks_per_node and n % cfg.ranks_per_node:
        raise ConfigError(f"--ranks-per-node must divide the rank count: {n} % {cfg.ranks_per_node} != 0")
    budget = parse_size(cfg.mem_budget) if cfg.mem_budget else None
    group = (cfg.ranks_per_node or None) if hybrid else n    # ranks sharing one copy
    if budget is not None and group is not None:      # else the engine checks once it knows the node
        try:
            off = offload_policy(cfg)
            check_budget(Layout(model.units, shards=group), cfg.stage, n, budget, group if hybrid else None,
                         cfg.precision, cfg.grad_accum, off.tiers, cfg.device, off.where)
        except MemoryBudgetError as e:
            raise ConfigError(f"--mem-budget {cfg.mem_budget}: {e}") from None
    return corpus, model, budget, src


@dataclass
class LoopResult:
    times: list = field(default_factory=list)      # seconds per step (the slowest rank's)
    losses: list = field(default_factory=list)     # global mean training loss per step
    wall: float = 0.0                               # seconds for the whole loop


def emulated_nodes(n: int):
    """RINGZERO_EMULATE_NODES=N: N emulated nodes of n/N consecutive ranks each (a node label per rank), as
    tests pass ``nodes=`` to the engine; unset: the nodes MPI finds. N must divide n (ConfigError)."""
    v = os.environ.get("RINGZERO_EMULATE_NODES", "")
    if not v:
        return None
    if not v.isdigit() or int(v) < 1 or n % int(v):
        raise ConfigError(f"RINGZERO_EMULATE_NODES: expected a node count that divides the {n} ranks, got {v!r}")
    return [r // (n // int(v)) for r in range(n)]


def saves_on_stop(cfg: Config) -> bool:
    """Whether a stop signal saves a checkpoint: when the run uses checkpoints
    (--save-every > 0 or --resume) or names a --save-dir other than the default."""
    return bool(cfg.save_every or cfg.resume or cfg.save_dir != Config.save_dir)


def train_loop(cfg: Config, comm, engine, train, evaluate, writer, say, stop=None, tw=None) -> LoopResult:
    """Steps from the resume point (or 0) to cfg.steps: one engine.step each,
    a metrics record, a checkpoint every cfg.save_every, a held-out eval every
    cfg.eval_interval (the final one is the end report's).

    ``stop`` (a preempt.StopRequest) is read before every step; the engine
    shares it with the step's scalars, and once any rank has a signal every
    rank saves (saves_on_stop) and raises preempt.Stopped after the same step.
    ``tw``: the --trace window (tracing.py), or None.
    """
    from ringzero.app.preempt import Stopped
    from ringzero.app.preempt import name as signame
    rank, n, xp = comm.rank, comm.size, engine.xp
    bar = None
    if rank == 0 and not cfg.quiet:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    note = bar.write if bar else say      # one line, above the bar when there is one
    tokens_per_step = cfg.batch * cfg.seq_len * n
    out, start = LoopResult(), 0
    if cfg.resume:
        from ringzero.runtime import checkpoint as ck
        try:
            man = ck.load(engine, cfg.resume, save_dir=cfg.save_dir)
        except ck.CheckpointError as e:
            raise ConfigError(str(e)) from None
        start = int(man["step"])
        say(f"ringzero | resumed from {man['path']} at step {start}")
        for line in man.get("notes", ()):
            say(f"ringzero | note: {line}")
        if bar:
            bar.update(start)
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        x, y = tw.load(train, step) if tw else train.get(step)
        engine.model.check_tokens(x, y)          # on the host, where they start (no device reductions)
        lr = lr_at(cfg, step)
        engine.stop_request = stop.signum if stop is not None else 0
        engine.topology.barrier()   # step time is the slowest rank's (watched for stalls)
        t0 = time.perf_counter()
        res = engine.step(xp.asarray(x), xp.asarray(y), lr)
        dt = time.perf_counter() - t0
        if tw:
            tw.stepped(step, t0, dt)
        out.times.append(dt)
        out.losses.append(res.loss)
        tps = tokens_per_step / dt
        if res.skipped:
            note(f"ringzero | step {step}: overflow in the {cfg.precision} gradients; step skipped on every rank, "
                 f"loss scale {res.loss_scale:g} -> {engine.scaler.scale:g}")
        ev = {}                 # the periodic held-out loss, in this step's record (plot loss draws it)
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and step + 1 < cfg.steps:
            with tw.span("evaluation", "eval") if tw else nullcontext():
                ev["eval_loss"] = evaluate()
            note(f"step {step + 1}: held-out loss {ev['eval_loss']:.4f}")
        if writer:
            writer.step(step=step, loss=res.loss, lr=lr, loss_scale=res.loss_scale, **ev,
                        grad_norm=res.grad_norm, tokens_per_s=tps, step_time_s=dt,
                        bytes_sent=int(sum(engine.last_step_ledger.values())),
                        bytes_sent_internode=int(sum(engine.last_step_internode.values())), skipped=res.skipped,
                        **{k: round(v, 6) for k, v in engine.timeline.items()})   # compute, reduction, hidden
        if bar:
            bar.set_postfix_str(f"loss {res.loss:.3f} | {tps:,.0f} tok/s | scale {res.loss_scale:g}")
            bar.update(1)
        saved = None
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            with tw.span("checkpoint save", "checkpoint") if tw else nullcontext():
                saved = _save(cfg, engine, step + 1)
            note(f"step {step + 1}: saved {saved}")
        if res.stop:            # every rank read the same max: all stop here
            if bar:
                bar.close()
                bar = None
            if saved is None and saves_on_stop(cfg):
                saved = _save(cfg, engine, step + 1)
            code = 128 + res.stop
            what = (f"saved {saved}" if saved else
                    "no checkpoint (no save directory: give --save-dir or --save-every)")
            say(f"ringzero | {signame(res.stop)} at step {step + 1}: {what}; exiting {code}")
            raise Stopped(res.stop, step + 1, saved)
    if bar:
        bar.close()
    out.wall = time.perf_counter() - t_start
    return out


def _save(cfg: Config, engine, step: int) -> str:
    """The one checkpoint call (periodic and on a stop signal). Collective."""
    from ringzero.runtime import checkpoint as ck
    return ck.save(engine, cfg.save_dir, step,
                   config={**dataclasses.asdict(cfg), **_model_record(engine.model.cfg),
                           "hf": getattr(engine.model, "hf_config", None)},
                   data_state={"step": step, "seed": cfg.seed}, keep=cfg.keep or None)


def _model_record(mcfg) -> dict:
    """The manifest's model config: "model_config" (the family recorded, nn/families.py) for every
    family, and "gpt" (the GPT's fields, which older readers take) for a GPT."""
    from ringzero.nn import families
    rec = {"model_config": families.to_dict(mcfg)}
    if families.family_of(mcfg) == families.GPT2:
        rec["gpt"] = dataclasses.asdict(mcfg)
    return rec


def run(cfg: Config, comm, stop=None) -> dict:
    """Train; returns the summary dict (every rank). Raises ConfigError (bad
    input, agreed by every rank), CheckpointError (a save failed, on every
    rank) or preempt.Stopped (a stop signal, saved)."""
    from ringzero.app import memcheck
    from ringzero.app.data import Batches, unigram_entropy
    from ringzero.runtime.optim import AdamConfig
    from ringzero.runtime.zero import Zero

    rank, n = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    # what only this rank can find out (its copy of the data, its device),
    # agreed before the engine's first collective
    corpus, model, budget, src = agree(comm, lambda: _rank_checks(cfg, rank, n))
    # looked at before the memory check's all-gather, so before any rank of this node can make it
    make_dir = bool(cfg.offload and cfg.offload_dir) and not os.path.exists(cfg.offload_dir)
    # will it fit? model state + workspace + activations against the memory there is (memcheck.py)
    agree(comm, lambda: memcheck.check(cfg, model, comm))
    agree(comm, lambda: make_offload_dir(cfg))            # mkdir -p --offload-dir, on every node
    if make_dir:
        say(f"ringzero | made --offload-dir {cfg.offload_dir}")
    # --init-from: each rank reads its own master pieces from the file (a resumed run reads the checkpoint)
    init = src.fill_master if src is not None and not cfg.resume else None
    from ringzero.runtime.offload import OffloadError, OffloadFailed
    from ringzero.runtime.zeropp import ZeroPPError
    try:     # a DIR with too little room for this node's ranks is refused here, on every rank alike
        engine = Zero(model, comm, cfg.stage, precision=cfg.precision, device=cfg.device, seed=cfg.seed, init=init,
                      adam=AdamConfig(weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip),
                      ranks_per_node=cfg.ranks_per_node or None, mem_budget=budget, grad_accum=cfg.grad_accum,
                      overlap=cfg.overlap, prefetch=cfg.prefetch, offload=offload_policy(cfg),
                      zeropp=zeropp_policy(cfg), nodes=emulated_nodes(n),
                      reduce_bucket=None if cfg.reduce_bucket_mb is None else int(cfg.reduce_bucket_mb * 2 ** 20))
    except OffloadFailed:               # the params cast failed in use (not bad input): exit 4, every rank
        raise
    except (OffloadError, ZeroPPError) as e:    # also ZeRO++ on a node map it cannot run: every rank alike
        raise ConfigError(str(e)) from None
    if src is not None:
        src.close()
    if init is not None:
        agree(comm, lambda: _raise(src.error))    # a read that failed on any rank stops every rank
        say(f"ringzero | initialized from {src.path}: {src.hf.get('model_type', 'gpt2')} {model.cfg.n_layer}L "
            f"{model.cfg.n_embd}C, vocab "
            f"{model.cfg.n_tokens} (padded to {model.cfg.vocab}), each rank read its own pieces")
    if cfg.steps == 0:                  # a conversion: the imported weights as a checkpoint, no step taken
        saved = _save(cfg, engine, 0)
        say(f"ringzero | --steps 0: saved the imported weights (Ψ = {engine.layout.numel:,}) to {saved}, "
            f"no step taken")
        return {"steps": 0, "saved": saved, "psi": engine.layout.numel}
    xp = engine.xp
    train = Batches(corpus.train, cfg.batch, cfg.seq_len, rank, n, cfg.seed)
    held = Batches(corpus.val, cfg.batch, cfg.seq_len, rank, n, cfg.seed + 1)
    H = unigram_entropy(corpus.val, corpus.vocab)

    def evaluate():
        tot = 0.0
        for k in range(cfg.eval_batches):
            x, y = held.get(k)
            model.check_tokens(x, y)      # on the host: the device path does not check ids
            tot += engine.eval_loss(xp.asarray(x), xp.asarray(y))
        return tot / cfg.eval_batches

    mem = start_report(say, cfg, corpus, engine, H)
    # the metrics file is opened only now, after every check passed
    writer = agree(comm, lambda: open_metrics(cfg, rank))
    from ringzero.app.tracing import TraceWindow
    tw = agree(comm, lambda: TraceWindow.open(cfg, comm, engine))     # --trace DIR: made on every rank
    try:
        loop = train_loop(cfg, comm, engine, train, evaluate, writer, say, stop, tw)
        if tw:
            tw.close()
        end = end_report(say, cfg, engine, loop, evaluate(), H)
        sample = _sample(engine, model, corpus, cfg) if cfg.sample_chars else ""
        if sample:
            say("sample ----------------------------------------------------------")
            say(sample)
            say("-----------------------------------------------------------------")
        summary = summarize(cfg, engine, mem, end, H)
        if writer:
            writer.summary(summary)
    finally:
        if writer:
            writer.close()
    return summary


def _rank_checks(cfg: Config, rank: int, n: int):
    """prepare() plus the device check (startup.py), on one rank. Raises ConfigError."""
    check_rank(cfg, rank)
    return prepare(cfg, n, rank)


def _sample(engine, model, corpus, cfg) -> str:
    """Generate from the trained weights on rank 0 (all ranks join the gather), with
    the decoding loop of ``python -m ringzero.sample`` (tools/sample.py)."""
    from ringzero.tools.sample import generate
    full = engine.full_params(root=0)             # one full copy, on rank 0 (shard rank 0 is world rank 0)
    if engine.comm.rank != 0:
        return ""
    prompt = corpus.encode("def ") if corpus.byte_level else np.zeros(1, np.int64)
    out = generate(model, engine.layout.views(full), prompt, cfg.sample_chars, 0.8, None,
                   np.random.default_rng(cfg.seed))
    return corpus.decode(out)


def main(argv=None) -> int:
    """The command line. Exit codes (exits.py): 0 done, 2 bad input, 3 a
    failed save, 4 out of memory on a rank or the offload tier failed mid-run, 128+N stopped by signal N
    after saving (preempt.py)."""
    from ringzero.app.preempt import Stopped, StopRequest
    from ringzero.runtime.checkpoint import CheckpointError
    from ringzero.runtime.offload import OffloadError
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, check, err = None, None, None
    try:
        cfg, check = parse_config(argv)
        if check is not None:          # validate only, no MPI
            src = prepare(cfg, check)[3]
            if src is not None:
                src.close()
            return 0
    except ConfigError as e:
        err = str(e)
    if err and not under_mpi():       # serial: nobody to agree with
        fail(err)
        return 2
    from mpi4py import MPI

    from ringzero.comm.threads import set_blas_threads
    comm = MPI.COMM_WORLD
    set_blas_threads(comm)             # this rank's share of the node's cores, before any matmul
    try:
        # a flag this rank alone rejects (a --data path one node lacks) must
        # stop the others too, before any of them waits in a collective
        agree(comm, lambda: _raise(err))
        with StopRequest(announce=comm.rank == 0) as stop:
            run(cfg, comm, stop)
    except ConfigError as e:           # agreed: every rank is here with the same line
        return leave(comm, 2, f"ringzero.train: error: {e}")
    except CheckpointError as e:       # a save failed on some rank: raised on every rank
        return leave(comm, 3, f"ringzero.train: error: {e}{newest_note(cfg)}")
    except OffloadError as e:          # the disk tier failed mid-run (a full disk): agreed by every rank
        return leave(comm, 4, f"ringzero.train: error (rank {comm.rank}): {e}{newest_note(cfg)}", every_rank=True)
    except Stopped as e:               # the loop printed its line; every rank stopped at e.step
        return leave(comm, e.code, None)
    except MemoryError as e:           # this rank alone, maybe inside a collective: its line, then out
        return out_of_memory(comm, e)
    return 0


def _raise(err):
    if err:
        raise ConfigError(err)


if __name__ == "__main__":
    sys.exit(main())
