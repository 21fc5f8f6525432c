"""The trainer's settings: one typed dataclass, its flags, its TOML file, its checks.

What it is
    ``Config`` lists every setting once, with its default and its help text
    (``opt(default, help)`` stores the text in the field's metadata). The
    argparse flags are generated from it; ``--config file.toml`` sets any of
    them and flags given on the command line win. ``parse_config`` returns a
    validated Config or raises ``ConfigError``: one line, exit code 2.

What it is not
    No MPI, no data, no model: checks that need the data or the sizes are
    ``ringzero.app.train.prepare``'s. The --offload* and --zeropp* flags'
    policies and their checks are policies.py's (``validate`` calls them).
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields

from ringzero.app.exits import ConfigError


def opt(default, help: str):
    """A Config field: its default, and its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # ---- model (a GPT-2 or Llama-family preset; the vocabulary comes from the data)
    model: str = opt("", 'GPT-2 shapes: gpt2 | gpt2-medium | gpt2-large | gpt2-xl; Llama family (docs/llama.md): '
                         'smollm2-135m | smollm2-360m | qwen2.5-0.5b | tinyllama-1.1b | llama-3.2-1b '
                         '("" = the small GPT default)')
    n_layer: int | None = opt(None, "transformer blocks (None: 4, or the --model preset's)")
    n_head: int | None = opt(None, "attention heads (None: 4, or the preset's)")
    n_embd: int | None = opt(None, "width (None: 128, or the preset's); Ψ ≈ 12·n_layer·n_embd² + vocab·n_embd")
    n_kv_head: int | None = opt(None, "key/value heads of a Llama-family --model (None: the preset's); "
                                      "must divide --n-head")
    seq_len: int = opt(128, "tokens per sequence (the position table: this, or the preset's 1024; with "
                            "--init-from and no --seq-len: the smaller of 128 and the model's context)")
    init_from: str = opt("", "start from a Hugging Face checkpoint (GPT-2, Llama, Qwen2, Mistral): a folder "
                             "(config.json + model.safetensors or a sharded index) or a .safetensors file; it gives "
                             "the shapes, --data must be its tokenizer's ids (python -m ringzero.data encode)")
    # ---- data
    data: str = opt("", 'text file or token .bin (llm.c header, or bare uint16); "" = stdlib source corpus')
    batch: int = opt(8, "sequences per rank per optimizer step (global batch = batch * ranks)")
    grad_accum: int = opt(1, "micro-batches per optimizer step, batch/K rows each (batch % K == 0)")
    seed: int = opt(1337, "weights, batches and sampling all derive from it")
    # ---- schedule
    steps: int = opt(400, "optimizer steps (0 with --init-from: save the imported weights into --save-dir, "
                          "no training, no --data needed)")
    lr: float = opt(4e-3, "peak learning rate (a --model preset's own when not given: gpt2 6e-4, gpt2-medium "
                          "3e-4, gpt2-large 2.5e-4, gpt2-xl 2e-4, smollm2-135m 6e-4, smollm2-360m and "
                          "qwen2.5-0.5b 3e-4, tinyllama-1.1b and llama-3.2-1b 2e-4)")
    min_lr_frac: float = opt(0.1, "cosine decays to lr * min_lr_frac")
    warmup: int = opt(40, "linear warm-up steps")
    weight_decay: float = opt(0.1, "AdamW, not on biases and norms")
    grad_clip: float = opt(1.0, "global-norm clipping (0 = off)")
    # ---- runtime
    stage: str = opt("2", "0|1|2|3|hybrid, or NO_SHARD|SHARD_GRAD_OP|FULL_SHARD|HYBRID_SHARD")
    ranks_per_node: int = opt(0, 'hybrid: ranks per "node" (0 = the MPI shared-memory node)')
    device: str = opt("cpu", "cpu | cuda")
    precision: str = opt("fp16", "fp16 (fp16 storage, loss scaling) | bf16 (bf16 storage, no scaler; cpu) | fp32")
    activation_checkpointing: bool = opt(False, "keep block inputs only; recompute in backward")
    overlap: bool | None = opt(None, "run the reductions and the update's gathers on a progress thread "
                                     "beside the compute (None: when the ranks span several nodes; the "
                                     "same bits either way)")
    prefetch: int | None = opt(None, "stage 3/hybrid with overlap: start a unit's all-gather this many "
                                     "units before it is read (None: 1, as FSDP; 0: where it is read)")
    reduce_bucket_mb: float | None = opt(None, "stages 0-2: reduce the gradients of consecutive units in "
                                               "buckets of up to this many MiB (0: each unit alone; None: "
                                               "16 without overlap, 0 with)")
    mem_budget: str = opt("", 'per-rank model-state budget, e.g. 512MiB ("" = none)')
    mem_check: bool = opt(True, "refuse at start a run whose model state + workspace + activations exceed the "
                                "memory there is (MemAvailable, the memory cgroup, RLIMIT_DATA); "
                                "--no-mem-check (or RINGZERO_MEM_CHECK=0) skips it")
    offload: str = opt("", 'state classes kept in files under --offload-dir and streamed through the update: '
                           '"optimizer" (fp32 master, Adam m, v) or "optimizer,params" (stage 3/hybrid: the '
                           'params shard too); "" = all in RAM; with --device cuda: "optimizer" in host memory, '
                           'or in files with --offload-dir (docs/offload.md)')
    offload_dir: str = opt("", "the folder of the offload files (one per class per rank, freed at exit); "
                               "a local disk with room for the offloaded state")
    offload_pin_limit: str = opt("2GiB", "--device cuda with --offload: host bytes per rank the update's transfer "
                                         "slots may pin (page-locked, for async copies; master, m, v are never "
                                         "pinned); past it, pageable memory; 0 pins nothing")
    offload_ahead: bool = opt(False, "stage 3/hybrid with --offload: the update streams unit by unit beside the "
                                     "next step's forward, which starts on unit 0 while later units are updated "
                                     "(the same bits)")
    offload_delay: int | None = opt(None, "with --offload optimizer: ZeRO-Offload's delayed parameter update "
                                          "after N exact steps: step t's update runs beside step t+1, whose "
                                          "forward reads params one step stale (changes the arithmetic; "
                                          "docs/offload.md); None: off")
    offload_depth: int = opt(2, "with --offload: tiles the update reads ahead of the one it computes (its host "
                                "buffers: depth + 2 tiles of each offloaded class, counted by the memory check)")
    offload_threads: int = opt(8, "with --offload: I/O requests per rank in the kernel at once (O_DIRECT where the "
                                  "filesystem takes it, docs/offload.md)")
    zeropp: str = opt("", 'ZeRO++ at stage 3/hybrid (docs/quantized.md): any of "qwz" (int8 params in the '
                          'all-gathers), "hpz" (a secondary params shard inside the node: the backward\'s gathers '
                          'stay there; stage 3), "qgz" (the gradients\' reduce-scatter in int4/int8 through a '
                          'two-hop all-to-all), comma-separated; "" = off. Turns overlap off')
    zeropp_block: int = opt(2048, "--zeropp: elements per fp32 scale of qwz's int8 weights")
    zeropp_grad_block: int = opt(256, "--zeropp: elements per fp32 scale of qgz's gradient codes (at 2048, "
                                 "int4 sends half a gradient as zero)")
    zeropp_bits: int = opt(4, "--zeropp qgz: bits of the gradient codes, 4 (ZeRO++'s) or 8")
    zeropp_error_feedback: bool = opt(False, "--zeropp qgz: keep each rank's quantization residual (4 bytes per "
                                             "parameter) and add it to the next step's gradient")
    # ---- reporting
    eval_interval: int = opt(100, "steps between held-out evaluations (0 = only at the end)")
    eval_batches: int = opt(4, "batches per evaluation, per rank")
    metrics: str = opt("", "write one JSON object per step here (JSONL)")
    trace: str = opt("", "write a timeline of --trace-steps per rank, DIR/rank{R}_trace.json (Chrome trace format: "
                         "Perfetto, HTA; python -m ringzero.trace summary DIR; docs/trace.md)")
    trace_steps: str = opt("", 'the steps A:B (B excluded) --trace records ("" = 5:8, or the last 3 of a '
                               'shorter run)')
    sample_chars: int = opt(200, "length of the text sample at the end (0 = none)")
    # ---- checkpoints (ringzero.runtime.checkpoint)
    save_every: int = opt(0, "save every N steps into --save-dir (0 = never)")
    save_dir: str = opt("checkpoints", "one sub-directory per saved step: step-000010, ...")
    keep: int = opt(0, "keep only the newest K checkpoints (0 = all)")
    resume: str = opt("", 'a step-NNNNNN directory, or "latest" in --save-dir')
    quiet: bool = opt(False, "no progress bar")


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
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        # default=None marks "not given", so TOML values are only overridden by real flags
        text = f"{f.metadata.get('help', '')} (default: {f.default!r})".replace("%", "%%")
        if f.type in ("bool", bool, "bool | None"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, default=None, metavar=f.name.upper(), help=text)
    return p


