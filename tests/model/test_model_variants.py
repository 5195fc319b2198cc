"""Model variants of real checkpoints (--qk-layernorm, --squared-relu, --openai-gelu,
--apply-residual-connection-post-layernorm, --apply-layernorm-1p) in float64: one layer equals
megatron-core 0.16.1's TransformerLayer (the post-norm residual, which megatron-core ignores, is
checked against the legacy definition), 1p equals the norm with weight + 1, and TP x SP keeps the
single-process math (the q/k norm weights see only their rank's heads)."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from megafab.distributed.finalize_grads import finalize_model_grads
from megafab.distributed.topology import build_topology
from megafab.model.activations import openai_gelu
from megafab.model.gpt import GPTModel, masked_mean_loss
from megafab.model.transformer import TransformerLayer, build_norm
from megafab.run.fork_ranks import run_ranks
from tests.helpers.tiny import (
    GPT2_STYLE,
    LLAMA_STYLE,
    batch,
    context,
    full_grad,
    reference_model,
    tiny_config,
)

VARIANTS = {
    "plain": dict(),
    "qk_layernorm": dict(qk_layernorm=True),
    "qk_rmsnorm": dict(qk_layernorm=True, normalization="RMSNorm"),
    "squared_relu": dict(squared_relu=True),
    "openai_gelu": dict(openai_gelu=True),
}


@pytest.fixture
def megatron_cpu():
    """megatron-core's layers on CPU in this process. Workarounds (tests only): its attention asks
    CUDA for a scratch buffer and an RNG tracker, so those are swapped for CPU ones (and the causal
    mask is passed explicitly); a 1-process gloo group backs its parallel_state."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)

    class NoFork:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    patch = pytest.MonkeyPatch()
    patch.setattr(dot_product_attention.parallel_state, "get_global_memory_buffer", CpuBuffer)
    patch.setattr(dot_product_attention.tensor_parallel, "get_cuda_rng_tracker", NoFork)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()  # the harness forks later tests from this process
    patch.undo()


