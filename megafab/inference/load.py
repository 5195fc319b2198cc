"""A one-process GPTModel from a megafab checkpoint saved with any layout."""

from __future__ import annotations

import torch

from megafab.config.moe import moe_settings
from megafab.convert.checkpoint import read_checkpoint
from megafab.convert.state_dict import module_state_dict
from megafab.model.gpt import GPTModel
from megafab.model.moe.balancing import LossScale
from megafab.model.transformer import LayerContext


def load_model(load_dir: str, iteration: int | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """(GPTModel in eval mode holding every layer (and every expert), the checkpoint's Config)."""
    sd, cfg = read_checkpoint(load_dir, iteration)
    return model_from_state_dict(sd, cfg, dtype, device), cfg


def model_from_state_dict(sd: dict[str, torch.Tensor], cfg, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu") -> GPTModel:
    """The one-process GPTModel (eval mode, no dropout) holding full megafab state dict `sd` of Config
    `cfg` (convert/state_dict.py; e.g. import_hf's)."""
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0
    device = torch.device(device)
    moe = moe_settings(cfg)
    ctx = LayerContext(None, False, dtype, device, cfg.training.seed, moe=moe,
                       moe_loss_scale=LossScale() if moe is not None else None)
    model = GPTModel(m, ctx).eval()
    weights = module_state_dict(sd, model.state_dict().keys())  # SequentialMLP experts: rows of the stack
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True)
    return model
