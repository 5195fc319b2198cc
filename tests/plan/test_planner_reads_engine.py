"""The planner reads the engine: for the tests' model variants (dense GPT-2 and Llama styles, GQA,
SwiGLU, untied embeddings, learned positions, LayerNorm / RMSNorm, biases on and off; MoE with
shared experts, grouped and sequential experts, router and expert biases, dense layers between;
multi-latent attention with and without a query LoRA, dense and MoE) and
layouts (TP 1/2/4, PP 1/2/4 with uneven splits and VPP, EP 1/2/4, ETP 1/2), every rank's planned
parameters, routed-expert parameters, per-tensor list and FSDP2 units equal the chunks
build_model_chunks builds for that rank (on the meta device, SizedGroup for the groups, which a
multi-rank test holds equal to real groups), and the expected checkpoint keys equal the model's."""

import pytest
import torch

from megafab.config.moe import moe_settings
from megafab.convert.state_dict import expected_keys, moe_keys
from megafab.distributed.fsdp import expert_units, layer_units
from megafab.distributed.sized_group import SizedGroup
from megafab.model.gpt import GPTModel, build_model_chunks
from megafab.model.transformer import LayerContext
from megafab.param_names import experts_name
from megafab.pipeline_split import PipelineSplit
from megafab.plan.moe import expert_sizes
from megafab.plan.optimizer_tensors import chunk_tensors, param_tensors
from megafab.plan.params import fsdp_layer_units, model_params
from megafab.plan.planner import plan
from tests.helpers.mcore_mla import MLA_STYLE
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config

