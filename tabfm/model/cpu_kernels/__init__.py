"""Fused bf16 CPU kernels (AVX512-BF16), built from this folder's C++ on first use.

`attention.fused_attention` (attention forward + backward), `rms_norm.rms_norm_bf16`
(RMSNorm with a bf16 output) and `gelu.gelu_tanh_bf16`; `build` compiles and loads them and
says where they cannot run (`available`, `reason`), in which case the model uses torch's ops
with a warning (`build.usable`).
"""
from .attention import fused_attention
from .build import available, reason
from .gelu import gelu_tanh_bf16
from .rms_norm import rms_norm_bf16

__all__ = ["available", "fused_attention", "gelu_tanh_bf16", "reason", "rms_norm_bf16"]
