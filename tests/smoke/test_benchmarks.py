"""Every script in benchmarks/ runs at tiny sizes, exits 0 and prints its table.

What it is
    ``RUNS`` holds, per script, the tiny command lines (ranks under mpirun or
    None, arguments, one line of the table it must print).
    ``test_every_script_is_covered`` fails when a script in benchmarks/ has
    no entry, so a new benchmark cannot go untested. train_peer.py runs one
    ringzero row and one torch row (DDP); without torch it prints one line
    saying the torch rows are skipped, and the test checks that line instead.
What it is not
    A timing: the sizes are far too small for any figure to mean anything.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
import types

import pytest
from smoke_run import PY, ROOT, TIMEOUT, TINY_GPT, check, prev_comm, run, smoke_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.smoke

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_DS = HAVE_TORCH and importlib.util.find_spec("deepspeed") is not None
PEER = ["--ranks", "2", "--steps", "3", "--warmup", "1", "--modes", "ringzero,ddp", "--timeout", "200", *TINY_GPT]
# a GPT-2 preset made tiny: gpt2's width and heads, one block, T = 16, a 1000-id vocabulary (its head
# 1024 x 768, vocab_for's rounding)
PRESET = ["--model", "gpt2", "--n-layer", "1", "--vocab", "1000"]
PEER_PRESET = ["--ranks", "2", "--steps", "2", "--warmup", "1", "--modes", "ringzero,ddp", "--timeout", "200",
               "--seq-len", "16", "--batch", "1", "--compute-steps", "1", *PRESET]
# a Llama-family preset made tiny: transformers' LlamaForCausalLM as the torch peer (DDP, and FSDP FULL_SHARD
# built on the meta device), one layer of width 64, 4 heads, 2 KV heads, the byte vocabulary, T = 16
PEER_LLAMA = ["--ranks", "2", "--steps", "2", "--warmup", "1", "--modes", "ringzero,ddp,fsdp-full", "--timeout", "200",
              "--seq-len", "16", "--batch", "1", "--compute-steps", "1", "--model", "smollm2-135m", "--n-layer", "1",
              "--n-embd", "64", "--n-head", "4", "--n-kv-head", "2"]
# the sharded peers: FSDP2 and DeepSpeed ZeRO-1/2/3 (meta-device and zero.Init starts) at the tiny size
PEER_SHARDED = ["--ranks", "2", "--steps", "3", "--warmup", "1", "--modes", "ringzero,fsdp2-full,ds-zero1,ds-zero2,"
                "ds-zero3", "--timeout", "200", "--compute-steps", "1", *TINY_GPT]
CAPACITY_PEERS = ["--cap", "600MiB", "--nd", "2", "--stages", "3", "--offload", "", "--peers", "fsdp2-full,ds-zero3",
                  "--n-embd", "64", "--n-head", "2", "--seq-len", "16", "--max-layers", "1", "--no-baseline",
                  "--timeout", "600"]  # a fresh venv builds cpu_adam first (3+ min)
PREV = "{prev}"   # replaced by the prev_comm fixture's folder
TMP = "{tmp}"     # replaced by a folder under the test's tmp_path (an output)
# a random Qwen2 folder at qwen2.5-0.5b's shapes made tiny, in shards of 100 KiB (an index beside them)
HF_RANDOM = ["--model", "qwen2.5-0.5b", "--n-layer", "1", "--n-embd", "64", "--n-head", "4", "--n-kv-head", "2",
             "--vocab", "300", "--shard-mb", "0.1", "--out", TMP]

# script -> [(ranks or None, args, a line of its table)]
RUNS = {
    "allreduce_schedules.py": [(4, ["4K", "16K"], r"^n=4 MPI time / schedule time: 4K recursive_doubling=")],
    "bench_quant.py": [(4, ["64K", "--nodes", "2", "--repeats", "1"],
                        r"^reduce_scatter\s+65,536\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+98,304\s+24,672\s+32,768\s+8,224$")],
    "bench_adam.py": [(None, ["--elements", "64K", "--repeats", "1"], r"^  fused / NumPy throughput: [\d.]+x")],
    "bench_offload.py": [(2, ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--steps", "1",
                              "--probe", "1M", "--offload-dir", "/tmp"],
                          r"^step / max\(compute \+ arithmetic, I/O\) = [\d.]+$")],
    "bench_model.py": [(None, ["--batch", "1", "--seq", "16", "--repeats", "1", "--warmup", "0"],
                        r"fwd\+bwd: median"),
                       (None, ["--batch", "1", "--seq", "16", "--repeats", "1", "--warmup", "0", *PRESET],
                        r"^ratio ringzero/gemm-floor: [\d.]+x")],
    "bench_llama.py": [(None, ["--model", "smollm2-135m", "--n-layer", "1", "--vocab", "256", "--seq", "16",
                              "--repeats", "1"], r"^  ringzero / gemm floor = [\d.]+$")],
    "bench_stages.py": [(2, [*TINY_GPT, "--iters", "2", "--warmup", "1"], r"^\s+3\s+[\d.]+ ms\s+[\d.]+x"),
                        (2, [*TINY_GPT, "--iters", "2", "--warmup", "1", "--stages", "0,hybrid"],
                         r"^hybrid\s+[\d.]+ ms\s+[\d.]+x\s+[\d,]+ B\s+[\d,]+ B\s+off( +[\d.]+ ms){5}$"),
                        (None, ["--rss", "-n", "2", "--stages", "0,3", *TINY_GPT], r"^\s+3\s+[\d.]+ MiB")],
    "capacity.py": [(None, ["--cap", "300MiB", "--nd", "2", "--stages", "0,3", "--offload", "optimizer", "--peers", "",
                            "--n-embd", "512", "--n-head", "4", "--seq-len", "16", "--max-layers", "2",
                            "--no-baseline", "--timeout", "120"], r"^\| stage 3\+optimizer \| 2 \| [1-9]")],
    # the meta-initialized FSDP2 and DeepSpeed ZeRO-3 (zero.Init) as capacity peers: each trains 1 layer under the cap
    "capacity.py#peers": [(None, CAPACITY_PEERS, r"^\| stage 3 \| 2 \| 1 ")],
    "check_simulate.py": [(None, ["--ns", "2", "--models", "1L-32C", "--iters", "2", "--max-bytes", "16K"],
                           r"^\|error\|: median")],
    "hf_random_folder.py": [(None, HF_RANDOM, r"^wrote .*: Qwen2ForCausalLM at qwen2.5-0.5b's shapes, 1L 64C 4H 2KV, "
                                                r"vocab 300, [\d,]+ params, bf16, \d+ file\(s\) .*index\.json$")],
    "interleave_bias.py": [(2, ["4096"], r"all_reduce\s+4096\s+loop\s+ring")],
    "link_pairs.py": [(4, ["64K", "--repeats", "1"], r"^\s+65,536\s+both ways, 2 pairs\s+[\d.]+$")],
    "plan_profile.py": [(2, ["all_reduce", "4K", "20"], r"Ring call .* us, MPI")],
    "ring_before_after.py": [(2, [PREV, "--ops", "all_reduce", "--sizes", "4K", "--allocs", "1", "--budget", "0.05"],
                              r"all_reduce\s+4096")],
    "stage3_ring_before_after.py": [(2, [PREV, "2"], r"new/old step time: [\d.]+")],
    "sgemm_libs.py": [(None, ["--n-embd", "8", "--rows", "16"], r"^\s+the layer\s+\|\s+[\d.]+")],
    "trace_overhead.py": [(None, ["--pairs", "1", "--ranks", "2", "--steps", "4", "--warm", "2", "--", *TINY_GPT],
                           r"^median on / off over 1 pairs: [\d.]+ \([-+][\d.]+%\); load now")],
    "trace_pictures.py": [(None, ["--only", "stages", "--out", TMP, "--", *TINY_GPT],
                           r"^  -> .*trace-stage3\.png$")],
    "train_peer.py": [(None, PEER, r"^\| ringzero \| 2 \| \d+"),
                      (None, PEER_PRESET, r"^\| ringzero \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \|$"),
                      (None, PEER_SHARDED, r"^\| ringzero \| 2 \| \d+"),
                      (None, PEER_LLAMA, r"^\| ringzero \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \|$")],
    # one host, 4 ranks as 2 emulated nodes (the script's own mpirun), two configs, two steps
    "zeropp_convergence.py": [(None, ["--emulate", "--steps", "2", "--configs", "off,all", "--eval-interval", "1",
                                      "--eval-batches", "1", "--timeout", "200", "--out", TMP,
                                      *TINY_GPT], r"^\| all \| qwz,hpz,qgz \| [\d.]+ \| [+-][\d.]+ % \|")],
}
# not scripts of their own: what runs them
COVERED_BY = {"torch_gpt.py": "bench_model.py and train_peer.py (the torch side)",
              "torch_llama.py": "train_peer.py --model smollm2-135m (the torch side of a Llama-family preset)",
              "peer_models.py": "train_peer.py (its model's shapes and vocabulary)",
              "peer_engines.py": "train_peer.py and capacity.py (how each torch-side mode is built)",
              "peer_tables.py": "train_peer.py (its tables)",
              "train_peer_worker.py": "train_peer.py (its ranks)",
              "cluster_opts.py": "bench_stages.py and check_simulate.py (their --cluster flags)"}
# scripts that keep their runs' files in a temporary folder of this prefix, which they must remove
SCRATCH = {"trace_overhead.py": "trace_overhead-", "trace_pictures.py": "trace_pictures-"}
CASES = [(s.partition("#")[0], i, *r) for s, rs in RUNS.items() for i, r in enumerate(rs)]
IDS = [f"{s}#{i}" for s, rs in RUNS.items() for i in range(len(rs))]


def test_every_script_is_covered():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
    runs = {s.partition("#")[0] for s in RUNS}          # "capacity.py#peers": a second group of capacity.py's
    missing = scripts - runs - set(COVERED_BY)
    assert not missing, f"benchmarks/ scripts with no smoke run (add them to RUNS): {sorted(missing)}"
    stale = (runs | set(COVERED_BY)) - scripts
    assert not stale, f"RUNS / COVERED_BY name scripts that are gone: {sorted(stale)}"


@pytest.mark.parametrize("script,i,ranks,args,table", CASES, ids=IDS)
def test_benchmark(script, i, ranks, args, table, request):
    if PREV in args:
        args = [request.getfixturevalue("prev_comm") if a == PREV else a for a in args]
    if TMP in args:
        args = [str(request.getfixturevalue("tmp_path") / "out") if a == TMP else a for a in args]
    path = os.path.join("benchmarks", script)
    argv = [PY, "-m", "mpi4py", path, *args] if ranks else [PY, path, *args]
    scratch = None
    if script in SCRATCH:       # its own temporary folder goes under a TMPDIR watched here
        scratch = request.getfixturevalue("tmp_path") / "scratch"
        scratch.mkdir()
    # the DeepSpeed peer's first run in a fresh venv builds cpu_adam (3+ min on 2 slow cores): room for it
    rc, out = run(argv, ranks=ranks, timeout=max(TIMEOUT, 900) if args == CAPACITY_PEERS else TIMEOUT,
                  env={"TMPDIR": str(scratch)} if scratch else None)
    what = f"benchmarks/{script} ({f'mpirun -n {ranks} ' if ranks else ''}{' '.join(args)})"
    check(rc, out, table, what)
    if scratch:
        left = sorted(n for n in os.listdir(scratch) if n.startswith(SCRATCH[script]))
        assert not left, f"{what}: left its temporary folder(s) behind: {left}"
    if script == "train_peer.py" and args == PEER_SHARDED:
        _check_sharded_peers(rc, out, what)
    elif args == CAPACITY_PEERS:
        _check_capacity_peers(rc, out, what)
    elif script == "train_peer.py":
        if HAVE_TORCH:
            check(rc, out, r"^\| ddp \| 2 \| \d+", what + ": the torch row")
            if "--model" in args:      # the torch mode's step, compute and exposed communication too
                check(rc, out, r"^\| ddp \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \|$",
                      what + ": the torch row of the step table")
            if args == PEER_LLAMA:     # transformers' Llama, sharded: its row, and the same parameter count
                check(rc, out, r"^\| fsdp-full \| 2 \| \d+", what + ": the FSDP FULL_SHARD row")
                assert "MISMATCH" not in out, f"{what}: the two sides' models differ:\n{out[-2000:]}"
        else:
            check(rc, out, r"torch is not installed", what + ": the line saying the torch rows are skipped")
            print("train_peer.py: torch is not installed here, so its torch row was skipped", file=sys.stderr)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (RINGZERO_PEER=1 installs it)")
def test_hf_random_folder_opens_in_transformers(tmp_path):
    """The random folder is one transformers opens with no missing or unexpected key, in its dtype,
    sharded, with the preset's computing fields (Qwen2: the q/k/v bias, θ 1e6, ε 1e-6)."""
    args = [a if a != TMP else str(tmp_path / "qwen") for a in HF_RANDOM]
    rc, out = run([PY, os.path.join("benchmarks", "hf_random_folder.py"), *args])
    check(rc, out, r"^wrote ", "benchmarks/hf_random_folder.py " + " ".join(args))
    import torch
    import transformers
    m, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen"), output_loading_info=True)
    assert type(m).__name__ == "Qwen2ForCausalLM" and m.dtype == torch.bfloat16, (type(m).__name__, m.dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    c = m.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.vocab_size, c.rms_norm_eps) == \
        (1, 64, 2, 300, 1e-6), c
    assert c.rope_parameters["rope_theta"] == 1e6 and c.tie_word_embeddings, c
    assert float(m.model.layers[0].self_attn.k_proj.bias.detach().float().std()) > 0.01     # drawn, not zeros


