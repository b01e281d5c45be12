"""flash3: FlashAttention-3 for JAX on NVIDIA Hopper GPUs (Pallas Mosaic GPU).

    import flash3
    o = flash3.dot_product_attention(q, k, v, is_causal=True)

The front door mirrors jax.nn.dot_product_attention; docs/semantics.md defines
every mask rule.
"""

from flash3._dispatch import interpret_kernels
from flash3.attention import dot_product_attention
from flash3.context_parallel import context_parallel_attention, unzigzag, zigzag
from flash3.visibility import MaskSpec

__version__ = "0.1.0"
__all__ = [
    "dot_product_attention", "context_parallel_attention", "zigzag", "unzigzag",
    "interpret_kernels", "MaskSpec", "__version__",
]
