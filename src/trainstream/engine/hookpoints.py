"""Where the engine's hooks attach to autograd: the tensors a forward returned, whether a hook
runs inside a backward, and a parameter's AccumulateGrad node."""

from __future__ import annotations

import torch


def tensors_in(out):
    """The tensors in a forward's output, nested in tuples, lists and dicts (a ModelOutput is
    a dict)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from tensors_in(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from tensors_in(o)


def in_autograd() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward called now is
    a checkpointed block recomputing, even before any gradient of the pass has landed."""
    return torch._C._current_graph_task_id() != -1


def grad_accumulator(param):
    """`param`'s AccumulateGrad node. Its post hooks run once p.grad holds the gradient, after
    every hook registered on the tensor (register_post_accumulate_grad_hook), a user's made
    later included. Whoever hooks it must hold it: autograd keeps it only weakly, and a new
    one (without the hook) would take its place in the next graph. Found through a view made
    with grad enabled (under no_grad a view has no grad_fn)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]
