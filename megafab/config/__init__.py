"""megafab's configuration: schema (the sections and their flags), derive (Megatron's derivations),
rules (pure cross-field checks), probes (start-up checks of files); Config ties them together."""

from megafab.config.core import Config, ConfigError
from megafab.config.derive import CP_COMM_TYPES, default_bucket_size, pad_vocab_size, swiglu_ffn_size
from megafab.config.schema import (
    ATTENTION_BACKENDS,
    CKPT_FORMATS,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
    field_docs,
)

__all__ = ["ATTENTION_BACKENDS", "CKPT_FORMATS", "CP_COMM_TYPES", "SECTIONS", "CheckpointConfig", "Config",
           "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig", "MoEConfig",
           "OptimizerConfig", "ParallelConfig",
           "PrecisionConfig", "TrainingConfig", "default_bucket_size", "field_docs", "pad_vocab_size",
           "swiglu_ffn_size"]
