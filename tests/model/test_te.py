"""Transformer Engine path: clear refusals where TE/FP8 cannot run, the local<->TE name mapping, the
TE layer's glue and FP8 regions on CPU through stand-ins for TE's modules (init, attention settings,
one fp8_autocast per model chunk with the TP x DP x CP amax group), and a TE-vs-local parity test
that runs only where transformer_engine and CUDA exist."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megafab.model.gpt import GPTModel
from megafab.model.te import (
    TransformerEngineError,
    check_transformer_engine,
    fp8_amax_group,
    local_to_te_name,
    te_available,
    te_to_local_name,
    to_local_state_dict,
    to_te_state_dict,
    transformer_engine_problems,
)
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, context, reference_model, tiny_config


@pytest.mark.parametrize("layout", [{}, {"use_torch_fsdp2": True, "dp": 2},
                                    {"use_megatron_fsdp": True, "dp": 2},
                                    {"context_parallel_size": 2, "dp": 2},
                                    {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}],
                         ids=["plain", "fsdp2", "megatron-fsdp", "cp2", "selective"])
def test_transformer_engine_on_cpu_is_refused_before_training(layout):
    """With any layout, on CPU only TE's absence is refused: one message naming the flag and the fix."""
    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, **layout)
    problems = transformer_engine_problems(cfg.model, cfg.precision, "cpu")
    assert len(problems) == 1
    want = "transformer_engine (a CUDA build; this run is on cpu), which is not installed" \
        if not te_available() else "needs a CUDA GPU but this run is on cpu"
    assert problems[0].startswith("--transformer-impl transformer_engine needs ") and want in problems[0]
    assert "use --transformer-impl local" in problems[0]
    with pytest.raises(TransformerEngineError, match="--transformer-impl transformer_engine needs"):
        check_transformer_engine(cfg.model, cfg.precision, "cpu")


def test_fp8_on_cpu_is_refused_with_the_fix():
    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid",
                      use_torch_fsdp2=True, dp=2)
    problems = transformer_engine_problems(cfg.model, cfg.precision, "cpu")
    assert len(problems) == 1 and problems[0].startswith("--fp8-format needs ")
    assert "--transformer-impl local" in problems[0] and "without --fp8-format" in problems[0]


def test_fp8_without_transformer_engine_impl_is_a_config_error():
    with pytest.raises(ValueError, match="--fp8-format needs --transformer-impl transformer_engine"):
        tiny_config(bf16=True, fp8_format="e4m3")
    # as in Megatron, FP8 needs no 16-bit model: TE's FP8 GEMMs take fp32 weights too
    assert tiny_config(transformer_impl="transformer_engine", fp8_format="e4m3").precision.params_dtype_name \
        == "float32"


def test_local_implementation_needs_nothing():
    cfg = tiny_config()
    check_transformer_engine(cfg.model, cfg.precision, "cpu")  # no error


def test_driver_refuses_te_before_any_process_group():
    from megafab.training.build import init_distributed

    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, distributed_backend="gloo")
    with pytest.raises(TransformerEngineError):
        init_distributed(cfg)
    assert not torch.distributed.is_initialized()


