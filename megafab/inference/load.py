"""A one-process GPTModel from a megafab checkpoint saved with any layout."""

from __future__ import annotations

import torch

from megafab.convert.checkpoint import read_checkpoint
from megafab.model.gpt import GPTModel
from megafab.model.transformer import LayerContext


def load_model(load_dir: str, iteration: int | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """(GPTModel in eval mode holding every layer, the checkpoint's Config)."""
    sd, cfg = read_checkpoint(load_dir, iteration)
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0
    device = torch.device(device)
    model = GPTModel(m, LayerContext(None, False, dtype, device, cfg.training.seed)).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return model, cfg
