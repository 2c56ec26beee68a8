"""TrainStreamTrainer: transformers.Trainer over a wrapped model.

The Trainer's own arguments keep their meaning; where the engine does the work itself, the
Trainer's code path that would act on ``p.grad`` (None under the engine) is turned off:

- the optimizer the Trainer builds (``optim`` adamw_torch, adamw_torch_fused, adamw_hf) is
  converted by wrap() with its groups, learning rate, betas, eps and weight decay; the
  scheduler is built on the wrapped optimizer, so it drives the learning rate the updates
  read;
- ``max_grad_norm`` clips inside the engine (wrap(max_grad_norm=...)), and the logged
  grad_norm is the global norm the engine computed for that step;
- ``gradient_accumulation_steps`` is wrap(accumulation_steps=...): the gradients of the
  window's backward passes are summed in host memory, as p.grad would sum them, with the
  Trainer's loss normalisation (``num_items_in_batch``) unchanged;
- the model is wrapped once, when the Trainer is built, on the device the Trainer chose
  (``args.device``): the Trainer does not move it there first, wrap() does, placing what fits.
- with more than one process (torchrun) the model is wrapped data parallel over the Trainer's
  process group and is not wrapped in DistributedDataParallel ([Note: no DDP wrapper]); rank
  0's parameters and buffers are taken first wherever a rank's differ, as DDP broadcasts them
  ([Note: rank 0's weights]); every rank takes part in the optimizer's state_dict() when the
  main process saves a checkpoint, which gathers the moments to that process alone (to every
  rank with save_on_each_node).

With ``chunked_loss`` (default True) a causal LM's training loss is computed by
:func:`trainstream.causal_lm_loss` from the final hidden states and the output layer's
weight, in chunks, so the full logits never exist (see [Note: chunked loss] below).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping

import torch
import transformers
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from ... import options as _options
from ...api import _engine_of
from ...engine.switch import MODE_KEY, saved_mode
from .wrap import _is_peft, wrap_hf

log = logging.getLogger(__name__)

WHERE = "TrainStreamTrainer(trainstream=...)"
# Older checkpoints' file of the engine's mode when they were saved (now in the optimizer's state).
ENGINE_STATE_NAME = "trainstream_state.json"

# The Trainer's optimizers that are AdamW as torch.optim.AdamW computes it.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")

# Options of the trainer itself, beside wrap()'s: name -> (default, accepted).
TRAINER_OPTIONS = {
    "chunked_loss": (True, "True, False"),
    "loss_chunk_size": (1024, "an integer >= 1"),
}

# wrap() options that TrainingArguments already set: one place for each setting.
SET_BY_ARGS = {
    "max_grad_norm": "TrainingArguments.max_grad_norm",
    "accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "lr": "TrainingArguments.learning_rate",
    "device": "the device the Trainer chooses (TrainingArguments.use_cpu, CUDA_VISIBLE_DEVICES)",
}

# Config fields through which a model changes its logits after the output layer; the
# chunked loss computes plain logits, so such a model keeps its own loss.
LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def parse_trainstream(given) -> tuple[dict, dict, frozenset]:
    """(wrap() options, trainer options, names given) from the ``trainstream=`` argument;
    every value checked as wrap() checks it, a bad name or value a ValueError naming it."""
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise TypeError(f"{WHERE}: trainstream must be a dict of options, got {type(given).__name__}")
    accepted = [n for n in _options.WRAP_OPTIONS if n not in SET_BY_ARGS] + list(TRAINER_OPTIONS)
    wrap_opts, own = {}, {name: default for name, (default, _) in TRAINER_OPTIONS.items()}
    for name, value in given.items():
        if name in SET_BY_ARGS:
            raise ValueError(f"{WHERE}: option {name!r} is set by {SET_BY_ARGS[name]}; set it there")
        if name in TRAINER_OPTIONS:
            own[name] = _trainer_option(name, value)
        elif name in _options.WRAP_OPTIONS:
            _options.check(name, value, where=WHERE)
            wrap_opts[name] = value
        else:
            close = difflib.get_close_matches(str(name), accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{WHERE}: unknown option {name!r}{hint}; accepted options: {', '.join(accepted)}")
    return wrap_opts, own, frozenset(given)


def _trainer_option(name: str, value):
    ok = isinstance(value, bool) if name == "chunked_loss" else (type(value) is int and value >= 1)
    if not ok:
        raise ValueError(f"{WHERE}: option {name!r} got {value!r}; accepted: {TRAINER_OPTIONS[name][1]}")
    return value


def _check_args(args, check_optim: bool) -> None:
    """TrainingArguments the engine cannot honour: a clear error before anything is wrapped."""
    if args.fp16:
        raise ValueError(
            "TrainStreamTrainer: fp16=True is not supported (an update queued during backward cannot be "
            "skipped by fp16 loss scaling); use bf16=True, or fp32"
        )
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name, False):
            raise ValueError(
                f"TrainStreamTrainer: {name}=True is not supported (it casts the wrapped model for "
                "evaluation); evaluate under the training precision"
            )
    if args.n_gpu > 1:
        raise ValueError(
            f"TrainStreamTrainer: {args.n_gpu} GPUs are visible to one process, which the Trainer would train "
            "through nn.DataParallel; the engine trains one device per process (set CUDA_VISIBLE_DEVICES to one GPU)"
        )
    optim = str(getattr(args.optim, "value", args.optim))
    if check_optim and optim not in ADAMW_OPTIMS:
        raise ValueError(
            f"TrainStreamTrainer: optim={optim!r} is not supported; accepted: {', '.join(ADAMW_OPTIMS)} "
            "(each trains as torch.optim.AdamW)"
        )


# TrainingArguments that tune the DistributedDataParallel wrapper, which a wrapped model never
# gets (the engine reduces the gradients itself, unit by unit): name -> the values that ask for
# nothing the engine does not do (None: DDP's default, left unset).
DDP_ONLY_ARGS = {
    "ddp_bucket_cap_mb": (None,),
    "ddp_static_graph": (None, False),
    "ddp_broadcast_buffers": (None, False),
}


def _check_parallelism(trainer, wrap_opts: dict) -> None:
    """How the Trainer would spread the run, against what the engine does: a clear error
    before anything is wrapped (docs/huggingface.md, "Data parallel")."""
    args = trainer.args
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False) or (name == "FSDP" and getattr(trainer, "is_fsdp_xla_enabled", False)):
            raise ValueError(
                f"TrainStreamTrainer: {name} is not supported (TrainingArguments.deepspeed / fsdp, or the accelerate "
                "config): the engine keeps the optimizer in host RAM and shards it across the processes itself; "
                "launch with torchrun and neither, and the Trainer trains data parallel through the engine"
            )
    if args.world_size <= 1:
        return
    if wrap_opts.get("distributed") is False:
        raise ValueError(
            f"TrainStreamTrainer: distributed=False with {args.world_size} processes: the Trainer gives each "
            "process its own shard of the data, so ranks training apart would end with different weights "
            "(and only the main process's would be saved); leave distributed unset (None) or True"
        )
    for name, accepted in DDP_ONLY_ARGS.items():
        value = getattr(args, name, None)
        if value not in accepted:
            raise ValueError(
                f"TrainStreamTrainer: {name}={value!r} is not supported: the model is not wrapped in "
                "DistributedDataParallel (the engine reduces the gradients itself, unit by unit, and never broadcasts buffers "
                f"during training); accepted: {', '.join(repr(v) for v in accepted)}"
            )


class TrainStreamTrainer(transformers.Trainer):
    """A :class:`transformers.Trainer` whose model and optimizer are wrapped by TrainStream.

    ``trainstream={...}`` takes every :func:`trainstream.wrap` option except those
    TrainingArguments set (``max_grad_norm``, ``accumulation_steps``, ``lr``, ``device``),
    plus ``"chunked_loss"`` (default True) and ``"loss_chunk_size"`` (default 1024). The
    model is wrapped here, with the optimizer the Trainer builds (or the torch AdamW/Adam
    passed in ``optimizers=(optimizer, None)``); schedules, clipping, accumulation,
    checkpoints, ``resume_from_checkpoint``, ``evaluate()`` and activation checkpointing
    work as with the stock Trainer. bf16=True or fp32; fp16=True raises ValueError.
    """

    def __init__(self, *args, trainstream: Mapping | None = None, **kwargs):
        self._ts_wrap, self._ts_own, self._ts_given = parse_trainstream(trainstream)
        super().__init__(*args, **kwargs)
        given_optimizer, given_scheduler = self.optimizer, self.lr_scheduler
        _check_args(self.args, check_optim=given_optimizer is None and self.optimizer_cls_and_kwargs is None)
        _check_parallelism(self, self._ts_wrap)
        self._ts_chunked = self._decide_chunked()
        if given_optimizer is not None:  # optimizers=(torch AdamW/Adam, ...): converted by wrap()
            self.optimizer = self._wrap(self.model, given_optimizer)
        else:
            self.create_optimizer()
        if given_scheduler is not None:
            _check_scheduler(given_scheduler, self.optimizer)

    # -- wrapping ----------------------------------------------------------------------------

    def _move_model_to_device(self, model, device) -> None:
        # wrap() places the weights on args.device itself: what fits, the rest streamed. A
        # whole-model move first would need the whole model's memory there.
        pass

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # [Note: no DDP wrapper] on this Trainer's own accelerator only.
        self.accelerator.prepare_model = functools.partial(_prepare_model_without_ddp, self.accelerator.prepare_model)

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, converted by wrap() along with the model (once per model:
        a model_init run builds a new model, which is wrapped afresh)."""
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        super().create_optimizer(model)  # torch.optim.AdamW over the Trainer's param groups
        torch_optimizer, self.optimizer = self.optimizer, None
        self.optimizer = self._wrap(model, torch_optimizer)
        return self.optimizer

    def _wrap(self, model, optimizer):
        if _is_wrapped(model):
            raise ValueError(
                "TrainStreamTrainer: this model is already wrapped (by another trainer or wrap()); "
                "pass a model that is not, or trainstream.unwrap() it first"
            )
        clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        options = dict(self._ts_wrap)
        if self.args.world_size > 1:
            # Data parallel over the Trainer's process group: one missing is wrap()'s clear
            # error, never ranks training apart on their shards of the data.
            options["distributed"] = True
            # As DDP at construction: buffers too, unless ddp_broadcast_buffers=False leaves them out.
            taken = _from_rank_zero(model, buffers=getattr(self.args, "ddp_broadcast_buffers", None) is not False)
            if taken:
                log.info("TrainStreamTrainer: took rank 0's %s (they differed on some rank)", ", ".join(taken))
        device = self.args.device
        if device.type == "cpu":  # accelerate names each rank's CPU cpu:<rank>: one memory, torch's "cpu"
            device = torch.device("cpu")
        model, optimizer = wrap_hf(
            model,
            optimizer,
            device=device,
            max_grad_norm=clip,
            accumulation_steps=self.args.gradient_accumulation_steps,
            **options,
        )
        return optimizer

    # -- clipping and the logged norm --------------------------------------------------------

    def _clip_grad_norm(self, model):
        # The engine clips inside step() at wrap(max_grad_norm=args.max_grad_norm); p.grad is
        # None, so the Trainer's clip would find nothing.
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        # Known only once step() has computed it: _maybe_log_save_evaluate reads it.
        return None

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        grad_norm = _ours(self.optimizer).last_grad_norm
        return super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )

    # -- saving ------------------------------------------------------------------------------

    def _save(self, output_dir=None, state_dict=None) -> None:
        # Every update in flight is written before the weights are read: model.state_dict()
        # then gives the host weights (adapters only, for a peft model, through peft).
        _synchronize(self.optimizer)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The engine's mode is saved inside the optimizer's state_dict (engine/switch.py).
        _synchronize(self.optimizer)
        if self.args.world_size <= 1:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Data parallel: state_dict() gathers every rank's moment shards (a collective), so
        # every rank calls it once, here. The stock method calls it on the processes that save
        # (should_save) and nowhere else: they get the dict gathered here. Without
        # save_on_each_node the one that saves is rank 0, and the shards are gathered to it
        # alone (the others get {}); with it each node's first process saves, and every rank
        # gets the whole dict.
        state = _ours(self.optimizer).state_dict(rank0_only=not self.args.save_on_each_node)
        with _state_dict_given(self.optimizer, state):
            super()._save_optimizer_and_scheduler(output_dir)

    # -- loading ----------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        with _adapters_load_in_place(self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        with _adapters_load_in_place(self.model):
            super()._load_best_model()

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        # The optimizer's state_dict carries the mode it was saved in, and loading one saved
        # after offload='auto' switched to stock switches this run first (engine/switch.py,
        # [Note: resuming in the saved mode]). Checkpoints written before the mode was part of
        # it kept the mode in their own file, read here before the optimizer state loads.
        path = os.path.join(checkpoint, ENGINE_STATE_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                mode = saved_mode({MODE_KEY: json.load(f).get("mode")})
            _ours(self.optimizer).resume_in(mode, f"the checkpoint {checkpoint}")
        optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file)):
            return super()._load_optimizer_and_scheduler(checkpoint)  # it finds nothing to load either
        # Read into host memory, where the engine keeps the moments (each rank its shard of the
        # whole ones saved, whatever the number of ranks that saved them): the stock method
        # reads them onto each rank's GPU under data parallel, the whole moments in its VRAM.
        self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        reissue_pt_warnings(caught)

    # -- the loss ----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._ts_chunked or return_outputs or not model.training or not _chunkable_batch(inputs):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss = _chunked_causal_lm_loss(
            model,
            inputs,
            self._ts_own["loss_chunk_size"],
            num_items_in_batch if self.model_accepts_loss_kwargs else None,
            self.accelerator.autocast,  # the precision the model's own output layer ran in
        )
        if (
            self.args.average_tokens_across_devices
            and self.model_accepts_loss_kwargs
            and num_items_in_batch is not None
        ):
            # As the stock compute_loss: the sum over this process's tokens was divided by
            # every process's token count.
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return loss

    def _decide_chunked(self) -> bool:
        """Whether training calls use the chunked loss. A model it cannot stand in for keeps its
        own loss, said in a warning; an error when chunked_loss=True was asked for."""
        if not self._ts_own["chunked_loss"]:
            return False
        if self.label_smoother is not None or self.compute_loss_func is not None:
            reason = "the Trainer computes the loss itself (label_smoothing_factor or compute_loss_func)"
        else:
            reason = unchunkable_model(self.model)
        if reason is None:
            return True
        if "chunked_loss" in self._ts_given:
            raise ValueError(f"TrainStreamTrainer: chunked_loss=True does not apply: {reason}")
        warnings.warn(
            f"TrainStreamTrainer: chunked_loss does not apply ({reason}); the model computes its own loss",
            stacklevel=3,
        )
        return False