def test_parameter_names_map_both_ways():
    assert local_to_te_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert local_to_te_name("decoder.layers.0.pre_mlp_layernorm.bias") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"
    assert te_to_local_name("decoder.layers.0.self_attention.core_attention._extra_state") is None
    for style in ({}, LLAMA_STYLE):
        names = list(reference_model(tiny_config(**({"style": style} if style else {})).model).state_dict())
        te_names = [local_to_te_name(n) for n in names]
        assert len(set(te_names)) == len(names)
        assert [te_to_local_name(n) for n in te_names] == names
        assert "decoder.final_layernorm.weight" in te_names  # the final norm stays a separate module
    state = reference_model(tiny_config().model).state_dict()
    te_state = to_te_state_dict(state)
    te_state["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    back = to_local_state_dict(te_state)
    assert back.keys() == state.keys() and all(back[k] is state[k] for k in state)


@pytest.mark.skipif(not (te_available() and torch.cuda.is_available()),
                    reason="needs transformer_engine and a CUDA GPU (neither is on the CPU CI machine)")
def test_te_layers_equal_local_layers_on_gpu():
    device = torch.device("cuda")
    for style in ({}, LLAMA_STYLE):
        kwargs = {"style": style} if style else {}
        local_cfg = tiny_config(bf16=True, **kwargs).model
        te_cfg = tiny_config(bf16=True, transformer_impl="transformer_engine", **kwargs).model
        ctx = context(dtype=torch.float32)
        ctx.device = device
        local, te_model = GPTModel(local_cfg, ctx), GPTModel(te_cfg, ctx)
        te_model.load_state_dict(to_te_state_dict(local.state_dict()), strict=False)
        tokens = torch.randint(0, local_cfg.vocab_size, (2, local_cfg.seq_length), device=device)
        a, b = local(tokens).float(), te_model(tokens).float()
        assert (a - b).abs().max().item() < 1e-3 * a.abs().max().item()


# ---- the TE glue on CPU, through stand-ins for transformer_engine's modules -------------------------
class _FakeTE:
    """transformer_engine.pytorch / .common.recipe stand-ins with TE's constructor signatures and
    plain-PyTorch math: enough to run TETransformerLayer's own logic (q/k/v split, RoPE, residuals,
    init, the arguments it passes, where fp8_autocast is entered) without TE."""

    def __init__(self):
        self.autocasts, self.active, self.modules_in_fp8, self.checkpoints = [], [], [], []
        self.recomputing = 0
        fake = self

        class Autocast:
            def __init__(self, **kwargs):
                fake.autocasts.append(kwargs)

            def __enter__(self):
                fake.active.append(True)

            def __exit__(self, *exc):
                fake.active.pop()

        class Module(torch.nn.Module):
            def record(self):  # TE: FP8 inside fp8_autocast, or in its checkpoint's recompute phase
                fake.modules_in_fp8.append(bool(fake.active) or fake.recomputing > 0)

        class LayerNormLinear(Module):
            def __init__(self, n_in, n_out, bias, parallel_mode, eps, normalization, zero_centered_gamma,
                         tp_group, tp_size, sequence_parallel, params_dtype, device, get_rng_state_tracker):
                super().__init__()
                assert parallel_mode == "column" and not zero_centered_gamma
                self.eps, self.rms = eps, normalization == "RMSNorm"
                self.layer_norm_weight = torch.nn.Parameter(torch.ones(n_in, dtype=params_dtype))
                if not self.rms:
                    self.layer_norm_bias = torch.nn.Parameter(torch.zeros(n_in, dtype=params_dtype))
                self.weight = torch.nn.Parameter(torch.empty(n_out // tp_size, n_in, dtype=params_dtype))
                self.bias = None
                if bias:
                    self.bias = torch.nn.Parameter(torch.empty(n_out // tp_size, dtype=params_dtype))

            def forward(self, x):
                self.record()
                if self.rms:
                    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.layer_norm_weight
                else:
                    h = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
                return F.linear(h, self.weight, self.bias)

        class Linear(Module):
            def __init__(self, n_in, n_out, bias, parallel_mode, tp_group, tp_size, sequence_parallel,
                         params_dtype, device, get_rng_state_tracker):
                super().__init__()
                assert parallel_mode == "row"
                self.weight = torch.nn.Parameter(torch.empty(n_out, n_in // tp_size, dtype=params_dtype))
                self.bias = torch.nn.Parameter(torch.empty(n_out, dtype=params_dtype)) if bias else None

            def forward(self, x):
                self.record()
                return F.linear(x, self.weight, self.bias)

        class DotProductAttention(Module):
            def __init__(self, heads, kv_channels, **kwargs):
                super().__init__()
                fake.attention_kwargs = kwargs

            def forward(self, q, k, v):  # [s, b, heads | groups, d] -> [s, b, heads * d]
                self.record()
                kw = fake.attention_kwargs
                assert kw["attn_mask_type"] == "causal" and kw["qkv_format"] == "sbhd"
                q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kw["softmax_scale"],
                                                     enable_gqa=q.shape[1] != k.shape[1])
                return out.permute(2, 0, 1, 3).flatten(2)

        def checkpoint(function, *args, distribute_saved_activations, get_rng_state_tracker, tp_group,
                       use_reentrant, context_fn):
            fake.checkpoints.append(use_reentrant)
            forward, recompute = context_fn()

            class Recompute:
                def __enter__(self):
                    fake.recomputing += 1
                    recompute.__enter__()

                def __exit__(self, *exc):
                    fake.recomputing -= 1
                    return recompute.__exit__(*exc)
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                                     context_fn=lambda: (forward, Recompute()))

        pytorch = types.ModuleType("transformer_engine.pytorch")
        pytorch.fp8_autocast, pytorch.checkpoint = Autocast, checkpoint
        pytorch.LayerNormLinear, pytorch.Linear = LayerNormLinear, Linear
        pytorch.DotProductAttention = DotProductAttention
        recipe = types.ModuleType("transformer_engine.common.recipe")
        recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
        recipe.DelayedScaling = lambda **kwargs: ("DelayedScaling", kwargs)
        common = types.ModuleType("transformer_engine.common")
        common.recipe = recipe
        package = types.ModuleType("transformer_engine")
        package.pytorch, package.common = pytorch, common
        self.modules = {"transformer_engine": package, "transformer_engine.pytorch": pytorch,
                        "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}


@pytest.fixture
def fake_te(monkeypatch):
    fake = _FakeTE()
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


# gpt-oss's dense MLP: clamped quick-GEGLU (the clamp bites at this init), the +1 offset, biases
GPT_OSS_STYLE = dict(LLAMA_STYLE, swiglu=False, quick_geglu=True, activation_func_clamp_value=0.05,
                     glu_linear_offset=1.0, add_bias_linear=True)


@pytest.mark.parametrize("style", [GPT2_STYLE, LLAMA_STYLE, GPT_OSS_STYLE])
def test_te_layer_shares_init_and_attention_settings_with_the_local_layer(fake_te, style):
    """Same seed: the TE model's weights are the local model's (under TE names) and, with the
    stand-ins' plain math, so is its output (causal, 1/sqrt(d), GQA, RoPE, residuals)."""
    local_cfg = tiny_config(style=style).model
    te_cfg = tiny_config(style=style, transformer_impl="transformer_engine", bf16=True).model
    local, te_model = GPTModel(local_cfg, context()), GPTModel(te_cfg, context())
    te_state = te_model.state_dict()
    for name, value in local.state_dict().items():
        assert torch.equal(te_state[local_to_te_name(name)], value), name
    assert fake_te.attention_kwargs["softmax_scale"] == 1.0 / te_cfg.kv_channels ** 0.5
    assert fake_te.attention_kwargs["num_gqa_groups"] == te_cfg.num_query_groups
    assert "cp_group" not in fake_te.attention_kwargs  # no CP group, no TE CP arguments
    tokens = torch.randint(0, local_cfg.vocab_size, (2, local_cfg.seq_length))
    assert (local(tokens) - te_model(tokens)).abs().max() < 1e-10


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_autocast_wraps_each_model_chunk_once_with_the_amax_group(fake_te, recompute):
    extra = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1} if recompute else {}
    cfg = tiny_config(transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid", **extra)
    amax_group = object()
    ctx = context()
    ctx.precision, ctx.fp8_group = cfg.precision, amax_group
    first = GPTModel(cfg.model, ctx, 0, 2, pre_process=True, post_process=False)
    second = GPTModel(cfg.model, ctx, 2, 4, pre_process=False, post_process=True)
    tokens, labels, _ = batch(cfg.model)
    hidden = first(tokens)
    assert len(fake_te.autocasts) == 1
    second.set_input_tensor(hidden)
    loss = second(labels=labels)
    assert len(fake_te.autocasts) == 2  # one per chunk, not one per layer
    assert all(call["fp8_group"] is amax_group and call["enabled"] for call in fake_te.autocasts)
    assert fake_te.autocasts[0]["fp8_recipe"][1]["fp8_format"] == "HYBRID"
    assert len(fake_te.modules_in_fp8) == 4 * 5 and all(fake_te.modules_in_fp8)  # 4 layers x 5 modules
    loss.sum().backward()
    # full recompute runs through TE's checkpoint (one per layer), whose recompute phase keeps the
    # forward's FP8 state: no new fp8_autocast region in backward, every module re-run in FP8
    assert fake_te.checkpoints == ([False] * 4 if recompute else [])
    assert len(fake_te.autocasts) == 2
    assert len(fake_te.modules_in_fp8) == 4 * 5 * (2 if recompute else 1) and all(fake_te.modules_in_fp8)


def _amax_group_ranks(rank, world):
    from megafab.distributed.topology import build_topology

    topo = build_topology(tp=2, pp=2, cp=2)
    return torch.distributed.get_process_group_ranks(fp8_amax_group(topo))


def test_fp8_amax_group_is_the_tp_dp_cp_group():
    # 8 ranks, TP 2 x CP 2 x PP 2 (DP 1): TP fastest, then CP; PP slowest
    assert run_ranks(_amax_group_ranks, 8, timeout=60) == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
