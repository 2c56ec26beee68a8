"""Which module's forward reads which parameter, so that a parameter is waited for just
before the forward that reads it, and no earlier.

The standalone optimizer gets parameters, not the model, so it learns the modules from a
global module forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``).
A parameter is read by the forward of a module that holds it directly, when that module's
forward runs. A module whose forward never runs (nn.MultiheadAttention's ``out_proj``,
read by its parent's forward) leaves its parameters to its nearest ancestor whose forward
does: "runs" is learned from the calls seen so far, so before a module has been seen called
its parameters are waited for at its parent's call (earlier than needed, never later).

Parameters no forward seen so far would wait for (held by no module that ran) are
``unowned()``: their user reads them outside any module's forward, so the optimizer must
finish their updates before step() returns.
"""

from __future__ import annotations

import weakref

import torch


class ForwardGuard:
    def __init__(self, wait_for):
        """`wait_for(records)`: called before a forward reading the parameters of `records`
        (the values given to `add`), with those whose update may still be in flight."""
        self._wait_for = wait_for
        self._records: dict = {}  # param -> its record (a dict keyed by id: tensors hash by identity)
        self._pending: set = set()  # records whose update the next reading forward must wait for
        self._owned: set = set()  # records some seen forward reads
        self._called: weakref.WeakSet = weakref.WeakSet()  # modules whose forward has run
        self._readers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (generation, records)
        self._generation = 0  # bumped when the readers may have changed: they are recomputed
        me = weakref.ref(self)
        # The global hook holds the guard weakly: the optimizer (and through it the model's
        # parameters) stays collectable; a finalizer takes the hook off.
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: _before_forward(me, module)
        )
        self._finalizer = weakref.finalize(self, handle.remove)

    def add(self, param: torch.Tensor, record) -> None:
        self._records[param] = record
        self._generation += 1

    def remove(self) -> None:
        """No more waits: the hook is taken off."""
        self._finalizer()
        self._pending.clear()

    def pending(self, record) -> None:
        """`record`'s update was queued: the next forward that reads it waits for it."""
        self._pending.add(record)

    def done(self, record) -> None:
        """`record`'s update is visible to compute (waited for, or synchronized)."""
        self._pending.discard(record)

    def unowned(self) -> list:
        """The records no forward seen so far reads."""
        return [r for r in self._records.values() if r not in self._owned]

    def before_forward(self, module: torch.nn.Module) -> None:
        if module not in self._called:
            # A first call moves the params this module reads out of its ancestors' readers;
            # a module reading none of ours (a loss module built each step) changes nothing.
            self._called.add(module)
            readers = self._read_by(module)
            if readers:
                self._generation += 1
            self._readers[module] = (self._generation, readers)
        # Computed even with nothing pending: the records it reads become owned, which the
        # next step() needs to know before any update is pending.
        cached = self._readers.get(module)
        if cached is None or cached[0] != self._generation:
            cached = self._readers[module] = (self._generation, self._read_by(module))
        if not self._pending:
            return
        waiting = [r for r in cached[1] if r in self._pending]
        if waiting:
            self._wait_for(waiting)
            self._pending.difference_update(waiting)

    def _read_by(self, module: torch.nn.Module) -> list:
        """The records of the parameters `module`'s forward reads: its own, and those of its
        descendants reached through modules whose forward has not been seen to run."""
        out, seen = [], set()
        todo = [module]
        while todo:
            m = todo.pop()
            for p in m._parameters.values():
                record = self._records.get(p) if p is not None else None
                if record is not None and id(record) not in seen:
                    seen.add(id(record))
                    out.append(record)
            todo.extend(c for c in m._modules.values() if c is not None and c not in self._called)
        self._owned.update(out)
        return out


def _before_forward(guard_ref, module) -> None:
    guard = guard_ref()
    if guard is not None:
        guard.before_forward(module)
