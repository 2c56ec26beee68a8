"""A frozen nn.Linear whose weight the engine streams, as one autograd Function.

[Note: frozen linears] A streamed weight (a quantized resident unit's, dequantized for each
use; a paged unit's, fetched) is a transient device tensor: the engine attaches it to its
param before the block runs and releases it after. Stock autograd saves the weight of a
Linear whose input requires grad (for grad_input = grad_output @ W), so the engine runs such
a block under saved-tensor hooks that swap the saved weight for a record (engine.SavedWeight)
and refetch it in backward: a Python call for every tensor the block saves. For a frozen
Linear, FrozenLinearFunction saves nothing at all: W needs no gradient, so the input is not
needed either, and backward reads the weight that the engine re-attached for the block's
backward (block_backward_starts; or it attaches it itself, as unpack does). A block whose
streamed weights are all served this way needs no hooks (Engine._needs_saved_hooks).

Bits: forward is F.linear itself, under the ambient autocast. Backward computes what
autograd's mm backward computes for the input of the product (mm_mat1_backward: grad @ W,
in the dtype the forward computed in, then cast back to the input's dtype as autocast's
copy would be in backward), for the contiguous inputs only that the Function takes: their
flattened matrix is row-major, as the stock matmul sees it. A frozen bias has no gradient
either. Double backward is not needed by the engine and is not tested: the backward is
written with differentiable ops (W a constant).

Only where that is plainly true: an exact nn.Linear (not a subclass: MultiheadAttention's
out_proj is read by F.multi_head_attention_forward, not its forward), in a block (not the
block itself, whose forward is the engine's), whose
weight (and bias, if any) is frozen and registered by no other module. Its forward is ours
from install() to remove(). At call time the Function serves it only with grad enabled, a
plain contiguous input of 2 or more dims that requires grad, no extra arguments, outside
torch.compile, and the weight attached as a streamed weight; otherwise the Linear's own
forward runs, under the engine's saved-tensor hooks if a fetched weight is read with no
hooks active. A weight some other code saves for backward (a DoRA layer reading
base_layer.weight) is seen by the engine's hooks in the measured passes (saved_elsewhere):
its unit keeps the hooks from then on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layout import Fetch


class FrozenLinearFunction(torch.autograd.Function):
    """y = x @ W.T (+ b) for a frozen W (and b): nothing saved; grad_x only. `frozen`: the
    tuple (weight, bias, slot, pager, dtypes). x is the one input autograd sees: W and b need
    no gradient, and each further argument of apply() costs a pass of torch's per-argument
    Python (functorch's unwrap of each) on every call of every frozen Linear."""

    @staticmethod
    def forward(ctx, x, frozen):
        weight, bias, slot, pager, dtypes = frozen
        y = F.linear(x, weight, bias)
        inputs = x.shape[-1]
        rows = math.prod(x.shape[:-1])
        # The product's input matrix as the stock matmul folds it (autocast's copy of x keeps
        # its strides): a column-major one gets its gradient computed transposed
        # (mm_mat1_backward). A contiguous x folds column-major only as 1 row or 1 column.
        column_major = False
        if rows == 1 or inputs == 1:
            x2 = x if x.dim() == 2 else x.reshape(rows, inputs)
            column_major = x2.stride(0) == 1 and x2.stride(1) == x2.shape[0]
        # y's dtype: autocast's if it cast, else x's. One tuple: backward reads it at once.
        ctx.state = (slot, pager, dtypes, x.dtype, y.dtype, x.shape, rows, column_major)
        return y

    @staticmethod
    def backward(ctx, grad):
        slot, pager, dtypes, x_dtype, compute_dtype, x_shape, rows, column_major = ctx.state
        w = pager.attached_weight(slot, dtypes)
        if w.dtype != compute_dtype:
            w = w.to(compute_dtype)  # the copy autocast made in forward
        flat = len(x_shape) == 2
        g2 = grad if flat else grad.reshape(rows, grad.shape[-1])
        gx = w.t().mm(g2.t()).t() if column_major else g2.mm(w)
        if not flat:
            gx = gx.reshape(x_shape)
        if gx.dtype != x_dtype:
            gx = gx.to(x_dtype)  # the backward of autocast's cast of x
        return gx, None


def _direct_apply():
    """FrozenLinearFunction's apply without torch.autograd.Function.apply's Python around it
    (its setup_context test, functorch's check and its unwrap of each argument): the C apply
    that one ends in, bound to the Function. The caller takes it only outside functorch's
    transforms, which the Python apply would hand to functorch (and refuse: the Function has
    no setup_context), and unwraps x itself as that one does. Where this torch does not offer
    it, the Python apply."""
    base = getattr(torch._C, "_FunctionBase", None)
    raw = getattr(base, "__dict__", {}).get("apply")
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if raw is None or unwrap is None or not hasattr(raw, "__get__"):
        return None, None
    return raw.__get__(None, FrozenLinearFunction), unwrap


def _registrations(model: torch.nn.Module) -> dict:
    """Each parameter (by id) -> how many (module, name) pairs register it in `model`."""
    counts: dict = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


class FrozenLinears:
    """The frozen Linears of the blocks whose forward is FrozenLinearFunction's while the
    engine is installed ([Note: frozen linears]). `pager`: the WeightPager (attached
    weights); `hooks_for(unit)`: the engine's (pack, unpack) pair for a unit's block."""

    def __init__(self, pager, hooks_for):
        self.pager = pager
        self.hooks_for = hooks_for
        self.covered: set = set()  # slots a FrozenLinearFunction serves (weights and biases)
        self.saved_elsewhere: set = set()  # of those, slots some other code saved for backward
        self._own: dict = {}  # module -> its own `forward` instance attribute, or None
        self._serves: dict = {}  # unit -> ((its views, len(covered), len(saved_elsewhere)), serves(unit))

    def install(self, model: torch.nn.Module, blocks: list, block_units: list, wrap) -> None:
        """Give every eligible Linear of `blocks` our forward, each wrapped by `wrap` (the
        engine's _Installed: refuses to be copied or pickled with the model)."""
        registered = _registrations(model)
        for block, unit in zip(blocks, block_units):
            slot_of = {id(s.param): s for s in unit.slots}
            for module in block.modules():
                # A block that is itself a Linear keeps its block forward (the engine's own).
                if type(module) is not torch.nn.Linear or module is block or module in self._own:
                    continue
                params = [p for p in (module.weight, module.bias) if p is not None]
                slots = [slot_of.get(id(p)) for p in params]
                if any(
                    s is None or s.trainable or p.requires_grad or registered.get(id(p), 0) != 1
                    for p, s in zip(params, slots)
                ):
                    continue
                own = module.__dict__.get("forward")
                self._own[module] = own
                module.forward = wrap(self._forward_of(module, slots[0], module.forward), wraps=module.forward)
                self.covered.update(slots)

    def remove(self) -> None:
        """Every Linear's forward back to what it was before install()."""
        for module, own in self._own.items():
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._own = {}
        self.covered = set()
        self._serves = {}

    def serves(self, unit) -> bool:
        """Whether every streamed weight of `unit` is served by a FrozenLinearFunction, so
        that its block saves none of them and needs no saved-tensor hooks for them. Asked at
        every block call: the answer is kept while what it depends on stands (the unit's
        views, the Linears covered, the slots seen saved elsewhere, which only grows)."""
        views = unit.views
        key = (views, len(self.covered), len(self.saved_elsewhere))
        known = self._serves.get(unit)
        if known is not None and known[0] == key:
            return known[1]
        covered, elsewhere = self.covered, self.saved_elsewhere
        answer = all(s in covered and s not in elsewhere for s in views.streamed_slots)
        self._serves[unit] = (key, answer)
        return answer

    def saved(self, slot) -> None:
        """The engine's hooks saw `slot`'s fetched weight saved for backward: code other
        than its Linear's forward reads it, and its unit keeps the hooks."""
        if slot in self.covered:
            self.saved_elsewhere.add(slot)

    def _forward_of(self, module, slot, forward):
        pager, hooks_for, unit = self.pager, self.hooks_for, slot.unit
        apply = FrozenLinearFunction.apply
        direct, unwrap_if_dead = _direct_apply()
        transforms_active = torch._C._are_functorch_transforms_active
        top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
        grad_enabled, compiling = torch.is_grad_enabled, torch.compiler.is_compiling
        params = module._parameters  # module.weight / module.bias, without nn.Module.__getattr__
        saved_elsewhere = self.saved_elsewhere  # the set itself: saved() adds to it
        attached = Fetch.ATTACHED

        def frozen_forward(x, *args, **kwargs):
            # The common call first, in one test (once per Linear and forward: the hot path).
            # ATTACHED implies `fetched` is a dict (the invariant of Unit.fetch).
            if (
                unit.fetch is attached
                and type(x) is torch.Tensor
                and x.requires_grad
                and not args
                and not kwargs
                and x.dim() >= 2
                and x.is_contiguous()
                and grad_enabled()
                and slot in unit.fetched
                and slot not in saved_elsewhere
                and not compiling()
            ):
                frozen = (params["weight"], params.get("bias"), slot, pager, unit.fetch_dtypes)
                if direct is not None and not transforms_active():
                    return direct(unwrap_if_dead(x), frozen)
                return apply(x, frozen)
            fetched = unit.fetched
            if fetched is None or unit.fetch is not attached or slot not in fetched:
                return forward(x, *args, **kwargs)  # resident (or not attached): nothing streamed
            if not grad_enabled() or not getattr(x, "requires_grad", True):
                return forward(x, *args, **kwargs)  # nothing for autograd to save: W and b are frozen
            # A call the Function does not take: extra arguments, a tensor subclass, fewer than
            # 2 dims, a strided input, a weight some other code saves, torch.compile.
            if top_hooks(False) is None:  # the block runs without hooks: today's path, with ours
                pack, unpack = hooks_for(unit)
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    return forward(x, *args, **kwargs)
            return forward(x, *args, **kwargs)

        return frozen_forward
