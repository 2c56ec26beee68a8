"""The lander thread: a failed weight copy reaches the training loop, and the process exits
cleanly with updates in flight."""

import os
import subprocess
import sys

import pytest
from helpers import RESIDENT
from models import tiny_mlp

import trainstream


def test_a_failed_weight_copy_surfaces_on_the_training_thread():
    """Whether the lander thread or the training thread pushes the weights, a failure
    reaches the training loop, never a silent stale weight."""
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", **RESIDENT)
    pager = model._trainstream_engine.weights

    def broken(unit):
        raise OSError("copy failed")

    pager.push = broken
    with pytest.raises((RuntimeError, OSError)) as info:
        loss_fn(model, batch(0, "cpu")).backward()
        opt.step()
        pager.lander.stop()  # the thread has handled every update it was given
        model(batch(1, "cpu"))
    error = info.value
    assert "copy failed" in str(error) + str(error.__cause__)


_EXIT_SCRIPT = """
import atexit, os, threading


@atexit.register  # registered first, so it runs after trainstream's own exit hook
def no_lander_left():
    if any(t.name == "trainstream-lander" and t.is_alive() for t in threading.enumerate()):
        os._exit(3)


import trainstream
from models import tiny_mlp
model, batch, loss_fn = tiny_mlp(layers=8, dim=2048, rows=64)
model, opt = trainstream.wrap(model, None, device="cpu", param_offload=False, offload=True, threads=1)
for i in range(3):
    loss_fn(model, batch(i, "cpu")).backward()
    opt.step()  # returns with updates still running: the lander thread waits on them
    opt.zero_grad()
print("exiting")
"""


def test_the_process_exits_cleanly_while_updates_are_in_flight():
    """At interpreter exit the lander thread may be waiting inside a native call; killed
    there by Python's shutdown, it aborted the process. An exit hook stops it first."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_the_thread_ends_when_its_engine_is_collected():
    """The thread holds waiting units weakly and is joined by the engine's finalizer: once
    a collection has freed a deleted model, its lander thread is gone too."""
    import weakref

    from helpers import collected, train

    _, _, (model, opt) = train("mlp", RESIDENT, steps=3)
    thread = model._trainstream_engine.weights.lander._thread
    assert thread is not None and thread.is_alive()  # resident units' updates went through it
    engine = weakref.ref(model._trainstream_engine)
    del model, opt
    assert collected(lambda: engine() is None)
    assert not thread.is_alive()  # joined by the collection that freed the engine, no waiting after it
