"""Each unit's update, queued as soon as its gradients are there: on the host thread pool,
or with optimizer_mode="gpu" as the CUDA AdamW over the moment regions (moments.py).

The queue returns at once. What must follow an update waits for its handle: a host job's,
or a DeviceUpdate (the end of the last kernel, and the moments' trip home). The next
forward of a resident unit waits for its new weights' copy (the lander's push, params.py)
or, on the device, for the kernel itself.
"""

from __future__ import annotations

import torch

from .device import DeviceUpdate

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # what an update reads from its param group


def _hyperparameters(group: dict) -> dict:
    """As plain floats (a tensor lr, betas as a list after a load compare by value)."""
    return {k: (tuple(map(float, group[k])) if k == "betas" else float(group[k])) for k in HYPERPARAMETERS}


def _device_update_roles(s, paged: bool) -> tuple:
    """optimizer_mode="gpu": where the update writes `s`'s new weights, and its host fp32
    master (None: the fp32 device param is the master, see params.refresh_host)."""
    if not paged:
        return s.param.data, (None if s.dtype == torch.float32 else s.master)
    copy = s.copy_dtype()
    return (s.host[copy] if copy is not None else s.master), s.master


class Updater:
    # optimizer_mode="gpu": the kernel's grid beside backward. Enough blocks keep PCIe busy;
    # more take SMs the backward GEMMs need (the engine suite measures the trade).
    DEVICE_UPDATE_BLOCKS = 16

    def __init__(self, backend, optimizer, grads, weights, moments, ledger, update_order: list):
        self.backend = backend
        self.optimizer = optimizer  # the AdamW math: host jobs, or kernels on the current stream
        self.grads = grads  # reads each slot's gradient where it landed
        self.weights = weights  # a resident unit's new weights go to the device when done
        self.moments = moments  # the MomentStager (optimizer_mode="gpu"), else None
        self.ledger = ledger
        self.update_order = update_order
        # Group positions (load_state_dict replaces the group dicts, never their order), and
        # the hyper-parameters each group had when this window's first update of it was
        # queued, with the units queued: step() compares them to the group's current ones.
        self._group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._used: dict = {}  # group index -> (hyper-parameters, [unit names])

    def close(self) -> None:
        """No more updates (unwrap, the switch to stock): the moment regions may go."""
        self.moments = None

    def queue(self, unit, grad_scale: float = 1.0) -> None:
        """Queue `unit`'s update from the gradients of this window, scaled by `grad_scale`
        (clipping); returns at once."""
        slots = [s for s in unit.trainable if s.has_grad]
        if slots:
            self.note_hyperparameters(unit.name, slots)
            # Numbered by when the next forward needs the unit: blocks update in backward
            # order, but block 0 (and the embeddings before it) are needed first.
            unit.priority = self.update_order.index(unit)
            if self.moments is not None:
                self._queue_on_device(unit, slots, grad_scale)
            else:
                self._queue_on_host(unit, slots, grad_scale)

    def note_hyperparameters(self, name: str, slots) -> None:
        """An update of `slots` (named `name` in the warning) reads its groups' hyper-parameters
        now: the device-state update (engine.py) notes them here too."""
        groups = self.optimizer.param_groups
        for i in {self._group_of[s.param] for s in slots}:
            self._used.setdefault(i, (_hyperparameters(groups[i]), []))[1].append(name)

    def changed_hyperparameters(self) -> list:
        """(group index, name, value the queued updates used, value now, their units) for
        each group whose hyper-parameters changed since this window's updates of it were
        queued."""
        groups = self.optimizer.param_groups
        out = []
        for i, (used, units) in sorted(self._used.items()):
            now = _hyperparameters(groups[i])
            for key in HYPERPARAMETERS:
                if now[key] != used[key]:
                    out.append((i, key, used[key], now[key], units))
                    break
        return out

    def end_window(self) -> None:
        """The window's updates are all queued (step(), zero_grad())."""
        self._used.clear()

    def queue_shard(self, unit, slots: list, grads: list, grad_scale: float) -> list:
        """Data parallel: queue the AdamW of this rank's shard of `slots` (the optimizer holds
        the shard ranges) from `grads`, their reduced shards (distributed.py): host jobs, or
        with optimizer_mode="gpu" the kernel over the moment regions (_queue_shard_on_device).
        Returns the handles to wait for; the caller hands the unit's weights over once they
        are gathered."""
        groups = self.optimizer.param_groups
        for i in {self._group_of[s.param] for s in slots}:
            self._used.setdefault(i, (_hyperparameters(groups[i]), []))[1].append(unit.name)
        unit.priority = self.update_order.index(unit)
        self.weights.before_host_update(unit)
        if self.moments is not None:
            return self._queue_shard_on_device(slots, grads, grad_scale)
        return [handle for handle, _ in self.optimizer.queue(slots, grads, grad_scale, unit.priority)]

    def _queue_shard_on_device(self, slots: list, grads: list, grad_scale: float) -> list:
        """optimizer_mode="gpu" under data parallel: the kernel on the update stream over each
        moment region of `slots` (staged or mapped, as _queue_on_device), updating each slot's
        fp32 master_shard in place from its reduced shard in `grads`. Both are in the arenas'
        host memory (pinned on a GPU), written by the host before this is called (the
        reduction was waited for), so the kernel follows no device work but its regions'.
        Returns one DeviceUpdate: the gather thread waits for it (its host side reads the
        master shard), as does the next reduction into the unit's reduced shard."""
        backend = self.backend
        stream = backend.update
        grad_of = {s: g for s, g in zip(slots, grads)}
        kernel_done = home = None
        try:
            for group in self.moments.by_region(slots):
                staged = self.moments.stage_in([s.param for s in group], stream)
                with backend.on(stream):
                    self.optimizer.queue_on_device(
                        backend.device,
                        group,
                        [grad_of[s] for s in group],
                        [s.master_shard for s in group],
                        [None] * len(group),
                        staged.moments,
                        grad_scale,
                        self.DEVICE_UPDATE_BLOCKS,
                    )
                kernel_done = backend.record(stream)
                home = self.moments.send_home(staged, kernel_done) or home
                staged = None  # its VRAM copy goes once its streams pass it (room for the next region's)
        except BaseException:
            # A later region failed (out of memory): the kernels queued before it still read the
            # reduced shard and write the master; nothing else tracks them, so they finish here.
            if kernel_done is not None:
                DeviceUpdate(kernel_done, home).wait()
            raise
        return [DeviceUpdate(kernel_done, home)]

    def _queue_on_host(self, unit, slots, grad_scale: float) -> None:
        self.weights.before_host_update(unit)
        jobs = self.optimizer.queue(slots, [self.grads.grad_of(s) for s in slots], grad_scale, unit.priority)
        for handle, ss in jobs:
            self.grads.read_by(ss, handle)
        self.weights.host_update_queued(unit, [handle for handle, _ in jobs])

    def _queue_on_device(self, unit, slots, grad_scale: float) -> None:
        """optimizer_mode="gpu": the AdamW kernel on the update stream, once compute has
        produced the gradients and queued every read of the old weights. One kernel per
        moment region (moments.py), each queued between its region's copy in and its copy
        home: a region then holds VRAM for one copy each way and its own kernel, and the
        next region's copy in overlaps this one's copy home under max_inflight_bytes, so both
        PCIe directions stay busy (a kernel per unit would hold all of a unit's regions in VRAM
        until the last arrived). A resident unit's weights are updated in place on the device
        (fp32 ones are their own master there); a paged unit's in host memory, where its next
        fetch reads them."""
        backend = self.backend
        stream = backend.update
        self.weights.take_edits(unit)  # a param edited in place: the kernel reads the edit (params.py)
        backend.follow_compute(stream)
        if unit.paged and unit.fetch_event is not None:
            backend.wait(unit.fetch_event, stream)  # a copy from the host weights may still be reading them
        for s in slots:  # a host job still adding into the gradient sum (accumulation): the kernel
            if s.reader is not None and not isinstance(s.reader, DeviceUpdate):  # is outside its pool
                s.reader.wait()
        with backend.on(stream):
            # The non-finite check on the device, ahead of the kernels (None: gradients not left
            # on the device, or nonfinite="ignore"): they write nothing once it is set.
            skip_flag = self.grads.check_on_device(unit, slots)
        counted = []  # the slots whose step the optimizer has advanced
        kernel_done = home = handle = None
        try:
            for group in self.moments.by_region(slots):
                targets, masters = zip(*(_device_update_roles(s, unit.paged) for s in group))
                grads = [self.grads.grad_of(s) for s in group]
                staged = self.moments.stage_in([s.param for s in group], stream)
                with backend.on(stream):
                    self.optimizer.queue_on_device(
                        backend.device,
                        group,
                        grads,
                        list(targets),
                        list(masters),
                        staged.moments,
                        grad_scale,
                        self.DEVICE_UPDATE_BLOCKS,
                        skip_flag,
                    )
                    counted += group
                    for g in grads:
                        if g.device == backend.device:
                            backend.keep_until(g, stream)
                kernel_done = backend.record(stream)
                home = self.moments.send_home(staged, kernel_done) or home
                self.ledger.add(
                    kernel_done, sum(g.numel() * g.element_size() for g in grads if g.device == backend.device)
                )
                # Let go of the region's buffer and gradients now: the allocator frees them once
                # their streams pass this kernel and copy, as the ledger just recorded (held to
                # the unit's end, they would also take room the next region's copy needs).
                self.grads.release_device_grads(group)
                staged = grads = None
        finally:
            # Even if a later region's copy failed (out of memory), the kernels already queued
            # are tracked: host readers of their moments and the next forward wait for them.
            if kernel_done is not None:
                handle = DeviceUpdate(kernel_done, home)
                self.grads.read_by(slots, handle)
                self.weights.device_update_queued(unit, handle)
            if skip_flag is not None:
                # Whatever was queued, the check was: its outcome is learned once the stream is past it.
                done = handle if handle is not None else DeviceUpdate(backend.record(stream))
                self.grads.checked_on_device(unit, counted, done, lambda: self._take_back(counted))

    def _take_back(self, slots) -> None:
        """The device skipped the update of `slots` (a gradient not finite, nonfinite.py): the
        step counts the optimizer advanced when it was queued go back, so the next update of
        each takes the step this one would have."""
        for s in slots:
            self.optimizer.state[s.param]["step"] -= 1
