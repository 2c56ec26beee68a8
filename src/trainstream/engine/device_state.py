"""Device state: a small trainable set (a LoRA's adapters) trained where it computes.

The plan (placement.py, Plan.device_state) names the trainable slots whose whole state stays
on the compute device: weights, the gradient, AdamW's two moments and, for a param that is
not fp32, an fp32 master. Nothing of them crosses PCIe and no hook runs per gradient:
autograd accumulates ``p.grad`` exactly as it does without the engine (summed over an
accumulation window, as torch sums), and ``optimizer.step()`` updates them all at once, after
the host path's own work, as a held update: the window's gradients, clipped by the global
norm over host and device-state gradients together, skipped whole when a gradient is not
finite. ``zero_grad()`` clears ``p.grad`` as torch does (the optimizer's own zero_grad).

Invariants:
- the moments are ``optimizer.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` on the device in the
  plan's moment dtype, ``["step"]`` a float32 CPU tensor as on the host path: state_dict()
  is torch's format, and a load lands the moments back on the device (adopt_state);
- a master is this module's, not the optimizer state's (the host path keeps its masters
  outside state_dict() too); the param holds the master rounded to nearest even. A user's
  in-place edit of the param moves its version counter, and the master takes the edit
  before the next update (take_edits); the update's own writes go through ``p.data``,
  whose counter is its own;
- on CUDA the update is the engine's AdamW kernel on the current stream (behind backward,
  ahead of the next forward: nothing else waits for it); on the CPU path the host AdamW,
  which gives the same bits, done when step() returns.
"""

from __future__ import annotations

import torch

from .. import ops


