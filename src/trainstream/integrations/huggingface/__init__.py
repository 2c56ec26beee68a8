"""Hugging Face integration: transformers' Trainer and models over the TrainStream engine.

The names are imported on first use, so ``load_model`` does not pull in transformers'
Trainer (and what it imports) and neither does ``import trainstream``."""

_NAMES = {"load_model": ".loading", "TrainStreamTrainer": ".trainer", "wrap_hf": ".wrap"}

__all__ = list(_NAMES)


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
