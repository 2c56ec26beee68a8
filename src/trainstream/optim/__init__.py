from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW"]