def _chunkable_batch(inputs) -> bool:
    # Labels to shift; a batch with its own shift_labels (padding-free collators) keeps the
    # model's loss, which reads them.
    return "labels" in inputs and "shift_labels" not in inputs


def unchunkable_model(model) -> str | None:
    """Why the chunked causal-LM loss cannot stand in for `model`'s own (None: it can)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = model.get_base_model() if _is_peft(model) else model
    if _is_peft(model) and model.active_peft_config.is_prompt_learning:
        return "a prompt-learning peft model adds its own inputs"
    if type(hf).__name__ not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return f"{type(hf).__name__} is not a causal LM"
    head = hf.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not an nn.Linear"
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    for name in LOGIT_MODIFIERS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"its config sets {name}={value!r}, which changes the logits"
    return None


class _HiddenOut:
    """Stands in for the output layer's forward during one call: returns its input, so the
    model's "logits" are the final hidden states."""

    def __init__(self):
        self.seen = []

    def __call__(self, hidden):
        self.seen.append(hidden)
        return hidden


# [Note: chunked loss]
# The model is called as usual (so the engine's hooks on the model see the whole forward and
# the gradient of its output), without labels and with its output layer's forward replaced by
# the identity: the "logits" it returns are the hidden states the output layer would read.
# causal_lm_loss then applies the output layer's weight chunk by chunk. A model that changes
# its logits after the output layer (softcapping, scaling) would return something else; that
# is checked on every call (identity, or the same values cast to fp32 by accelerate's
# autocast wrapper), so the loss is never silently another one.
def _chunked_causal_lm_loss(model, inputs, chunk_size: int, num_items, autocast):
    from ...loss import causal_lm_loss

    hf = model.get_base_model() if _is_peft(model) else model
    head = hf.get_output_embeddings()
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    stand_in = _HiddenOut()
    own = head.__dict__.get("forward")  # an instance-level forward someone installed, kept
    head.forward = stand_in
    try:
        outputs = model(**inputs)
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own
    returned = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    if len(stand_in.seen) != 1 or not _same_hidden(returned, stand_in.seen[0]):
        raise RuntimeError(
            f"TrainStreamTrainer: {type(hf).__name__} does not return its output layer's result as its "
            "logits (it changes them after the layer, or calls it more than once); pass "
            "trainstream={'chunked_loss': False}"
        )
    with autocast():
        return causal_lm_loss(
            returned,
            head.weight,
            labels.to(returned.device),
            head.bias,
            chunk_size=chunk_size,
            ignore_index=-100,
            num_items=num_items,
        )


