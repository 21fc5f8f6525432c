"""The engine: a model's training state sharded at one ZeRO stage, and its step.

What it is
    ``Zero`` (exported by zero.py, whose docstring teaches the four stages)
    puts the parts together and runs them:

        policy.py     StagePolicy: what the stage holds in full, gathers, reduces
        topology.py   the shard group, the replica group, their rings
        flat.py       the layout table: offsets, padding, pieces
        state.py      the five flat state buffers, held in full or as a shard
        plan.py       when each unit is materialized and reduced, in which slot
        passes.py     forward and backward through the plan, position by position
        workspace.py  the slots' buffers and views (slots.py); gather+cast (gather.py),
                      cast+reduce (reduce.py, buckets.py)
        inflight.py   the started collectives (overlap): what they hold, where they end
        optim.py      AdamW and the loss scaler, on this rank's pieces
        update.py     the update: AdamW on this rank's pieces (in RAM, streamed, or ahead), then publish
        offload.py    the disk tier: which classes live in files (OffloadPolicy), the files
        host_tier.py  a device run's offload: host arrays (pinned up to a bound), the link's copies
        stream.py     the offloaded update: tiles through a few buffers, a reader and a writer thread
        reports.py    memory and traffic, measured beside the formulas
        engine_setup.py  the construction: state (and offload), ZeRO++'s buffers, plan and workspaces
        zeropp.py     ZeRO++ (``zeropp=ZeroPPPolicy(...)``): quantized gathers (qwZ), a secondary
                      shard inside the node (hpZ), the quantized reduce-scatter (qgZ)

    The step is forward and backward through the plan, then the update: the
    global gradient norm from per-piece partial sums, the overflow check, and
    AdamW on every piece this rank holds of master.

    Gradient accumulation (``grad_accum=K``): the step's (B, T) batch is cut
    into K micro-batches of B/K rows, run one after the other through the
    same plan; workspace.py's ``close_grad`` says where their gradients are
    summed (on the rank at stages 0-2, after a reduce-scatter at 3/hybrid).
    Each backward is seeded with scale/K, so the summed gradient is the mean
    over micro-batches at the magnitude of K = 1 (no extra fp16 overflow);
    the loss is the mean of the K micro-batch losses. Loss scale, overflow
    check and update happen once per step, over all K. K = 1 is the same
    code and arithmetic as without accumulation.

    Offload (``offload=OffloadPolicy(...)``, docs/offload.md): master, m and v
    (and at stage 3 the params shard) live in files; the update streams them
    in tiles and writes the cast params in the same pass. On a device run they
    live in host memory (or the files) and each tile's gradient and params cross
    the link (host_tier.py). Where state lives
    changes, the arithmetic does not: losses and weights are bitwise those
    without offload.

    Precision: fp16 (dynamic loss scaler), bf16 (ml_dtypes.bfloat16 on the
    host; a static scale of 1, a non-finite gradient still skips the step),
    or fp32. Master and Adam are fp32 in every case.

What it is not
    It imports no model (nn/contract.py says what a model provides), and
    knows nothing of data, the learning-rate schedule or printing.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ringzero.comm.backend import select_device, xp_for
from ringzero.comm.ring import Ring
from ringzero.comm.trace import RECORDER
from ringzero.runtime import engine_setup, norms, passes, reports, stream, update
from ringzero.runtime.flat import Layout
from ringzero.runtime.inflight import UpdateGathers
from ringzero.runtime.limits import alloc_guard
from ringzero.runtime.offload import OffloadPolicy
from ringzero.runtime.optim import AdamConfig, AdamW, LossScaler, clip_coef
from ringzero.runtime.policy import StagePolicy
from ringzero.runtime.state import cast_into, check_budget, storage_dtype
from ringzero.runtime.topology import Topology
from ringzero.runtime.zeropp import ZeroPPPolicy
from ringzero.runtime.zeropp import check as zeropp_check

if TYPE_CHECKING:                      # the contract, for readers and type checkers only
    from ringzero.nn.contract import ShardableModel


@dataclass
class StepResult:
    loss: float          # global mean training loss of this step
    grad_norm: float     # global L2 norm of the unscaled gradient (before clipping)
    skipped: bool        # True if an overflow made every rank skip the update
    loss_scale: float    # the scale this step's backward used
    stop: int = 0        # max over ranks of engine.stop_request at this step (0 = none)


class Zero:
    """A model's training state sharded across ``comm`` at one ZeRO stage.

        engine = Zero(model, MPI.COMM_WORLD, stage=2)
        res = engine.step(x, y, lr=3e-4)      # one optimizer step on this rank's batch
        engine.memory_report(); engine.traffic_report()
    """

    def __init__(self, model: "ShardableModel", comm, stage="2", *, precision="fp16", device="cpu", seed=0,
                 adam: AdamConfig | None = None, ranks_per_node=None, mem_budget=None,
                 scaler: LossScaler | None = None, timeout=None, grad_accum: int = 1, nodes=None,
                 overlap: bool | None = None, prefetch: int | None = None, reduce_bucket: int | None = None,
                 init=None, offload: OffloadPolicy | None = None, zeropp: ZeroPPPolicy | None = None):
        # init: None draws the weights from seed (Layout.init_param); else a callable(state) that fills
        # the master pieces this rank holds (state.held_ranks / state.piece) itself, before the params
        # are published from them: the trainer's --init-from (interop/hf_import.py) reads them from a file
        self.model, self.comm = model, comm
        self.policy = P = StagePolicy.of(stage)
        self.stage = P.stage
        self.storage_dtype = storage_dtype(precision)       # params, grads (ValueError if unknown)
        if precision == "bf16" and device == "cuda":
            raise ValueError("precision bf16 runs on --device cpu only: CuPy has no bfloat16 arrays; "
                             "use fp16 on a GPU")
        if isinstance(grad_accum, bool) or int(grad_accum) != grad_accum or grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        self.precision, self.grad_accum = precision, int(grad_accum)
        self.xp = xp = xp_for(device)
        if device == "cuda":
            select_device(comm)          # one GPU per rank, by node-local rank
        # fp32 compute on CPU (NumPy has no fast fp16 GEMM), the storage dtype on GPU
        self.compute_dtype = np.float32 if xp is np else self.storage_dtype
        # nodes: a node label per rank, to emulate nodes on one host (topology.py)
        self.topology = topo = Topology.build(comm, P, ranks_per_node, timeout=timeout, nodes=nodes)
        self.ring = topo.ring
        self.layout = L = Layout(model.units, shards=topo.shard_size)
        self.offload = offload or OffloadPolicy()
        self.zeropp = zeropp or ZeroPPPolicy()      # ZeRO++'s switches (runtime/zeropp.py); refused before allocating
        zeropp_check(self.zeropp, P, self.offload, overlap, prefetch, host=device != "cuda")
        if mem_budget is not None:       # refuse before allocating anything
            check_budget(L, self.stage, topo.world_size, mem_budget, P.ranks_per_node(topo.shard_size),
                         precision, self.grad_accum, self.offload.tiers, device, self.offload.where)
        engine_setup.make_state(self, device)
        engine_setup.make_zeropp(self)
        with alloc_guard("the initial weights (an fp32 host copy of the master's size)"):
            if init is None:
                self.state.init_master(seed)
            else:
                init(self.state)
        self.update_gathers = UpdateGathers()   # stages 1-2: the update's all-gathers of the params
        self.publish_params()
        engine_setup.make_schedule(self, model, overlap, prefetch, reduce_bucket)
        self.timeline = {}                   # the last step's seconds: compute, reduction, and what was hidden
        self.adam = AdamW(adam or AdamConfig(), max(L.piece_numel), np if self.offload.enabled else xp)  # offload: host
        self.scaler = scaler or LossScaler(dynamic=(precision == "fp16"),
                                           init=2.0 ** 16 if precision == "fp16" else 1.0)
        engine_setup.make_norm_buffers(self)
        self.activation_peak = 0
        self.step_count = 0
        self.last_step_ledger = {}
        self.last_step_internode = {}        # the part of last_step_ledger sent to other nodes
        self.taken_step, self.taken_step_ledger, self.taken_step_internode = None, {}, {}   # reports.reported_step

    @property
    def bufs(self) -> dict:
        """The state buffers by name ("params", "grads", "master", "adam_m", "adam_v"), every started
        gather landed (overlap)."""
        self.wait_params()
        return self.state.bufs

    @property
    def work(self) -> dict:
        """The workspaces by name, each a list of unit-sized slots."""
        return self.workspaces.bufs

    # ------------------------------------------------------------------ step
    def forward_backward(self, x, y, micro: int = 0) -> float:
        """Forward and backward of micro-batch ``micro`` (of grad_accum) over all
        units (passes.py); after the last one the grads are reduced. Returns its local loss."""
        return passes.train_pass(self, x, y, micro)

    def _grad_pieces(self):
        """Yield (u, r, g) for every gradient piece this rank updates, r outer:
        ``g`` is the piece widened to fp32 in one reused scratch buffer."""
        L = self.layout
        for r in self.state.held_ranks("master"):
            for u in range(len(L.units)):
                g = self._grad_scratch[:L.piece_numel[u]]
                cast_into(g, self.state.piece("grads", u, r))
                yield u, r, g

    def _seed(self) -> float:
        """d(loss)/d(loss) of each backward: the loss scale over K (exact for K a power of 2)."""
        return self.scaler.scale / self.grad_accum

    def micro_batches(self, x, y):
        """[(x_k, y_k)]: the K row slices (views) of a (B, T) batch; B % K == 0."""
        K, B = self.grad_accum, x.shape[0]
        if B % K:
            raise ValueError(f"the batch must split into grad_accum = {K} micro-batches: expected "
                             f"B % {K} == 0, got B = {B}")
        m = B // K
        return [(x[k * m:(k + 1) * m], y[k * m:(k + 1) * m]) for k in range(K)]

    def step(self, x, y, lr: float) -> StepResult:
        """One optimizer step on this rank's batch (x, y): (B, T) ints, run as
        grad_accum micro-batches of B/K rows."""
        Ring.set_context(f"step {self.step_count}")   # named by the Ring's stall and timeout lines
        rec = RECORDER if RECORDER.active else None      # --trace (comm/trace.py): events carry this step
        if rec:
            rec.at_step(self.step_count)
        led0 = reports.ledger_totals(self.topology)
        net0 = reports.ledger_totals(self.topology, "bytes_sent_internode")
        io0 = reports.io_snapshot(self)
        scale, n, K = self.scaler.scale, self.topology.world_size, self.grad_accum
        seed = self._seed()
        loss = 0.0
        t0 = self.trace_t0 = time.perf_counter()
        for k, (xk, yk) in enumerate(self.micro_batches(x, y)):
            loss += self.forward_backward(xk, yk, k)
        loss /= K                                    # the mean of the micro-batch means
        tl = self.workspaces.timeline()
        # forward+backward wall time less the waits for collectives = compute; "comm_s": the
        # collectives' own time, hidden or not (stages 1-2's parameter gathers are the update's)
        pg, gw, pc = self.update_gathers.timeline()
        fb = time.perf_counter() - t0
        self.timeline = {"fwd_bwd_s": fb, **tl, "param_gather_s": pg, "param_gather_exposed_s": gw,
                         "progress_cpu_s": tl["progress_cpu_s"] + pc,
                         "compute_s": fb - tl["reduce_exposed_s"] - tl["gather_exposed_s"] - gw,
                         "comm_s": tl["reduce_s"] + tl["gather_s"] + pg}

        # global squared norm: partial per piece r, summed over units in order,
        # the partials then added in rank order -- identical at every stage.
        # Every dot stays on the device (one (pieces, units) fp32 buffer) and
        # comes back in one copy per step: no host sync per unit per piece.
        t1 = time.perf_counter()
        update.drain_ahead(self)                     # the last step's update, if it ran ahead or delayed
        t2 = time.perf_counter()
        sumsq = norms.share_scalars(self, loss, norms.piece_sumsq(self))
        t3 = time.perf_counter()
        # the wait for an update ahead; the norm's dots and the step's scalar all-gather (a collective)
        self.timeline.update(update_wait_s=t2 - t1, scalars_s=t3 - t2)
        if rec:
            rec.span("grad norm", "norm", t2, t3)
        loss = float(self._all_scalars[:, 0].sum() / n) if n > 1 else loss
        inv = 1.0 / (seed * K * n)                   # K = 1: 1 / (scale * n)
        gnorm = math.sqrt(sumsq) * inv if math.isfinite(sumsq) else float("inf")
        skipped = self.scaler.update(not math.isfinite(sumsq))
        t4 = time.perf_counter()
        if self.topology.zeropp is not None:         # qgZ's error feedback: cleared on overflow, rescaled
            self.topology.zeropp.after_step(skipped, scale, self.scaler.scale)
        if not skipped:
            update.apply(self, np.float32(inv * clip_coef(gnorm, self.adam.cfg.grad_clip)), lr)
            if self.topology.zeropp is not None:     # hpZ: the secondary shard holds the old params
                self.topology.zeropp.invalidate()
        # the update's time on this thread: the join's wait and the update (delayed: its start alone)
        self.timeline["update_exposed_s"] = t2 - t1 + time.perf_counter() - t4
        self.step_count += 1
        if rec:
            rec.end_step(t0, fb)
        reports.io_delta(self, io0)
        led1 = reports.ledger_totals(self.topology)
        self.last_step_ledger = {k: led1[k] - led0.get(k, 0) for k in led1}
        net1 = reports.ledger_totals(self.topology, "bytes_sent_internode")
        self.last_step_internode = {k: net1[k] - net0.get(k, 0) for k in net1}
        if not skipped:       # the last step taken: a skipped one updates nothing, so stages 1-2 gather no params
            self.taken_step = self.step_count - 1
            self.taken_step_ledger, self.taken_step_internode = self.last_step_ledger, self.last_step_internode
        return StepResult(loss, gnorm, skipped, scale, int(self._all_scalars[:, 2].max()))

    def publish_params(self):
        """master -> storage-dtype params (own pieces), all-gathered where params are full."""
        self.wait_params()
        if self.topology.zeropp is not None:         # hpZ: the secondary shard holds the old params
            self.topology.zeropp.invalidate()
        if self.offload_stream is not None:          # master on disk: the cast streams it in tiles
            first, err = self.offload_stream.casts == 0, None
            try:
                stream.cast_params(self.state, self.offload_stream, self.offload_tiles, self.device_link)
            except Exception as e:   # noqa: BLE001 (any kind on any rank: agreed, one line on every rank)
                err = stream.error_text(e)
            stream.agree(self, err, f"casting the params from the offloaded master ({'start' if first else 'resume'}, "
                         f"{self.offload.dir or 'host'})", failed=True)
        self.state.publish(self.ring, cast=self.offload_stream is None)

    # ------------------------------------------------------------------ offload
    def close(self):
        """Stop the offload threads and close its files (freed by the kernel). The engine is done."""
        update.close(self)                       # an update ahead or delayed: its thread ends
        if self.offload_stream is not None:
            self.offload_stream.close()
        self.workspaces.close()                  # its params reads ahead (offload params)
        self.state.close()

    def wait_params(self, units=None):
        """Wait for the started all-gathers of these units' params (all: every one). Collective-free,
        except with an update running ahead (offload ``ahead``) or delayed (``delay``): all units then
        drain it, collectively (a delayed one's params published first: the state is exact)."""
        if units is None:
            update.drain_ahead(self)
        self.update_gathers.wait(units)
        if self.update_ahead and units is not None:
            self.update_ahead.wait(units)

    # ------------------------------------------------------------- forward only
    def eval_loss(self, x, y) -> float:
        """Global mean loss of a forward pass (no gradients, no update), run as
        grad_accum micro-batches like a step (activations of B/K rows)."""
        self.wait_params()
        loss = sum(passes.forward_pass(self, xk, yk) for xk, yk in self.micro_batches(x, y))
        buf = np.array([loss / self.grad_accum], np.float64)
        allb = np.zeros(self.topology.world_size, np.float64)
        self.topology.control.all_gather(buf, allb)
        return float(allb.sum() / self.topology.world_size)

    def full_params(self, dtype=np.float32, root=None):
        """Every storage-dtype parameter, gathered and widened: a host array of
        ``layout.padded`` elements. Collective: call on all ranks (root: only that
        shard rank gets it, the others None; at GPT-2 XL a full fp32 copy is 5.9 GB a rank)."""
        return self.full_state("params", dtype, root)

    def full_state(self, name: str, dtype=np.float32, root=None):
        """One state class ("params", "master", "adam_m", "adam_v") in full, on
        the host. Collective; for checks, sampling and export, not the hot path."""
        self.wait_params()
        return self.state.gather(name, self.ring, dtype, root)

    # --------------------------------------------------- checkpoint and reports
    def checkpoint_meta(self) -> dict:
        """What a checkpoint records beside the buffers (runtime/checkpoint.py); the params are final then."""
        self.wait_params()
        return {"stage": self.stage, "world": self.topology.world_size, "shards": self.layout.shards,
                "precision": self.precision, "grad_accum": self.grad_accum,
                "engine_step_count": int(self.step_count),
                "adam": {"t": int(self.adam.t), **asdict(self.adam.cfg)},
                "scaler": self.scaler.state_dict()}

    def restore_meta(self, m: dict):
        """The inverse of ``checkpoint_meta`` once the buffers are loaded; then
        re-publish the params from master (collective)."""
        self.adam.t = int(m["adam"]["t"])
        if m.get("precision") == self.precision:   # an fp32 engine keeps its static scale of 1
            self.scaler.load_state_dict(m["scaler"])
        self.step_count = int(m.get("engine_step_count", m["step"]))
        self.publish_params()

    @property
    def optimizer_scratch_nbytes(self) -> int:
        return self.adam.scratch_nbytes + int(self._grad_scratch.nbytes)

    def memory_report(self) -> dict:
        """Bytes allocated on this rank per state class, beside the formula (reports.py)."""
        return reports.memory_report(self)

    def io_report(self) -> dict:
        """Bytes this rank read and wrote in its offload files in the last step, beside the formula."""
        return reports.io_report(self)

    def traffic_report(self) -> dict:
        """Bytes this rank sent in the last step, beside the formula (reports.py)."""
        return reports.traffic_report(self)

