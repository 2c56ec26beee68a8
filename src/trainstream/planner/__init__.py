"""The memory planner: the hardware profile and the plan (which blocks page their weights
and their activations). The engine's adapter (engine/adapt.py) feeds it measured sizes and
peaks and applies its decisions."""

from .plan import BlockBytes, BlockPlan, PlanInputs, device_bytes, make_plan
from .profile import HardwareProfile, conservative_profile, profile_hardware

__all__ = [
    "BlockBytes",
    "HardwareProfile",
    "BlockPlan",
    "PlanInputs",
    "conservative_profile",
    "device_bytes",
    "make_plan",
    "profile_hardware",
]
