"""The main job: ``mpirun -n 8 python -m mpi4py -m ringzero.train`` trains a GPT.

What it is
    A byte-level GPT trained on the standard library's source (or ``--data``)
    by the sharding runtime at any ZeRO stage, with a tqdm bar, held-out
    evaluation, the memory and traffic accounting of the running stage, a
    JSONL metrics file and a text sample at the end. Only rank 0 prints.

What it is not
    The runtime (zero.py) or the model (nn/gpt.py): this file wires data,
    schedule, logging and reports around them. Flags are generated from the
    ``Config`` dataclass below; ``--config file.toml`` sets any of them and
    flags given on the command line win.

Bad flags or config values exit with one line and code 2 on every rank,
before any communication and before any file is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, fields

import numpy as np


@dataclass
class Config:
    # ---- model (GPT-2 style, byte-level)
    n_layer: int = 4                 # transformer blocks
    n_head: int = 4                  # attention heads
    n_embd: int = 128                # width; Ψ ≈ 12·n_layer·n_embd² + vocab·n_embd
    seq_len: int = 128               # tokens per sequence (also the position table size)
    # ---- data
    data: str = ""                   # text file or nanoGPT uint16 .bin; "" = stdlib source corpus
    batch: int = 8                   # sequences per rank per step (global batch = batch * ranks)
    seed: int = 1337                 # weights, batches and sampling all derive from it
    # ---- schedule
    steps: int = 400                 # optimizer steps
    lr: float = 4e-3                 # peak learning rate
    min_lr_frac: float = 0.1         # cosine decays to lr * min_lr_frac
    warmup: int = 40                 # linear warm-up steps
    weight_decay: float = 0.1        # AdamW, not on biases and norms
    grad_clip: float = 1.0           # global-norm clipping (0 = off)
    # ---- runtime
    stage: str = "2"                 # 0|1|2|3|hybrid, or NO_SHARD|SHARD_GRAD_OP|FULL_SHARD|HYBRID_SHARD
    ranks_per_node: int = 0          # hybrid: ranks per "node" (0 = the MPI shared-memory node)
    device: str = "cpu"              # cpu | cuda
    precision: str = "fp16"          # fp16 (fp16 storage, loss scaling) | fp32
    activation_checkpointing: bool = False   # keep block inputs only; recompute in backward
    mem_budget: str = ""             # per-rank model-state budget, e.g. 512MiB ("" = none)
    # ---- reporting
    eval_interval: int = 100         # steps between held-out evaluations (0 = only at the end)
    eval_batches: int = 4            # batches per evaluation, per rank
    metrics: str = ""                # write one JSON object per step here (JSONL)
    sample_chars: int = 200          # length of the text sample at the end (0 = none)
    # ---- checkpoints (ringzero.runtime.checkpoint)
    save_every: int = 0              # save every N steps into --save-dir (0 = never)
    save_dir: str = "checkpoints"    # one sub-directory per saved step: step-000010, ...
    keep: int = 0                    # keep only the newest K checkpoints (0 = all)
    resume: str = ""                 # a step-NNNNNN directory, or "latest" in --save-dir
    quiet: bool = False              # no progress bar


STAGE_HELP = "0|1|2|3|hybrid or NO_SHARD|SHARD_GRAD_OP|FULL_SHARD|HYBRID_SHARD"


class ConfigError(ValueError):
    """A bad flag or config value: reported in one line, exit code 2."""


def _comments() -> dict:
    """Field -> its trailing comment in the dataclass source (the --help text)."""
    import inspect
    out = {}
    for line in inspect.getsource(Config).splitlines():
        s = line.strip()
        if ":" in s and "#" in s and not s.startswith("#"):
            name = s.split(":", 1)[0].strip()
            out[name] = s.split("#", 1)[1].strip()
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, not usage + error
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m ringzero.train",
        description="Train a byte-level GPT with ZeRO sharding over MPI. Launch under mpirun, "
                    "e.g. `mpirun -n 8 python -m mpi4py -m ringzero.train --stage 3` "
                    "(./launch/train does this).")
    p.add_argument("--config", metavar="FILE.toml", help="read any of the settings below from a TOML file")
    p.add_argument("--check", type=int, metavar="N", default=None,
                   help="only validate flags, config and data for a run on N ranks, without MPI; "
                        "exit 2 with one line on a problem (launch/train does this first)")
    helps = _comments()
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        # default=None marks "not given", so TOML values are only overridden by real flags
        text = f"{helps.get(f.name, '')} (default: {f.default!r})".replace("%", "%%")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, default=None, metavar=f.name.upper(), help=text)
    return p


def _coerce(name, typ, value):
    kind = {"int": int, "float": float, "str": str, "bool": bool}[typ if isinstance(typ, str) else typ.__name__]
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number' if kind is float else 'a string'}, "
                          f"got {value!r}") from None


def parse_config(argv=None):
    """Flags over TOML over defaults; validated. Returns (cfg, check_world). Raises ConfigError."""
    ns = build_parser().parse_args(argv)
    values = {}
    if ns.config:
        try:
            import tomllib
        except ModuleNotFoundError:      # Python < 3.11
            import tomli as tomllib
        try:
            with open(ns.config, "rb") as fh:
                toml = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"--config file {ns.config!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config file {ns.config!r} is not valid TOML: {e}") from None
        known = {f.name for f in fields(Config)}
        for k, v in toml.items():
            key = k.replace("-", "_")
            if key not in known:
                raise ConfigError(f"--config file {ns.config!r}: unknown setting {k!r}")
            values[key] = v
    for f in fields(Config):
        v = getattr(ns, f.name)
        if v is not None:
            values[f.name] = v
    kw = {}
    for f in fields(Config):
        if f.name in values:
            kw[f.name] = _coerce("--" + f.name.replace("_", "-"), f.type, values[f.name])
    cfg = Config(**kw)
    validate(cfg)
    if ns.check is not None and ns.check < 1:
        raise ConfigError(f"--check takes a rank count >= 1, got {ns.check}")
    return cfg, ns.check


def validate(cfg: Config):
    from ringzero.runtime import accounting
    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)
    for k in ("n_layer", "n_head", "n_embd", "seq_len", "batch", "steps"):
        need(getattr(cfg, k) >= 1, f"--{k.replace('_', '-')} must be >= 1, got {getattr(cfg, k)}")
    need(cfg.n_embd % cfg.n_head == 0,
         f"--n-embd must be divisible by --n-head: got {cfg.n_embd} % {cfg.n_head} = {cfg.n_embd % cfg.n_head}")
    need(cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}")
    need(0 <= cfg.min_lr_frac <= 1, f"--min-lr-frac must be in [0, 1], got {cfg.min_lr_frac}")
    need(cfg.warmup >= 0 and cfg.eval_interval >= 0 and cfg.eval_batches >= 1 and cfg.sample_chars >= 0,
         "--warmup, --eval-interval and --sample-chars must be >= 0 and --eval-batches >= 1")
    need(cfg.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {cfg.device!r}")
    need(cfg.precision in ("fp16", "fp32"), f"--precision must be fp16 or fp32, got {cfg.precision!r}")
    try:
        cfg.stage = accounting.parse_stage(cfg.stage)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--stage: {e}") from None
    if cfg.mem_budget:
        try:
            accounting.parse_bytes(cfg.mem_budget)
        except ValueError as e:
            raise ConfigError(f"--mem-budget: {e}") from None
    if cfg.data:
        need(os.path.isfile(cfg.data), f"--data file {cfg.data!r} does not exist")
    need(cfg.save_every >= 0 and cfg.keep >= 0, "--save-every and --keep must be >= 0")
    if cfg.resume and cfg.resume != "latest":
        need(os.path.isfile(os.path.join(cfg.resume, "manifest.json")),
             f"--resume {cfg.resume!r} is not a checkpoint directory (no manifest.json)")
    if cfg.resume == "latest":
        from ringzero.runtime.checkpoint import latest
        need(latest(cfg.save_dir) is not None, f"--resume latest: no complete checkpoint in --save-dir {cfg.save_dir!r}")


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_frac."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _mib(b) -> str:
    return f"{b / 2**20:9.2f} MiB"


# ---------------------------------------------------------------------- run
def prepare(cfg: Config, n: int):
    """Every input check that needs the data or the sizes; no MPI. Raises ConfigError."""
    from ringzero.runtime import accounting
    from ringzero.app.data import load_corpus
    from ringzero.runtime.flat import Layout
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import MemoryBudgetError, check_budget
    if cfg.device == "cuda":           # before mpirun: not N ranks failing alike later
        from ringzero.comm.backend import cupy_missing_reason, cupy_or_none
        if cupy_or_none() is None:
            raise ConfigError(f"--device cuda: expected CuPy with a visible GPU, got {cupy_missing_reason()}; "
                              "HINT: pip install cupy-cuda12x on the GPU machine, or use --device cpu")
    try:
        corpus = load_corpus(cfg.data or None, cfg.seq_len)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    gcfg = GPTConfig(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len, corpus.vocab)
    model = GPT(gcfg, checkpoint=cfg.activation_checkpointing)
    if cfg.stage == "hybrid" and cfg.ranks_per_node and n % cfg.ranks_per_node:
        raise ConfigError(f"--ranks-per-node must divide the rank count: {n} % {cfg.ranks_per_node} != 0")
    budget = accounting.parse_bytes(cfg.mem_budget) if cfg.mem_budget else None
    group = n if cfg.stage != "hybrid" else (cfg.ranks_per_node or None)
    if budget is not None and group is not None:      # else the engine checks once it knows the node
        try:
            check_budget(Layout(model.units, nd=group), cfg.stage, n, budget,
                         group if cfg.stage == "hybrid" else None)
        except MemoryBudgetError as e:
            raise ConfigError(f"--mem-budget {cfg.mem_budget}: {e}") from None
    return corpus, model, budget


def run(cfg: Config, comm) -> dict:
    """Train; returns the summary dict (every rank)."""
    from ringzero.runtime import accounting
    from ringzero.app.data import Batches, unigram_entropy
    from ringzero.runtime.zero import Zero

    rank, n = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    corpus, model, budget = prepare(cfg, n)

    engine = Zero(model, comm, cfg.stage, precision=cfg.precision, device=cfg.device, seed=cfg.seed,
                  adam=_adam(cfg), ranks_per_node=cfg.ranks_per_node or None, mem_budget=budget)
    xp = engine.xp
    train = Batches(corpus.train, cfg.batch, cfg.seq_len, rank, n, cfg.seed)
    held = Batches(corpus.val, cfg.batch, cfg.seq_len, rank, n, cfg.seed + 1)
    H = unigram_entropy(corpus.val, corpus.vocab)
    L = engine.layout

    # ---- start report
    mem = engine.memory_report()
    say(f"ringzero | {corpus.describe()}")
    say(f"ringzero | GPT {cfg.n_layer}L {cfg.n_head}H {cfg.n_embd}C T={cfg.seq_len}, Ψ = {L.numel:,} "
        f"(padded {L.padded:,}), Nd = {n}, stage {cfg.stage} "
        f"({accounting.bytes_per_param_formula(cfg.stage)}), {cfg.precision}, {cfg.device}")
    say(f"ringzero | held-out unigram entropy {H:.3f} nats (target: final eval loss <= {0.6 * H:.3f})")
    say("model state per rank       measured       formula")
    for c, d in mem["classes"].items():
        say(f"  {c:<18} {_mib(d['measured_bytes'])} {_mib(d['formula_bytes'])}")
    say(f"  {'total':<18} {_mib(mem['model_state_measured'])} {_mib(mem['model_state_formula'])}")
    say("  workspace (not model state): " + ", ".join(f"{k} {_mib(v).strip()}" for k, v in mem["workspace"].items()))
    others = []
    for st in accounting.STAGES:
        if st == "hybrid" and cfg.stage != "hybrid":
            continue
        rpn = engine.nd if st == "hybrid" else None
        others.append(f"{st}: {accounting.model_state_total(st, L.padded, n, rpn) / 2**20:.2f} MiB")
    say("  every stage at this Nd: " + " | ".join(others))

    # ---- metrics file: opened only now, after every check passed
    mfile = open(cfg.metrics, "w") if (cfg.metrics and rank == 0) else None

    def evaluate():
        tot = 0.0
        for k in range(cfg.eval_batches):
            x, y = held.get(k)
            model.check_tokens(x, y)      # on the host: the device path does not check ids
            tot += engine.eval_loss(xp.asarray(x), xp.asarray(y))
        return tot / cfg.eval_batches

    bar = None
    if rank == 0 and not cfg.quiet:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    note = bar.write if bar else say      # one line, above the bar when there is one
    tokens_per_step = cfg.batch * cfg.seq_len * n
    eval_loss, times, losses = float("nan"), [], []
    start = 0
    if cfg.resume:
        from ringzero.runtime import checkpoint as ck
        try:
            man = ck.load(engine, cfg.resume, save_dir=cfg.save_dir)
        except ck.CheckpointError as e:
            raise ConfigError(str(e)) from None
        start = int(man["step"])
        say(f"ringzero | resumed from {man['path']} at step {start}")
        if bar:
            bar.update(start)
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        x, y = train.get(step)
        model.check_tokens(x, y)          # on the host, where they start (no device reductions)
        lr = lr_at(cfg, step)
        comm.Barrier()          # step time is the slowest rank's
        t0 = time.perf_counter()
        res = engine.step(xp.asarray(x), xp.asarray(y), lr)
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(res.loss)
        tps = tokens_per_step / dt
        if res.skipped:
            note(f"ringzero | step {step}: overflow in the fp16 gradients; step skipped on every rank, "
                f"loss scale {res.loss_scale:g} -> {engine.scaler.scale:g}")
        if mfile:
            mfile.write(json.dumps({"step": step, "loss": res.loss, "lr": lr, "loss_scale": res.loss_scale,
                                    "grad_norm": res.grad_norm, "tokens_per_s": tps, "step_time_s": dt,
                                    "bytes_sent": int(sum(engine.last_step_ledger.values())),
                                    "skipped": res.skipped}) + "\n")
        if bar:
            bar.set_postfix_str(f"loss {res.loss:.3f} | {tps:,.0f} tok/s | scale {res.loss_scale:g}")
            bar.update(1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            from ringzero.runtime import checkpoint as ck
            path = ck.save(engine, cfg.save_dir, step + 1, config=dataclasses.asdict(cfg),
                           data_state={"step": step + 1, "seed": cfg.seed}, keep=cfg.keep or None)
            note(f"step {step + 1}: saved {path}")
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and step + 1 < cfg.steps:
            eval_loss = evaluate()
            note(f"step {step + 1}: held-out loss {eval_loss:.4f}")
    if bar:
        bar.close()
    wall = time.perf_counter() - t_start
    traffic = engine.traffic_report()     # the last training step's ledger
    eval_loss = evaluate()
    train_loss = float(np.mean(losses[-10:])) if losses else float("nan")
    steady = times[min(2, len(times) - 1):] or [float("nan")]
    tput = tokens_per_step / float(np.median(steady))

    rel = 100 * (1 - eval_loss / H)
    say(f"ringzero | final held-out loss {eval_loss:.4f} nats vs unigram entropy {H:.4f} "
        f"({abs(rel):.1f}% {'below' if rel >= 0 else 'above'}); train loss (last 10) {train_loss:.4f}")
    say(f"ringzero | throughput {tput:,.0f} tokens/s (median step {np.median(steady) * 1e3:.1f} ms), "
        f"{cfg.steps} steps in {wall:.1f} s")
    say(f"traffic per step per rank  measured {traffic['measured_bytes_per_step']:,} B   formula "
        f"{traffic['formula']} = {traffic['formula_bytes_per_step']:,} B")
    for op, b in traffic["by_op"].items():
        if b:
            say(f"  {op:<22} {b:,} B")
    if traffic["schedule_bytes_per_step"] != traffic["formula_bytes_per_step"]:
        say(f"  differs by {traffic['formula_bytes_per_step'] - traffic['measured_bytes_per_step']:,} B: the "
            f"last unit's forward and backward are adjacent, so it is gathered once, not twice (as FSDP does)")

    sample = _sample(engine, model, corpus, cfg) if cfg.sample_chars else ""
    if sample:
        say("sample ----------------------------------------------------------")
        say(sample)
        say("-----------------------------------------------------------------")
    summary = {"summary": True, "params": L.numel, "params_padded": L.padded, "world_size": n,
               "stage": cfg.stage, "precision": cfg.precision,
               "ranks_per_node": engine.nd if cfg.stage == "hybrid" else None,
               "memory": {c: {"measured_bytes": d["measured_bytes"], "formula_bytes": d["formula_bytes"]}
                          for c, d in mem["classes"].items()},
               "traffic": {"measured_bytes_per_step": traffic["measured_bytes_per_step"],
                           "formula_bytes_per_step": traffic["formula_bytes_per_step"],
                           "schedule_bytes_per_step": traffic["schedule_bytes_per_step"]},
               "train_loss": train_loss, "eval_loss": eval_loss, "unigram_entropy": H,
               "tokens_per_s": tput, "activation_peak_bytes": engine.activation_peak}
    if mfile:
        mfile.write(json.dumps(summary) + "\n")
        mfile.close()
    return summary


def read_metrics(path: str) -> tuple:
    """(step lines, summary or None) of a trainer metrics .jsonl."""
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


def _adam(cfg):
    from ringzero.runtime.optim import AdamConfig
    return AdamConfig(weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)


def _sample(engine, model, corpus, cfg) -> str:
    """Generate from the trained weights on rank 0 (all ranks join the gather)."""
    full = engine.full_params()
    if engine.comm.rank != 0:
        return ""
    P = engine.layout.views(full)
    prompt = "def " if corpus.byte_level else None
    idx = corpus.encode(prompt)[None, :] if prompt else np.zeros((1, 1), np.int64)
    rng = np.random.default_rng(cfg.seed)
    out = model.generate(P, idx, cfg.sample_chars, 0.8, rng)
    return corpus.decode(np.asarray(out)[0])


def main(argv=None) -> int:
    try:
        cfg, check = parse_config(argv)
        if check is not None:          # validate only, no MPI
            prepare(cfg, check)
            return 0
    except ConfigError as e:
        _fail(str(e))
        return 2
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    try:
        run(cfg, comm)
    except ConfigError as e:           # found before any communication, on every rank alike
        if comm.rank == 0:
            print(f"ringzero.train: error: {e}", file=sys.stderr)
        return 2
    return 0


def _fail(msg):
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if rank == 0:
        print(f"ringzero.train: error: {msg}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