# the small default model, for dimensions neither a flag nor a preset sets
DEFAULT_DIMS = {"n_layer": 4, "n_head": 4, "n_embd": 128}
# The peak learning rate of each preset when --lr is not given: GPT-3's table 2.1 at the
# same sizes (125M 6e-4, 350M 3e-4, 760M 2.5e-4, 1.3B 2e-4), nanoGPT's 6e-4 for gpt2.
# The small default's 4e-3 makes a 1.5B model's loss climb within its first updates.
# The Llama-family presets take the same table by size (135M ~ 125M, 360M and 494M ~ 350M,
# 1.1B and 1.2B ~ 1.3B): training from scratch; a fine-tune from --init-from wants less.
PRESET_LR = {"gpt2": 6e-4, "gpt2-medium": 3e-4, "gpt2-large": 2.5e-4, "gpt2-xl": 2e-4,
             "smollm2-135m": 6e-4, "smollm2-360m": 3e-4, "qwen2.5-0.5b": 3e-4, "tinyllama-1.1b": 2e-4,
             "llama-3.2-1b": 2e-4}


def _coerce(name, typ, value):
    if isinstance(typ, str) and typ.endswith(" | None"):     # a None-able field given a value
        typ = typ[:-len(" | None")]
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
        what = "an integer" if kind is int else "a number" if kind is float else "a string"
        raise ConfigError(f"{name} must be {what}, got {value!r}") from None


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
    if "lr" not in kw and kw.get("model") in PRESET_LR:
        kw["lr"] = PRESET_LR[kw["model"]]
    if "seq_len" not in kw and kw.get("init_from"):    # the default, within the imported model's context
        from ringzero.interop.hf_import import context_of
        ctx = context_of(kw["init_from"])              # None if unreadable: prepare says why
        if ctx is not None:
            kw["seq_len"] = min(Config.seq_len, ctx)
    cfg = Config(**kw)
    validate(cfg)
    if ns.check is not None and ns.check < 1:
        raise ConfigError(f"--check takes a rank count >= 1, got {ns.check}")
    return cfg, ns.check


