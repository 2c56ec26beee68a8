"""The memory planner: the hardware profile (this stage); the plan and its adaptation come next."""
from .profile import HardwareProfile, conservative_profile, profile_hardware

__all__ = ["HardwareProfile", "conservative_profile", "profile_hardware"]