def _same_hidden(returned, hidden) -> bool:
    if returned is hidden:
        return True
    # accelerate's mixed-precision wrapper returns bf16/fp16 outputs as fp32 copies
    return (
        returned.dtype == torch.float32
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and returned.shape == hidden.shape
        and torch.equal(returned, hidden.float())
    )


# [Note: no DDP wrapper]
# With more than one process the Trainer hands the model to accelerate's prepare_model, which
# wraps it in DistributedDataParallel for training (transformers 4.x and 5.x alike: neither
# wraps it in DDP itself). The engine already reduces the gradients, unit by unit as backward
# lands them, so a wrapped model is prepared as accelerate prepares a model for evaluation:
# mixed-precision forward, placement and compilation as for training, and no data-parallel
# wrapper (DDP would broadcast at construction, then reduce p.grad, which the engine keeps
# None). Everything else accelerate does for N processes stays: the data loaders' shards, the
# gathers of the logged loss and the metrics, the token count across devices.
def _prepare_model_without_ddp(prepare_model, model, device_placement=None, evaluation_mode=False):
    if _is_wrapped(model):
        # wrap() has placed it (what fits on the device, the rest streamed): no move either,
        # as _move_model_to_device makes none.
        device_placement, evaluation_mode = False, True
    return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)


