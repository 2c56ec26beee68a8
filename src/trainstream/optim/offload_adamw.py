"""OffloadAdamW: torch.optim.AdamW's update, computed by the native host AdamW.

On CPU-resident float32 parameters it is a drop-in replacement for
``torch.optim.AdamW(foreach=False)``: the same param groups, LR schedulers, ``zero_grad``
and a ``state_dict`` in torch AdamW's format, loadable by ``torch.optim.AdamW`` and back.
On GPU parameters (mode="cpu") the gradients stream to host memory and the new weights
back (host_updates.py); the optimizer state stays in host memory either way.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from .. import ops, options
from .host_updates import PARAM_DTYPES as STREAMED_DTYPES
from .host_updates import HostUpdates
from .update_batches import UpdateBatches

# torch.optim.Adam/AdamW options this optimizer does not implement, with the only value
# it accepts for each.
UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
# Group keys torch.optim.AdamW writes into a state_dict; kept so the dict loads there.
_TORCH_GROUP_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


WHERE = "OffloadAdamW()"
# The state_dict key of the stochastic-rounding seed (bf16 moments).
SEED_KEY = "stochastic_rounding_seed"
# Per-param state kept in host memory, loaded here rather than by torch (which would cast
# it to the param's device and dtype): the moments, and a streamed bf16 param's fp32 master.
HOST_STATE = ("exp_avg", "exp_avg_sq", "master")


def _check(name: str, value, where: str = WHERE):
    return options.check(name, value, caller=options.OFFLOAD_ADAMW, where=where)


def check_hyperparameters(lr, betas, eps, weight_decay, *, where: str = WHERE) -> dict:
    """The torch AdamW hyper-parameters, checked as torch checks them; betas come back as
    floats, as torch holds them."""
    return {
        "lr": _check("lr", lr, where),
        "betas": _check("betas", betas, where),
        "eps": _check("eps", eps, where),
        "weight_decay": _check("weight_decay", weight_decay, where),
    }


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose update runs in host memory on a native C++ thread pool.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (weight decay is decoupled).
        mode: ``"cpu"``: the host AdamW. On parameters in host memory it updates them in
            place; on parameters on a GPU (float32 or bfloat16, all on one device) it keeps
            an fp32 master of each in host memory, with the moments. Each gradient is copied
            to pinned host memory as backward makes it and then dropped, so ``p.grad`` stays
            None and VRAM holds no gradients: ``torch.nn.utils.clip_grad_norm_`` finds no
            gradient and clips nothing (pass ``max_grad_norm=``). ``step()`` queues each
            parameter's host update as soon as its gradient has landed (while the GPU computes
            the earlier layers' gradients, as a rule; with clipping or accumulation once all
            have) and returns once all are queued; each new
            weight goes back to the GPU on a copy stream as soon as its update is done, and
            the forward of a module holding the parameter waits for that copy (only that
            one). Read or edit weights outside the model's forward after ``synchronize()``;
            an in-place edit (``model.load_state_dict``) is taken into the master at the next
            ``step()``. A bfloat16 parameter's fp32 master is in ``state_dict()`` (the key
            ``"master"``). ``"gpu"``: the
            zero-copy CUDA AdamW, for float32 parameters on a GPU: the moments live in pinned
            host memory and the kernel reads and writes them over PCIe, so they take no VRAM;
            ``step()`` is asynchronous on the current CUDA stream, like torch's GPU optimizers.
        max_grad_norm: clip the global gradient norm to this value inside ``step()``; the
            same result as ``torch.nn.utils.clip_grad_norm_`` followed by ``step()``.
        accumulation_steps: backward passes per update. Each ``step()`` call adds the
            current gradients to a host fp32 buffer; every N-th call updates with the
            *mean* of the N gradients (so pass each micro-batch's un-divided loss) and the
            calls in between return without touching the weights. Call ``zero_grad()``
            after every ``step()`` as usual.
        moment_dtype: ``"float32"`` or ``"bfloat16"`` (also ``"fp32"``, ``"bf16"`` and the
            torch dtypes; bf16 halves moment memory; rounding is stochastic and reproducible:
            same seed and step give the same bits).
        threads: host threads, from 1 to the cores this process may use (default: all of
            them, less two on a host of 8 or more: ``trainstream.options.default_threads()``).
        decoupled_weight_decay: ``False`` gives ``torch.optim.Adam`` (L2 added to the
            gradient), used when converting an ``Adam`` optimizer.
        seed: stochastic-rounding seed (default: ``torch.initial_seed()``).

    Every option is checked against the table in :mod:`trainstream.options`, the one
    ``wrap()`` uses. ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable`` are
    accepted only at their defaults; ``foreach`` and ``fused`` are ignored (the native pass
    is always fused).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        mode="cpu",
        max_grad_norm=None,
        accumulation_steps=1,
        moment_dtype="float32",
        threads=None,
        decoupled_weight_decay=True,
        seed=None,
        amsgrad=False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    ):
        _reject_unsupported(
            {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable, "differentiable": differentiable}
        )
        for name, value, accepted in (
            ("decoupled_weight_decay", decoupled_weight_decay, (True, False)),
            ("foreach", foreach, (None, True, False)),
            ("fused", fused, (None, True, False)),
        ):
            if not any(value is a for a in accepted):
                raise ValueError(f"{WHERE}: option {name!r} got {value!r}; accepted: {', '.join(map(str, accepted))}")
        hyper = check_hyperparameters(lr, betas, eps, weight_decay)
        mode = _check("mode", mode)
        if mode == "gpu":
            from .._native import require_cuda

            require_cuda("OffloadAdamW(mode='gpu')")
        self.mode = mode
        self.max_grad_norm = _check("max_grad_norm", max_grad_norm)
        self.accumulation_steps = _check("accumulation_steps", accumulation_steps)
        self.moment_dtype = _check("moment_dtype", moment_dtype)
        self.threads = _check("threads", threads)  # None until the pool resolves it (ops.get_pool)
        self.seed = (torch.initial_seed() if seed is None else _check_seed(seed)) & 0xFFFF_FFFF_FFFF_FFFF
        self._micro_step = 0
        self._grad_sums: dict[torch.Tensor, torch.Tensor] = {}  # host fp32 sums (accumulation)
        self._grad_seen: set[torch.Tensor] = set()  # parameters with a gradient this window
        self._inflight: list = []  # gpu mode: events after step kernels not yet known to be done
        # mode="cpu" on GPU parameters: their gradients' and weights' way between the device
        # and the host update (None while the params are in host memory).
        self._host_updates: HostUpdates | None = None
        self._in_place_params = False  # mode="cpu": some params are updated where they are, in host memory
        self._sums_in_use: set = set()  # streamed params whose _grad_sums a queued update may still read
        defaults = dict(
            **hyper,
            **_TORCH_GROUP_DEFAULTS,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        if isinstance(params, (torch.Tensor, str, bytes, dict)) or not isinstance(params, Iterable):
            raise TypeError(
                f"{WHERE}: params must be an iterable of tensors or of param-group dicts, got {type(params).__name__}"
            )
        super().__init__(params, defaults)

    # -- groups and state ------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"{WHERE}: a param group must be a dict with 'params', got {type(param_group).__name__}")
        _reject_unsupported({k: param_group[k] for k in UNSUPPORTED if k in param_group})
        _reject_duplicates(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.update(
            check_hyperparameters(
                group["lr"], group["betas"], group["eps"], group["weight_decay"], where=f"{WHERE} param group"
            )
        )
        for p in group["params"]:
            self._check_param(p)

    # Tests set it to run the GPU parameters' path (host_updates.py) on CPU parameters,
    # over the CPU backend's stand-in streams.
    _stream_host_params = False

    def _check_param(self, p: torch.Tensor) -> None:
        # Overridden by the engine's optimizer (which streams nothing itself): a parameter
        # is streamed only when this optimizer checked it as its own.
        streamed = self._streams(p)
        _check_param(p, self.mode, streamed, self.param_groups)
        if self.mode != "cpu":
            return
        if streamed and self._in_place_params or not streamed and self._host_updates is not None:
            raise ValueError(
                f"OffloadAdamW(mode='cpu'): parameters on {p.device} and on another device; accepted: every "
                "parameter in host memory, or every one on one GPU"
            )
        if not streamed:
            self._in_place_params = True
            return
        if self._host_updates is None:
            self._host_updates = HostUpdates(p.device)
        self._host_updates.adopt(p)

    def _streams(self, p: torch.Tensor) -> bool:
        return self.mode == "cpu" and (p.device.type == "cuda" or self._stream_host_params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._host_updates is not None:
            self._host_updates.zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        _check_moments(state_dict, self.param_groups)  # before anything is replaced
        for group in state_dict["param_groups"]:
            _reject_unsupported({k: group[k] for k in UNSUPPORTED if k in group})
        self._synchronize()  # a kernel in flight may still write the moments being replaced
        # torch would cast every moment to its parameter's device and dtype first (all of
        # them in VRAM at once in gpu mode): load the rest through torch, the moments here,
        # as copies, so the caller's dict is never updated by later steps.
        moments = {pid: {k: v for k, v in st.items() if k in HOST_STATE} for pid, st in state_dict["state"].items()}
        slim = dict(state_dict)
        slim["state"] = {
            pid: {k: v for k, v in st.items() if k not in HOST_STATE} for pid, st in state_dict["state"].items()
        }
        super().load_state_dict(slim)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in moments:
                continue
            state = self.state[p]
            for key, value in moments[pid].items():
                if key == "master":
                    self._load_master(p, value)
                    continue
                state[key] = self._host_buffer(value.detach().to(device="cpu", dtype=self.moment_dtype, copy=True))
            state["step"] = torch.as_tensor(float(state["step"]), dtype=torch.float32)
            self._link_master(p, state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
        if SEED_KEY in state_dict:  # absent from torch's own state dicts: the seed stays
            self.seed = int(state_dict[SEED_KEY]) & 0xFFFF_FFFF_FFFF_FFFF
        self._grad_sums.clear()
        self._grad_seen.clear()
        self._sums_in_use.clear()
        self._micro_step = 0

    def _load_master(self, p: torch.Tensor, value) -> None:
        """A saved fp32 master of a streamed bf16 param (a param updated in place, or an fp32
        one, is its own master: the key is ignored). Whether it agrees with the param is decided
        at the next update (HostUpdates._take_edit): kept where the param holds what it rounds to
        (the model's state dict of the same checkpoint, loaded before or after), replaced by the
        param otherwise (a master another optimizer carried without updating it: torch AdamW
        keeps and saves the key it loaded, stale, while it trains the param itself)."""
        records = self._host_updates.records if self._host_updates is not None else {}
        record = records.get(p)
        if record is None or record.copy is None:
            return
        record.master.copy_(value.detach().to(device="cpu", dtype=torch.float32))
        record.copy.copy_(record.master)
        record.version = -1  # no version of the param: compared at the next update

    def _link_master(self, p: torch.Tensor, state: dict) -> None:
        """A streamed bf16 param's master is part of its state (state_dict() saves it)."""
        record = self._host_updates.records.get(p) if self._host_updates is not None else None
        if record is not None and record.copy is not None:
            state["master"] = record.master
        else:
            state.pop("master", None)

    def state_dict(self) -> dict:
        self._synchronize()
        sd = super().state_dict()
        if self.mode == "gpu":
            # The live pinned moments are written by the next step's kernel while the caller
            # may still be saving them: hand out copies, as consistent as torch's checkpoints.
            sd["state"] = {
                pid: {k: (v.clone() if k in ("exp_avg", "exp_avg_sq") else v) for k, v in st.items()}
                for pid, st in sd["state"].items()
            }
        # bf16 moments round stochastically from (seed, step, element): a resumed run gives the
        # same bits only with the same seed. torch's optimizers ignore the extra key.
        sd[SEED_KEY] = self.seed
        return sd

    def synchronize(self) -> None:
        """Wait for every update in flight: parameters read after it hold the last step()'s
        values. A gpu-mode step returns with its kernels queued (whatever stream they ran on);
        a cpu-mode step on GPU parameters with its host updates queued, their weights on their
        way back; one on host parameters has finished when it returns. state_dict() and
        load_state_dict() call it themselves."""
        for event in self._inflight:
            event.synchronize()
        self._inflight = []
        if self._host_updates is not None:
            self._host_updates.synchronize()

    def _stop_streaming(self) -> None:
        """Before another optimizer takes the params over (convert_optimizer): every update
        on the device, then no more hooks on the params."""
        if self._host_updates is not None:
            self._host_updates.close()

    def _synchronize(self) -> None:
        # The internal callers' name (convert_optimizer, state_dict): a subclass overrides
        # synchronize() alone.
        self.synchronize()

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """Moments live in host memory; pinned in gpu mode, where the kernel maps them."""
        t = t.contiguous()
        return t.pin_memory() if self.mode == "gpu" and not t.is_pinned() else t

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            pin = self.mode == "gpu"
            state["exp_avg"] = torch.zeros(p.shape, dtype=self.moment_dtype, pin_memory=pin)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.moment_dtype, pin_memory=pin)
            self._link_master(p, state)
        return state

    def _seed_for(self, index: int) -> int:
        # Distinct, reproducible stochastic-rounding streams per parameter.
        return (self.seed ^ ((index + 1) * 0x9E37_79B9_7F4A_7C15)) & 0xFFFF_FFFF_FFFF_FFFF

    # -- the update ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._gradients_for_update()
        if grads is None:
            return loss  # an accumulation micro-step: gradients were added to the host sums
        grad_scale = 1.0 / self.accumulation_steps
        clip = None
        if self.max_grad_norm is not None and grads:
            total_norm = torch.nn.utils.get_total_norm(list(grads.values()), 2.0) * grad_scale
            clip = torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)
            if self.mode == "cpu":
                grad_scale, clip = float(grad_scale * clip), None
            # gpu: the factor stays on the device and the kernel reads it (no host sync).

        handles = []
        index = 0
        streamed = self._host_updates
        if streamed is not None:
            self._queue_streamed(grads, grad_scale)
            streamed.after_step()
            # The queued updates read the sums: they are zeroed at the next window's first
            # micro-step, once their update is done.
            self._sums_in_use |= self._grad_seen
            self._grad_seen.clear()
            return loss
        try:
            for group in self.param_groups:
                params, g_list, m_list, v_list, steps, seeds = [], [], [], [], [], []
                for p in group["params"]:
                    index += 1
                    g = grads.get(p)
                    if g is None:
                        continue
                    state = self._state_for(p)
                    state["step"] += 1
                    params.append(p.data)
                    g_list.append(g)
                    m_list.append(state["exp_avg"])
                    v_list.append(state["exp_avg_sq"])
                    steps.append(int(state["step"].item()))
                    seeds.append(self._seed_for(index - 1))
                if not params:
                    continue
                hyper = dict(ops.adamw.group_hyper(group), grad_scale=grad_scale, seeds=seeds)
                if self.mode == "gpu":
                    ops.adamw_step_gpu(params, g_list, m_list, v_list, steps, grad_scale_tensor=clip, **hyper)
                    self._record_inflight(params[0].device)
                else:
                    handles.append(ops.adamw_step(params, g_list, m_list, v_list, steps, threads=self.threads, **hyper))
        finally:
            # Never return (or raise) while host work still writes the weights.
            for handle in handles:
                handle.wait()
        for p in self._grad_seen:
            self._grad_sums[p].zero_()
        self._grad_seen.clear()
        return loss

    def _queue_streamed(self, grads: dict, grad_scale: float) -> None:
        """The GPU params' host updates, each queued as soon as its gradient is in host memory
        (`grads` is in landing order): step() is called while the GPU is still in backward, as
        a rule, and the host pool then updates the last layers' params while backward computes
        the first layers' gradients. Numbered by the param's position (seeds, priorities: the
        pool runs first what the next forward reads first); gathered into native jobs by
        update_batches.py."""
        streamed = self._host_updates
        # id(param) -> (its group, its position among all the optimizer's params); by id, as
        # a tensor's own hash is a Python call
        place = {}
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                place[id(p)] = (group, index)
                index += 1
        # Compute's reads of the old weights, all queued before now: the pushes wait for them.
        mark = streamed.backend.record()
        batches = UpdateBatches(streamed, grad_scale=grad_scale, threads=self.threads, mark=mark)
        for p, g in grads.items():
            record = streamed.records[p]
            if not streamed.landed(record):  # the jobs gathered so far run while this one lands
                batches.flush()
                streamed.wait_landed(record)
            group, i = place[id(p)]
            state = self._state_for(p)
            state["step"] += 1
            batches.add(record, g, state, group, self._seed_for(i))
        batches.flush()

    def _record_inflight(self, device: torch.device) -> None:
        self._inflight = [e for e in self._inflight if not e.query()]  # drop finished ones
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._inflight.append(event)

    def _gradients_for_update(self) -> dict | None:
        """The gradient each parameter's update reads, or None on a micro-step that only
        accumulates. With accumulation the update reads the host fp32 sums."""
        for group in self.param_groups:
            for p in group["params"]:
                # A param frozen when it was added was not checked (torch skips it): one that
                # has a gradient now is checked before anything reads it.
                if p.grad is not None:
                    _check_trainable(p, self._streams(p), self.param_groups)
        current = {}
        if self._host_updates is not None:  # landed in host memory (the hooks took p.grad)
            # Updates that read only their own gradient wait for it alone (_queue_streamed);
            # clipping and accumulation read every gradient first.
            alone = self.accumulation_steps == 1 and self.max_grad_norm is None
            current = self._host_updates.gradients([p for g in self.param_groups for p in g["params"]], wait=not alone)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise ValueError("OffloadAdamW does not support sparse gradients")
                    current[p] = p.grad.detach().contiguous()
        if self.accumulation_steps == 1:
            return current
        totals = []
        for p, g in current.items():
            total = self._grad_sums.get(p)
            if total is None:  # on the gradient's device: host sums in cpu mode, VRAM in gpu mode
                total = self._grad_sums[p] = torch.zeros(p.shape, dtype=torch.float32, device=g.device)
            elif p in self._sums_in_use:  # the last window's update read it: a new window starts at zero
                self._host_updates.release(p)
                self._sums_in_use.discard(p)
                total.zero_()
            totals.append(total)
            self._grad_seen.add(p)
        if self.mode == "cpu":
            # Wait before returning: the caller's zero_grad() may clear the gradients next.
            ops.accumulate_(totals, list(current.values()), threads=self.threads).wait()
        else:
            torch._foreach_add_(totals, list(current.values()))
        self._micro_step += 1
        if self._micro_step % self.accumulation_steps:
            return None
        return {p: self._grad_sums[p] for p in self._grad_seen}


