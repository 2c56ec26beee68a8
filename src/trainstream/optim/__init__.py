from .convert import convert_optimizer
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW", "convert_optimizer"]
