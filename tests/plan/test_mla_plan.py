"""The planner's multi-latent attention terms are the engine's: the activation bytes of MLA's attention
(plan/mla_activations.py) equal the bytes autograd keeps for backward (float32, CPU's math kernel),
with and without a query LoRA and with each selective-recompute module that touches it; the FLOPs
count MLA's score and context widths; the per-chunk RoPE term is MLA's RoPE part."""

from __future__ import annotations

import pytest
import torch

from megafab.model.gpt import GPTModel
from megafab.model.rotary import RotaryEmbedding, rotary_channels
from megafab.optim.memory import SavedActivations
from megafab.plan.flops import flops_per_iteration
from megafab.plan.mla_activations import mla_attention_bytes
from megafab.plan.state_memory import BYTES
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.tiny import context, tiny_config

MODULES = {"none": None, "core_attn": ["core_attn"], "mla_up_proj": ["mla_up_proj"],
           "both": ["core_attn", "mla_up_proj"]}


def _measured_attention_bytes(cfg) -> int:
    m = cfg.model
    model = GPTModel(m, context(dtype=torch.float32))
    attention = model.decoder.layers["0"].self_attention
    x = torch.randn(m.seq_length, cfg.training.micro_batch_size, m.hidden_size, requires_grad=True)
    positions = torch.arange(m.seq_length).expand(cfg.training.micro_batch_size, -1)
    angles = RotaryEmbedding.from_model_config(m, torch.device("cpu"))(positions, torch.float32)
    with SavedActivations(model.parameters()) as saved:
        out = attention(x, angles)
    out.sum().backward()
    return saved.bytes


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("modules", list(MODULES))
def test_mla_attention_activation_bytes_are_what_autograd_keeps(q_lora_rank, modules):
    recompute = {} if MODULES[modules] is None else dict(recompute_granularity="selective",
                                                         recompute_modules=MODULES[modules])
    cfg = tiny_config(style=MLA_STYLE, q_lora_rank=q_lora_rank, seq_length=32, **recompute)
    m, b, e = cfg.model, cfg.training.micro_batch_size, BYTES["float32"]
    measured = _measured_attention_bytes(cfg)
    outside = e * m.seq_length * b * (m.hidden_size + 2 * rotary_channels(m))  # its input, cos and sin
    planned = outside + mla_attention_bytes(cfg, "cpu", "core_attn" in (MODULES[modules] or []),
                                            "mla_up_proj" in (MODULES[modules] or []))
    assert planned == pytest.approx(measured, rel=0.05), (measured, planned)


def test_mla_flops_and_rope_terms_read_mlas_widths():
    cfg = tiny_config(style=MLA_STYLE)
    m = cfg.model
    assert rotary_channels(m) == m.qk_pos_emb_head_dim
    wider = tiny_config(style={**MLA_STYLE, "qk_pos_emb_head_dim": 32})
    s, layers = m.seq_length, m.num_layers
    # scores 2 s^2 n pe more; the projections' weights grow by 16 columns per head (q) and h x 16 (kv down)
    extra = 2 * s * s * m.num_attention_heads * 16 + 2 * s * (
        m.q_lora_rank * m.num_attention_heads * 16 + m.hidden_size * 16)
    assert flops_per_iteration(wider, 1) - flops_per_iteration(cfg, 1) == pytest.approx(3 * layers * extra)


@pytest.mark.parametrize("q_lora_rank,tp", [(24, 1), (None, 1), (24, 2)])
def test_mla_step_time_gemms_are_the_layers_weights(q_lora_rank, tp):
    """The step-time model's attention GEMMs of an MLA layer (plan/layer_time.py) are its built
    attention's weights, per TP rank: 2 M n k FLOPs each = 2 M x the rank's weight elements."""
    from megafab.plan.layer_time import Shapes, attention_shapes
    from megafab.plan.machines import BUILTIN

    cfg = tiny_config(tp=tp, style=MLA_STYLE, q_lora_rank=q_lora_rank)
    x = Shapes(cfg, BUILTIN["h100-sxm-80gb"])
    attention = GPTModel(cfg.model, context(dtype=torch.float32)).decoder.layers["0"].self_attention
    weights = sum(p.numel() for name, p in attention.named_parameters() if "layernorm" not in name)
    assert sum(2 * m * n * k for m, n, k in attention_shapes(x)) == 2 * x.M * weights // tp


def test_mla_step_time_rope_term_reads_the_positional_channels():
    """The memory-bound RoPE term of an MLA layer's step time rotates only the positional channels
    (the rank's query heads and the one shared key head), not kv_channels-wide q and k heads."""
    from megafab.plan.layer_time import layer_passes
    from megafab.plan.machines import BUILTIN

    machine = BUILTIN["h100-sxm-80gb"]
    cfg = tiny_config(style=MLA_STYLE)
    m = cfg.model

    def memory(**style):
        return layer_passes(tiny_config(style={**MLA_STYLE, **style}), machine)[0].memory

    assert memory(kv_channels=2 * m.kv_channels) == memory()
    rows = cfg.training.micro_batch_size * m.seq_length
    bytes_more = 2 * BYTES[cfg.precision.params_dtype_name] * rows * (m.num_attention_heads + 1) * 16
    wider = memory(qk_pos_emb_head_dim=m.qk_pos_emb_head_dim + 16) - memory()
    assert wider == pytest.approx(bytes_more / (machine.hbm_bandwidth * machine.hbm_efficiency))
