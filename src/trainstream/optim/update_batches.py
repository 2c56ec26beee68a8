"""Streamed parameters' host updates (OffloadAdamW(mode="cpu") on GPU parameters), gathered
into native jobs.

A parameter's new weights go back to the device when the job that updates it is done, so
each large parameter keeps a job of its own: the next forward waits for that parameter's
update only. Small ones (biases, norms) queued one after another are gathered into one job
of up to `MAX_ELEMENTS` (about a fifth of a millisecond of a host pool's time): the Python
checks and the queueing of a job are paid once for all of them, and a forward waiting for
one of them waits at most that much longer. One job holds one param group's parameters
(one set of hyper-parameters) of one gradient dtype, all with a bf16 copy or all without.
"""

from __future__ import annotations

from .. import ops

MAX_ELEMENTS = 1 << 20


class UpdateBatches:
    def __init__(self, updates, *, grad_scale: float, threads, mark):
        """`updates`: the HostUpdates; `mark`: compute's position at step() (the pushes wait
        for it)."""
        self._updates = updates
        self._grad_scale = grad_scale
        self._threads = threads
        self._mark = mark
        self._key = None
        self._group = None
        self._items: list = []  # (record, master, grad, state, seed, priority)
        self._numel = 0

    def add(self, record, grad, state: dict, group: dict, seed: int) -> None:
        """Queue `record`'s update (the gradient `grad`, in host memory; `state` holds its
        moments and step, already counted), in the current job or a new one."""
        key = (id(group), grad.dtype, record.copy is None)
        numel = grad.numel()
        if self._items and (key != self._key or self._numel + numel > MAX_ELEMENTS):
            self.flush()
        master = self._updates.before_update(record)
        self._items.append((record, master, grad, state, seed, self._updates.priority_of(record)))
        self._key, self._group = key, group
        self._numel += numel

    def flush(self) -> None:
        """Queue the job gathered so far (nothing if empty)."""
        items, group = self._items, self._group
        if not items:
            return
        self._items, self._numel = [], 0
        records = [item[0] for item in items]
        copies = [r.copy for r in records]
        handle = ops.adamw_step(
            [item[1] for item in items],
            [item[2] for item in items],
            [item[3]["exp_avg"] for item in items],
            [item[3]["exp_avg_sq"] for item in items],
            [int(item[3]["step"].item()) for item in items],
            **ops.adamw.group_hyper(group),
            grad_scale=self._grad_scale,
            seeds=[item[4] for item in items],
            param_copies=None if copies[0] is None else copies,
            threads=self._threads,
            priority=min(item[5] for item in items),
        )
        for record in records:
            self._updates.update_queued(record, handle, self._mark)