MOE = dict(num_experts=4, moe_router_topk=2)
MODELS = {
    "gpt2": dict(GPT2_STYLE),
    "llama": dict(LLAMA_STYLE),
    "gpt2-untied-rmsnorm-qkbias": dict(GPT2_STYLE, untie_embeddings_and_output_weights=True,
                                       normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True),
    "llama-tied-layernorm-learned": dict(LLAMA_STYLE, untie_embeddings_and_output_weights=False,
                                         normalization="LayerNorm",
                                         position_embedding_type="learned_absolute"),
    "gqa-qk-norm-1p": dict(LLAMA_STYLE, qk_layernorm=True, apply_layernorm_1p=True, num_query_groups=1),
    "moe-sequential-shared-gate": dict(LLAMA_STYLE, **MOE, moe_shared_expert_intermediate_size=40,
                                       moe_shared_expert_gate=True, moe_layer_freq=(0, 1, 1, 1)),
    "moe-grouped-biases": dict(GPT2_STYLE, **MOE, moe_grouped_gemm=True, moe_ffn_hidden_size=48,
                               moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
    "moe-every-other-shared": dict(LLAMA_STYLE, **MOE, moe_layer_freq=2, moe_grouped_gemm=True,
                                   moe_shared_expert_intermediate_size=24),
    # multi-latent attention: query LoRA, latent norms, YaRN; a direct query projection with MoE
    "mla-q-lora": dict(MLA_STYLE),
    "mla-moe-no-q-lora": dict(MLA_STYLE, **MOE, q_lora_rank=None, moe_layer_freq=(0, 1, 1, 1),
                              moe_shared_expert_intermediate_size=40, moe_router_score_function="sigmoid",
                              moe_router_enable_expert_bias=True),
}
# (tp, pp, ep, etp, overrides); expert sizes apply to MoE models only
LAYOUTS = [
    (1, 1, 1, None, {}),
    (2, 1, 1, None, {}),
    (4, 2, 1, None, {}),
    (1, 2, 1, None, dict(num_layers_per_virtual_pipeline_stage=1)),
    (2, 4, 1, None, dict(num_layers=8, num_layers_per_virtual_pipeline_stage=1)),
    (1, 2, 1, None, dict(num_layers=5, decoder_first_pipeline_num_layers=2)),
    (1, 4, 1, None, dict(num_layers=6, account_for_embedding_in_pipeline_split=True,
                         account_for_loss_in_pipeline_split=True)),
    (1, 1, 2, None, {}),
    (1, 2, 4, None, {}),
    (2, 1, 2, 1, {}),
    (2, 2, 2, 2, {}),
    (4, 1, 4, 1, {}),
    (4, 1, 1, 2, {}),
]


def _applies(model: str, layout) -> bool:
    """Expert layouts only for MoE models; expert biases only at ETP 1 (the rules refuse them split)."""
    _, _, ep, etp, _ = layout
    if "num_experts" not in MODELS[model]:
        return ep == 1 and etp is None
    return not (MODELS[model].get("add_bias_linear") and (etp or 1) > 1)


def _cases(models, layouts) -> list:
    return [pytest.param(m, lay, id=f"{m}-{_layout_id(lay)}") for m in models for lay in layouts
            if _applies(m, lay)]


def _config(model: str, layout) -> object:
    tp, pp, ep, etp, overrides = layout
    flat = dict(MODELS[model], **overrides)
    if "num_query_groups" in flat:  # the rules want whole query groups on each TP rank
        flat["num_query_groups"] = max(flat["num_query_groups"], tp)
    moe = "num_experts" in flat
    if moe and not isinstance(flat.get("moe_layer_freq", 1), int):
        pattern = flat["moe_layer_freq"]
        flat["moe_layer_freq"] = tuple(pattern[i % 4] for i in range(flat.get("num_layers", 4)))
    if moe and flat.get("add_bias_linear"):  # the rules refuse expert biases split over ETP
        etp = 1
    if moe:
        flat.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    else:
        ep, etp = 1, None
    expert_grid = (etp or tp) * ep
    dp = max(1, expert_grid // tp) if expert_grid % tp == 0 else expert_grid
    return tiny_config(tp=tp, pp=pp, dp=dp, sequence_parallel=tp > 1, global_batch_size=2 * dp * pp, **flat)


def _rank_groups(cfg, tp_rank: int, ep_rank: int, etp_rank: int) -> dict:
    """LayerContext fields of one rank with SizedGroup stand-ins (as megafab.training.build passes
    the real groups)."""
    p, moe = cfg.parallel, moe_settings(cfg)
    ep, etp = expert_sizes(cfg)
    fields = dict(tp_group=SizedGroup(p.tensor_model_parallel_size, tp_rank))
    if moe is not None:
        fields.update(moe=moe, ep_group=SizedGroup(ep, ep_rank), etp_group=SizedGroup(etp, etp_rank),
                      tp_ep_group=SizedGroup(etp * ep, ep_rank * etp + etp_rank))
    return fields


def _chunks(cfg, pp_rank: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0):
    """The model chunks of one rank, built by the engine on the meta device."""
    p = cfg.parallel
    ctx = LayerContext(sequence_parallel=p.sequence_parallel, params_dtype=torch.float32,
                       device=torch.device("cpu"), seed=1, **_rank_groups(cfg, tp_rank, ep_rank, etp_rank))
    split = PipelineSplit.from_config(cfg)
    return build_model_chunks(cfg.model, ctx, split.pp, pp_rank, split.vpp, split, on_meta=True)


def _ranks(cfg):
    """(tp, ep, etp) ranks to build: the first and the last of each group."""
    ep, etp = expert_sizes(cfg)
    tp = cfg.parallel.tensor_model_parallel_size
    return sorted({(0, 0, 0), (tp - 1, ep - 1, (etp - 1) if moe_settings(cfg) else 0)})


def _layout_id(layout) -> str:
    tp, pp, ep, etp, overrides = layout
    return f"tp{tp}-pp{pp}-ep{ep}-etp{etp or tp}" + "".join(f"-{k}" for k in overrides)


@pytest.mark.parametrize("model,layout", _cases(MODELS, LAYOUTS))
def test_planned_parameters_of_every_rank_equal_the_chunks_the_engine_builds(model, layout):
    cfg = _config(model, layout)
    stages = plan(cfg)
    assert len(stages) == cfg.parallel.pipeline_model_parallel_size
    for stage in stages:
        for ranks in _ranks(cfg):
            chunks = _chunks(cfg, stage.pp_rank, *ranks)
            params = [p for c in chunks for p in c.parameters()]
            assert stage.params == sum(p.numel() for p in params), (stage.pp_rank, ranks)
            assert stage.expert_params == sum(p.numel() for p in params if getattr(p, "is_expert", False))
            for c, chunk in enumerate(chunks):  # the optimizer's tensors, in the chunk's order
                planned = chunk_tensors(cfg, stage.pp_rank, c)
                assert [t.numel for t in planned] == [p.numel() for p in chunk.parameters()]
                assert [t.shared_embedding for t in planned] == \
                    [getattr(p, "shared_embedding", False) for p in chunk.parameters()]
        assert param_tensors(cfg, stage.pp_rank) == sum(len(list(c.parameters())) for c in chunks)


def _built_units(layer) -> list[tuple[int, int]]:
    """FSDP2's groups of a built layer as FullyShardedDataParallel shards them."""
    experts = expert_units(layer)
    blocks = layer_units([layer])
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    routed = sum(count(u) for u in experts)
    attention, mlp = count(blocks[0]), count(blocks[1]) - routed
    return [(count(layer) - attention - mlp - routed, 0), (attention, 0), (mlp, 0)] + \
        ([(0, routed)] if experts else [])


@pytest.mark.parametrize("model,layout", _cases(["gpt2", "moe-sequential-shared-gate", "moe-grouped-biases"],
                                                [LAYOUTS[2], LAYOUTS[10], LAYOUTS[11]]))
def test_fsdp_units_are_the_built_layers_groups(model, layout):
    cfg = _config(model, layout)
    ep, etp = expert_sizes(cfg)
    tp = cfg.parallel.tensor_model_parallel_size
    for pp_rank in range(cfg.parallel.pipeline_model_parallel_size):
        for chunk in _chunks(cfg, pp_rank):
            for number, layer in chunk.decoder.layers.items():
                assert fsdp_layer_units(cfg, int(number), tp, etp, ep) == _built_units(layer), number


@pytest.mark.parametrize("model", MODELS)
def test_model_totals_and_checkpoint_keys_are_the_one_process_models(model):
    cfg = _config(model, (1, 1, 1, None, {}))
    moe = moe_settings(cfg)
    ctx = LayerContext(None, False, torch.float32, torch.device("cpu"), 1, moe=moe)
    whole = GPTModel(cfg.model, ctx)  # real tensors, no stand-ins
    params = list(whole.parameters())
    total = sum(p.numel() for p in params)
    routed = sum(p.numel() for p in params if getattr(p, "is_expert", False))
    active = total - routed + (routed * moe.moe_router_topk // moe.num_experts if moe else 0)
    assert model_params(cfg) == (total, active)
    keys = {experts_name(k) for k in whole.state_dict()}
    assert expected_keys(cfg.model, moe) == keys
    if moe is not None:
        layer = next(i for i in range(cfg.model.num_layers) if moe.is_moe_layer(i))
        assert {f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight",
                f"decoder.layers.{layer}.mlp.router.weight"} <= keys  # grouped, whatever the model's layout
        suffixes = {k.split(".", 3)[3] for k in keys if k.startswith(f"decoder.layers.{layer}.mlp.")}
        assert set(moe_keys(cfg.model, moe)) == suffixes
        assert ("mlp.router.expert_bias" in suffixes) == moe.moe_router_enable_expert_bias


@pytest.mark.parametrize("model", ["gpt2", "gpt2-untied-rmsnorm-qkbias", "moe-every-other-shared"])
def test_expected_keys_are_every_pipeline_ranks_state_dict_keys(model):
    """The checkpoint's keys, as every PP rank's VPP chunks hold them (global names), TP and EP 2:
    the expert rows of each EP rank under the checkpoint's grouped name."""
    cfg = _config(model, (2, 2, 2, 1, dict(num_layers_per_virtual_pipeline_stage=1)) if "moe" in model
                  else (2, 2, 1, None, dict(num_layers_per_virtual_pipeline_stage=1)))
    held = set()
    for pp_rank in range(2):
        for ranks in _ranks(cfg):
            for chunk in _chunks(cfg, pp_rank, *ranks):
                held |= {experts_name(k) for k in chunk.state_dict()}
    if not cfg.model.untie_embeddings_and_output_weights:
        held.discard("output_layer.weight")  # the last stage's copy of the tied embedding
    assert expected_keys(cfg.model, moe_settings(cfg)) == held


def _real_and_stand_in(rank, world, model, layout):
    """(name, shape, is_expert) of this rank's chunk built with real groups and with SizedGroups of
    the same sizes and ranks."""
    from megafab.distributed.mappings import group_rank, group_size
    from megafab.distributed.topology import build_topology
    from megafab.training.moe import moe_context_fields

    cfg = _config(model, layout)
    p = cfg.parallel
    ep, etp = expert_sizes(cfg)
    topo = build_topology(tp=p.tensor_model_parallel_size, ep=ep, etp=etp)
    groups = {k: v for k, v in moe_context_fields(cfg, topo).items() if k.endswith("_group")}
    groups["tp_group"] = topo.group("tp")
    moe = moe_settings(cfg)
    split = PipelineSplit.from_config(cfg)

    def described(fields):
        ctx = LayerContext(sequence_parallel=p.sequence_parallel, params_dtype=torch.float32,
                           device=torch.device("cpu"), seed=1, moe=moe, **fields)
        chunks = build_model_chunks(cfg.model, ctx, 1, 0, 1, split, on_meta=True)
        return [(n, tuple(q.shape), getattr(q, "is_expert", False))
                for c in chunks for n, q in c.named_parameters()]

    stand_ins = {k: SizedGroup(group_size(g), group_rank(g)) for k, g in groups.items()}
    return described(groups), described(stand_ins)


@pytest.mark.parametrize("model,layout", [("llama", (2, 1, 1, None, {})),
                                          ("moe-sequential-shared-gate", (2, 1, 2, 1, {})),
                                          ("moe-every-other-shared", (2, 1, 1, 2, {}))],
                         ids=["tp2", "tp2-ep2-etp1", "tp2-etp2"])
def test_sized_groups_build_what_real_groups_build(model, layout):
    from megafab.run.fork_ranks import run_ranks

    results = run_ranks(_real_and_stand_in, 2, model, layout, timeout=120)
    for real, stand_in in results:
        assert real == stand_in and real


def test_building_the_parts_leaves_torch_dynamo_unimported():
    """The CLI's estimate builds parts on the meta device without torch's Python meta kernels, which
    import torch._dynamo on first use (2 s of every megafab-estimate run)."""
    import pathlib
    import subprocess
    import sys

    code = ("import sys\n"
            "from tests.plan.test_planner_reads_engine import LAYOUTS, MODELS, _applies, _config\n"
            "from megafab.convert.state_dict import expected_keys\n"
            "from megafab.plan.flops import flops_per_iteration\n"
            "from megafab.plan.planner import plan\n"
            "for model in MODELS:\n"
            "    for layout in LAYOUTS[:3] + LAYOUTS[9:]:\n"
            "        if _applies(model, layout):\n"
            "            cfg = _config(model, layout)\n"
            "            plan(cfg), flops_per_iteration(cfg, 8), expected_keys(cfg.model, cfg.moe)\n"
            "assert 'torch._dynamo' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[2])


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_attention_parameters_are_megatrons_closed_form(q_lora_rank):
    """The planned parameters of an MLA model move with its shapes as megatron-core's layer holds them:
    down/up projections, latent norms (RMSNorm, --qk-layernorm) and the output projection."""
    base = _config("mla-q-lora", (1, 1, 1, None, {"q_lora_rank": q_lora_rank}))
    m = base.model
    n, h, qk, pe, v, kvr = (m.num_attention_heads, m.hidden_size, m.qk_head_dim, m.qk_pos_emb_head_dim,
                            m.v_head_dim, m.kv_lora_rank)
    q = h * n * (qk + pe) if q_lora_rank is None else q_lora_rank * (h + n * (qk + pe) + 1)
    attention = q + kvr * (h + n * (qk + v) + 1) + h * pe + n * v * h
    wider = _config("mla-q-lora", (1, 1, 1, None, {"q_lora_rank": q_lora_rank, "v_head_dim": v + 4}))
    assert model_params(wider)[0] - model_params(base)[0] == m.num_layers * 4 * n * (kvr + h)  # up_kv, proj
    layer = GPTModel(m, LayerContext(None, False, torch.float32, torch.device("cpu"), 1)).decoder.layers["0"]
    assert sum(p.numel() for p in layer.self_attention.parameters()) == attention
