"""The built-in `fair` scheduler (the default): `fcfs` within a tenant, fair shares across
tenants.

With one tenant (every server without API keys) it is exactly `fcfs`. With several, the
engine's sequence slots (`max_num_seqs`) are shared: a tenant's fair share is the slots
divided by the tenants that have work in the engine. Each step, before `fcfs` schedules:
- waiting requests of tenants below their share go first, in arrival order;
- when the slots are all taken, a request of the tenant furthest above its share is
  preempted (its newest, which has the least to recompute) for each tenant below its share
  that waits, so a tenant that floods the engine delays another tenant's request by a step,
  not by the length of its own requests.
A preempted request keeps its place among its tenant's waiting requests and is recomputed
later, mostly from the prefix cache.
"""

from __future__ import annotations

from collections import Counter, deque

from pagedserve.common.contracts import Request, SchedulerOutput
from pagedserve.plugins.fcfs_scheduler import FCFSScheduler


class FairScheduler(FCFSScheduler):
    def schedule(self) -> SchedulerOutput:
        preempted = self._rebalance() if self.waiting else []
        out = super().schedule()
        out.preempted[:0] = preempted
        return out

    def _rebalance(self) -> list[Request]:
        """Order the waiting queue by need, and free slots for tenants below their share."""
        running = Counter(r.tenant for r in self.running)
        waiting = Counter(r.tenant for r in self.waiting)
        tenants = set(waiting) | set(running)
        if len(tenants) < 2:
            return []
        share = max(1, self.max_num_seqs // len(tenants))
        needy = sorted((t for t in waiting if running[t] < share), key=lambda t: running[t])
        free = self.max_num_seqs - len(self.running)
        preempted = []
        for tenant in needy:
            want = min(share, running[tenant] + waiting[tenant])
            while running[tenant] < want:
                if free > 0:  # a free slot: fcfs admits it in the new order below
                    free -= 1
                else:
                    richest, count = max(running.items(), key=lambda item: item[1])
                    if count <= share:
                        break
                    victim = max((r for r in self.running if r.tenant == richest), key=lambda r: r.arrival_time)
                    self._preempt(victim)
                    running[richest] -= 1
                    preempted.append(victim)
                running[tenant] += 1  # the slot is this tenant's
        # Tenants below their share first, each in arrival order; the rest as they were.
        first = set(needy)
        self.waiting = deque([r for r in self.waiting if r.tenant in first] +
                             [r for r in self.waiting if r.tenant not in first])
        return preempted
