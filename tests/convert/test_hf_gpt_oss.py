"""HF gpt-oss <-> megafab with transformers as the oracle, on tiny random models it builds offline
(alternating sliding / full layers with a window shorter than the sequence, nonzero sinks, YaRN with a
short original context, GQA with q/k/v/o biases, 4 experts top-2 with router and expert biases, a
swiglu_limit that clamps, untied embeddings): the import's logits within 1e-5 of transformers' (fp32),
8 greedy tokens equal transformers.generate's with the window crossing the prompt (KV cache on and
off), the export reproduces every tensor and loads in transformers with equal logits; each feature is
in effect; what the converter cannot reproduce is refused naming the field; the import runs at
TP 2 x EP 2 with transformers' logits."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megafab.convert import ConversionError, export_hf, import_hf
from megafab.inference.generate import SamplingParams, generate
from megafab.inference.load import model_from_state_dict
from tests.helpers.checkpoint import finetune_state, full_logits
from tests.helpers.hf_gpt_oss_tiny import LIMIT, WINDOW, hf_gpt_oss
from tests.helpers.hf_tiny import VOCAB, edit_hf_config, megafab_logits

FULL_FIRST = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
PLAIN_ROPE = dict(rope_type="default", rope_theta=5000.0)
CASES = {"gpt-oss": lambda: hf_gpt_oss(),
         "tied-rope-mqa-full-first": lambda: hf_gpt_oss(tied=True, rope=PLAIN_ROPE, num_key_value_heads=1,
                                                        layer_types=FULL_FIRST)}
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))  # > window, > 16


def _import(hf, path, **kwargs):
    hf.save_pretrained(path)
    return import_hf(str(path), **kwargs)


def _logits(sd, cfg):
    return megafab_logits(model_from_state_dict(sd, cfg), TOKENS, VOCAB)


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_generate_export_equal_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = CASES[name]()
    sd, cfg = _import(hf, tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
    model = model_from_state_dict(sd, cfg)
    err = (megafab_logits(model, TOKENS, VOCAB) - want).abs().max().item()
    assert err < 1e-5, err
    print(f"{name}: import logits vs transformers {err:.1e}")

    prompt = TOKENS[1, :12].tolist()  # longer than the window; positions 12-19 pass YaRN's original 16
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 12:].tolist()
    for cache in (True, False):
        assert generate(model, prompt, SamplingParams(max_new_tokens=8), use_kv_cache=cache) == theirs

    assert export_hf(sd, cfg, str(tmp_path / "out")) == "gpt_oss"
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    fields = ("layer_types", "sliding_window", "rope_parameters", "swiglu_limit", "swiglu_alpha", "head_dim",
              "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "intermediate_size",
              "attention_bias", "router_aux_loss_coef", "rms_norm_eps", "tie_word_embeddings")
    assert {f: written[f] for f in fields} == {f: getattr(hf.config, f) for f in fields}
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - want).abs().max().item() == 0


def test_imported_config_values(tmp_path):
    _, cfg = _import(hf_gpt_oss(), tmp_path)
    m, moe = cfg.model, cfg.moe
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type, m.kv_channels, m.num_query_groups) == \
        ((WINDOW - 1, 0), (1, 0, 1, 0), "learnable", 8, 2)
    assert (m.position_embedding_type, m.rotary_base, m.rotary_scaling_factor,
            m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow, m.mscale,
            m.mscale_all_dim, m.yarn_correction_range_round_to_int) == \
        ("yarn", 5000, 4.0, 16, 32, 1, 1, 0, False)
    assert (m.quick_geglu, m.swiglu, m.activation_func_clamp_value, m.glu_linear_offset, m.add_bias_linear,
            m.normalization, m.norm_epsilon, m.untie_embeddings_and_output_weights) == \
        (True, False, LIMIT, 1.0, True, "RMSNorm", 1e-5, True)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_layer_freq,
            moe.moe_router_score_function, moe.moe_router_pre_softmax, moe.moe_router_dtype,
            moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff) == \
        (4, 2, 12, 1, "softmax", False, "fp32", "aux_loss", 0.02)


def _zero(sd, *suffixes):
    return {k: (torch.zeros_like(v) if k.endswith(suffixes) else v) for k, v in sd.items()}


@pytest.mark.parametrize("feature", ["window", "sinks", "yarn", "clamp", "offset", "router_bias",
                                     "expert_bias", "attention_bias", "interleave"])
def test_each_feature_is_in_effect(feature, tmp_path):
    hf = hf_gpt_oss()
    sd, cfg = _import(hf, tmp_path)
    got = _logits(sd, cfg)
    m = cfg.model
    changes = {"window": dict(window_size=None, window_attn_skip_freq=None),
               "sinks": dict(softmax_type="vanilla"), "yarn": dict(position_embedding_type="rope"),
               "clamp": dict(activation_func_clamp_value=None), "offset": dict(glu_linear_offset=0.0)}
    if feature in changes:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, **changes[feature]))
    elif feature == "router_bias":
        sd = _zero(sd, "router.bias")
    elif feature == "expert_bias":
        sd = _zero(sd, "experts.linear_fc1.bias", "experts.linear_fc2.bias")
    elif feature == "attention_bias":
        sd = _zero(sd, "linear_qkv.bias", "linear_proj.bias")
    else:  # gate_up_proj's columns taken as [gate | up] halves instead of interleaved
        fc1 = {k for k in sd if k.endswith(("experts.linear_fc1.weight", "experts.linear_fc1.bias"))}
        gate_up = {k.replace("decoder.layers", "model.layers").replace("linear_fc1.weight", "gate_up_proj")
                   .replace("linear_fc1.bias", "gate_up_proj_bias"): k for k in fc1}
        hf_sd = load_file(str(tmp_path / "model.safetensors"))
        raw = {mf: hf_sd[name].transpose(1, 2) if name.endswith("proj") else hf_sd[name]
               for name, mf in gate_up.items()}
        sd = {**sd, **{k: v.contiguous() for k, v in raw.items()}}
    delta = (_logits(sd, cfg) - got).abs().max().item()
    assert delta > 1e-3, delta
    print(f"{feature} off changes the logits by {delta:.3f}")


def test_window_only_on_sliding_layers(tmp_path):
    """Positions inside the window give the same logits with and without it; past it they differ."""
    sd, cfg = _import(hf_gpt_oss(), tmp_path)
    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, window_size=None,
                                                              window_attn_skip_freq=None))
    windowed, unwindowed = _logits(sd, cfg), _logits(sd, full)
    assert torch.allclose(windowed[:, :WINDOW], unwindowed[:, :WINDOW], atol=1e-6)


def test_attention_bias_false_with_zero_biases_imports_as_disable_bias_linear(tmp_path):
    """Megatron's examples/gptoss trains with --disable-bias-linear: such a model exports with
    attention_bias false and zero expert and router biases, and imports back as it was."""
    from transformers import AutoModelForCausalLM

    hf = hf_gpt_oss(attention_bias=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            for bias in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias,
                         layer.mlp.experts.down_proj_bias):
                bias.zero_()
        want = hf(TOKENS).logits
    sd, cfg = _import(hf, tmp_path / "hf")
    assert not cfg.model.add_bias_linear and not any(k.endswith("bias") for k in sd)
    assert (_logits(sd, cfg) - want).abs().max().item() < 1e-5
    export_hf(sd, cfg, str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attention_bias"] is False
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - want).abs().max().item() == 0


def test_attention_bias_false_with_expert_biases_is_refused(tmp_path):
    hf_gpt_oss(attention_bias=False).save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match="attention_bias false with a nonzero model.layers.0.mlp") as e:
        import_hf(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes,field", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5"),
    ({"swiglu_limit": None}, "swiglu_limit None"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]},
     "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window 0"),
    ({"rope_parameters": {"rope_type": "dynamic"}}, "'dynamic'"),
    ({"rope_parameters": {"attention_factor": 0.5}}, "attention_factor=0.5"),
    ({"rope_parameters": {"mscale": 0.0, "mscale_all_dim": 0.7}}, "mscale 0.0 with mscale_all_dim"),
])
def test_config_values_not_reproduced_are_refused_by_name(changes, field, tmp_path):
    hf_gpt_oss().save_pretrained(tmp_path)
    edit_hf_config(tmp_path, **changes)
    with pytest.raises(ConversionError, match=field) as e:
        import_hf(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("section,changes,flag", [
    ("model", {"glu_linear_offset": 0.0}, "--glu-linear-offset 0.0"),
    ("model", {"activation_func_clamp_value": None}, "no --activation-func-clamp-value"),
    ("model", {"qk_layernorm": True}, "--qk-layernorm"),
    ("model", {"add_bias_linear": False, "add_qkv_bias": True}, "--add-qkv-bias with --disable-bias-linear"),
    ("model", {"rotary_percent": 0.5, "position_embedding_type": "rope"}, "--rotary-percent 0.5"),
    ("moe", {"moe_router_pre_softmax": True}, "--moe-router-pre-softmax True"),
    ("moe", {"moe_layer_freq": (0, 1, 1, 1)}, "--moe-layer-freq"),
    ("moe", {"moe_router_topk_scaling_factor": 2.0}, "--moe-router-topk-scaling-factor 2.0"),
])
def test_exports_that_hf_cannot_hold_are_refused_by_name(section, changes, flag, tmp_path):
    sd, cfg = _import(hf_gpt_oss(), tmp_path / "hf")
    bad = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
    with pytest.raises(ConversionError, match=flag) as e:
        export_hf(sd, bad, str(tmp_path / "out"))
    assert "\n" not in str(e.value)


def _tp2_ep2_logits(rank, world, flat, load_dir):
    state = finetune_state(flat, world, load_dir, tp=2, ep=2, sequence_parallel=True, seq_length=24,
                           expert_tensor_parallel_size=1)  # Megatron: biased experts are not split
    with torch.no_grad():
        return full_logits(state, TOKENS)


def test_import_runs_at_tp2_ep2_with_transformers_logits(tmp_path):
    """import_hf padded for TP 2 -> torch_dist -> four gloo ranks at TP 2 (+SP) x EP 2 load it with
    --finetune (sinks sharded by head, two whole experts per EP rank at ETP 1): every rank's logits
    equal transformers' within 1e-5."""
    from megafab.convert import write_checkpoint
    from megafab.run.fork_ranks import run_ranks

    hf = hf_gpt_oss()
    sd, cfg = _import(hf, tmp_path / "hf", tp=2, make_vocab_size_divisible_by=8)
    write_checkpoint(str(tmp_path / "imported"), sd, cfg)
    with torch.no_grad():
        want = hf(TOKENS).logits
    logits = run_ranks(_tp2_ep2_logits, 4, cfg.to_flat(), str(tmp_path / "imported"), timeout=180)
    errors = [(out[..., :VOCAB] - want).abs().max().item() for out in logits]
    assert max(errors) < 1e-5, errors
    print(f"TP 2 x EP 2 logits vs transformers: {max(errors):.1e}")