@pytest.mark.parametrize("ahead", [False, True])
def test_bench_offload_split_adds_up_to_the_step(ahead):
    """bench_offload's split of the median step: compute, collectives exposed, update arithmetic, I/O
    waited (reads, write slots, last writes), update ahead waited, rest. The parts are measured apart
    (engine.timeline), so they add up to the step with a rest >= 0 only if none is counted twice."""
    args = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--steps", "3", "--probe", "1M",
            "--offload-dir", "/tmp", "--offload", "optimizer,params"] + (["--ahead"] if ahead else [])
    rc, out = run([PY, "-m", "mpi4py", os.path.join("benchmarks", "bench_offload.py"), *args], ranks=2)
    check(rc, out, r"^  step [\d.]+ s = compute", "benchmarks/bench_offload.py " + " ".join(args))
    ln = next(x for x in out.splitlines() if x.startswith("  step "))
    step = float(re.match(r"  step ([\d.]+) s = ", ln)[1])
    io = re.search(r"I/O waited ([\d.]+) \(reads ([\d.]+) \+ write slots ([\d.]+) \+ last writes ([\d.]+)\)", ln)
    parts = dict((k, float(v)) for k, v in re.findall(r"(compute|collectives exposed|update arithmetic|I/O waited|"
                                                       r"update ahead waited|rest) ([-\d.]+)", ln))
    assert len(parts) == 6 and parts["rest"] >= 0, ln
    assert abs(sum(parts.values()) - step) <= 0.001 * 6, ln           # printed to the ms: rounding alone
    if ahead:         # the update's own seconds ran beside the forward: not on the step's thread
        assert parts["update arithmetic"] == parts["I/O waited"] == 0.0 and io is None, ln
    else:
        assert io and abs(sum(float(g) for g in io.groups()[1:]) - float(io[1])) <= 0.002, ln


