"""flash3: FlashAttention-3 for JAX on NVIDIA Hopper GPUs (Pallas Mosaic GPU)."""

from flash3.visibility import MaskSpec

__version__ = "0.1.0"
__all__ = ["MaskSpec", "__version__"]