# [Note: rank 0's weights]
# DDP broadcasts rank 0's parameters, trainable and frozen, and its buffers (unless
# broadcast_buffers=False) when it wraps the model, so under the stock Trainer ranks whose
# initial weights differ (a head, adapters or a frozen module initialized without a common
# seed, a base built with random weights on each rank) still train one model. The engine
# does not, so before wrap() every rank compares a SHA-256 digest of the bytes of each
# parameter and buffer with rank 0's, and those that differ on some rank are sent whole from
# rank 0 (a model loaded from one checkpoint sends nothing but the digests, however large its
# frozen base). A digest of the bytes sees what a sum and a norm cannot: a permutation of the
# values, a NaN's payload, the sign of a zero. A parameter stored quantized (quant.stored)
# holds a placeholder as its data: its codes and scales are what is compared and sent. Every
# rank must hold the same tensors (names, shapes, dtypes, which train, which are quantized and
# how): otherwise ValueError on every rank, before anything is sent.
DIGEST_CHUNK_BYTES = 64 << 20  # a device tensor's bytes come to the host this many at a time


def _from_rank_zero(model, *, buffers: bool) -> list:
    """Take rank 0's parameters (and, with `buffers`, its buffers) wherever some rank's
    differ ([Note: rank 0's weights]). Returns the names of those taken (the same on every
    rank)."""
    import torch.distributed as dist

    entries = _compared(model, buffers)
    group = dist.new_group(backend="gloo")  # host tensors, whatever the default group's backend
    src = dist.get_global_rank(group, 0)
    try:
        _check_same_layout(entries, group, src)
        with torch.no_grad():
            mine = torch.tensor([_digest(e.tensors) for e in entries], dtype=torch.int64).reshape(len(entries), 2)
            zero = mine.clone()
            dist.broadcast(zero, src=src, group=group)
            differs = (mine != zero).any(dim=1).to(torch.int32)
            dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
            taken = [e for e, d in zip(entries, differs.tolist()) if d]
            for e in taken:
                for t in e.tensors:
                    _broadcast_into(t, src, group)
    finally:
        dist.destroy_process_group(group)
    return [e.name for e in taken]


