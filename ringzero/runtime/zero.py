"""The sharding runtime: ZeRO stages 0-3 and HYBRID_SHARD over flat, partitioned state.

The four stages, one schedule
    Every class of model state lives in ONE flat buffer, cut per unit into Nd
    equal pieces by the layout table (flat.py). A rank's *shard* of a class
    is its piece of every unit. The stage only decides which classes exist
    in full on a rank and which exist as the shard:

        stage   params(fp16)  grads(fp16)  master/m/v(fp32)   per step, per unit
        0       full          full         full               all-reduce grads (ring RS+AG)
        1       full          full         shard              RS grads; update shard; AG params
        2       full          shard        shard              RS grads via a unit bucket; AG params
        3       shard         shard        shard              AG params before fwd, again before bwd; RS grads
        hybrid  like 3 inside a node of Ng ranks; shard grads all-reduced across nodes

    A step, at every stage:
      1. forward, unit by unit. Before a unit runs, the parameters it reads are
         *materialized*: gathered from the shards (stage 3), then cast to the
         compute dtype (fp32 on CPU) into a unit-sized workspace. A plan made
         once at start-up says when each unit is materialized and which slot it
         uses, so nothing is allocated per step.
      2. backward, units in reverse. The loss gradient is seeded with the loss
         scale. A unit's gradient is accumulated in a float32 workspace (on GPU
         too, where the forward computes in fp16); once no later
         unit writes to it (a tied head writes the embedding's gradient early),
         it is cast to fp16 and reduced: all-reduce (0), or reduce-scatter into
         this rank's piece (1, 2, 3, hybrid), then all-reduced across nodes (hybrid).
      3. the update, on this rank's pieces only (every piece at stage 0): the
         fp16 gradient is unscaled in fp32, its global norm (per-piece partial
         sums, added in rank order, the same at every stage) drives clipping and
         the overflow check, and AdamW updates master, m and v. The new master
         is cast to fp16 params; stages 1 and 2 all-gather them.

    Because the ring's all-reduce is bitwise its reduce-scatter plus all-gather,
    and the update is elementwise, stages 0-3 give bitwise identical training.
    World size 1 runs through the same code.

What it is not
    It imports no model: it needs ``model.units`` (the layout declaration) and
    the per-unit ``forward_unit``/``backward_unit`` contract (nn/gpt.py).
    Data, schedules and printing belong to the trainer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ringzero.runtime import accounting
from ringzero.comm.backend import get_array_module, select_device, to_host, xp_for
from ringzero.comm.ring import Ring
from ringzero.runtime.flat import Layout
from ringzero.comm import kernels
from ringzero.runtime.optim import AdamConfig, AdamW, LossScaler, clip_coef


class MemoryBudgetError(ValueError):
    """The requested stage's model state does not fit the per-rank budget."""


@dataclass
class StepResult:
    loss: float          # global mean training loss of this step
    grad_norm: float     # global L2 norm of the unscaled gradient (before clipping)
    skipped: bool        # True if an overflow made every rank skip the update
    loss_scale: float    # the scale this step's backward used