def test_model_flags_file_reads_back_the_windows(tmp_path):
    """model_flags.toml writes --window-size and the per-layer pattern as lists; --config reads them
    back as the flags would (pretrain_gpt.py --config model_flags.toml of continued pretraining)."""
    from megafab.arguments import config_from_args
    from megafab.convert.model_flags import write_model_flags

    _, cfg = _import(hf_gpt_oss(), tmp_path / "hf")
    path = write_model_flags(cfg, str(tmp_path), "test")
    run = config_from_args(["--config", path, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                            "--mock-data", "--seq-length", "24"], world_size=1)
    m = run.model
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type, m.position_embedding_type) == \
        ((WINDOW - 1, 0), (1, 0, 1, 0), "learnable", "yarn")


def test_convert_cli_legacy_ep2_generates_as_transformers(tmp_path, capsys):
    """megafab-convert: HF -> legacy torch files at EP 2 (TP 1: biased experts stay whole) ->
    megafab-generate's greedy ids equal transformers.generate's; legacy files at TP 2 (experts split
    at ETP = TP) are refused naming the fix."""
    import os

    from megafab.cli.convert import main as convert
    from megafab.cli.generate import main as megafab_generate
    from megafab.convert import write_checkpoint

    hf = hf_gpt_oss()
    hf.save_pretrained(tmp_path / "hf")
    legacy = str(tmp_path / "torch_ep2")
    assert convert(["convert", "--hf-dir", str(tmp_path / "hf"), "--save-dir", legacy, "--saver", "torch",
                    "--target-expert-parallel-size", "2", "--make-vocab-size-divisible-by", "8"]) == 0
    assert len(os.listdir(os.path.join(legacy, "iter_0000000"))) == 2  # one file per EP rank
    prompt = TOKENS[1, :12].tolist()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 12:].tolist()
    capsys.readouterr()
    assert megafab_generate(["--load", legacy, "--prompt", " ".join(map(str, prompt)), "--greedy",
                             "--max-new-tokens", "8", "--eod", "-1", "--print-ids"]) == 0
    ids = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ids: ")][0]
    assert [int(t) for t in ids[5:].split()] == theirs
    sd, cfg = import_hf(str(tmp_path / "hf"), tp=2)
    with pytest.raises(ConversionError, match="--expert-tensor-parallel-size 1; write torch_dist"):
        write_checkpoint(str(tmp_path / "torch_tp2"), sd, cfg, ckpt_format="torch")
