"""What the trainer prints and records at the start and the end of a run.

What it is
    ``start_report`` prints what runs (model, data, Ψ, stage) and the model
    state per rank, measured beside the formulas, and returns the memory
    report. ``end_report`` prints the final held-out loss, the throughput, the
    traffic per step beside its formula (and the part across nodes) and every
    rank's peak RSS, and returns those figures; ``summarize`` turns them into
    the closing metrics record (ringzero/metrics.py's SUMMARY_KEYS).

What it is not
    The loop (train.py) or the accounting's formulas (runtime/accounting.py):
    this file only formats what they give. Only rank 0's ``say`` prints.
"""
from __future__ import annotations

import sys

import numpy as np

from ringzero.app.config import Config
from ringzero.runtime.offload import memory_fs


def _mib(b) -> str:
    return f"{b / 2**20:9.2f} MiB"


def start_report(say, cfg: Config, corpus, engine, H: float) -> dict:
    """Print what runs and the model state per rank beside the formulas; return the memory report."""
    from ringzero.runtime import accounting
    L, n, mem = engine.layout, engine.topology.world_size, engine.memory_report()
    g, pr, K = engine.model.cfg, cfg.precision, cfg.grad_accum
    say(f"ringzero | {corpus.describe()}")
    kv = f" {g.n_kv_head}KV" if hasattr(g, "n_kv_head") else ""            # a Llama-family model
    say(f"ringzero | {'Llama' if kv else 'GPT'} {cfg.model + ' ' if cfg.model else ''}{g.n_layer}L {g.n_head}H{kv} "
        f"{g.n_embd}C "
        f"T={cfg.seq_len} (context {g.block_size}) V={g.vocab}, Ψ = {L.numel:,} "
        f"(padded {L.padded:,}), Nd = {n}, stage {cfg.stage} "
        f"({accounting.bytes_per_param_formula(cfg.stage, pr, K)}), {pr}"
        f"{' (no loss scaler)' if pr == 'bf16' else ''}, {cfg.device}"
        f"{', overlap' if engine.overlap else ''}{f', prefetch {engine.prefetch}' if engine.prefetch else ''}")
    if K > 1:
        say(f"ringzero | grad accumulation: {K} micro-batches of {cfg.batch // K} rows per step "
            f"({'summed on the rank, reduced once' if engine.policy.accumulate_locally else 'reduce-scattered each'}"
            f"; global batch {cfg.batch * n} sequences)")
    say(f"ringzero | held-out unigram entropy {H:.3f} nats (target: final eval loss <= {0.6 * H:.3f})")
    off = engine.offload.enabled
    # the tiers shown: RAM and disk; a device run's offload the device first (host_tier.py)
    dev = off and engine.device_link is not None
    cols = ("device", "ram", "disk") if dev else ("ram", "disk")
    say("model state per rank       measured       formula" + (("   tier     device        RAM           disk (blocks)"
                                                                 if dev else "   tier   RAM           disk (blocks)")
                                                                if off else ""))
    for c, d in mem["classes"].items():
        say(f"  {accounting.class_name(c, pr):<18} {_mib(d['measured_bytes'])} {_mib(d['formula_bytes'])}"
            + (f"   {d['tier']:<{7 if dev else 5}}" + "".join(f" {_mib(d[f'{t}_bytes'])}" for t in cols)
               if off else ""))
    say(f"  {'total':<18} {_mib(mem['model_state_measured'])} {_mib(mem['model_state_formula'])}"
        + (" " * (11 if dev else 9) + " ".join(_mib(mem['tiers'][t]) for t in cols) if off else ""))
    if off:
        where = f"in {engine.offload.dir}" if engine.offload.dir else "in host memory"
        say(f"  offload {mem['offload']} {where}: the update streams tiles of "
            f"{engine.offload_stream.tile:,} elements through {engine.offload.buffers} buffers "
            f"({_mib(mem['offload_buffers'] - mem['offload_delay_bytes']).strip()}), "
            f"{engine.offload_stream.depth} read ahead, {engine.offload.io_threads} requests in flight"
            + (f", {engine.offload_stream.io.mode}" if engine.offload.dir else "")
            + (", beside the next forward (ahead)" if engine.offload.ahead else "")
            + (f"; delayed one step after {engine.offload.delay} exact step"
               f"{'' if engine.offload.delay == 1 else 's'}, its buffer "
               f"{_mib(mem['offload_delay_bytes']).strip()} (docs/offload.md)" if engine.delayed is not None else ""))
        fs = memory_fs(engine.offload.dir) if engine.offload.dir else None
        if fs:
            say(f"  note: {engine.offload.dir} is a {fs}: the offloaded files are held in memory, not on disk "
                "(the memory check counts them as the node's memory); HINT: an --offload-dir on a disk frees it")
        if engine.pinned:
            say(f"  host memory pinned {_mib(mem['host_pinned']).strip()} (limit "
                f"{_mib(engine.pinned.limit).strip()}), pageable {_mib(mem['host_pageable']).strip()}; "
                "grads and params tiles cross the link on a CuPy stream each")
    if mem.get("zeropp"):          # ZeRO++'s own buffers (runtime/zeropp.py), beside their formulas
        say(f"  ZeRO++ {mem['zeropp']}:"
            + (f" hpZ secondary shard {_mib(mem['hpz_secondary_bytes']).strip()} (formula "
               f"{mem.get('hpz_itemsize', 2)}Ψ/P, P = "
               f"{mem['hpz_ranks_per_node']} ranks per node: {_mib(mem['hpz_secondary_formula_bytes']).strip()})"
               if engine.zeropp.hpz else " no hpZ shard")
            + (f", qgZ error-feedback residual {_mib(mem['qgz_residual_bytes']).strip()} (formula 4Ψ: "
               f"{_mib(mem['qgz_residual_formula_bytes']).strip()})" if mem["qgz_residual_bytes"] else ""))
    say("  workspace (not model state): " + ", ".join(f"{k} {_mib(v).strip()}" for k, v in mem["workspace"].items()))
    others = []
    for st in accounting.STAGES:
        hybrid = accounting.replicated_across_nodes(st)
        if hybrid and not engine.policy.hybrid:
            continue        # hybrid is shown only when it runs: its group is the node's
        rpn = L.shards if hybrid else None
        others.append(f"{st}: {accounting.model_state_total(st, L.padded, n, rpn, pr, K) / 2**20:.2f} MiB")
    say("  every stage at this Nd: " + " | ".join(others))
    return mem


