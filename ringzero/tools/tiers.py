"""The memory tiers: what each stage keeps in RAM, device memory and on disk per rank, with and without offload.

What it is
    ``tier_rows(...)``: for every stage and offload choice (none; ``optimizer``: master, Adam m and v;
    ``optimizer,params``: also stage 3's param shard), the bytes per rank on each tier and whether the
    run fits a node's RAM, a rank's device memory and the node's disk. ``print_tiers`` is
    ``python -m ringzero.estimate --ram 24GiB --disk 80GB [--device-mem 80GB]``.

        CPU run (no --device-mem)   RAM: state not offloaded + workspace + activations; disk: offloaded state
        GPU run (--device-mem)      device: the same as a CPU run's RAM; host RAM: offloaded state while the
                                    node's RAM holds it (pinned), else disk

    ``offload_time(step, io, disk_bw, sharing)``: a step with offload, from a simulated step
    (tools/simulate.py's step_time) and the bytes the update streams (budget.offload_io_bytes), blocking
    and streamed (``python -m ringzero.simulate --disk-bw``). ``print_offload`` is ``python -m
    ringzero.explain offload``.

What it is not
    The offload itself (runtime/), or a measurement: arithmetic on accounting.py's classes
    (runtime/budget.py places them on tiers).
"""
from __future__ import annotations

import sys

from ringzero.runtime import accounting as acc
from ringzero.runtime import budget

GB, GIB = 10**9, 2**30
OFFLOADS = ((), ("optimizer",), ("optimizer", "params"))


def _off_name(off) -> str:
    return ",".join(off) if off else "-"


def tier_rows(psi: int, nd: int, nodes: int = 1, extra_per_rank: int = 0, precision: str = "fp16",
              grad_accum: int = 1, ram: int | None = None, disk: int | None = None,
              device_mem: int | None = None, extra_of=None) -> list:
    """One dict per (stage, offload): bytes per rank on each tier and the verdict.

    ``extra_per_rank``: workspace + activations per rank (or ``extra_of(stage) -> bytes``); they stay in
    RAM (device memory on a GPU run). ``ram`` and ``disk`` are per node (nd/nodes ranks), ``device_mem``
    per rank. A field left None is not checked."""
    ppn = nd // nodes
    rows = []
    for st in ("0", "1", "2", "3"):
        for off in OFFLOADS:
            if "params" in off and st != "3":
                continue                          # params are offloaded only where they are sharded
            t = budget.tier_totals(budget.state_by_tier(st, psi, nd, None, precision, grad_accum, off))
            extra = extra_of(st) if extra_of else extra_per_rank
            near, far = t["ram"] + extra, t["disk"]  # near: RAM (CPU run) or device memory (GPU run)
            if device_mem is None:
                r = {"ram": near, "device": 0, "disk": far}
            else:
                pinned = far if ram is None or ppn * far <= ram else 0
                r = {"ram": pinned, "device": near, "disk": far - pinned}
            why = []
            if ram is not None and ppn * r["ram"] > ram:
                why.append("RAM")
            if device_mem is not None and r["device"] > device_mem:
                why.append("device")
            if disk is not None and ppn * r["disk"] > disk:
                why.append("disk")
            rows.append({"stage": st, "offload": _off_name(off), "per_rank": r,
                         "per_node": {k: ppn * v for k, v in r.items()},
                         "io": budget.offload_io_bytes(st, psi, nd, None, precision, grad_accum, off),
                         "fits": not why, "short_of": why})
    return rows


def print_tiers(rows, psi, nd, nodes, ram, disk, device_mem, extra_note: str, f=None):
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    ppn = nd // nodes

    def g(b):
        return f"{b / GIB:,.2f}"
    p(f"\nTiers: Ψ = {psi:,}, Nd = {nd} on {nodes} node{'s' if nodes > 1 else ''} of {ppn} rank"
      f"{'s' if ppn > 1 else ''}; " + ("a GPU run: state not offloaded, workspace and activations in device "
                                       "memory, offloaded state in host RAM while the node's RAM holds it, "
                                       "else on disk" if device_mem else
                                       "a CPU run: state not offloaded, workspace and activations in RAM, "
                                       "offloaded state on disk"))
    lim = ", ".join(x for x in (f"RAM {g(ram)} GiB per node" if ram else "", f"disk {g(disk)} GiB per node"
                                if disk else "", f"device {g(device_mem)} GiB per rank" if device_mem else "") if x)
    p(f"  limits: {lim or 'none given'}; {extra_note}")
    p(f"  {'stage':<6}{'offload':<18}{'RAM/rank':>10}{'device/rank':>13}{'disk/rank':>11}{'RAM/node':>10}"
      f"{'disk/node':>11}{'update I/O/rank (read+written)':>32}  fits")
    for r in rows:
        a, n, io = r["per_rank"], r["per_node"], r["io"]
        p(f"  {r['stage']:<6}{r['offload']:<18}{g(a['ram']):>10}{g(a['device']):>13}{g(a['disk']):>11}"
          f"{g(n['ram']):>10}{g(n['disk']):>11}{(g(io['read']) + ' + ' + g(io['written'])):>32}  "
          + ("yes" if r["fits"] else "no: " + ", ".join(r["short_of"])))
    ok = [f"stage {r['stage']}" + (f" --offload {r['offload']}" if r["offload"] != "-" else "")
          for r in rows if r["fits"]]
    p("  GiB = 2^30 B. Fits: " + ("; ".join(ok) if ok else "nothing at this Nd: more ranks (nodes) or a smaller model"))


