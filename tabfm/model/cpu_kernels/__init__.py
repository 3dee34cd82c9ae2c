"""Fused bf16 CPU kernels (AVX512-BF16), built from this folder's C++ on first use.

`attention.fused_attention` (attention forward + backward) and `rms_norm.rms_norm_bf16`
(RMSNorm with a bf16 output); `build` compiles and loads them and says where they cannot
run (`available`, `reason`), in which case the model uses torch's ops with a warning.
"""
from .attention import fused_attention
from .build import available, reason
from .rms_norm import rms_norm_bf16

__all__ = ["available", "fused_attention", "reason", "rms_norm_bf16"]