def end_report(say, cfg: Config, engine, loop, eval_loss: float, H: float) -> dict:
    """Print the final loss, throughput and traffic; return the figures the summary keeps.

    loop: the train.LoopResult (times, losses, wall)."""
    traffic = engine.traffic_report()     # the last training step's ledger
    train_loss = float(np.mean(loop.losses[-10:])) if loop.losses else float("nan")
    steady = loop.times[min(2, len(loop.times) - 1):] or [float("nan")]
    tput = cfg.batch * cfg.seq_len * engine.topology.world_size / float(np.median(steady))
    rel = 100 * (1 - eval_loss / H)
    say(f"ringzero | final held-out loss {eval_loss:.4f} nats vs unigram entropy {H:.4f} "
        f"({abs(rel):.1f}% {'below' if rel >= 0 else 'above'}); train loss (last 10) {train_loss:.4f}")
    say(f"ringzero | throughput {tput:,.0f} tokens/s (median step {np.median(steady) * 1e3:.1f} ms), "
        f"{cfg.steps} steps in {loop.wall:.1f} s")
    say(f"traffic per step per rank  measured {traffic['measured_bytes_per_step']:,} B   formula "
        f"{'(unquantized) ' if traffic.get('zeropp') else ''}{traffic['formula']} = "
        f"{traffic['formula_bytes_per_step']:,} B")
    taken, run = traffic.get("measured_step"), traffic.get("steps_run", 0)
    if taken is None and run and traffic["measured_bytes_per_step"] != traffic["plan_bytes_per_step"]:
        say("  every step was skipped (fp16 overflow): a skipped step updates nothing, so it all-gathers no "
            "updated params")
    elif taken is not None and taken != run - 1:
        say(f"  (step {taken}, the last step taken: the {run - 1 - taken} after it were skipped for fp16 overflow, "
            "and a skipped step all-gathers no updated params)")
    for op, b in traffic["by_op"].items():
        if b:
            say(f"  {op:<22} {b:,} B")
    if traffic["plan_bytes_per_step"] != traffic["formula_bytes_per_step"] and not traffic.get("zeropp"):
        say(f"  differs by {traffic['formula_bytes_per_step'] - traffic['measured_bytes_per_step']:,} B: the "
            f"last unit's forward and backward are adjacent, so it is gathered once, not twice (as FSDP does)")
    if traffic["nodes"] > 1:              # the part that left the node (N nodes of P ranks)
        f = traffic["formula_internode_bytes_per_step"]
        say(f"  across nodes ({traffic['node_map']})  measured {traffic['measured_internode_bytes_per_step']:,} B   "
            + (f"formula {traffic['internode_formula']} = {f:,} B" if f is not None else "no formula"))
    if traffic.get("zeropp_hybrid"):
        say(f"  ZeRO++ {traffic['zeropp']} at hybrid: quantized inside the node; across nodes only the replicas' "
            "all-reduce (full precision)")
    elif traffic.get("zeropp"):            # ZeRO++: the cross-node bytes in Ψ units beside 3Ψ -> 0.75Ψ
        ph = traffic["zeropp_phases_psi"]
        say(f"  ZeRO++ {traffic['zeropp']} across nodes: measured {traffic['zeropp_measured_psi']:.4f} x (N-1)/Nd·Ψ·"
            f"{np.dtype(engine.storage_dtype).itemsize} B   formula {traffic['zeropp_formula_psi']:.4f} (forward "
            f"gather {ph['forward_all_gather']:.4f} + backward gather {ph['backward_all_gather']:.4f} + "
            f"reduce-scatter {ph['reduce_scatter']:.4f}; unquantized 3; ZeRO++'s 0.75 with no block scales) = "
            f"{traffic['zeropp_formula_internode_bytes_per_step']:,} B"
            + (" (a step after a skipped one sends qgZ's bytes alone: the params are still in the secondary shard)"
               if engine.zeropp.hpz else ""))
    if traffic.get("zeropp"):
        split = traffic["zeropp_quantized_bytes_so_far"]
        say(f"  quantized bytes of the run so far: codes {split['codes_inter']:,} B + scales "
            f"{split['scales_inter']:,} B across nodes, codes {split['codes_intra']:,} B + scales "
            f"{split['scales_intra']:,} B inside")
    if engine.offload.enabled and engine.state.files and engine.last_step_io:
        io = engine.io_report()
        def plan(k):       # the plan's exact figure where it differs (params: the last unit is gathered once)
            return "" if io[f"{k}_plan_bytes"] == io[f"{k}_formula_bytes"] else f", plan {io[f'{k}_plan_bytes']:,} B"
        say(f"offload I/O per step per rank  read {io['read_bytes_per_step']:,} B (formula {io['read_formula']} = "
            f"{io['read_formula_bytes']:,} B{plan('read')})   written {io['write_bytes_per_step']:,} B (formula "
            f"{io['write_formula']} = {io['write_formula_bytes']:,} B{plan('write')})")
        tl = engine.timeline
        say(f"  last update: read {tl.get('offload_read_s', 0):.3f} s, compute {tl.get('offload_compute_s', 0):.3f} s, "
            f"write {tl.get('offload_write_s', 0):.3f} s, I/O exposed {tl.get('offload_exposed_s', 0):.3f} s "
            f"(reads {tl.get('offload_read_wait_s', 0):.3f}, write slots {tl.get('offload_slot_wait_s', 0):.3f}, "
            f"last writes {tl.get('offload_drain_s', 0):.3f})")
    rss = peak_rss_per_rank(engine.comm)
    say(f"ringzero | peak RSS per rank: max {rss[int(np.argmax(rss))] / 2**20:.1f} MiB (rank {int(np.argmax(rss))}), "
        f"min {min(rss) / 2**20:.1f} MiB")
    return {"traffic": traffic, "train_loss": train_loss, "eval_loss": eval_loss, "tokens_per_s": tput,
            "peak_rss_bytes": rss}


