"""wrap_hf(): trainstream.wrap() for a Hugging Face transformers model (or a peft model over
one), for a training loop of your own. TrainStreamTrainer wraps through it too.

What it adds to wrap(): the block stack is the model's decoder layers, found from what
transformers declares about them (``_no_split_modules``: the layer classes that must stay
whole), and the model is called with ``use_cache=False`` while it trains (a KV cache holds
every layer's keys and values for generation, which training never reads). wrap() runs
with the random number generators' states kept as they were, so wrapping changes neither
the data order nor the dropout masks of the run.
"""

from __future__ import annotations

import contextlib
import inspect
import random

import torch

from ...api import wrap


def _hf_model(model):
    """The transformers model inside `model` (a peft model holds it as its base model)."""
    import transformers

    inner = model.get_base_model() if _is_peft(model) else model
    if not isinstance(inner, transformers.PreTrainedModel):
        raise TypeError(
            "wrap_hf(): model must be a transformers.PreTrainedModel or a peft model over one, "
            f"got {type(model).__module__}.{type(model).__qualname__} (use trainstream.wrap() for other modules)"
        )
    return inner


def _is_peft(model) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def decoder_layers(model) -> list | None:
    """The model's layer stacks: every nn.ModuleList whose children are all of one class that
    transformers names in ``_no_split_modules`` (LlamaDecoderLayer, Qwen2DecoderLayer, T5Block
    ...), in module order, joined (T5's encoder.block then decoder.block), none inside another
    stack's layer. None when the model names no such class (wrap() then finds the stack)."""
    hf = _hf_model(model)
    names = set(getattr(hf, "_no_split_modules", None) or ())
    layers, inside = [], set()
    for module in hf.modules():
        if id(module) in inside or not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child).__name__ for child in module}
        if len(kinds) != 1 or not kinds <= names:
            continue
        layers += list(module)
        inside.update(id(m) for layer in module for m in layer.modules())
    return layers or None


class _NoCacheWhileTraining:
    """Forward pre-hook: a call in training mode gets use_cache=False unless it names it."""

    def __call__(self, module, args, kwargs):
        if module.training and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return args, kwargs


@contextlib.contextmanager
def rng_preserved():
    """The Python, NumPy and torch (CPU and initialized CUDA) generators' states are restored
    on exit: measuring the hardware and planning may draw random numbers, which would
    otherwise shift every draw of the run after them (data order, dropout)."""
    py = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:
        np, np_state = None, None
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def wrap_hf(model, optimizer=None, **options):
    """:func:`trainstream.wrap` for a transformers model (or a peft model over one).

    Takes every wrap() option. Unless ``blocks=`` is given, the stack is the model's decoder
    layers (:func:`decoder_layers`). While the model is in training mode its calls get
    ``use_cache=False`` (when its forward takes it); evaluation and ``generate()`` keep the
    config's setting. A peft
    model trains what requires grad: its adapters. Returns ``(model, optimizer)`` as wrap().
    """
    _hf_model(model)
    if "blocks" not in options:
        layers = decoder_layers(model)
        if layers is not None:
            options["blocks"] = layers
    takes_cache = "use_cache" in inspect.signature(_hf_model(model).forward).parameters
    with rng_preserved():
        model, optimizer = wrap(model, optimizer, **options)
    if takes_cache:
        model.register_forward_pre_hook(_NoCacheWhileTraining(), with_kwargs=True)
    return model, optimizer