class _Compared:
    """One parameter or buffer as ranks compare it: the tensors holding its bytes (its data,
    or its codes and scales when it is stored quantized) and its layout, which every rank's
    must match before any bytes are compared."""

    __slots__ = ("name", "tensors", "layout")

    def __init__(self, name: str, tensors: list, layout: tuple):
        self.name, self.tensors, self.layout = name, tensors, layout


def _compared(model, buffers: bool) -> list:
    from ...quant import stored

    lost = {
        f"{prefix}.{n}" if prefix else n for prefix, module in model.named_modules() for n in stored.lost_codes(module)
    }
    entries = []
    for name, p in model.named_parameters():
        q = stored.codes_of(p)
        common = ("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        if name in lost:  # its data is a placeholder and it has no codes: wrap() refuses it
            entries.append(_Compared(name, [], (*common, "lost codes")))
        elif q is not None:
            quant = (q.format, q.block_size, tuple(q.codes.shape), str(q.codes.dtype), tuple(q.absmax.shape))
            entries.append(_Compared(name, [q.codes, q.absmax], (*common, quant)))
        else:
            entries.append(_Compared(name, [p], (*common, p.is_meta)))
    if buffers:
        for name, b in model.named_buffers():
            entries.append(_Compared(name, [b], ("buffer", name, tuple(b.shape), str(b.dtype), b.is_meta)))
    return entries


def _check_same_layout(entries: list, group, src: int) -> None:
    """ValueError on every rank unless every rank holds the same parameters and buffers."""
    import torch.distributed as dist

    rows = [hashlib.sha256(repr(e.layout).encode()).digest()[:8] for e in entries]
    mine = torch.tensor(
        [
            sum(e.layout[0] == "parameter" for e in entries),
            sum(e.layout[0] == "buffer" for e in entries),
            int.from_bytes(hashlib.sha256(b"".join(rows)).digest()[:8], "little", signed=True),
        ],
        dtype=torch.int64,
    )
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if all(torch.equal(t, every[0]) for t in every):
        return
    rank = dist.get_rank(group)
    counts = ", ".join(f"rank {r}: {int(t[0])} parameters, {int(t[1])} buffers" for r, t in enumerate(every))
    first = ""
    if all(torch.equal(t[:2], every[0][:2]) for t in every):  # as many of each: name the first that differs
        layouts = torch.tensor([int.from_bytes(r, "little", signed=True) for r in rows], dtype=torch.int64)
        zero = layouts.clone()
        dist.broadcast(zero, src=src, group=group)
        at = torch.tensor([next((i for i, d in enumerate((layouts != zero).tolist()) if d), len(rows))])
        dist.all_reduce(at, op=dist.ReduceOp.MIN, group=group)
        if int(at) < len(entries):
            e = entries[int(at)]
            first = f"; the first that differs from rank 0's is {e.layout[0]} {e.name}, here {e.layout[2:]}"
    raise ValueError(
        "TrainStreamTrainer: data parallel needs the same model on every rank, but the parameters or buffers "
        f"differ (names, shapes, dtypes, which train, which are stored quantized): {counts}{first}; "
        f"this is rank {rank}"
    )


def _digest(tensors: list) -> tuple:
    """128 bits of the SHA-256 of the tensors' bytes (host tensors read in place; a device
    tensor's come to the host in chunks)."""
    h = hashlib.sha256()
    for t in tensors:
        if t.is_meta or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)  # a copy only of a tensor that is not contiguous
        if flat.device.type == "cpu":
            h.update(flat.numpy())
        else:
            for lo in range(0, flat.numel(), DIGEST_CHUNK_BYTES):
                h.update(flat[lo : lo + DIGEST_CHUNK_BYTES].cpu().numpy())
    d = h.digest()
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:16], "little", signed=True)


