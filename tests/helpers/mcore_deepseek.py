"""DeepSeek-V3's shape in small for the checkpoint tests: megafab's config (tests/helpers/tiny.py sizes,
multi-latent attention with a query LoRA and YaRN, a dense first layer then MoE layers with a shared
expert and sigmoid group routing with the expert bias, one MTP layer), a float64 TrainState of it at
any TP / PP / EP / DP, and megatron-core 0.16.1's GPTModel of the same model (local spec, the MLA
oracle's shims of tests/helpers/mcore_mla.py; call it inside mcore_moe.megatron_moe_on_cpu)."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from megafab.config.moe import moe_settings
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from tests.helpers.mcore_mla import MLA_STYLE, MathCoreAttention, to_float64_rope
from tests.helpers.tiny import tiny_config

# 4 layers: a dense first, three MoE; 4 experts top-2 in 2 groups (1 picked), sigmoid, expert bias
DEEPSEEK_MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1, 1, 1), moe_ffn_hidden_size=24,
                    moe_shared_expert_intermediate_size=40, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                    moe_router_num_groups=2, moe_router_group_topk=1, moe_aux_loss_coeff=1e-2,
                    moe_token_dispatcher_type="alltoall")
DEEPSEEK = dict(MLA_STYLE, num_layers=4, vocab_size=128, make_vocab_size_divisible_by=8, mtp_num_layers=1,
                mtp_loss_scaling_factor=0.3, **DEEPSEEK_MOE)


def deepseek_config(tp=1, pp=1, ep=1, dp=1, **overrides):
    flat = dict(DEEPSEEK, dp=dp, micro_batch_size=1, global_batch_size=4, ddp_bucket_size=700, lr=1e-2,
                train_iters=10, expert_model_parallel_size=ep, sequence_parallel=tp > 1)
    return tiny_config(tp=tp, pp=pp, **{**flat, **overrides})


def deepseek_state(tp=1, pp=1, ep=1, dp=1, dist_opt=False, save=None, load=None, dtype=torch.float64,
                   **overrides) -> TrainState:
    """The model, optimizer and schedule of one rank (the harness's process group: tp x pp x dp ranks)."""
    cfg = deepseek_config(tp, pp, ep, dp, use_distributed_optimizer=dist_opt, save=save, load=load,
                          bf16=dtype == torch.bfloat16, **overrides)
    topo = build_topology(tp=tp, pp=pp, ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def megatron_deepseek(cfg, seed: int = 0):
    """megatron-core's GPTModel (local spec, float64, its MTP block) of megafab Config `cfg`, random
    weights; its routers' expert_bias stays float32 as megatron-core keeps it."""
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, settings = cfg.model, moe_settings(cfg)
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    moe = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(settings).items()
           if k in fields and k != "moe_grouped_gemm"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MLATransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size, normalization=m.normalization,
            layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float64,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, qk_layernorm=m.qk_layernorm,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            rope_type=m.rope_type or "yarn",
            rotary_base=m.rotary_base, rotary_percent=m.rotary_percent,
            rotary_scaling_factor=m.rotary_scaling_factor, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
            apply_rope_fusion=False, mtp_num_layers=m.mtp_num_layers,
            mtp_loss_scaling_factor=m.mtp_loss_scaling_factor, num_moe_experts=settings.num_experts, **moe)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = MathCoreAttention
        have_te = multi_latent_attention.HAVE_TE
        multi_latent_attention.HAVE_TE = False
        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        try:
            model = McoreGPT(config, spec, vocab_size=m.padded_vocab_size,
                             max_sequence_length=m.max_position_embeddings, parallel_output=False,
                             share_embeddings_and_output_weights=False, position_embedding_type="rope",
                             rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
                             mtp_block_spec=mtp)
        finally:
            multi_latent_attention.HAVE_TE = have_te
    model = model.double()
    for module in model.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias = module.expert_bias.float()
        if getattr(module, "rotary_pos_emb", None) is not None:
            to_float64_rope(module.rotary_pos_emb, m.rotary_base)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.add_(torch.randn_like(module.expert_bias) * 0.05)
    return model.eval()
