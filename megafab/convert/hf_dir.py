"""HuggingFace model directories (config.json + safetensors) <-> full megafab state dicts.

    export_hf(sd, cfg, out_dir)          -> out_dir loads with AutoModelForCausalLM (offline)
    import_hf(hf_dir, tp=1)              -> (full megafab state dict, Config)
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from megafab.config import Config, ModelConfig
from megafab.convert import (
    hf_deepseek_v3,
    hf_gpt2,
    hf_gpt_oss,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_qwen2,
    hf_qwen3,
    hf_qwen3_moe,
)
from megafab.convert.state_dict import ConversionError, finalize_model_config
from megafab.convert.tokenizer_files import save_tokenizer_files, tokenizer_special_ids

ARCHITECTURES = {"gpt2": hf_gpt2, "llama": hf_llama, "mistral": hf_mistral, "mixtral": hf_mixtral,
                 "qwen2": hf_qwen2, "qwen3": hf_qwen3, "qwen3_moe": hf_qwen3_moe,
                 "deepseek_v3": hf_deepseek_v3, "gpt_oss": hf_gpt_oss}
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")  # their converters take cfg.moe
CONFIG_READERS = ("deepseek_v3",)  # their from_hf_state_dict reads config.json too (hf_config)
WEIGHTS = "model.safetensors"


def architecture_of(m: ModelConfig, moe=None) -> str:
    """gpt2 (learned positions, LayerNorm, GELU, biases) or llama (RoPE, RMSNorm, SwiGLU, no biases),
    the latter as qwen3 with --qk-layernorm, qwen2 with --add-qkv-bias and mistral with --window-size
    (every layer windowed); a mixture of experts
    (moe: cfg.moe) of the Llama architecture: qwen3_moe with --qk-layernorm, else mixtral; multi-latent
    attention: deepseek_v3; a mixture of experts with learnable sinks and --quick-geglu: gpt_oss."""
    if m.multi_latent_attention:
        return "deepseek_v3"
    if moe is not None and moe.num_experts is not None:
        if m.softmax_type == "learnable" and m.quick_geglu:
            return "gpt_oss"
        return "qwen3_moe" if m.qk_layernorm else "mixtral"
    gpt2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                add_bias_linear=True)
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    for name, want in (("gpt2", gpt2), ("llama", llama)):
        if all(getattr(m, k) == v for k, v in want.items()):
            if name == "llama" and (m.qk_layernorm or m.add_qkv_bias):
                return "qwen3" if m.qk_layernorm else "qwen2"
            if name == "llama" and hf_mistral.window_of(m) is not None:
                return "mistral"
            return name
    have = {k: getattr(m, k) for k in gpt2}
    raise ConversionError(f"model {have} is neither the GPT-2 architecture {gpt2} nor the Llama architecture "
                          f"{llama}; only these two export to HuggingFace")


def export_hf(sd: dict[str, torch.Tensor], cfg: Config, out_dir: str,
              dtype: torch.dtype | None = None) -> str:
    """Write config.json, model.safetensors and (HF/SentencePiece/GPT-2 BPE tokenizers) the tokenizer
    files of the megafab model `sd` with training config `cfg`; returns the architecture name."""
    from safetensors.torch import save_file

    arch = architecture_of(cfg.model, cfg.moe)
    module = ARCHITECTURES[arch]
    ids = tokenizer_special_ids(cfg.data)
    extra = {"bos": ids["bos"]} if arch != "gpt2" and "bos" in ids else {}
    moe = _moe_args(arch, cfg)
    hf_config = module.to_hf_config(cfg.model, **moe, eod=ids.get("eod"), **extra)
    hf_sd = module.to_hf_state_dict(sd, cfg.model, **moe)
    if dtype is not None:
        hf_sd = {k: _cast(k, v, dtype, module) for k, v in hf_sd.items()}
        hf_config.dtype = str(dtype).removeprefix("torch.")
    os.makedirs(out_dir, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, os.path.join(out_dir, WEIGHTS),
              metadata={"format": "pt"})
    save_tokenizer_files(cfg.data, out_dir)
    return arch


def _cast(key: str, tensor: torch.Tensor, dtype: torch.dtype, module) -> torch.Tensor:
    """`tensor` in `dtype`, but a module's KEEP_FP32 tensors (e.g. DeepSeek's expert bias) stay float32."""
    return tensor if key.endswith(getattr(module, "KEEP_FP32", ())) else tensor.to(dtype)


def _moe_args(arch: str, cfg: Config) -> dict:
    return {"moe": cfg.moe} if arch in MOE_ARCHITECTURES else {}


def _read(path: str, load):
    """load(path), or one ConversionError naming the file when it cannot be read."""
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - json, safetensors and torch.load each fail their own way
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConversionError(f"{path} could not be read ({type(e).__name__}: {first}); it is truncated "
                              f"or not what save_pretrained writes: copy it again from the model's "
                              f"source") from None


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin (read with weights_only)."""
    from safetensors.torch import load_file

    single, index = os.path.join(hf_dir, WEIGHTS), os.path.join(hf_dir, WEIGHTS + ".index.json")
    if os.path.exists(single):
        return _read(single, load_file)
    if os.path.exists(index):
        files = sorted(set(_read(index, lambda p: _json(p)["weight_map"]).values()))
        out = {}
        for name in files:
            out.update(_read(os.path.join(hf_dir, name), load_file))
        return out
    legacy = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(legacy):
        return _read(legacy, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    raise ConversionError(f"{hf_dir} holds no weights ({WEIGHTS}, its .index.json or pytorch_model.bin); "
                          f"pass a directory written by save_pretrained")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConversionError(f"{path} not found; pass a HuggingFace model directory")
    c = _read(path, _json)
    if not isinstance(c, dict) or c.get("model_type") not in ARCHITECTURES:
        kind = c.get("model_type") if isinstance(c, dict) else None
        raise ConversionError(f"{path}: model_type {kind!r} is not one of "
                              f"{sorted(ARCHITECTURES)}; megafab converts GPT-2, Llama, Qwen2, Qwen3, "
                              f"Mistral, Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss models")
    return c


def import_hf(hf_dir: str, tp: int = 1, make_vocab_size_divisible_by: int = 128,
              dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], Config]:
    """(full megafab state dict, Config) of a HF directory of one of ARCHITECTURES' model types. The
    vocabulary is padded for tensor-parallel size `tp` as training with --make-vocab-size-divisible-by
    will pad it; the tokenizer directory is recorded as HuggingFaceTokenizer when it has tokenizer files."""
    c = read_hf_config(hf_dir)
    module = ARCHITECTURES[c["model_type"]]
    flat = module.from_hf_config(c)
    flat["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    flat["tensor_model_parallel_size"] = tp
    if any(os.path.exists(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")):
        flat.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(hf_dir))
    cfg = dataclasses.replace(Config.from_flat(flat), model=finalize_model_config(flat, tp))
    weights = read_hf_weights(hf_dir)
    extra = {"hf_config": c} if c["model_type"] in CONFIG_READERS else {}
    sd = module.from_hf_state_dict(weights, cfg.model, **_moe_args(c["model_type"], cfg), **extra)
    if dtype is not None:
        sd = {k: _cast(k, v, dtype, module) for k, v in sd.items()}
    return sd, cfg