def _broadcast_into(t: torch.Tensor, src: int, group) -> None:
    """Rank 0's bytes of `t` into `t` (any dtype; a host tensor in place)."""
    import torch.distributed as dist

    if t.is_meta or t.numel() == 0:
        return
    in_place = t.device.type == "cpu" and t.is_contiguous()
    host = t.detach() if in_place else t.detach().to("cpu", copy=True).contiguous()
    dist.broadcast(host.reshape(-1).view(torch.uint8), src=src, group=group)
    if not in_place:
        t.copy_(host)


# [Note: adapters load in place]
# The stock Trainer loads a peft model's checkpoint (resume_from_checkpoint, and
# load_best_model_at_end) through model.load_adapter, whose default autocast_adapter_dtype=True
# replaces every bf16 or fp16 adapter weight by a NEW fp32 Parameter (peft's cast_adapter_dtype).
# The engine and the wrapped optimizer hold the Parameters the model was wrapped with: they
# would go on updating those, which the forward no longer reads. While the Trainer loads, the
# wrapped model's load_adapter is called with autocast_adapter_dtype=False: peft then copies the
# checkpoint's values into the existing Parameters (set_peft_model_state_dict loads through
# load_state_dict, in place, which the engine's state hooks take in), in the dtype they were
# trained in, so a resumed run goes on as the uninterrupted one. fp32 adapters are never cast.
@contextlib.contextmanager
def _adapters_load_in_place(model):
    if not (_is_peft(model) and _is_wrapped(model)):
        yield
        return
    own = model.__dict__.get("load_adapter")  # an instance-level one someone installed, kept
    model.__dict__["load_adapter"] = functools.partial(model.load_adapter, autocast_adapter_dtype=False)
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["load_adapter"]
        else:
            model.__dict__["load_adapter"] = own


