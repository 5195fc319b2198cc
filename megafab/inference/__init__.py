"""Text generation: KV cache, sampling and a one-process model loader."""

from megafab.inference.generate import GenerationError, SamplingParams, generate
from megafab.inference.kv_cache import KVCache
from megafab.inference.load import load_model

__all__ = ["GenerationError", "KVCache", "SamplingParams", "generate", "load_model"]