def peak_rss_per_rank(comm) -> list:
    """Every rank's peak resident set size in bytes (getrusage; Linux reports KiB). Collective."""
    import resource
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return comm.allgather(int(mine)) if comm.size > 1 else [int(mine)]


def summarize(cfg: Config, engine, mem: dict, end: dict, H: float) -> dict:
    """The closing metrics record (metrics.SUMMARY_KEYS), also run's return value."""
    L, traffic = engine.layout, end["traffic"]
    return {"summary": True, "params": L.numel, "params_padded": L.padded,
            "world_size": engine.topology.world_size, "stage": cfg.stage, "precision": cfg.precision,
            "grad_accum": cfg.grad_accum, "model": cfg.model or None,
            "ranks_per_node": engine.policy.ranks_per_node(L.shards),
            "memory": {c: {"measured_bytes": d["measured_bytes"], "formula_bytes": d["formula_bytes"]}
                       for c, d in mem["classes"].items()},
            "traffic": {"measured_bytes_per_step": traffic["measured_bytes_per_step"],
                        "formula_bytes_per_step": traffic["formula_bytes_per_step"],
                        "plan_bytes_per_step": traffic["plan_bytes_per_step"],
                        **{k: traffic[k] for k in ("nodes", "node_ppn", "measured_internode_bytes_per_step",
                                                   "formula_internode_bytes_per_step", "internode_formula")},
                        **{k: traffic[k] for k in ("zeropp", "zeropp_measured_psi", "zeropp_formula_psi",
                                                   "zeropp_formula_internode_bytes_per_step") if k in traffic}},
            "train_loss": end["train_loss"], "eval_loss": end["eval_loss"], "unigram_entropy": H,
            "tokens_per_s": end["tokens_per_s"], "activation_peak_bytes": engine.activation_peak,
            "peak_rss_bytes": end["peak_rss_bytes"]}