def _reject_duplicates(param_group: dict) -> None:
    """A parameter listed twice in one group: torch warns and updates it twice; the updates
    here are per parameter, so it is refused rather than updated once."""
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(f"{WHERE} param group: 'params' must be an iterable of tensors, got {type(params).__name__}")
    else:  # a generator is read once: torch reads the list
        params = param_group["params"] = list(params)
    seen = set()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{WHERE} param group: parameter {i} must be a torch.Tensor, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError(
                f"{WHERE} param group: parameter {i} (shape {tuple(p.shape)}) is listed twice; list each parameter once"
            )
        seen.add(id(p))


def _check_seed(seed) -> int:
    """An integer (any sign: the stochastic-rounding streams take its low 64 bits); a float
    would be truncated into another seed, so it is refused."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{WHERE}: option 'seed' got {seed!r}; accepted: None, an integer")
    return int(seed)


def _check_moments(state_dict: dict, param_groups: list) -> None:
    """Each saved exp_avg and exp_avg_sq is a tensor of its parameter's shape: a wrong one
    would load and then fail, or update the wrong elements, at the next step(). Parameters
    pair with the saved ids group by group, in order, as torch pairs them; groups of other
    sizes are left to torch's own error."""
    where = f"{WHERE}.load_state_dict()"
    if (
        not isinstance(state_dict, dict)
        or not isinstance(state_dict.get("state"), dict)
        or not isinstance(state_dict.get("param_groups"), list)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in state_dict["param_groups"])
    ):
        raise TypeError(
            f"{where}: state_dict must be a dict of 'state' (a dict) and 'param_groups' (a list of dicts with "
            "'params'), as state_dict() gives"
        )
    for pid, st in state_dict["state"].items():
        # torch's AdamW refuses a non-empty state without its step count at the load (its
        # __setstate__ reads it); a moment without the count it was taken at has no meaning.
        if isinstance(st, dict) and st and "step" not in st:
            raise ValueError(
                f"{where}: state[{pid!r}] has no 'step' (it holds {sorted(map(str, st))}); accepted: a param's "
                "state with its 'step' count, as state_dict() gives it, or an empty one (a param never stepped)"
            )
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved, param_groups)
    ):
        return
    for s, g in zip(saved, param_groups):
        for pid, p in zip(s["params"], g["params"]):
            for key, value in state_dict["state"].get(pid, {}).items():
                if key not in HOST_STATE:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{where}: state[{pid!r}][{key!r}] must be a tensor, got {type(value).__name__}")
                if value.shape != p.shape:
                    raise ValueError(
                        f"{where}: state[{pid!r}][{key!r}] has shape {tuple(value.shape)}, its parameter "
                        f"{tuple(p.shape)}; accepted: a moment of its parameter's shape (is the state_dict "
                        "from another model?)"
                    )


