"""The model flags of a converted checkpoint as a config file: megafab-convert writes
SAVE_DIR/model_flags.toml next to each Megatron checkpoint it writes, so that continued pretraining
is `pretrain_gpt.py --config SAVE_DIR/model_flags.toml --load SAVE_DIR --finetune` plus the run's
own data, batch, schedule and layout flags (any of which the command line may also override).
It holds the model's and MoE's flag values that differ from the defaults, and the tokenizer.
"""

from __future__ import annotations

import os

from megafab.config import Config
from megafab.config.fields import field_default
from megafab.config.schema import flag_fields
from megafab.config_file import resolved_config_toml

MODEL_FLAGS_FILE = "model_flags.toml"
SECTIONS = ("model", "moe")
DATA_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def model_flag_values(cfg: Config) -> dict[str, dict]:
    """{section: {field: value}} of the flags that rebuild `cfg`'s model (non-default values)."""
    out: dict[str, dict] = {name: {} for name in (*SECTIONS, "data")}
    for section, f in flag_fields():
        value = getattr(getattr(cfg, section), f.name)
        wanted = section in SECTIONS or (section == "data" and f.name in DATA_FIELDS)
        if wanted and value is not None and value != field_default(f):
            out[section][f.name] = list(value) if isinstance(value, tuple) else value
    return {name: fields for name, fields in out.items() if fields}


def write_model_flags(cfg: Config, save_dir: str, source: str) -> str:
    """Write SAVE_DIR/model_flags.toml; returns its path."""
    values = model_flag_values(cfg)
    settable = {name for fields in values.values() for name in fields}
    header = [f"the model flags of the checkpoint megafab-convert wrote from {source}",
              f"train on it: pretrain_gpt.py --config {os.path.join(save_dir, MODEL_FLAGS_FILE)} --load "
              f"{save_dir} --finetune <data, batch, schedule and layout flags>"]
    path = os.path.join(save_dir, MODEL_FLAGS_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(resolved_config_toml(values, settable, header))
    return path
