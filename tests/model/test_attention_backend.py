"""--attention-backend: each name runs attention inside the SDPA kernels it maps to, gives the
same values (float64), and a backend this machine cannot run is refused before training."""

import pytest
import torch
import torch.nn.functional as F

from megafab.model import transformer
from megafab.model.attention_backend import attention_backend_problems
from megafab.model.transformer import TransformerLayer
from tests.helpers.tiny import context, tiny_config


def _enabled():
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}


@pytest.mark.parametrize("backend,allowed", [("auto", None), ("flash", {"flash"}), ("unfused", {"math"}),
                                             ("local", {"math"})])
def test_backend_restricts_sdpa_and_keeps_the_values(backend, allowed, monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append({k for k, on in _enabled().items() if on})
        return real(*args, **kwargs)

    x = torch.randn(16, 2, 32, dtype=torch.float64)
    reference = TransformerLayer(tiny_config().model, context(), 0)(x)
    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", recording)
    layer = TransformerLayer(tiny_config(attention_backend=backend).model, context(), 0)
    assert (layer(x) - reference).abs().max() < 1e-12
    assert len(seen) == 1
    if allowed is None:
        assert {"flash", "math"} <= seen[0]  # nothing restricted
    else:
        assert seen[0] == allowed


def test_impossible_backends_are_refused_here():
    fused = tiny_config(attention_backend="fused")
    assert attention_backend_problems(fused, "cpu") == [
        "--attention-backend fused needs a CUDA GPU (cuDNN / memory-efficient attention kernels); on this "
        "machine use auto, flash or unfused"]
    assert attention_backend_problems(fused, "cuda") == []
    flash = tiny_config(attention_backend="flash", reset_attention_mask=True)
    assert attention_backend_problems(flash, "cpu") == []  # PyTorch's CPU flash kernel takes masks
    assert len(attention_backend_problems(flash, "cuda")) == 2  # fp32 model, per-document mask