def _reject_unsupported(options: dict) -> None:
    for name, value in options.items():
        if value is not UNSUPPORTED[name]:  # only the bool: amsgrad=0 or None is not a setting
            raise ValueError(f"OffloadAdamW does not support {name}={value!r} (accepted: {UNSUPPORTED[name]})")


def _check_param(p: torch.Tensor, mode: str, streamed: bool, groups: list) -> None:
    """`streamed`: mode="cpu" on a GPU param, whose master lives in host memory. A frozen
    param's dtype and layout are not checked: torch skips a param without a gradient (a peft
    model's AdamW(model.parameters()) holds its fp16 or int8 base too)."""
    if mode == "cpu" and not streamed and p.device.type != "cpu":
        raise ValueError(
            f"OffloadAdamW(mode='cpu') updates parameters in host memory or on a CUDA GPU; {_name(p, groups)} is "
            f"on {p.device}"
        )
    if mode == "gpu" and p.device.type != "cuda":
        raise ValueError(f"OffloadAdamW(mode='gpu') updates parameters on a GPU; {_name(p, groups)} is on {p.device}")
    if p.requires_grad:
        _check_trainable(p, streamed, groups)


def _check_trainable(p: torch.Tensor, streamed: bool, groups: list) -> None:
    if streamed:
        if p.dtype not in STREAMED_DTYPES:
            raise ValueError(
                f"OffloadAdamW(mode='cpu') on a GPU needs float32 or bfloat16 parameters, got {p.dtype} for "
                f"{_name(p, groups)} (for float16 weights keep fp32 parameters and train under torch.autocast; "
                "a frozen parameter, requires_grad=False, is skipped)"
            )
    elif p.dtype != torch.float32:
        raise ValueError(
            f"OffloadAdamW needs float32 parameters (the master weights), got {p.dtype} for {_name(p, groups)} "
            "(a frozen parameter, requires_grad=False, is skipped)"
        )
    if not p.is_contiguous():
        raise ValueError(
            f"OffloadAdamW needs contiguous parameters (it updates them in place); {_name(p, groups)} is not"
        )


def _name(p: torch.Tensor, groups: list) -> str:
    """The parameter as the error names it: its group, index and shape."""
    for g, group in enumerate(groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                return f"parameter {i} of param group {g} (shape {tuple(p.shape)})"
    return f"a parameter of shape {tuple(p.shape)}"