def _is_wrapped(model) -> bool:
    try:
        _engine_of(model)
    except ValueError:
        return False
    return True


def _check_scheduler(scheduler, optimizer) -> None:
    """A scheduler passed in must drive the wrapped optimizer's groups."""
    target = getattr(scheduler, "optimizer", None)
    groups = getattr(target, "param_groups", None)
    if (
        groups is None
        or len(groups) != len(optimizer.param_groups)
        or any(a is not b for a, b in zip(groups, optimizer.param_groups))
    ):
        raise ValueError(
            "TrainStreamTrainer: the scheduler passed in optimizers=(optimizer, scheduler) does not drive the "
            "wrapped optimizer's param groups; pass optimizers=(optimizer, None) and set "
            "TrainingArguments.lr_scheduler_type / lr_scheduler_kwargs instead"
        )


def _ours(optimizer):
    """The wrapped optimizer, inside accelerate's AcceleratedOptimizer when the Trainer made one."""
    return getattr(optimizer, "optimizer", optimizer)


_NONE = object()  # _state_dict_given: no instance attribute to put back


@contextlib.contextmanager
def _state_dict_given(optimizer, state: dict):
    """Inside the block `optimizer.state_dict()` returns `state`, gathered already, rather
    than gathering again where only this process would call it. Afterwards it is what it was
    (the class's method, or an attribute of the instance someone had set)."""
    own = vars(optimizer).get("state_dict", _NONE)
    optimizer.state_dict = lambda: state
    try:
        yield
    finally:
        if own is _NONE:
            del optimizer.state_dict
        else:
            optimizer.state_dict = own


def _synchronize(optimizer) -> None:
    """Wait for every update in flight (the weights and moments read next are current)."""
    _ours(optimizer).synchronize()


__all__ = ["TrainStreamTrainer", "parse_trainstream", "unchunkable_model"]
