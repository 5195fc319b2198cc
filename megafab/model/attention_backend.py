"""--attention-backend: Megatron's attention kernel choice mapped onto PyTorch SDPA's backends.

    auto      SDPA chooses (flash / memory-efficient / cuDNN on CUDA, flash or math on CPU)
    flash     SDPBackend.FLASH_ATTENTION (CUDA: fp16/bf16 and no arbitrary mask; CPU: any dtype)
    fused     cuDNN, else memory-efficient attention: the fused kernels (TE's FusedAttention); CUDA only
    unfused   SDPBackend.MATH: softmax(q k^T / sqrt(d)) v spelled out (Megatron's unfused path)
    local     the same math kernel (Megatron's local spec runs its own unfused attention)

With --transformer-impl transformer_engine the choice goes to TE's NVTE_*_ATTN switches instead.
A backend this machine cannot run is refused before training starts, not at the first forward.
"""

from __future__ import annotations

import contextlib
import functools
import os

from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}
# Megatron's own mapping onto Transformer Engine (megatron-core's LanguageModule): flash, fused, unfused.
TE_SWITCHES = {"flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1), "local": (0, 0, 1)}


def sdpa_context(backend: str):
    """A factory of the context the attention kernel runs in (nothing to restrict for auto)."""
    backends = SDPA_BACKENDS[backend]
    if backends is None:
        return contextlib.nullcontext
    return functools.partial(sdpa_kernel, backends)


QK_LAYER_SCALING = "NVTE_APPLY_QK_LAYER_SCALING"  # TE takes --apply-query-key-layer-scaling only so


def set_te_attention_switches(backend: str, qk_layer_scaling: bool = False) -> None:
    """Transformer Engine reads NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN, and
    NVTE_APPLY_QK_LAYER_SCALING (set here for --apply-query-key-layer-scaling; a contradicting value is
    refused by attention_backend_problems)."""
    if backend in TE_SWITCHES:
        names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
        for name, value in zip(names, TE_SWITCHES[backend]):
            os.environ[name] = str(value)
    if qk_layer_scaling:
        os.environ[QK_LAYER_SCALING] = "1"


def attention_backend_problems(cfg, device_type: str) -> list[str]:
    """Why --attention-backend cannot run on `device_type` ("cuda" or "cpu") with this config."""
    backend = cfg.model.attention_backend
    out = []
    scaling, env = cfg.model.apply_query_key_layer_scaling, os.environ.get(QK_LAYER_SCALING)
    if cfg.model.transformer_impl == "transformer_engine" and env not in (None, "") and \
            env.strip() != ("1" if scaling else "0"):  # megatron-core's TEDotProductAttention refuses it too
        asked = "--apply-query-key-layer-scaling" if scaling else "no --apply-query-key-layer-scaling"
        out.append(f"{QK_LAYER_SCALING}={env} contradicts {asked}: Transformer Engine takes the layer "
                   f"scaling only from that variable; unset it")
    if backend == "fused" and device_type != "cuda":
        out.append("--attention-backend fused needs a CUDA GPU (cuDNN / memory-efficient attention "
                   "kernels); on this machine use auto, flash or unfused")
    if backend == "flash" and device_type == "cuda":
        if not (cfg.precision.bf16 or cfg.precision.fp16):
            out.append("--attention-backend flash runs in fp16/bf16 on CUDA; add --bf16 or use auto")
        masks = [flag for flag in ("--reset-attention-mask", "--dataloader-inter-document-masking")
                 if getattr(cfg.data, flag[2:].replace("-", "_"))]
        if masks:
            out.append(f"--attention-backend flash takes no per-document mask on CUDA ({masks[-1]}); use "
                       f"auto or fused")
    return out