def _gathers_params(stage) -> bool:
    from ringzero.runtime.policy import StagePolicy
    try:
        return StagePolicy.of(stage).gather_params
    except ValueError:
        return False              # an unknown stage has its own message


def trace_window(cfg) -> tuple:
    """(A, B): the steps A <= step < B --trace records (app/tracing.py). Default: 5:8, after the first steps'
    plan building and loss-scale skips, or the last 3 of a shorter run. Raises ConfigError."""
    s = cfg.trace_steps
    if not s:
        b = min(8, cfg.steps)
        return max(0, min(5, b - 3)), b
    try:
        a, b = (int(v) for v in s.split(":"))
    except ValueError:
        raise ConfigError(f"--trace-steps: expected A:B (two step numbers, B excluded), got {s!r}") from None
    if not 0 <= a < b:
        raise ConfigError(f"--trace-steps: expected 0 <= A < B, got {a}:{b}")
    if a >= cfg.steps:
        raise ConfigError(f"--trace-steps {s}: the run has steps 0..{cfg.steps - 1}, expected A < --steps {cfg.steps}")
    return a, min(b, cfg.steps)


def validate(cfg: Config):
    from ringzero.runtime import accounting
    from ringzero.sizes import parse_size

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)
    for k in ("n_layer", "n_head", "n_embd", "n_kv_head", "seq_len", "batch", "steps", "grad_accum"):
        v = getattr(cfg, k)
        if k == "steps" and v == 0:          # a bare conversion: the imported weights saved, no step taken
            need(bool(cfg.init_from) and not cfg.resume,
                 "--steps 0 saves an --init-from model as a ringzero checkpoint (into --save-dir) without "
                 f"training: expected --init-from DIR{' and no --resume' if cfg.resume else ''}, got "
                 f"{'--resume ' + repr(cfg.resume) if cfg.resume else 'no --init-from'}")
            continue
        need(v is None or v >= 1, f"--{k.replace('_', '-')} must be >= 1, got {v}")
    from ringzero.nn.gemm import BlasError, check_setting
    try:
        check_setting()                # the environment's RINGZERO_BLAS, before any product
    except BlasError as e:
        raise ConfigError(str(e)) from None
    trace_window(cfg)                  # --trace-steps: A:B inside the run
    need(cfg.prefetch is None or cfg.prefetch >= 0, f"--prefetch must be >= 0, got {cfg.prefetch}")
    need(not cfg.prefetch or cfg.overlap is not False,
         f"--prefetch {cfg.prefetch} needs overlap (a gather runs beside compute only then): drop --no-overlap "
         "or use --prefetch 0")
    need(cfg.reduce_bucket_mb is None or cfg.reduce_bucket_mb >= 0,
         f"--reduce-bucket-mb must be >= 0, got {cfg.reduce_bucket_mb}")
    need(not cfg.reduce_bucket_mb or not _gathers_params(cfg.stage),
         f"--reduce-bucket-mb applies to stages 0-2; stage {cfg.stage} reduces each unit's gradient as its "
         "backward ends (FSDP's order): drop it")
    need(cfg.batch % cfg.grad_accum == 0,
         f"--batch must split into --grad-accum micro-batches: expected batch % K == 0, got "
         f"{cfg.batch} % {cfg.grad_accum} = {cfg.batch % cfg.grad_accum} (batch is rows per rank per step)")
    from ringzero.nn.families import LLAMA, family_of, preset_names
    need(cfg.model in ("",) + preset_names(),
         f"--model must be one of {', '.join(preset_names())} (or empty for the small default), got {cfg.model!r}")
    need(cfg.n_kv_head is None or cfg.init_from or (cfg.model and family_of(cfg.model) == LLAMA),   # init: prepare
         f"--n-kv-head applies to a Llama-family --model (grouped-query attention), got --model {cfg.model!r}")
    d = model_dims(cfg)
    need(d["n_embd"] % d["n_head"] == 0,
         f"--n-embd must be divisible by --n-head: got {d['n_embd']} % {d['n_head']} = {d['n_embd'] % d['n_head']}")
    if cfg.init_from:                            # the shapes are config.json's: checked in prepare
        need(os.path.exists(cfg.init_from), f"--init-from {cfg.init_from!r} does not exist: expected a Hugging "
             "Face folder (config.json + model.safetensors), a sharded index or a .safetensors file")
    else:
        g = model_config(cfg, 256)               # the shapes, before the data sets the vocab
        need(cfg.seq_len <= g.block_size,
             f"--seq-len must be <= the model's context: expected <= {g.block_size} ({cfg.model}), got {cfg.seq_len}")
    need(cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}")
    need(0 <= cfg.min_lr_frac <= 1, f"--min-lr-frac must be in [0, 1], got {cfg.min_lr_frac}")
    need(cfg.warmup >= 0 and cfg.eval_interval >= 0 and cfg.eval_batches >= 1 and cfg.sample_chars >= 0,
         "--warmup, --eval-interval and --sample-chars must be >= 0 and --eval-batches >= 1")
    need(cfg.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {cfg.device!r}")
    need(cfg.precision in ("fp16", "bf16", "fp32"), f"--precision must be fp16, bf16 or fp32, got {cfg.precision!r}")
    if cfg.precision == "bf16":
        need(cfg.device == "cpu", "--precision bf16 runs on --device cpu only: CuPy has no bfloat16 "
                                  "arrays; use --precision fp16 on a GPU")
        from ringzero.runtime.state import storage_dtype
        try:
            storage_dtype("bf16")
        except ValueError as e:
            raise ConfigError(f"--precision {e}") from None
    try:
        cfg.stage = accounting.parse_stage(cfg.stage)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--stage: {e}") from None
    from ringzero.app.policies import validate_offload, validate_zeropp
    validate_offload(cfg)
    validate_zeropp(cfg)
    if cfg.mem_budget:
        try:
            parse_size(cfg.mem_budget)
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
        need(latest(cfg.save_dir) is not None,
             f"--resume latest: no complete checkpoint in --save-dir {cfg.save_dir!r}")


def model_config(cfg: Config, vocab: int):
    """The effective model config (a GPTConfig or a LlamaConfig, nn/families.py): the --model
    preset (or the small GPT default), the data's vocabulary, and the dimension flags the user
    set (None keeps the preset's). The default model's context is --seq-len; a preset keeps its own."""
    from ringzero.nn import families
    try:
        if cfg.model and families.family_of(cfg.model) == families.LLAMA:
            return families.model_config(cfg.model, vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                         n_embd=cfg.n_embd, n_kv_head=cfg.n_kv_head)
        return families.model_config(cfg.model or None, vocab, block_size=None if cfg.model else cfg.seq_len,
                                     **model_dims(cfg))
    except ValueError as e:
        raise ConfigError(f"--model: {e}") from None


gpt_config = model_config       # its older name (the GPT was the only family)


def model_dims(cfg: Config) -> dict:
    """{n_layer, n_head, n_embd} in effect: a flag's value, else the preset's, else the default."""
    from ringzero.nn.families import model_config as preset_config
    from ringzero.nn.families import preset_names
    base = preset_config(cfg.model).__dict__ if cfg.model in preset_names() else DEFAULT_DIMS
    return {k: base[k] if getattr(cfg, k) is None else getattr(cfg, k) for k in DEFAULT_DIMS}


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_frac."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
