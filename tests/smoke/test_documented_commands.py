"""Every ``python -m ringzero.X`` command in the README's and docs' code blocks runs, made tiny.

What it is
    tests/smoke/documented.py reads the commands out of the Markdown; each one
    becomes a test here, named by the file and line that show it and the tool
    (``README.md:39:train``). ``tiny()`` keeps the command as written and
    changes only what CI cannot afford or does not have: a 1-layer GPT and
    2 steps for the trainer, 1-4 KiB and a
    few iterations for the bench, the fixture's checkpoint, metrics and bench
    files for placeholder inputs (``CKPT``, ``run.jsonl``, ``q2.json``), and a
    temporary folder for every output (``-o``, ``--plot``, ``--json``: nothing
    under docs/img is rewritten). Commands shown under mpirun run under the
    venv's mpirun at the rank count shown (2 for ``$N``). Each must exit 0
    and print its table (``TABLES``: one line of it, per module and word).
What it is not
    A check of any figure the docs quote; and the benchmarks/ scripts are
    tests/smoke/test_benchmarks.py's.
"""
from __future__ import annotations

import os
import re

import pytest
from documented import commands
from smoke_run import (  # noqa: F401
    PY,
    TINY_GPT,
    bench_files,
    check,
    gpt2_files,
    run,
    smoke_dir,
    text_file,
    traced,
    trained,  # (fixtures)
)

from ringzero.nn.llama_config import PRESETS as LLAMA_PRESETS  # noqa: E402

pytestmark = pytest.mark.smoke

# (module, first word or None) -> a line of the table the command prints
TABLES = {
    ("ringzero.train", None): r"^model state per rank\s+measured\s+formula",
    ("ringzero.bench", None): r"^#\s+op\s+size\b.*\bbusbw",
    ("ringzero.bench", "sched"): r"\bring=.*\bmpi=",
    ("ringzero.bench", "dtypes"): r"float16",
    ("ringzero.bench", "median"): r"^\| op \| n \|",
    ("ringzero.estimate", None): r"^\s*stage\b",
    ("ringzero.explain", "traffic"): r"^\s*stage\b",
    ("ringzero.explain", "fragmentation"): r"OOMs",
    ("ringzero.explain", "precision"): r"loss scaler",
    ("ringzero.explain", "offload"): r"^\s*stage\s+offload",
    ("ringzero.explain", "quantized"): r"^\s*gradient\s+bytes/elem",
    ("ringzero.fit", None): r"α|alpha",
    ("ringzero.simulate", None): r"^\s*stage\b",
    ("ringzero.plot", None): r"\.png",
    ("ringzero.checkpoint", "inspect"): r"step",
    ("ringzero.checkpoint", "export"): r"safetensors",
    ("ringzero.sample", None): r"\S",
    ("ringzero.data", None): r"unigram entropy",
    ("ringzero.data", "encode"): r"tokens, ids 0\.\.\d+, uint16",
    ("ringzero.trace", "summary"): r"straggler",
    ("ringzero.trace", "merge"): r"^wrote .*merged_trace\.json",
    ("ringzero.evaluate", None): r"^loss \d+\.\d+\s+perplexity \d",
}
TINY_TRAIN = TINY_GPT + ["--steps", "2", "--eval-interval", "1", "--eval-batches", "1", "--sample-chars", "16"]
BENCH_TINY = {"-b": "1K", "--minbytes": "1K", "-e": "4K", "--maxbytes": "4K", "-n": "2", "--iters": "2",
              "--count": "1K"}
OUTPUT_FLAGS = ("-o", "--plot", "--json")   # and the trainer's --metrics
CMDS = commands()


def word(cmd):
    """The subcommand (``sched``, ``traffic``, ...) when the first argument is one."""
    return cmd.args[0] if cmd.args and re.fullmatch(r"[a-z]+", cmd.args[0]) else None


HF_DIRS = ("gpt2", "qwen", "smol", "CKPT_OR_HF_DIR")    # the recipes' Hugging Face folders: the GPT-2 fixture stands in
EXPORTED = ("smol-ft",)     # folders a recipe exports (an output there) and then reads (the GPT-2 fixture)
CHECKPOINTS = ("ft", "smol-rz")     # ringzero checkpoints the recipes write and then read (the fine-tuned fixture)


def gpt2_input(a, prev, inputs, module=""):
    """The fixture file for an input argument of docs/gpt2.md's recipe, or None: the GPT-2
    folder "gpt2", its tokenizer, the encoded data, the text, the fine-tuned checkpoint "ft"."""
    if prev in ("--save-dir", "--model"):
        return None
    if prev == "--tokenizer":
        return inputs["gpt2"]()["tokenizer"]
    if prev == "--init-from" or a.rstrip("/") in HF_DIRS or (a.rstrip("/") in EXPORTED
                                                               and module != "ringzero.checkpoint"):
        return inputs["gpt2"]()["dir"]
    if prev == "--data" and (a.endswith(".bin") or a == "FILE"):
        return inputs["gpt2"]()["data"]
    if a.endswith(".txt"):
        return inputs["text"]
    if a.rstrip("/") in CHECKPOINTS:
        return inputs["gpt2"]()["finetuned"]
    return None


def conversion(cmd) -> bool:
    """``ringzero.train --init-from DIR --steps 0 --save-dir OUT``: a conversion, run as written (no step,
    no data; the fixture's folder in, a checkpoint out)."""
    a = list(cmd.args)
    return cmd.module == "ringzero.train" and "--init-from" in a and "--steps" in a and \
        a.index("--steps") + 1 < len(a) and a[a.index("--steps") + 1] == "0"