def offload_time(step: dict, io: dict, disk_bw: float, sharing: int = 1, grad_accum: int = 1) -> dict:
    """A step with offload, from ``step`` (simulate.step_time's dict: step_s, update, ...) and ``io``
    (budget.offload_io_bytes), on a disk of ``disk_bw`` bytes/s shared by ``sharing`` ranks.

        optimizer I/O   io_opt = sharing · 2 · (12Ψ/Nd) / disk_bw     (read and written by the update)
        params I/O      io_par = sharing · (2K + 1) · (2Ψ/Nd) / disk_bw  (read per gather, written once)
        blocking        step + io_opt + io_par                          (read, update, write in turn)
        streamed        max(step - update, io_par) + max(update, io_opt)  (tiles read and written beside
                        the update; the param shard read ahead of its gathers, beside the compute)
    """
    opt_s = sharing * 2 * io["optimizer"] / disk_bw
    par_s = sharing * (2 * grad_accum + 1) * io["params_per_gather"] / disk_bw
    rest = step["step_s"] - step["update"]
    return {"io_s": opt_s + par_s, "io_optimizer_s": opt_s, "io_params_s": par_s,
            "blocking_s": step["step_s"] + opt_s + par_s,
            "streamed_s": max(rest, par_s) + max(step["update"], opt_s)}


def print_offload(psi: int, nd: int, ppn: int, disk_bw: float, precision: str = "fp16", f=None):
    """``python -m ringzero.explain offload``: the tiers, what moves, what it costs, with this model's numbers."""
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    sb = acc.storage_bytes(precision)
    s0 = acc.model_state_bytes("0", psi, 1, precision=precision)
    p(f"Ψ = {psi:,}, Nd = {nd} ({ppn} ranks per node), {precision}; disk {disk_bw / 1e9:g} GB/s per node.\n")
    p(f"1. What the 16 bytes per parameter are, and which are needed when. Of {sum(s0.values()) / GB:.2f} GB "
      f"of model state: params {s0['params_fp16'] / GB:.2f} GB ({sb} B) and grads {s0['grads_fp16'] / GB:.2f} "
      f"GB ({sb} B) are read and written by every forward and backward; master, Adam m and v "
      f"({(s0['master_fp32'] + s0['adam_m_fp32'] + s0['adam_v_fp32']) / GB:.2f} GB, 12 B) only by the update, "
      "once per step. That 75 % is what offload moves to a larger, slower tier.")
    p("\n2. The tiers, per rank (runtime/budget.py state_by_tier):")
    p(f"  {'stage':<7}{'offload':<19}{'in RAM (device)':>16}{'on disk (host)':>16}{'update reads':>14}"
      f"{'and writes':>12}")
    for st in ("0", "1", "2", "3"):
        for off in OFFLOADS:
            if "params" in off and st != "3":
                continue
            t = budget.tier_totals(budget.state_by_tier(st, psi, nd, None, precision, 1, off))
            io = budget.offload_io_bytes(st, psi, nd, None, precision, 1, off)
            p(f"  {st:<7}{_off_name(off):<19}{t['ram'] / GB:>13.3f} GB{t['disk'] / GB:>13.3f} GB"
              f"{io['read'] / GB:>11.3f} GB{io['written'] / GB:>9.3f} GB")
    io3 = budget.offload_io_bytes("3", psi, nd, None, precision, 1, ("optimizer",))
    t_opt = ppn * (io3["read"] + io3["written"]) / disk_bw
    p(f"\n3. The cost: optimizer offload reads and writes 12Ψ/Nd = {io3['optimizer'] / GB:.3f} GB per rank per "
      f"step each way. {ppn} ranks share the node's disk: {t_opt:.2f} s of I/O per step at {disk_bw / 1e9:g} GB/s. "
      "Params offload (stage 3) adds 2Ψ/Nd read per gather (forward and backward) and written by the update.")
    p("  Blocking, that time adds to the step. Streamed (tile i+1 read while tile i is updated and tile i-1 "
      "written, a few fixed host buffers), the update takes max(its compute, its I/O); "
      "the simulator's --disk-bw predicts both.")
    p("\n4. Who does this, and what their users met:")
    p("  DeepSpeed ZeRO-Offload: master, m, v and the step on the CPU (its CPU Adam: AVX, OpenMP); "
      "ZeRO-Infinity: the same on NVMe, tiles through pinned buffers, pipelined reads and writes; "
      "FSDP CPUOffload: params, grads and optimizer state on the CPU, the step there.")
    p("  Reported: the CPU step dominating (3-10x slower steps), pinned memory exhausting host RAM (killed "
      "with -9), checkpoints under NVMe offload, and the accelerator idle while the optimizer runs.")
    p("  ringzero refuses at start a run that will not fit (docs/training.md) and says which flag would: "
      "a higher --stage, --activation-checkpointing, --offload, or more nodes.")


