"""The Ring's memory between calls: kept plans, the scratch their views point into, and the byte ledger.

What it is
    ``PlanCache(max_plans)``:
      - ``plans``: an LRU of CollectivePlans by buffer key (the arrays' type,
        dtype, shape, strides and address, the op, the knobs). A plan is kept
        from the SECOND call with a key on (``seen`` remembers the first), so a
        one-off call leaves no requests behind;
      - ``hot``: the shortcut of the hot path, (id(send), id(recv), op name, op)
        -> the kept plan that holds those very objects (so their ids are
        theirs); any knob change clears it;
      - ``scratch(xp, nbytes, k)``: k grow-only uint8 buffers per array module;
        growing drops every kept plan (they hold views of the old ones);
      - ``ledger``: the per-op counters, folded from the plans' run counts.

What it is not
    It builds and runs nothing: ring.py decides what to keep, plan.py builds,
    executor.py runs.
"""
from __future__ import annotations

from collections import OrderedDict

from ringzero.comm.schedule import OPS
from ringzero.comm.steps import free_plan

MAX_PLANS = 256


class Ledger:
    """Cumulative per-op counters of this rank: bytes_sent (of which bytes_sent_internode went to
    ranks on other nodes), bytes_recv, messages, calls.

    A kept plan only counts its runs (the hot path adds 1); the counters are
    base + runs * the plan's per-call figures, folded into base when a plan
    is dropped. ``live`` is the container of kept plans (the cache's LRU).
    """

    # ledger key -> the CollectivePlan's per-run figure
    _PER_RUN = {"bytes_sent": "sent", "bytes_sent_internode": "sent_net", "bytes_recv": "recvd", "messages": "msgs"}
    _KEYS = (*_PER_RUN, "calls")

    def __init__(self, live=()):
        self._live = live
        self.reset()

    def reset(self):
        self._d = {op: dict.fromkeys(self._KEYS, 0) for op in OPS}
        for p in self._live:
            p.runs = 0

    @classmethod
    def _add(cls, d, plan, k):
        for key, attr in cls._PER_RUN.items():
            d[key] += k * getattr(plan, attr)
        d["calls"] += k

    def fold(self, plan):
        """Move a plan's runs into the base counters (the plan is being dropped)."""
        k, plan.runs = plan.runs, 0
        if k:
            self._add(self._d[plan.name], plan, k)

    def __getitem__(self, op):
        d = dict(self._d[op])
        for p in self._live:
            if p.name == op and p.runs:
                self._add(d, p, p.runs)
        return d

    def total_sent(self) -> int:
        return sum(self[op]["bytes_sent"] for op in OPS)

    def total_sent_internode(self) -> int:
        return sum(self[op]["bytes_sent_internode"] for op in OPS)

    def as_dict(self) -> dict:
        return {op: self[op] for op in OPS}


class PlanCache:
    def __init__(self, max_plans: int = MAX_PLANS):
        self.max_plans = max_plans
        self.plans = OrderedDict()   # key -> CollectivePlan, least recently used first
        self.hot = {}                # (id(send), id(recv), name, op) -> kept plan holding those objects
        self.seen = set()            # keys met once
        self.ledger = Ledger(self.plans.values())
        self.scratch_growths = 0
        self._scratch = {}           # array module name -> [uint8 array, ...], each grow-only
        self.orphans = []            # plans abandoned after an error (their requests may be active)

    def __len__(self):
        return len(self.plans)

    def get(self, key):
        """The kept plan of `key`, marked most recently used, or None."""
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
        return plan

    def offer(self, key, plan, send, recv, op: str, on_device: bool) -> bool:
        """Keep `plan` if `key` was seen before (True); else remember the key (False: the caller frees it)."""
        if key not in self.seen:
            if key is not None:
                self.seen.add(key)
            if len(self.seen) > 16 * self.max_plans:
                self.seen.clear()
            return False
        self.plans[key] = plan
        if len(self.plans) > self.max_plans:
            self._evict(self.plans.popitem(last=False)[1])
        # the objects of this call are the plan's own (plan.keep holds them)
        plan.hot = (id(send), id(recv), plan.name, op)
        plan.guard = (send.dtype, send.shape, recv.shape, on_device)
        self.hot[plan.hot] = plan
        return True

    def release(self, plan):
        """A plan that ran once and was not kept: count it, free its requests."""
        self.ledger.fold(plan)
        free_plan(plan)

    def _evict(self, plan):
        self.ledger.fold(plan)
        if plan.hot is not None:
            self.hot.pop(plan.hot, None)
        free_plan(plan)

    def clear(self):
        """Free every kept plan (counted first)."""
        for p in self.plans.values():
            self.ledger.fold(p)
            free_plan(p)
        self.plans.clear()
        self.hot.clear()

    def abandon(self, plan):
        """After an error: forget every plan without freeing (requests may be active; buffers stay alive)."""
        self.orphans.append(plan)
        for p in self.plans.values():  # kept plans may share the abandoned scratch
            self.ledger.fold(p)
        self.plans.clear()
        self.hot.clear()
        self.ledger.fold(plan)

    def scratch(self, xp, nbytes: int, k: int = 2, first: int = 0) -> list:
        """Scratch buffers first .. first+k-1 (uint8, grow-only) of >= nbytes each; growing drops the kept plans.

        A plan that needs scratch for several passes (the node-aware schedule) asks for each pass
        at its own ``first``, so the passes never share a buffer.
        """
        have = self._scratch.setdefault(xp.__name__, [])
        while len(have) < first:
            have.append(xp.empty(0, xp.uint8))
        grew = False
        for i in range(first, first + k):
            if i == len(have) or have[i].nbytes < nbytes:
                old = have[i].nbytes if i < len(have) else 0
                cap = -(-max(nbytes, 2 * old, 4096) // 64) * 64  # any itemsize divides it
                have[i:i + 1] = [xp.empty(cap, xp.uint8)]
                grew = True
        if grew:
            self.scratch_growths += 1
            self.clear()  # they hold views of the old scratch
        return have[first:first + k]