def _megatron_layer(flat: dict):
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu as megatron_openai_gelu

    activation = squared_relu if flat.get("squared_relu") else \
        megatron_openai_gelu if flat.get("openai_gelu") else F.gelu
    normalization = flat.get("normalization", "LayerNorm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
            use_cpu_initialization=True, params_dtype=torch.float64, gradient_accumulation_fusion=False,
            hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, normalization=normalization, activation_func=activation,
            qk_layernorm=flat.get("qk_layernorm", False))
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=normalization)
        return build_module(spec, config=config, layer_number=1).double()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_equals_megatron_core(variant, megatron_cpu):
    flat = VARIANTS[variant]
    cfg = tiny_config(num_layers=2, **flat).model
    ours = TransformerLayer(cfg, context(), 0)
    with torch.no_grad():  # non-trivial norms, so that q/k norms and residual order matter
        for name, p in ours.named_parameters():
            if "layernorm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    theirs = _megatron_layer(flat)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

    x = torch.randn(16, 2, 32, dtype=torch.float64)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours = ours(x_ours)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    out_theirs, _ = theirs(x_theirs, attention_mask=causal)
    assert (out_ours - out_theirs).abs().max() < 1e-12
    grad = torch.randn_like(out_ours)
    out_ours.backward(grad)
    out_theirs.backward(grad)
    assert (x_ours.grad - x_theirs.grad).abs().max() < 1e-12
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs_params[name].grad).abs().max() < 1e-12, name
    if flat.get("qk_layernorm"):
        qk = {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
        assert qk <= theirs_params.keys()


def test_residual_post_layernorm_takes_the_residual_from_the_norm_output():
    # megatron-core 0.16.1 parses this flag but never reads it; Megatron's legacy
    # ParallelTransformerLayer defined it: residual = norm(x) for both sublayers.
    cfg = tiny_config(apply_residual_connection_post_layernorm=True).model
    layer = TransformerLayer(cfg, context(), 0)
    x = torch.randn(16, 2, 32, dtype=torch.float64)
    n1 = layer.input_layernorm(x)
    h = n1 + layer.self_attention(n1)
    n2 = layer.pre_mlp_layernorm(h)
    expected = n2 + layer.mlp(n2)
    assert (layer(x) - expected).abs().max() < 1e-14
    default = TransformerLayer(tiny_config().model, context(), 0)
    default.load_state_dict(layer.state_dict())
    assert (default(x) - expected).abs().max() > 1e-3


def test_openai_gelu_is_the_tanh_approximation():
    from megatron.core.transformer.utils import openai_gelu as megatron_openai_gelu

    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    assert (openai_gelu(x) - megatron_openai_gelu(x)).abs().max() < 1e-15
    assert (openai_gelu(x) - F.gelu(x)).abs().max() > 1e-4  # not the erf GELU


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_equals_the_norm_with_weight_plus_one(normalization):
    style = dict(GPT2_STYLE if normalization == "LayerNorm" else LLAMA_STYLE, qk_layernorm=True)
    one_p = tiny_config(style=style, apply_layernorm_1p=True).model
    plain = tiny_config(style=style).model
    norm = build_norm(one_p, context())
    assert torch.equal(norm.weight, torch.zeros_like(norm.weight))  # zero-centered init
    model_1p, model = reference_model(one_p), reference_model(plain)
    with torch.no_grad():
        for (name, p_1p), (_, p) in zip(model_1p.named_parameters(), model.named_parameters()):
            if "layernorm" in name and name.endswith("weight"):
                p_1p.normal_(0.0, 0.2)
                p.copy_(p_1p + 1.0)
            else:
                p.copy_(p_1p)
    tokens, labels, mask = batch(plain)
    loss_1p = masked_mean_loss(model_1p(tokens, labels=labels), mask)
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    assert abs(loss_1p.item() - loss.item()) < 1e-12
    loss_1p.backward()
    loss.backward()
    norms = 0
    for (name, p_1p), (_, p) in zip(model_1p.named_parameters(), model.named_parameters()):
        assert (p_1p.grad - p.grad).abs().max() < 1e-12, name  # d/dw (w + 1) = 1
        norms += "layernorm" in name
    assert norms >= 4 * 2 + 1  # input, pre-MLP, q and k norms of every layer, and the final norm


def _qk_layernorm_tp(rank, world):
    topo = build_topology(tp=world)
    out = []
    for style in (GPT2_STYLE, LLAMA_STYLE):
        cfg = tiny_config(tp=world, style=dict(style, qk_layernorm=True, apply_layernorm_1p=True)).model
        tokens, labels, mask = batch(cfg)
        ref = reference_model(cfg)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        masked_mean_loss(ref(tokens, labels=labels), mask).backward()
        ref_params = dict(ref.named_parameters())
        for sp in (False, True):
            model = GPTModel(cfg, context(topo.group("tp"), sp))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "q_layernorm" in name or "k_layernorm" in name:
                        p.copy_(ref_params[name])
            masked_mean_loss(model(tokens, labels=labels), mask).backward()
            finalize_model_grads([model], topology=topo, sequence_parallel=sp)
            for name, p in model.named_parameters():
                err = (full_grad(p, topo.group("tp")) - ref_params[name].grad).abs().max().item()
                assert err < 1e-10, (sp, name, err)
            out.append(sum("q_layernorm" in n for n, _ in model.named_parameters()))
    return out


def test_qk_layernorm_under_tp_and_sp_equals_one_process():
    # the q/k norm grads are summed over TP by finalize_model_grads, with and without SP
    # q_layernorm weight (+ bias with LayerNorm) in each of the 4 layers, GPT-2 and Llama style
    assert run_ranks(_qk_layernorm_tp, 2, timeout=120)[0] == [8, 8, 4, 4]