def _capacity_module():
    """benchmarks/capacity.py as a fresh module (a script, not a package: loaded from its path)."""
    spec = importlib.util.spec_from_file_location("capacity_tested", os.path.join(ROOT, "benchmarks", "capacity.py"))
    cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cap)
    return cap


def test_capacity_probe_counts_only_memory_as_not_fitting(monkeypatch):
    """capacity.py's verdict: a run that ran out of its cap (the lines Python, torch, OpenBLAS and a thread
    print) does not fit; a failure of another kind (a taken port) is run again, and twice is no verdict."""
    cap = _capacity_module()
    calls = []

    def runs(*outs):
        it = iter(outs)
        monkeypatch.setattr(cap, "run_probe", lambda *a: calls.append(1) or next(it))

    dims = {"n_layer": 1}
    for line in ["[rank0]: MemoryError", "RuntimeError: Resource temporarily unavailable",
                 "OpenBLAS error: Memory allocation still failed after 10 retries, giving up.",
                 "RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 8388608 bytes. Error code 12 (Cannot allocate memory)",
                 "timed out after 200 s"]:
        calls.clear()
        runs((False, "starting\n" + line + "\n"))
        assert cap.probe("3", 2, 1 << 20, dims, None) is False and len(calls) == 1, line
    calls.clear()
    runs((False, "RuntimeError: The server socket has failed to listen on any local network address. "
                 "port: 29500 (errno: 98 - Address already in use)."), (True, ""))
    assert cap.probe("fsdp2-full", 2, 1 << 20, dims, None) is True and len(calls) == 2
    runs((False, "ValueError: no such mode"), (False, "ValueError: no such mode"))
    with pytest.raises(cap.ProbeFailed, match="no such mode"):
        cap.probe("fsdp2-full", 2, 1 << 20, dims, None)
    # the uncapped start of a peer (refusal) is run once more too; what it says skips mpirun's banner rules
    a = types.SimpleNamespace(n_embd=64, n_head=2)
    calls.clear()
    runs((False, "Address already in use\n" + "-" * 74 + "\n"), (True, ""))
    assert cap.refusal("fsdp2-full", 2, a) == "" and len(calls) == 2
    banner = "-" * 74 + "\nprterun detected that one or more processes exited with non-zero status\n" + "-" * 74
    runs((False, "ValueError: no such mode\n" + banner), (False, "ValueError: no such mode\n" + banner))
    assert cap.refusal("fsdp2-full", 2, a) == "ValueError: no such mode"
    assert cap.last_error("starting\n" + banner).startswith("prterun detected that one or more processes")


