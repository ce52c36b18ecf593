from .core import mean

__all__ = ["mean"]
