"""pretrain_gpt.py --mock-data (float32, 5 iterations) with DeepSeek-V3's shape in small: multi-latent
attention (query LoRA, latent norms, YaRN), a dense first layer then an MoE layer (shared expert,
sigmoid group-limited routing with expert bias) and one MTP layer. TP 2 + SP x PP 2 x EP 2 (8 ranks),
the same with every selective recompute module, EP 2 with the distributed optimizer, FSDP2 at DP 2
(with and without EP 2) each log the lm loss, the MTP loss, the balancing loss and the grad norm of
one process within 1e-5."""

from __future__ import annotations

import re

import pytest

from tests.helpers.launch import pretrain_in_ranks
from tests.helpers.moe_pretrain import MOE
from tests.helpers.moe_pretrain import logged as moe_logged
from tests.helpers.tiny_corpus import TINY

# tests/helpers/mcore_mla.py's MLA_STYLE as flags (TP 2 divides the heads and the latents)
MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
       "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--qk-layernorm",
       "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "16",
       "--v-head-dim", "12", "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "1.0",
       "--mscale-all-dim", "0.707"]
# MOE's 4 experts top-2 (dense first layer, shared expert, sigmoid, expert bias) in 2 groups of 2,
# one group a token; DeepSeek-V3's top-k scaling; one MTP layer (an MoE layer: the last one's kind)
DEEPSEEK = MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                  "--moe-router-topk-scaling-factor", "2.5", "--mtp-num-layers", "1",
                  "--mtp-loss-scaling-factor", "0.3"]
FLAGS = TINY + MLA + DEEPSEEK
MTP_LOSS = re.compile(r"iteration\s+(\d+)/.*? mtp_1 loss: (\S+) \|")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*? grad norm: (\S+) \|")
TP_PP_EP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
            "--expert-model-parallel-size", "2"]
# every selective recompute module this model has (moe_act needs grouped experts): invisible
RECOMPUTE = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mla_up_proj",
             "layernorm", "mlp", "moe", "shared_experts"]
# case -> (world, layout flags, the grid rank 0 announces)
LAYOUTS = {
    "tp2-sp-pp2-ep2": (8, TP_PP_EP, "tp 2 pp 2 dp 2"),
    "tp2-sp-pp2-ep2-recompute": (8, TP_PP_EP + RECOMPUTE, "tp 2 pp 2 dp 2"),
    "ep2-dp2-distopt": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
                        "tp 1 pp 1 dp 2"),
    "dp2-fsdp2": (2, ["--use-torch-fsdp2"], "tp 1 pp 1 dp 2"),
    "ep2-dp2-fsdp2": (2, ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"], "tp 1 pp 1 dp 2"),
}
pytestmark = pytest.mark.slow  # 38 s for all on a loaded 2-core machine (each 8-rank case 10 s)


def logged(output: str) -> dict[int, tuple[float, float, float, float]]:
    """Per iteration: (lm loss, load_balancing_loss, mtp_1 loss, grad norm) of a run's log."""
    mtp = {int(m.group(1)): float(m.group(2)) for m in MTP_LOSS.finditer(output)}
    norm = {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(output)}
    return {it: (lm, balancing, mtp[it], norm[it]) for it, (lm, balancing, _) in moe_logged(output).items()}


@pytest.fixture(scope="module")
def single_process():
    one = logged(pretrain_in_ranks(FLAGS, 1, timeout=300)[0])
    assert sorted(one) == [1, 2, 3, 4, 5], one
    for lm, balancing, mtp, norm in one.values():
        assert 3.0 < lm < 6.0 and 3.0 < mtp < 6.0 and mtp != lm  # the MTP depth's own loss
        assert balancing > 0.5 and norm > 0  # logged, not zeros
    return one


def test_mla_flags_reach_the_model():
    """The runs below train multi-latent attention with YaRN and group routing (not silently dropped)."""
    from megafab.arguments import config_from_args

    cfg = config_from_args(FLAGS, world_size=1)
    m, moe = cfg.model, cfg.moe
    assert m.multi_latent_attention and m.q_lora_rank == 24 and m.rope_type == "yarn"
    assert m.mtp_num_layers == 1
    assert moe.moe_router_num_groups == 2 and moe.moe_router_group_topk == 1
    assert moe.moe_router_enable_expert_bias and moe.moe_router_score_function == "sigmoid"


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_deepseek_shape_layout_logs_the_single_process_losses(case, single_process):
    world, layout, grid = LAYOUTS[case]
    outs = pretrain_in_ranks(FLAGS + layout, world, timeout=600)
    assert f"megafab: {world} process(es), {grid}," in outs[0], outs[0][:2000]
    ours = logged(outs[-1])
    assert sorted(ours) == sorted(single_process), (case, ours)
    for it, values in ours.items():
        ref = single_process[it]
        for name, a, b in zip(("lm", "balancing", "mtp_1", "grad norm"), values, ref):
            assert abs(a - b) < 1e-5 * max(1.0, abs(b)), (case, it, name, values, ref)