# ---- the estimate's flags -------------------------------------------------------------
def add_tier_args(ap):
    """--ram / --disk / --device-mem / --nodes / --activation-checkpointing of ``python -m ringzero.estimate``."""
    g = ap.add_argument_group("tiers (what fits where, with and without offload)")
    g.add_argument("--ram", help="host RAM per node, e.g. 24GiB")
    g.add_argument("--disk", help="disk per node for offloaded state, e.g. 80GB")
    g.add_argument("--device-mem", help="device memory per rank (a GPU run), e.g. 80GB")
    g.add_argument("--nodes", type=int, default=1, help="the Nd ranks span this many nodes (default 1)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="count activations with checkpointing (with --batch and a GPT shape)")


def run_tiers(a, psi: int, cfg, seq, f=None) -> list | None:
    """Print the tier table when --ram, --disk or --device-mem is given; returns its rows (or None)."""
    from ringzero.sizes import parse_size
    if not (a.ram or a.disk or a.device_mem):
        return None
    if a.nodes < 1 or a.nd % a.nodes:
        raise ValueError(f"--nodes must be >= 1 and divide --nd: got nd={a.nd}, nodes={a.nodes}")
    ram, disk, dev = (parse_size(x) if x else None for x in (a.ram, a.disk, a.device_mem))
    extra_of, note = None, "model state only: give a GPT shape and --batch to count workspace and activations"
    if cfg is not None and a.batch:
        extra_of = _extra_of(cfg, a.nd, a.nodes, a.batch, seq, a.precision, a.grad_accum,
                             a.activation_checkpointing, gpu=dev is not None)
        note = (f"workspace and activations counted (micro-batch {a.batch // max(1, a.grad_accum)} x {seq}, "
                f"{'checkpointing' if a.activation_checkpointing else 'no checkpointing'}, "
                f"{'storage-dtype' if dev else 'fp32'} compute)")
    rows = tier_rows(psi, a.nd, a.nodes, 0, a.precision, a.grad_accum, ram, disk, dev, extra_of)
    print_tiers(rows, psi, a.nd, a.nodes, ram, disk, dev, note, f)
    return rows


def _extra_of(cfg, nd, nodes, batch, seq, precision, K, ckpt, gpu):
    """stage -> workspace + activations per rank of a GPT, as the trainer's start-up check counts them."""
    import numpy as np

    from ringzero.comm.schedule import TREE_BYTES
    from ringzero.nn.families import units_of
    from ringzero.runtime.flat import Layout
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.state import storage_dtype
    from ringzero.tools.activations import training_bytes
    L = Layout(units_of(cfg), shards=nd)
    sd = storage_dtype(precision)
    cd = sd if gpu else np.dtype(np.float32)
    act = training_bytes(cfg, max(1, batch // K), seq, ckpt, cd.itemsize)
    overlap = nodes > 1

    def extra(st):
        P = StagePolicy.of(st)
        bucket = 0 if overlap or P.gather_params else TREE_BYTES
        return act + budget.workspace_bytes(L, P, sd, cd, K, overlap, 1, bucket,
                                            [u != 0 for u in range(len(L.units))])
    return extra
