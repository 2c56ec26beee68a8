"""The engine's shape: managers are handed their collaborators, never the engine."""

import inspect

import pytest

from trainstream.engine import (
    activations,
    adapt,
    device_state,
    frozen_linear,
    grads,
    moments,
    nonfinite,
    params,
    state,
    updates,
)

MANAGERS = [
    params.WeightPager,
    activations.ActivationPager,
    grads.GradStreamer,
    moments.MomentStager,
    adapt.Adapter,
    state.StateHooks,
    updates.Updater,
    device_state.DeviceState,
    nonfinite.DeviceCheck,
    frozen_linear.FrozenLinears,
]


@pytest.mark.parametrize("manager", MANAGERS, ids=lambda m: m.__name__)
def test_no_manager_takes_the_engine(manager):
    names = list(inspect.signature(manager.__init__).parameters)
    assert "engine" not in names, f"{manager.__name__}({', '.join(names[1:])})"
    source = inspect.getsource(inspect.getmodule(manager))
    assert "self.engine" not in source, f"{manager.__module__} reaches through an engine"