class DeviceState:
    """Owns the device-state slots' moments' placement, masters and update."""

    def __init__(self, optimizer, slots: list, backend):
        """Built with the engine, before the weights are placed on the device: the masters
        and moments are made there at the first update (_place), as torch makes its state."""
        self.optimizer = optimizer  # the AdamW math and the state dicts
        self.slots = slots  # in the engine's update order
        self.backend = backend
        self.masters: dict = {}  # param -> fp32 master on the device, for params not fp32
        self._versions: dict = {}  # param -> its _version when the master last matched it
        # A converted OffloadAdamW's fp32 masters of bf16 params (optimizer.py, _carried; the
        # optimizer's attach() hands its own on and forgets them).
        mine = {s.param for s in slots}
        self._carried = {p: m for p, m in getattr(optimizer, "_carried", {}).items() if p in mine}
        self._ready: set = set()  # params whose master is made and whose moments are on the device

    def __len__(self) -> int:
        return len(self.slots)

    def adopt_state(self) -> None:
        """The optimizer's state was replaced (load_state_dict): its moments go to the device
        before the next update."""
        self._ready.clear()

    def _place(self, slots) -> None:
        """The moments of `slots` on the device in the moment dtype: those the optimizer holds
        (a converted optimizer's, a loaded state dict's) are moved there, zeros at step 0 where
        it holds none (torch makes a param's state at its first update too); and a master for
        each param that is not fp32, from the param (or the master carried in, where the param
        is what that rounds to)."""
        device, dtype = self.backend.device, self.optimizer.moment_dtype
        for s in slots:
            p = s.param
            self._ready.add(p)
            if p.dtype != torch.float32 and p not in self.masters:
                master = p.detach().to(dtype=torch.float32, copy=True)
                kept = self._carried.pop(p, None)
                if kept is not None and kept.shape == p.shape and torch.equal(kept.to(p.device, p.dtype), p.detach()):
                    master.copy_(kept)  # its low bits stand
                self.masters[p] = master
                self._versions[p] = p._version
            state = self.optimizer.state[s.param]
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros(s.param.shape, dtype=dtype, device=device)
                elif state[key].device != device or state[key].dtype != dtype:
                    state[key] = state[key].to(device=device, dtype=dtype).contiguous()

    # -- the window's gradients -------------------------------------------------------------

    def with_grads(self) -> list:
        """The slots with a gradient this window (torch's AdamW skips a param without one)."""
        out = []
        for s in self.slots:
            g = s.param.grad
            if g is None:
                continue
            if g.is_sparse:
                raise ValueError(f"trainstream: sparse gradients are not supported ({s.name})")
            out.append(s)
        return out

    def has_grads(self) -> bool:
        return any(s.param.grad is not None for s in self.slots)

    def _grads(self, slots) -> list:
        return [s.param.grad if s.param.grad.is_contiguous() else s.param.grad.contiguous() for s in slots]

    def norms(self, slots) -> list:
        """Each gradient's L2 norm in fp32 (one multi-tensor launch on CUDA), as the host path
        takes it and as torch's clip_grad_norm_ takes it of an fp32 gradient."""
        if not slots:
            return []
        return list(torch._foreach_norm(self._grads(slots), 2.0, dtype=torch.float32))

    def first_nonfinite(self, slots=None):
        """The first slot (of `slots`, default: those with a gradient) whose gradient is not
        finite, or None. One host read when all are: the norms say where to look, the
        gradient itself decides (a huge finite value overflows its square)."""
        slots = self.with_grads() if slots is None else slots
        norms = self.norms(slots)
        if not norms or bool(torch.isfinite(torch.stack(norms)).all()):
            return None
        for s, n in zip(slots, norms):
            if not bool(torch.isfinite(n)) and not bool(torch.isfinite(s.param.grad).all()):
                return s
        return None

    def drop(self) -> None:
        """Forget the window's gradients (a skipped or dropped window): p.grad goes to None."""
        for s in self.slots:
            s.param.grad = None

    # -- the update --------------------------------------------------------------------------

    def take_edits(self, slots) -> None:
        """A param edited in place since its master last matched it: the master takes the
        edit (an fp32 param is its own master, and its edit is simply there)."""
        for s in slots:
            p = s.param
            master = self.masters.get(p)
            if master is not None and p._version != self._versions[p]:
                master.copy_(p.detach())
                self._versions[p] = p._version

    def update(self, slots, grad_scale: float = 1.0, check: bool = False):
        """AdamW over `slots` from their gradients, scaled by `grad_scale` (clipping): one
        kernel per param group and gradient dtype. `check`: the gradients' values are checked
        on the device first (ops.mark_nonfinite_, one launch per dtype) into a flag the
        kernels read: set, they write nothing. The host reads the flag after the launches (on
        CUDA the one sync waits for the update, not for backward before it: the GPU never idles
        while the update is prepared). Returns the first slot whose gradient is not finite,
        its update skipped and every step count taken back, or None."""
        if not slots:
            return None
        self._place([s for s in slots if s.param not in self._ready])
        self.take_edits(slots)
        grads = self._grads(slots)
        flag, found = self._mark_nonfinite(grads) if check else (None, None)
        self.optimizer.update_device_state(self.backend.device, slots, grads, self.masters, grad_scale, flag)
        if flag is None or not int(flag.item()):
            return None
        for s in slots:
            self.optimizer.state[s.param]["step"] -= 1
        marks = torch.cat([found[i] for i in sorted(found)]).tolist()
        order = [j for i in sorted(found) for j in self._by_dtype[i]]
        return slots[min(j for j, m in zip(order, marks) if m)]

    def _mark_nonfinite(self, grads) -> tuple:
        """(flag, {dtype group: found}) with ops.mark_nonfinite_ queued over `grads`, one
        launch per gradient dtype; self._by_dtype maps each group to its gradients' indices."""
        device = self.backend.device
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        groups: dict = {}
        for j, g in enumerate(grads):
            groups.setdefault(g.dtype, []).append(j)
        self._by_dtype = dict(enumerate(groups.values()))
        found = {}
        for i, idx in self._by_dtype.items():
            found[i] = torch.zeros(len(idx), dtype=torch.int32, device=device)
            ops.mark_nonfinite_([grads[j] for j in idx], found[i], flag)
        return flag, found

    def nbytes(self) -> int:
        """Device bytes this state holds now: weights, gradients, moments, masters."""
        total = 0
        for s in self.slots:
            p = s.param
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
            state = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    total += state[key].numel() * state[key].element_size()
        return total + sum(m.numel() * 4 for m in self.masters.values())
