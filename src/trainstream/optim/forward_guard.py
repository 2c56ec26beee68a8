"""Which module's forward reads which parameter, so that a parameter is waited for just
before the forward that reads it, and no earlier.

The standalone optimizer gets parameters, not the model, so it learns the modules from a
global module forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``).
The rule it relies on: a parameter is read inside the forward of a module whose subtree
holds it. A module's forward waits for the pending parameters of its whole subtree except
those of descendants whose own forward will run (and wait for them itself). "Will run" is
learned, per context, from the calls seen so far: a descendant seen called in the same
context (grad mode, ``module.training``) is trusted to be called again; before that, its
parameters are waited for at its ancestor's call (earlier than needed, never later). The
context matters because a module may read its children's weights itself in one mode and call
them in another (nn.TransformerEncoderLayer's inference fast path under ``no_grad`` in eval
reads linear1, linear2 and the norms without calling them).

Reads outside any such forward are learned per window (from one step() to the next): a
parameter that got a gradient although no forward with grad enabled waited for it in that
window (a chunked loss reading ``lm_head.weight`` while only the model's body is called) is
read by code the guard does not see. `end_window()` names those pending parameters: the
optimizer brings them up to date before step() returns.

The hook runs on every module's forward in the process, and any global hook takes torch's
Module.__call__ off its fast path: it is on only while something is left to do in the window,
an update pending or a record whose readers were not seen yet (or a module seen for the first
time in the window: the learning goes on in the modules it calls). In a plain training loop
that is from step() to the end of the next forward; further forwards before the next step()
(accumulation, evaluation, recomputation in backward) run without it.

What the guard cannot see: a read before the first forward of a window that would have
covered it (a window's reads are learned at its end, so a change of how the model reads a
parameter, a module no longer called in the same context, is caught one step late), and
reads under ``no_grad`` outside any module holding the parameter (they leave no gradient).
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
        # context (grad enabled, module.training) -> the modules whose forward ran in it
        self._called: dict = {}
        # module -> {context: (generation, the records its forward waits for in that context)}
        self._readers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._generation = 0  # bumped when the readers may have changed: they are recomputed
        # ids of the records a forward with grad enabled waited for (or would have) in this
        # window. Only grows within a window: a record in it was read by a seen forward.
        self._covered: set = set()
        # The global hook runs on every module's forward in the process (and takes torch's
        # Module.__call__ off its fast path): it is installed only while a forward may have to
        # wait (an update pending) or the window still has records to learn the readers of;
        # in a plain training loop, from step() to the end of the next forward.
        self._hook: list = []  # the hook's handle while installed (a list: the finalizer holds it)
        self._closed = False
        # The generation when this window began: learning something in this window (a
        # module's first call in a context) keeps the hook on to the window's end, as the
        # learning goes on in the modules it calls (a first call of the root would otherwise
        # cover every record at once and take the hook off before its children are seen).
        self._window_generation = None
        self._finalizer = weakref.finalize(self, _remove_hook, self._hook)
        self._install()

    def _install(self) -> None:
        if not self._hook and not self._closed:
            me = weakref.ref(self)  # the hook holds the guard weakly: the optimizer stays collectable
            self._hook.append(
                torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda module, args: _before_forward(me, module)
                )
            )

    def _uninstall_if_idle(self) -> None:
        """Nothing to wait for and every record's readers seen in this window: no forward
        before the next step() needs the hook (end_window() and pending() put it back)."""
        if (
            self._hook
            and not self._pending
            and self._window_generation == self._generation
            and len(self._covered) >= len(self._records)
        ):
            _remove_hook(self._hook)

    @property
    def installed(self) -> bool:
        """Whether the global forward pre-hook is on."""
        return bool(self._hook)

    def add(self, param: torch.Tensor, record) -> None:
        self._records[param] = record
        self._generation += 1
        self._install()

    def remove(self) -> None:
        """No more waits: the hook is taken off for good and the records let go."""
        self._closed = True
        self._finalizer()
        self._pending.clear()
        self._records = {}
        self._readers = weakref.WeakKeyDictionary()
        self._covered = set()

    def pending(self, record) -> None:
        """`record`'s update was queued: the next forward that reads it waits for it."""
        self._pending.add(record)
        self._install()

    def done(self, record) -> None:
        """`record`'s update is visible to compute (waited for, or synchronized)."""
        self._pending.discard(record)
        if not self._pending:
            self._uninstall_if_idle()

    def end_window(self) -> list:
        """At step(), once its updates are pending: the pending records no forward with grad
        enabled waited for since the last step() (their reads are not seen by the guard), which
        the caller makes current now. A new window starts."""
        unseen = [r for r in self._pending if not self.seen(r)]
        self._covered = set()
        self._window_generation = self._generation
        self._install()
        return unseen

    def seen(self, record) -> bool:
        """Whether a forward with grad enabled read `record` in this window (so far)."""
        return id(record) in self._covered

    def before_forward(self, module: torch.nn.Module) -> None:
        grad = torch.is_grad_enabled()
        context = (grad, module.training)
        called = self._called.get(context)
        if called is None:
            called = self._called[context] = weakref.WeakSet()
        per_context = self._readers.get(module)
        if per_context is None:
            per_context = self._readers[module] = {}
        if module not in called:
            # A first call in this context moves the params this module reads out of its
            # ancestors' readers; a module reading none of ours (a loss module built each step)
            # changes nothing.
            called.add(module)
            readers = self._read_by(module, called)
            if readers:
                self._generation += 1
            cached = per_context[context] = (self._generation, readers)
        else:
            cached = per_context.get(context)
            if cached is None or cached[0] != self._generation:
                cached = per_context[context] = (self._generation, self._read_by(module, called))
        readers = cached[1]
        if grad and readers:
            self._covered.update(map(id, readers))
        if self._pending and readers:
            waiting = [r for r in readers if r in self._pending]
            if waiting:
                self._wait_for(waiting)
                self._pending.difference_update(waiting)
        if not self._pending:
            self._uninstall_if_idle()

    def _read_by(self, module: torch.nn.Module, called) -> list:
        """The records of the parameters `module`'s forward reads: its own, and those of its
        descendants reached through modules not seen called in this context."""
        out, seen = [], set()
        todo = [module]
        while todo:
            m = todo.pop()
            for p in m._parameters.values():
                record = self._records.get(p) if p is not None else None
                if record is not None and id(record) not in seen:
                    seen.add(id(record))
                    out.append(record)
            todo.extend(c for c in m._modules.values() if c is not None and c not in called)
        return out


def _remove_hook(box: list) -> None:
    while box:
        box.pop().remove()


def _before_forward(guard_ref, module) -> None:
    guard = guard_ref()
    if guard is not None:
        guard.before_forward(module)