def tiny(cmd, inputs, out_dir):
    """The command's argument list, made tiny and pointed at the fixtures' files."""
    args, out = list(cmd.args), []
    bench_inputs_done = False
    # docs/gpt2.md's recipe (the user's GPT-2 folder "gpt2", the fine-tuned "ft"): its own fixtures
    gpt2 = any(a in ("--init-from", "--tokenizer") or a.rstrip("/") in HF_DIRS + EXPORTED + CHECKPOINTS for a in args)
    i = 0
    while i < len(args):
        a = args[i]
        prev = args[i - 1] if i else ""
        outputs = OUTPUT_FLAGS + (("--metrics", "--save-dir") if cmd.module == "ringzero.train" else ())
        recipe = gpt2_input(a, prev, inputs, cmd.module) if gpt2 else None
        if recipe is not None:
            out.append(recipe)
        elif cmd.module == "ringzero.evaluate" and prev == "--seq-len":    # within the fixture's context (32)
            out.append("16")
        elif cmd.module == "ringzero.data" and a.endswith(".bin"):     # encode's output
            out.append(os.path.join(out_dir, os.path.basename(a)))
        elif prev in outputs and re.search(r"\.\w+$", a):                # an output file: into the temporary folder
            out.append(os.path.join(out_dir, os.path.basename(a.replace("$", "_"))))
        elif prev == "--trace" and cmd.module == "ringzero.train":     # the trace folder it writes
            out.append(os.path.join(out_dir, "trace"))
        elif prev == "--trace-steps":                                   # inside the tiny run's 2 steps
            out.append("0:2")
        elif prev in ("summary", "merge", "trace") and i == 1:         # a --trace folder read: the fixture's
            out.append(inputs["trace"]())
        elif prev == "--step" and word(cmd) == "trace":
            out.append("1")
        elif cmd.module == "ringzero.bench" and prev in BENCH_TINY:
            out.append(BENCH_TINY[prev])
        elif prev == "--data":
            out.append(inputs["text"])
        elif prev == "--offload-dir":                 # the offload files: anonymous, in the temporary folder
            out.append(out_dir)
        elif a.endswith(".safetensors"):
            out.append(os.path.join(out_dir, os.path.basename(a)))
        elif re.search(r"(^|/)step-\d+$", a):
            out.append(inputs["step_dir"]())
        elif a in ("CKPT", "ckpt", "ck", "/tmp/ck", "DIR"):
            out.append(inputs["save_dir"]())
        elif a.endswith(".jsonl"):
            out.append(inputs["metrics"]())
        elif re.fullmatch(r"[\w*${}\-]+\.json(\.\.\.)?", a) or a == "...":   # bench files to read
            if not bench_inputs_done:
                out += inputs["bench"]()
                bench_inputs_done = True
        else:
            out.append(a)
        i += 1
    if cmd.module == "ringzero.train" and not {"--help", "-h", "--check"} & set(out) and not conversion(cmd):
        # an imported model's shapes are its config.json's: no dimension flags then
        out += TINY_TRAIN if not gpt2 else ["--seq-len", "16", "--batch", "2"] + TINY_TRAIN[len(TINY_GPT):]
        if "--model" in out and out[out.index("--model") + 1] in LLAMA_PRESETS:
            out += ["--n-kv-head", "1"]           # a Llama-family preset: the tiny 2 heads share one KV head
    if cmd.module == "ringzero.bench" and word(cmd) is None:
        out += ["-w", "1"]
    return out


@pytest.fixture
def inputs(request):
    """Lazy: only the commands that read a checkpoint or bench files pay for making them."""
    fx = request.getfixturevalue
    return {"text": fx("text_file"),
            "save_dir": lambda: fx("trained")["save_dir"], "step_dir": lambda: fx("trained")["step_dir"],
            "metrics": lambda: fx("trained")["metrics"], "bench": lambda: fx("bench_files"),
            "gpt2": lambda: fx("gpt2_files"), "trace": lambda: fx("traced")}


def test_the_docs_show_commands():
    """The extraction finds the commands it must (an extractor that finds none would pass everything)."""
    found = {(c.module, word(c)) for c in CMDS}
    for must in [("ringzero.train", None), ("ringzero.bench", None), ("ringzero.estimate", None)]:
        assert must in found, f"no documented {must} command found in the code blocks: {sorted(found)}"
    user = [c for c in CMDS if c.module == "ringzero.train" and c.ranks == 8 and c.where.startswith("README")]
    assert user, "the README shows no `mpirun -n 8 python -m ringzero.train` command"


# ids without "ringzero" in them, so that ``./launch/test -k zero`` does not select every command
IDS = [f"{c.where}:{c.module.removeprefix('ringzero.')}{' ' + w if (w := word(c)) else ''}" for c in CMDS]


@pytest.mark.parametrize("cmd", CMDS, ids=IDS)
def test_documented_command(cmd, inputs, tmp_path):
    key = (cmd.module, word(cmd))
    table = TABLES.get(key, TABLES.get((cmd.module, None)))
    assert table, f"{cmd.where}: no table pattern for {key} in TABLES; add one"
    args = tiny(cmd, inputs, str(tmp_path))
    if "--help" in args:
        table = r"^usage:"
    if conversion(cmd):
        table = r"--steps 0: saved the imported weights \(Ψ = [\d,]+\) to \S+/step-000000, no step taken"
    argv = [PY, "-m", "mpi4py", "-m", cmd.module, *args] if cmd.ranks else [PY, "-m", cmd.module, *args]
    rc, out = run(argv, ranks=cmd.ranks, cwd=str(tmp_path))
    check(rc, out, table, f"{cmd.where}: {cmd.text}\n  ran as: {' '.join(argv)}")