def _aligned_empty(xp, n, dtype, align_bytes=64):
    """An n-element buffer whose start is ``align_bytes``-aligned (NumPy), so
    BLAS reductions over it take the same path in every run."""
    if xp is not np:
        return xp.empty(n, dtype)
    item = np.dtype(dtype).itemsize
    raw = np.empty(n + align_bytes // item, dtype)
    off = (-raw.ctypes.data % align_bytes) // item
    return raw[off:off + n]


class Zero:
    """A model's training state sharded across ``comm`` at one ZeRO stage.

        engine = Zero(model, MPI.COMM_WORLD, stage=2)
        res = engine.step(x, y, lr=3e-4)      # one optimizer step on this rank's batch
        engine.memory_report(); engine.traffic_report()
    """

    def __init__(self, model, comm, stage="2", *, precision="fp16", device="cpu", seed=0,
                 adam: AdamConfig | None = None, ranks_per_node=None, mem_budget=None,
                 scaler: LossScaler | None = None, timeout=None):
        self.model, self.comm = model, comm
        self.stage = accounting.parse_stage(stage)
        if precision not in ("fp16", "fp32"):
            raise ValueError(f"precision must be fp16 or fp32, got {precision!r}")
        self.precision = precision
        self.xp = xp = xp_for(device)
        if device == "cuda":
            select_device(comm)          # one GPU per rank, by node-local rank
        self.sdt = np.float16 if precision == "fp16" else np.float32   # storage dtype (params, grads)
        # compute dtype: fp32 on CPU (NumPy has no fast fp16 GEMM), storage dtype on GPU
        self.cdt = np.float32 if xp is np else self.sdt
        # gradient accumulation dtype: fp32 everywhere (a unit's gradient sums many
        # terms; fp16 would round after each), cast to the storage dtype once
        self.gdt = np.float32
        self.n, self.rank = comm.size, comm.rank

        # ---- topology: the sharding group, and (hybrid) the replica group
        if self.stage == "hybrid":
            if ranks_per_node:
                g = int(ranks_per_node)
                if g < 1 or self.n % g:
                    raise ValueError(f"ranks_per_node must divide the world size: expected "
                                     f"{self.n} % Ng == 0, got Ng={g}")
                self.shard_comm = comm.Split(self.rank // g, self.rank)
            else:
                from mpi4py import MPI
                self.shard_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.replica_comm = comm.Split(self.shard_comm.rank, self.rank)
            self.replica_ring = Ring(self.replica_comm, timeout=timeout)
        else:
            self.shard_comm, self.replica_comm, self.replica_ring = comm, None, None
        self.ring = Ring(self.shard_comm, timeout=timeout)
        self.nd, self.srank = self.shard_comm.size, self.shard_comm.rank
        self.layout = L = Layout(model.units, nd=self.nd)
        U = len(L.units)

        # ---- budget: refuse before allocating anything
        if mem_budget is not None:
            check_budget(L, self.stage, self.n, mem_budget, self.nd if self.stage == "hybrid" else None)

        # ---- the state buffers (the only model-state allocations, ever)
        full, shard = L.padded, L.shard_numel
        st = self.stage
        self.bufs = {}

        def alloc(name, n, dt):
            self.bufs[name] = b = xp.zeros(n, dt)
            return b

        self.params = alloc("params", shard if st in ("3", "hybrid") else full, self.sdt)
        self.grads = alloc("grads", full if st in ("0", "1") else shard, self.sdt)
        sn = full if st == "0" else shard
        self.master = alloc("master", sn, np.float32)
        self.adam_m = alloc("adam_m", sn, np.float32)
        self.adam_v = alloc("adam_v", sn, np.float32)

        # ---- initial weights: a pure function of (seed, name), same at any Nd/stage
        host = (L.init_full(np.empty(full, np.float32), seed) if st == "0"
                else L.init_shard(np.empty(shard, np.float32), seed, self.srank))
        self.master[...] = xp.asarray(host)
        del host
        self.publish_params()

        # ---- the plan: when each unit is materialized / reduced, and where
        self._plan(U)

        # ---- optimizer
        self.adam = AdamW(adam or AdamConfig(), max(L.piece), xp)
        self.scaler = scaler or LossScaler(dynamic=(precision == "fp16"),
                                           init=2.0 ** 16 if precision == "fp16" else 1.0)
        self._gscr = _aligned_empty(xp, max(L.piece), np.float32)   # one unscaled grad piece
        # per-piece squared norms of this rank's pieces, on the device: (pieces, units) fp32
        self._dots = xp.zeros((self.nd if self.stage == "0" else 1, U), np.float32)
        self._decay = {(u, r): self._decay_runs(u, r) for u in range(U) for r in range(self.nd)}
        self._scalars = np.zeros(2, np.float64)                        # [loss, sumsq] of this rank
        self._all_scalars = np.zeros((self.n, 2), np.float64)
        self.activation_peak = 0
        self.step_count = 0
        self.last_step_ledger = {}

    # ------------------------------------------------------------------ plan
    def _plan(self, U):
        """Static schedule of materializations and gradient reductions.

        A unit is materialized once for each maximal run of consecutive
        schedule positions that read it: a block is gathered for its forward
        and again for its backward; the last unit's forward and backward are
        adjacent, so it is gathered once (as FSDP does). Slots are assigned
        greedily and reused, so the number of unit-sized workspaces is the
        peak number of units alive at once.
        """
        L, m = self.layout, self.model
        bwd_reads = getattr(m, "backward_reads_params", lambda u: True)
        sched = [("F", u) for u in range(U)] + [("B", u) for u in reversed(range(U))]
        reads = [set(L.needs(u)) if (ph == "F" or bwd_reads(u)) else set() for ph, u in sched]
        writes = [set(L.needs(u)) if ph == "B" else set() for ph, u in sched]

        def runs(sets, fwd_only=False):
            """[(unit, first_pos, last_pos)] maximal runs, ordered by first_pos."""
            out = []
            P = U if fwd_only else len(sched)
            for w in range(U):
                pos = [i for i in range(P) if w in sets[i]]
                start = prev = None
                for i in pos:
                    if start is None or i != prev + 1:
                        if start is not None:
                            out.append((w, start, prev))
                        start = i
                    prev = i
                if start is not None:
                    out.append((w, start, prev))
            return sorted(out, key=lambda r: (r[1], r[0]))

        def assign(rs):
            """Greedy slot assignment; returns ({(w, first): slot}, n_slots)."""
            free, live, slot_of, n = [], [], {}, 0
            for w, a, b in rs:
                for item in [x for x in live if x[0] < a]:
                    live.remove(item)
                    free.append(item[1])
                s = free.pop() if free else n
                n = max(n, s + 1)
                live.append((b, s))
                slot_of[(w, a)] = s
            return slot_of, n

        self.sched = sched
        self.param_runs = runs(reads)
        # a gradient accumulates from its first write to its last (the tied
        # embedding is written by the head's backward and again by its own)
        self.grad_runs = sorted(
            (w, min(i for i, ws in enumerate(writes) if w in ws), max(i for i, ws in enumerate(writes) if w in ws))
            for w in range(U))
        self.grad_runs.sort(key=lambda r: (r[1], r[0]))
        self.fwd_runs = runs(reads, fwd_only=True)
        pslot, n_pslots = assign(self.param_runs)
        fslot, n_fslots = assign(self.fwd_runs)
        gslot, n_gslots = assign(self.grad_runs)
        xp, cap = self.xp, L.max_unit_padded
        gathers = self.stage in ("3", "hybrid")
        pcast = self.cdt != self.sdt       # params cast to a compute workspace
        gcast = self.gdt != self.sdt       # grads accumulated in an fp32 workspace

        # workspaces: compute-dtype params (cast target), storage-dtype gather slot,
        # compute-dtype grads, storage-dtype grad bucket (stages 2+)
        nps = max(n_pslots, n_fslots)
        self.work = {}
        if pcast:
            self.work["param_compute"] = [xp.empty(cap, self.cdt) for _ in range(nps)]
        if gcast:
            self.work["grad_compute"] = [xp.empty(cap, self.gdt) for _ in range(n_gslots)]
        if gathers:
            # with a cast, one storage-dtype landing slot suffices (cast right after the gather)
            self.work["gather"] = [xp.empty(cap, self.sdt) for _ in range(1 if pcast else nps)]
        if self.stage != "0" and self.stage != "1":
            self.work["grad_bucket"] = [xp.empty(cap, self.sdt) for _ in range(1 if gcast else n_gslots)]

        def mat_table(rs, slots, P):
            """Per schedule position: units to materialize there, and P views."""
            at = [[] for _ in range(P)]
            live = {}
            views = [None] * P
            for w, a, b in rs:
                at[a].append((w, slots[(w, a)]))
            ends = {(w, a): b for w, a, b in rs}
            for i in range(P):
                for w, s in at[i]:
                    live[w] = (s, ends[(w, i)])
                ph, u = sched[i]
                views[i] = {}
                for w in L.needs(u):
                    if w in live and live[w][1] >= i:   # only units materialized now
                        views[i].update(L.views(self._param_src(w, live[w][0]), w))
            return at, views

        self.mat_at, self.pviews = mat_table(self.param_runs, pslot, len(sched))
        self.fmat_at, self.fviews = mat_table(self.fwd_runs, fslot, U)
        # gradients: open (zero) at first write, close (cast + reduce) after last write
        self.gopen = [[] for _ in sched]
        self.gclose = [[] for _ in sched]
        live, self.gviews = {}, [None] * len(sched)
        for w, a, b in self.grad_runs:
            self.gopen[a].append((w, gslot[(w, a)]))
            self.gclose[b].append((w, gslot[(w, a)]))
        for i, (ph, u) in enumerate(sched):
            for w, s in self.gopen[i]:
                live[w] = s
            self.gviews[i] = {}
            if ph == "B":
                for w in L.needs(u):
                    self.gviews[i].update(L.views(self._grad_slot(live[w], w), w))

    def _param_src(self, w, s):
        """Where unit w's params are read from (compute dtype) when in slot s."""
        if "param_compute" in self.work:
            return self.work["param_compute"][s]
        if "gather" in self.work:
            return self.work["gather"][s]
        return self.layout.unit_full(self.params, w)   # stages 0-2, no cast: the buffer itself

    def _grad_slot(self, s, w):
        """Where the model accumulates unit w's gradient (float32, or the storage dtype if that is wider)."""
        if "grad_compute" in self.work:
            return self.work["grad_compute"][s]
        if self.stage in ("0", "1"):
            return self.layout.unit_full(self.grads, w)
        return self.work["grad_bucket"][s]

    # ------------------------------------------------------------- helpers
    def _decay_runs(self, u, r):
        """(start, stop) runs of decayed params inside piece (u, r), piece-relative."""
        L = self.layout
        a0 = L.unit_offset[u] + r * L.piece[u]
        b0 = a0 + L.piece[u]
        out = []
        for p in L.units[u].params:
            if not p.decay:
                continue
            s = L.slots[p.name]
            lo, hi = max(s.offset, a0), min(s.offset + p.numel, b0)
            if lo < hi:
                out.append((lo - a0, hi - a0))
        return out

    def _piece(self, buf, u, r, is_full):
        """Piece (u, r) of a state buffer held full or as this rank's shard."""
        L = self.layout
        if is_full:
            a = L.unit_offset[u] + r * L.piece[u]
            return buf[a:a + L.piece[u]]
        return L.unit_shard(buf, u)

    def _materialize(self, w, slot):
        """Make unit w's full params available in the compute dtype, in ``slot``."""
        L = self.layout
        if self.stage in ("3", "hybrid"):
            land = self.work["gather"][0 if "param_compute" in self.work else slot]
            seg = land[:L.unit_padded[w]]
            p = L.piece[w]
            own = seg[self.srank * p:(self.srank + 1) * p]
            own[...] = L.unit_shard(self.params, w)
            self.ring.all_gather(own, seg)
            src = seg
        else:
            src = L.unit_full(self.params, w)
        if "param_compute" in self.work:
            dst = self.work["param_compute"][slot][:L.unit_padded[w]]
            cast_into(dst, src)

    def _reduce_grad(self, w, slot):
        """Unit w's gradient is complete: cast to storage dtype and reduce it."""
        L = self.layout
        n = L.unit_padded[w]
        if self.stage in ("0", "1"):
            seg = L.unit_full(self.grads, w)
        else:
            seg = self.work["grad_bucket"][0 if "grad_compute" in self.work else slot][:n]
        if "grad_compute" in self.work:
            cast_into(seg, self.work["grad_compute"][slot][:n])
        if self.stage in ("0", "1"):
            # stage 0's all-reduce is spelled out as the reduce-scatter and
            # all-gather it is made of, so its ledger reads as the formula's
            # 2Ψ(n-1)/n whichever algorithm the ring picks for the unit's size
            # (Ring guarantees all_reduce == reduce_scatter + all_gather, bitwise)
            p = L.piece[w]
            own = seg[self.srank * p:(self.srank + 1) * p]
            self.ring.reduce_scatter(seg, own)
            if self.stage == "0":
                self.ring.all_gather(own, seg)
        else:
            out = L.unit_shard(self.grads, w)
            self.ring.reduce_scatter(seg, out)
            if self.replica_ring is not None and self.replica_ring.size > 1:
                self.replica_ring.all_reduce(out)

    def publish_params(self):
        """master -> fp16 params (own pieces), then all-gather where params are full."""
        L, st = self.layout, self.stage
        for u in range(len(L.units)):
            if st == "0":
                cast_into(L.unit_full(self.params, u), L.unit_full(self.master, u))
            elif st in ("3", "hybrid"):
                cast_into(L.unit_shard(self.params, u), L.unit_shard(self.master, u))
            else:
                seg = L.unit_full(self.params, u)
                p = L.piece[u]
                own = seg[self.srank * p:(self.srank + 1) * p]
                cast_into(own, L.unit_shard(self.master, u))
                self.ring.all_gather(own, seg)

    # ------------------------------------------------------------------ step
    def forward_backward(self, x, y) -> float:
        """Forward and backward over all units; leaves reduced grads. Returns local loss."""
        m, L = self.model, self.layout
        U = len(L.units)
        caches = [None] * U
        act = peak = 0
        h = x
        for i in range(U):
            for w, s in self.mat_at[i]:
                self._materialize(w, s)
            h, caches[i] = m.forward_unit(i, self.pviews[i], h, y if i == U - 1 else None)
            act += m.cache_nbytes(caches[i])
            peak = max(peak, act)
        loss = float(h)
        dy = self.scaler.scale
        for i in range(U, 2 * U):
            u = self.sched[i][1]
            for w, s in self.mat_at[i]:
                self._materialize(w, s)
            for w, s in self.gopen[i]:
                self._grad_slot(s, w)[:L.unit_padded[w]].fill(0)
            dy = m.backward_unit(u, dy, caches[u], self.pviews[i], self.gviews[i])
            act -= m.cache_nbytes(caches[u])
            caches[u] = None
            for w, s in self.gclose[i]:
                self._reduce_grad(w, s)
        self.activation_peak = max(self.activation_peak, peak)
        return loss

    def step(self, x, y, lr: float) -> StepResult:
        """One optimizer step on this rank's micro-batch (x, y): (B, T) ints."""
        xp, L = self.xp, self.layout
        led0 = self._ledger_totals()
        scale = self.scaler.scale
        loss = self.forward_backward(x, y)

        # global squared norm: partial per piece r, summed over units in order,
        # the partials then added in rank order -- identical at every stage.
        inv = 1.0 / (scale * self.n)
        mine = range(self.nd) if self.stage == "0" else (self.srank,)
        full_g = self.stage in ("0", "1")
        U = len(L.units)
        for i, r in enumerate(mine):          # every dot stays on the device ...
            for u in range(U):
                g = self._gscr[:L.piece[u]]
                cast_into(g, self._piece(self.grads, u, r, full_g))
                xp.dot(g, g, out=self._dots[i, u:u + 1].reshape(()))
        dots = to_host(self._dots)            # ... and comes back in one copy per step
        partial = {}
        for i, r in enumerate(mine):
            acc = 0.0
            for u in range(U):
                acc += float(dots[i, u])
            partial[r] = acc
        sumsq = self._gather_scalars(loss, partial)
        loss = float(self._all_scalars[:, 0].sum() / self.n) if self.n > 1 else loss
        gnorm = math.sqrt(sumsq) * inv if math.isfinite(sumsq) else float("inf")
        skipped = self.scaler.update(not math.isfinite(sumsq))
        if not skipped:
            coef = np.float32(inv * clip_coef(gnorm, self.adam.cfg.grad_clip))
            self.adam.begin_step()
            full_s = self.stage == "0"
            for r in mine:
                for u in range(len(L.units)):
                    g = self._gscr[:L.piece[u]]
                    cast_into(g, self._piece(self.grads, u, r, full_g))
                    g *= coef
                    self.adam.update(self._piece(self.master, u, r, full_s),
                                     self._piece(self.adam_m, u, r, full_s),
                                     self._piece(self.adam_v, u, r, full_s),
                                     g, lr, self._decay[(u, r)])
            self.publish_params()
        self.step_count += 1
        led1 = self._ledger_totals()
        self.last_step_ledger = {k: led1[k] - led0.get(k, 0) for k in led1}
        return StepResult(loss, gnorm, skipped, scale)

    def _gather_scalars(self, loss, partial) -> float:
        """Share [loss, sumsq partial] across ranks (a scalar check, MPI's own
        Allgather); return the global squared norm summed in rank order."""
        if self.stage == "0":
            total = 0.0
            for r in range(self.nd):
                total += partial[r]
            self._scalars[:] = (loss, total)
            if self.n > 1:
                self.comm.Allgather(self._scalars, self._all_scalars)
            else:
                self._all_scalars[0] = self._scalars
            return total
        self._scalars[:] = (loss, partial[self.srank])
        if self.n > 1:
            self.comm.Allgather(self._scalars, self._all_scalars)
        else:
            self._all_scalars[0] = self._scalars
        # shard-group ranks in shard order; hybrid replicas hold the same partials
        members = self._shard_members() if self.stage == "hybrid" else range(self.n)
        vals = [self._all_scalars[m, 1] for m in members]
        total = 0.0
        for v in vals:
            total += float(v)
        return total

    def _shard_members(self):
        """World ranks of my shard group, ordered by shard rank."""
        if not hasattr(self, "_members"):
            from mpi4py import MPI
            wg, sg = self.comm.Get_group(), self.shard_comm.Get_group()
            self._members = MPI.Group.Translate_ranks(sg, list(range(self.nd)), wg)
        return self._members

    # ------------------------------------------------------------- forward only
    def eval_loss(self, x, y) -> float:
        """Global mean loss of a forward pass (no gradients, no update)."""
        m, U = self.model, len(self.layout.units)
        h = x
        for i in range(U):
            for w, s in self.fmat_at[i]:
                self._materialize(w, s)
            h, _ = m.forward_unit(i, self.fviews[i], h, y if i == U - 1 else None)
        buf = np.array([float(h)], np.float64)
        allb = np.zeros(self.n, np.float64)
        self.comm.Allgather(buf, allb)
        return float(allb.sum() / self.n)

    def full_params(self, dtype=np.float32):
        """Every fp16 parameter, gathered and widened: a host array of
        ``layout.padded`` elements. Collective: call on all ranks."""
        return self.full_state("params", dtype)

    def full_state(self, name: str, dtype=np.float32):
        """One state class ("params", "master", "adam_m", "adam_v") in full, on
        the host. Collective; for checks, sampling and export, not the hot path:
        it holds one unit in flight beside the host result."""
        L = self.layout
        buf = self.bufs[name]
        out = np.empty(L.padded, dtype)
        is_full = buf.size == L.padded
        for u in range(len(L.units)):
            if is_full:
                seg = L.unit_full(buf, u)
            else:
                seg = self.xp.empty(L.unit_padded[u], buf.dtype)
                p = L.piece[u]
                own = seg[self.srank * p:(self.srank + 1) * p]
                own[...] = L.unit_shard(buf, u)
                self.ring.all_gather(own, seg)
            out[L.unit_offset[u]:L.unit_offset[u] + L.unit_padded[u]] = to_host(seg)
        return out

    # ------------------------------------------------------------- accounting
    def _ledger_totals(self) -> dict:
        out = {}
        for name, ring in (("shard", self.ring), ("replica", self.replica_ring)):
            if ring is None:
                continue
            for op, rec in ring.ledger.as_dict().items():
                key = op if name == "shard" else f"{op}@replica"
                out[key] = out.get(key, 0) + rec["bytes_sent"]
        return out

    def _formula_state(self, psi):
        f = accounting.model_state_bytes(self.stage, psi, self.comm.size,
                                         self.nd if self.stage == "hybrid" else None)
        if self.sdt == np.float32:   # fp32 params and grads take 4 bytes, not 2
            f["params_fp16"] *= 2
            f["grads_fp16"] *= 2
        return f

    def memory_report(self) -> dict:
        """Bytes allocated on this rank, per state class, beside the formula.

        'formula_bytes' uses the padded Ψ (what the formula predicts for the
        buffers this layout allocates); 'textbook_bytes' uses the real Ψ.
        """
        L = self.layout
        meas = {"params_fp16": self.params.nbytes, "grads_fp16": self.grads.nbytes,
                "master_fp32": self.master.nbytes, "adam_m_fp32": self.adam_m.nbytes,
                "adam_v_fp32": self.adam_v.nbytes}
        form, text = self._formula_state(L.padded), self._formula_state(L.numel)
        classes = {c: {"measured_bytes": int(meas[c]), "formula_bytes": form[c],
                       "textbook_bytes": text[c]} for c in meas}
        work = {k: sum(int(b.nbytes) for b in v) for k, v in self.work.items()}
        return {"stage": self.stage, "psi": L.numel, "psi_padded": L.padded,
                "nd": self.comm.size, "shard_group": self.nd,
                "classes": classes,
                "model_state_measured": sum(int(meas[c]) for c in meas),
                "model_state_formula": sum(form.values()),
                "workspace": work,
                "optimizer_scratch": int(self.adam._tmp.nbytes + self._gscr.nbytes),
                "activation_peak": int(self.activation_peak)}

    def traffic_report(self) -> dict:
        """Bytes this rank sent in the last step, by collective, beside the formula."""
        L = self.layout
        n = self.nd
        el = accounting.traffic_elements(self.stage, L.padded, self.comm.size,
                                         n if self.stage == "hybrid" else None)
        itm = np.dtype(self.sdt).itemsize
        formula = sum(el.values()) * itm
        # the exact figure for this schedule: units gathered once per run of
        # consecutive uses (the last unit once), every unit reduce-scattered once
        exact = formula
        if self.stage in ("3", "hybrid"):
            gathered = sum(L.unit_padded[w] for w, a, b in self.param_runs)
            exact = formula - (2 * L.padded - gathered) * (n - 1) // n * itm
        measured = sum(self.last_step_ledger.values())
        return {"stage": self.stage, "by_op": dict(self.last_step_ledger),
                "measured_bytes_per_step": int(measured),
                "formula_bytes_per_step": int(formula),
                "schedule_bytes_per_step": int(exact),
                "formula": accounting.traffic_formula(self.stage),
                "formula_elements": el}


def check_budget(layout: Layout, stage: str, world: int, budget: int, ranks_per_node=None):
    """Refuse, before anything is allocated, a stage whose model state per rank
    (the stage formula on the padded Ψ) exceeds ``budget`` bytes."""
    need = accounting.model_state_total(stage, layout.padded, world, ranks_per_node)
    if need <= budget:
        return
    fits = accounting.stages_that_fit(budget, layout.padded, world, ranks_per_node)
    if not fits:
        least = accounting.model_state_total("3", layout.padded, world)
        raise MemoryBudgetError(
            f"budget {budget / 2**20:.1f} MiB per rank is below the smallest stage's need: stage 3 "
            f"needs {least / 2**20:.1f} MiB at Nd={world} (Ψ={layout.numel:,}); add ranks or shrink the model")
    raise MemoryBudgetError(
        f"stage {stage} needs {need / 2**20:.1f} MiB of model state per rank (Ψ={layout.numel:,}, "
        f"Nd={world}), budget is {budget / 2**20:.1f} MiB; stages that fit: {', '.join(fits)}")


def cast_into(dst, src):
    """dst[...] = src with a dtype change, through the F16C kernel where it applies.

    fp16 <-> fp32 on the host goes through ringzero.comm.kernels (bitwise equal to
    NumPy's round-to-nearest-even); everything else is the array module's copy.
    """
    if dst.dtype == src.dtype:
        dst[...] = src
    elif isinstance(dst, np.ndarray) and dst.dtype == np.float32 and src.dtype == np.float16:
        kernels.f16_to_f32(src, dst)
    elif isinstance(dst, np.ndarray) and dst.dtype == np.float16 and src.dtype == np.float32:
        kernels.f32_to_f16(src, dst)
    else:
        get_array_module(dst).copyto(dst, src, casting="unsafe")
