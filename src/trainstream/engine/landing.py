"""The lander: sends a resident unit's new weights to the device the moment its host
update finishes.

The host AdamW takes longer than backward on every model worth offloading, so most updates
finish after step() has returned. Without the lander, each block's copy to the device would
only be issued when the next forward reaches the block, and the forward would wait for
copies one block at a time; with it, those copies overlap the updates still running. One
daemon thread per engine waits on the updates in the order they were queued (without the
GIL) and issues each copy on the copy-in stream under the pager's lock; whatever it has
not reached yet, the forward's guard pushes itself. It takes the pending units in the
order the host pool runs their updates (lowest priority number first), so it waits on the
update that finishes next, not on one the pool has put off.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref

# Landers with a running thread. At interpreter exit each is stopped before Python tears
# itself down: a daemon thread still inside a native wait when that happens is killed
# mid-call (Python ends such threads by unwinding them when they retake the GIL), which
# aborts the process.
_running: weakref.WeakSet[Lander] = weakref.WeakSet()


def _stop_thread(q: queue.SimpleQueue, box: list) -> None:
    q.put(None)
    for thread in box:
        if thread is not threading.current_thread():  # collected by the thread itself: it is ending
            thread.join()


@atexit.register
def _stop_all() -> None:
    for lander in list(_running):
        lander.stop()


class Lander:
    POLL_S = 1.0  # how often an idle thread checks whether its engine is gone

    def __init__(self, pager):
        self._pager = weakref.ref(pager)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        # When the pager (the engine) is collected, the thread is told to stop and joined, so
        # that once the collection returns nothing of the engine is left: the thread holds
        # units only weakly while they wait, and strongly only while it pushes one.
        self._thread_box: list = []  # the running thread, once started, shared with the finalizer
        weakref.finalize(pager, _stop_thread, self._queue, self._thread_box)
        self.error: BaseException | None = None

    def expect(self, unit) -> None:
        """`unit`'s update was just queued: push its weights when the update is done."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainstream-lander", daemon=True)
            self._thread_box.append(self._thread)
            self._thread.start()
            _running.add(self)
        self._queue.put(weakref.ref(unit))

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            self._thread_box.clear()
        _running.discard(self)

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("trainstream: copying updated weights to the device failed") from error

    def _next(self, pending: list):
        """The pending unit whose update the pool runs first; None to stop; waits idle.
        `pending` holds weak references: a unit whose engine is gone drops out."""
        while True:
            try:
                while True:
                    item = self._queue.get_nowait() if pending else self._queue.get(timeout=self.POLL_S)
                    if item is None:
                        return None
                    pending.append(item)
            except queue.Empty:
                pending[:] = [ref for ref in pending if ref() is not None]
                if pending:
                    break
                if self._pager() is None:
                    return None
        ref = min(pending, key=lambda r: getattr(r(), "priority", -1))
        pending.remove(ref)
        return ref() or self._next(pending)

    def _run(self) -> None:
        pending: list = []
        while True:
            unit = self._next(pending)
            if unit is None:
                return
            # Wait holding the update handles only (host buffers): the unit, and through it the
            # model's parameters, stay the engine's to let go of while the update runs.
            handles, ref = list(unit.updates), weakref.ref(unit)
            del unit
            try:
                for handle in handles:
                    handle.wait()
                unit, pager = ref(), self._pager()
                if unit is None or pager is None:
                    return
                with pager.lock:
                    if unit.stale:
                        pager.push(unit)
            except BaseException as e:  # surfaced on the training thread at the next guard or step
                self.error = e
            # Drop every reference before blocking in _next() again: this frame outlives the
            # engine, and a Unit left here keeps its slots' parameters (device weights) and
            # an AdamWHandle (host tensors) alive until the thread notices the engine is gone.
            unit = pager = handle = None
            handles = []