def test_capacity_rows_run_when_a_baseline_has_no_verdict(monkeypatch, capsys):
    """A side whose floor search fails twice for a reason that is not memory (a rank aborting without a
    line) leaves that baseline out with its reason; the table's rows still run and say what fits."""
    cap = _capacity_module()

    def probe(mode, n, c, dims, a):           # the tiny model's search fails; the rows fit up to 3 layers
        if dims.get("n_embd") == cap.TINY["n_embd"] and "n_layer" in dims and c < (1 << 30):
            raise cap.ProbeFailed("signal 6 (Aborted).")
        return dims["n_layer"] <= 3

    monkeypatch.setattr(cap, "probe", probe)
    rc = cap.main(["--cap", "1GiB", "--nd", "2", "--stages", "0", "--offload", "", "--peers", "", "--max-layers", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "baseline (ringzero, Nd = 2): no verdict, a probe failed twice, not for memory: signal 6 (Aborted)." in out
    row = [ln for ln in out.splitlines() if ln.startswith("| stage 0 | 2 |")]
    assert len(row) == 1 and row[0].split(" | ")[2] == "3" and "baseline not measured" in row[0], out


def test_step_table_rest_is_taken_step_by_step(monkeypatch):
    """train_peer's "the rest" column: the median over the steps of step - compute - waits, each step's
    own. Here every step's rest is 1 ms while the medians of the parts would give a negative one."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import peer_tables
    recs = [{"step_time_s": 0.091, "compute_s": 0.060, "reduce_exposed_s": 0.030},
            {"step_time_s": 0.091, "compute_s": 0.080, "reduce_exposed_s": 0.010},
            {"step_time_s": 0.111, "compute_s": 0.080, "reduce_exposed_s": 0.030}]
    med = lambda k: sorted(r[k] for r in recs)[1]                      # noqa: E731
    assert med("step_time_s") - med("compute_s") - med("reduce_exposed_s") < -0.018   # a difference of medians
    timeline = {k: med(k) for k in recs[0]} | peer_tables.step_rest(recs)
    row = {"ok": True, "mode": "ringzero", "ranks": 2, "timeline": timeline}
    assert peer_tables.step_split(row, 0)["rest"] == pytest.approx(0.001)
    assert peer_tables.step_table([row], 0).splitlines()[-1] == "| ringzero | 2 | 91.0 | 80.0 | 30.0 | 1.0 |"
    torch_row = {"ok": True, "mode": "ddp", "ranks": 2, "compute_s": [0.05], "fwd_bwd_s": [0.09, 0.07, 0.095],
                 "step_time_s": [0.10, 0.09, 0.096]}                  # each step's rest: 10, 20, 1 ms
    assert peer_tables.step_split(torch_row, 0)["rest"] == pytest.approx(0.010)
    assert peer_tables.step_rest([{"step_time_s": 1.0}]) == {}


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (RINGZERO_PEER=1 installs it)")
def test_a_stale_deepspeed_build_lock_is_removed(tmp_path, monkeypatch, capsys):
    """A cpu_adam build killed midway leaves torch's ``lock`` file, and every later DeepSpeed run waits on it
    forever: peer_engines removes one older than any build, and leaves a young one (a build under way)."""
    import time

    import torch
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import peer_engines
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    assert peer_engines.clear_stale_build_lock(torch) is None and lock.exists()          # young: a build's
    old = time.time() - peer_engines.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert peer_engines.clear_stale_build_lock(torch) == str(lock) and not lock.exists()
    assert "left by a build killed midway" in capsys.readouterr().out
    assert peer_engines.clear_stale_build_lock(torch) is None                             # none: nothing to do


def _check_sharded_peers(rc, out, what):
    """FSDP2's row where torch is; DeepSpeed's three rows where deepspeed is, else the line saying they were
    skipped; under CI's peer install (RINGZERO_PEER=1) deepspeed must be there."""
    if not HAVE_TORCH:
        check(rc, out, r"torch is not installed", what + ": the line saying the torch rows are skipped")
        return
    check(rc, out, r"^\| fsdp2-full \| 2 \| \d+", what + ": the FSDP2 row")
    if not _need_ds(rc, out, what, r"deepspeed is not installed"):
        return
    # each row's "loss first → last" (3 decimals) is ringzero's: the same model, weights, batches and AdamW
    loss = re.search(r"^\| ringzero \| 2 \| \d+ \| [^|]+\| [^|]+\| ([\d.]+ → [\d.]+) \|", out, re.MULTILINE)
    assert loss, f"{what}: no ringzero row with its losses"
    for m in ("fsdp2-full", "ds-zero1", "ds-zero2", "ds-zero3"):
        check(rc, out, rf"^\| {m} \| 2 \| \d+ \| [^|]+\| [^|]+\| {re.escape(loss.group(1))} \|",
              what + f": the {m} row, with ringzero's losses {loss.group(1)}")
    check(rc, out, r"ds-zero3 DeepSpeedCPUAdam|ds-zero3 torch.optim.AdamW", what + ": which AdamW DeepSpeed ran")


def _need_ds(rc, out, what, line):
    """True where deepspeed is installed; else the benchmark's line saying its rows were skipped is checked
    (and under CI's peer install, RINGZERO_PEER=1, its absence fails)."""
    if HAVE_DS:
        return True
    if os.environ.get("RINGZERO_PEER") == "1":
        pytest.fail("RINGZERO_PEER=1 but deepspeed is not installed (setup.cfg's peer extra pins it)")
    check(rc, out, line, what + ": the line saying the ds-zero rows are skipped")
    print(f"{what}: deepspeed is not installed here, so its ds-zero rows were skipped", file=sys.stderr)
    return False


def _check_capacity_peers(rc, out, what):
    """Each peer trains the 1-layer model under the cap (``layers`` 1, no 'did not start' row)."""
    if not HAVE_TORCH:
        check(rc, out, r"torch is not installed", what + ": the line saying the torch rows are skipped")
        return
    check(rc, out, r"^\| fsdp2-full \| 2 \| 1 ", what + ": the meta-initialized FSDP2 row")
    if _need_ds(rc, out, what, r"deepspeed is not installed"):
        check(rc, out, r"^\| ds-zero3 \| 2 \| 1 ", what + ": DeepSpeed ZeRO-3's row")


@pytest.mark.parametrize("script", ["bench_stages.py", "check_simulate.py"])
@pytest.mark.parametrize("bad", ["3", "2x", "1x2", "axb"])
def test_bad_cluster_is_one_line_exit_2(script, bad):
    rc, out = run([PY, os.path.join("benchmarks", script), "--cluster", bad], timeout=60)
    name = script[:-3]
    assert rc == 2 and out.strip().splitlines() == [out.strip()] and out.startswith(f"{name}: --cluster"), \
        f"benchmarks/{script} --cluster {bad}: exit {rc}, output:\n{out}"


def _before_after(name, tmp_path, first_args, table):
    """Run benchmarks/NAME against HEAD itself (a worktree of HEAD under tmp_path) with first_args,
    check its closing line (table, with {rev}), then that a bad commit or round count is one line
    and exit 2. Returns the first run's output."""
    import subprocess
    sh = os.path.join(ROOT, "benchmarks", name)
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(PY) + os.pathsep + env.get("PATH", "")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    rev = head.stdout.strip()

    def go(*args, timeout=600):
        p = subprocess.run([sh, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    try:
        rc, out = go(rev, *first_args)
        check(rc, out, table.format(rev=rev), name)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", str(tmp_path / f"ringzero-{rev}")],
                       capture_output=True)
    for bad, msg in ((["no-such-rev"], "is not a commit"), ([rev, "x"], "ROUNDS must be an integer")):
        rc, bad_out = go(*bad, timeout=60)
        lines = [ln for ln in bad_out.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and msg in lines[0], bad_out
    return out


def test_train_before_after_sh(tmp_path):
    """benchmarks/train_before_after.sh: 30 tiny steps in each tree; the same loss from both."""
    # 30 tiny steps: enough that each tree's "N steps in S s" is not 0.0 s
    out = _before_after("train_before_after.sh", tmp_path,
                        ["1", "--", "--steps", "30", "--eval-interval", "0", "--eval-batches", "1", *TINY_GPT],
                        r"^this tree / {rev}: [\d.]+x the training time")
    losses = re.findall(r"final held-out loss ([\d.]+)", out)
    assert len(losses) == 2 and losses[0] == losses[1], out


def test_model_before_after_sh(tmp_path):
    """benchmarks/model_before_after.sh: a tiny fwd+bwd in each tree, a row per run and the ratios."""
    out = _before_after("model_before_after.sh", tmp_path,
                        ["1", "--", "--batch", "1", "--seq", "16", "--repeats", "2", "--warmup", "0"],
                        r"^this tree / {rev}: [\d.]+x the fwd\+bwd time .*; "
                        r"[\d.]+x and [\d.]+x their GEMM floors, [\d.]+x of each other$")
    assert len(re.findall(r"round 1: fwd\+bwd +[\d.]+ ms, GEMM floor +[\d.]+ ms", out)) == 2, out


def test_bench_offload_refuses_up_front_with_the_numbers(monkeypatch):
    """bench_offload checks each engine's memory before it allocates, as the trainer does: on a node
    with 1 MiB available it ends with the memory check's one line on exit 2, not a kernel kill."""
    monkeypatch.setenv("RINGZERO_MEM_AVAILABLE", "1MiB")
    args = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--steps", "1", "--probe", "1M",
            "--offload-dir", "/tmp", "--compare-ram"]
    rc, out = run([PY, "-m", "mpi4py", os.path.join("benchmarks", "bench_offload.py"), *args], ranks=2)
    lines = [x for x in out.splitlines() if x.startswith("bench_offload: ")]
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    assert len(lines) == 1 and re.match(r"bench_offload: memory: stage 3 needs [\d,.]+ MiB per rank .*more than "
                                        r"there is", lines[0]), out[-3000:]
    assert "per step" not in out, out[-3000:]         # refused before the first engine's steps


def test_bench_offload_makes_its_folder(tmp_path):
    """--offload-dir is made where it is missing (mkdir -p, as the trainer and DeepSpeed's swap folder),
    and one that cannot be made is one line on exit 2 (it was a bare '[Errno 2] No such file or directory')."""
    base = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--steps", "1", "--probe", "1M"]
    made = tmp_path / "a" / "b"
    rc, out = run([PY, "-m", "mpi4py", os.path.join("benchmarks", "bench_offload.py"), *base,
                   "--offload-dir", str(made)], ranks=2)
    check(rc, out, r"^step / max\(compute \+ arithmetic, I/O\) = [\d.]+$", "bench_offload.py, a missing folder")
    assert made.is_dir()
    (tmp_path / "file").write_text("not a folder")
    rc, out = run([PY, "-m", "mpi4py", os.path.join("benchmarks", "bench_offload.py"), *base,
                   "--offload-dir", str(tmp_path / "file" / "sub")], ranks=2)
    lines = [x for x in out.splitlines() if x.startswith("bench_offload: ")]
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    assert len(lines) == 1 and "cannot be made" in lines[0], out[-3000:]


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (RINGZERO_PEER=1 installs it)")
def test_a_taken_rendezvous_port_is_launched_again(tmp_path, monkeypatch, capsys):
    """train_peer picks a free port for the torch peers' rendezvous, but another process can bind it before
    rank 0's TCPStore does. Here the first port handed out is held open: that launch fails with EADDRINUSE,
    and the mode is launched again on the next port and gives its row."""
    import socket
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import train_peer
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken, train_peer.free_port()])
        monkeypatch.setattr(train_peer, "free_port", lambda: next(ports))
        a = train_peer.parse(["--ranks", "2", "--steps", "2", "--warmup", "1", "--modes", "ddp",
                              "--timeout", "200", "--compute-steps", "0", *TINY_GPT])
        row = train_peer.run_mode("ddp", 2, a, str(tmp_path))
    err = capsys.readouterr().err
    assert row["ok"], row.get("error", "") + row.get("log_tail", "")
    assert "was taken before the rendezvous bound it; launching again" in err, err
    assert f"--port {taken} " not in row["command"] and len(row["loss"]) == 2
    assert next(ports, None) is None                    # both ports were used: one failed launch, one good
