"""model.state_dict() / load_state_dict() while wrapped.

A paged parameter's ``.data`` is a placeholder most of the time, so around saving and
loading each module points its paged params at their host weights (the fp32 master, or
the host copy in the model's dtype): saving reads them (host tensors in the state dict),
loading writes straight into them. Afterwards every derived copy (fp32 master of a bf16
model, compute-dtype paging copies, the master of a resident param, a data-parallel rank's
shard of the master) is brought level.
A quantized frozen weight is saved dequantized (the values training uses) and a loaded one
is quantized again.
"""

from __future__ import annotations

import ctypes

import torch

from ..quant.weight import QuantizedWeight


def _direct_slots(model, units) -> dict:
    by_module = {}
    slot_of = {s.param: s for u in units for s in u.slots}
    for module in model.modules():
        slots = [slot_of[p] for p in module.parameters(recurse=False) if p in slot_of]
        if slots:
            by_module[module] = slots
    return by_module


def _host_weights(s) -> torch.Tensor:
    """What a state dict holds for `s`: its host weights; a quantized weight dequantized into
    host memory, one at a time (a resident one's codes are on the device, and a state dict of
    every dequantized weight there would need the VRAM quantizing saved)."""
    if s.quant is not None:
        return s.quant.dequantize().cpu()
    return _own_storage(s.host[s.dtype])


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, with a storage of exactly its bytes: no copy, the same memory. Host weights
    are carved from larger pieces (HostArena: masters, staging regions and spares beside them),
    and torch.save writes a tensor's whole storage, so a state dict of views would be saved
    as the pieces (2.56x its own bytes on the tiny GPT). The alias keeps `t`, and through it
    the piece, alive; writes through either reach both."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == nbytes or not t.is_contiguous() or nbytes == 0:
        return t
    holder = type("HostWeightBytes", (ctypes.c_char * nbytes,), {})  # a subclass: it can hold `t`
    raw = holder.from_address(t.data_ptr())
    raw.source = t
    return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)


def _exposed(slots) -> list:
    """The slots whose .data is a placeholder between uses, looked up when needed (the
    adapter moves units between paged and resident). A device-state param is always its
    own weights, on the device."""
    return [s for s in slots if (s.unit.paged and not s.device_state) or s.quant is not None]


def _level(s) -> None:
    """After a load: bring every host copy of `s` level with the one that was written
    (a paged param's host weights in its dtype, or a resident param's device data); a
    quantized weight is quantized again from the loaded values, into its own buffers. A
    device-state param has no host copy; its fp32 master takes the load as an edit (the
    version counter, device_state.py)."""
    if s.device_state:
        return
    if s.quant is not None:
        q = QuantizedWeight.quantize(s.param.data, s.quant.format, s.quant.block_size)
        s.quant.codes.copy_(q.codes)
        s.quant.absmax.copy_(q.absmax)
        return
    written = s.host[s.dtype] if s.unit.paged else s.param.data
    if s.master_shard is not None:  # data parallel: this rank's elements of the master
        lo, hi = s.shard
        s.master_shard.copy_(written.reshape(-1)[lo:hi])
    if not s.unit.paged:
        if s.trainable:
            for t in s.host.values():
                t.copy_(written)
        return
    for t in s.host.values():
        if t is not written:
            t.copy_(written)  # the fp32 master from a bf16 model's weights, or a compute-dtype copy


class StateHooks:
    """Owns the state-dict hooks of every module holding a wrapped parameter."""

    def __init__(self, model, units, backend, weights):
        self.model = model
        self.units = units
        self.backend = backend
        self.weights = weights  # the WeightPager: in-flight updates, and the resident units' lock
        self._handles = []
        self._saved = {}

    def install(self) -> None:
        for module, slots in _direct_slots(self.model, self.units).items():
            # Every module waits for in-flight updates before it is read: a resident param's
            # device copy may still be on its way.
            self._handles += [
                module.register_state_dict_pre_hook(lambda m, prefix, keep_vars, ss=slots: self._expose(ss)),
                module.register_state_dict_post_hook(
                    lambda m, sd, prefix, meta, ss=slots: self._after_save(m, sd, prefix, ss)
                ),
                module.register_load_state_dict_pre_hook(
                    lambda m, sd, prefix, meta, strict, missing, unexpected, errors, ss=slots: self._before_load(
                        m, sd, prefix, meta, ss
                    )
                ),
                module.register_load_state_dict_post_hook(lambda m, keys, ss=slots: self._after_load(ss)),
            ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _expose(self, slots, only=None) -> None:
        """Point the placeholder params among `slots` (those in `only`, if given) at weights
        that can be read and written."""
        self.weights.synchronize_all()
        for s in _exposed(slots):
            if only is None or s in only:
                self._saved[s] = s.param.data
                s.param.data = _host_weights(s)

    def _after_save(self, module, state_dict, prefix, slots) -> None:
        # With keep_vars=True the entries are the Parameters themselves, which are about
        # to point at their placeholders again: hand out the host weights instead.
        names = {id(p): n for n, p in module.named_parameters(recurse=False)}
        slots = _exposed(slots)
        for s in slots:
            key = prefix + names[id(s.param)]
            if state_dict.get(key) is s.param:
                state_dict[key] = s.param.data.detach()  # the exposed weights, not yet restored
        self._restore(slots)

    def _restore(self, slots) -> None:
        for s in slots:
            s.param.data = self._saved.pop(s, s.placeholder)

    def _before_load(self, module, state_dict, prefix, meta, slots) -> None:
        if meta.get("assign_to_params_buffers", False):
            raise ValueError(
                "trainstream: load_state_dict(assign=True) would replace the wrapped parameters; "
                "load without assign, or unwrap() first"
            )
        backend = self.backend
        if backend.is_cuda:  # copies to the device may still read the host weights or codes written below
            torch.cuda.synchronize(backend.device)
        # Only the weights the state dict holds (a partial load, say a LoRA adapter's, leaves
        # the others, and a quantized one is not dequantized and quantized again for nothing).
        names = {id(p): n for n, p in module.named_parameters(recurse=False)}
        self._expose(slots, only={s for s in slots if prefix + names[id(s.param)] in state_dict})

    def _after_load(self, slots) -> None:
        for s in slots:
            if s.quant is not None and s not in self._saved:
                continue  # not in the state dict: its codes stand
            _level(s)
        # torch loads through the params (p.copy_), which moves their version counters on: the
        # loaded values, now in every host copy, are no edit (params.py, [Note: edits]). A paged
        # param the state dict does not hold keeps its count, and with it an edit of its own.
        self.weights.values_known([s for s in slots if s in self._saved or s not in _exposed(slots)])
        loaded = [s for s in _exposed(slots) if s in self._saved]
        self._restore(loaded)
        for s in loaded:
            if s.quant is not None:  # a write refused before may have spoiled its NaN ([Note: quantized edits])
                s.param.data.fill_(float("nan"))
        self.weights.codes_written()  # re-quantized codes, and host weights the copies read
        self.weights.loaded({s.unit for s in slots})
