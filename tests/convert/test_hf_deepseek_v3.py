"""HF DeepSeek-V3 <-> megafab with transformers as the oracle, on tiny random models it builds offline
(multi-latent attention with and without a query LoRA, YaRN with a short original context and
mscale_all_dim, rotate-half and interleaved RoPE, sigmoid group-limited routing with a nonzero
correction bias, routed scaling, shared experts, a dense first layer): the import's logits within
1e-5 of transformers' (fp32), 8 greedy tokens equal transformers.generate's (KV cache on and off),
the export reproduces every tensor and loads in transformers with equal logits; each feature is in
effect; an MTP layer exports as DeepSeek's layer num_hidden_layers, which transformers' MtpModel
reads and computes as megafab does; what the converter cannot reproduce is refused naming the field."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megafab.convert import ConversionError, export_hf, import_hf
from megafab.inference.generate import SamplingParams, generate
from megafab.inference.load import model_from_state_dict
from megafab.model.mtp import roll_left
from tests.helpers.checkpoint import finetune_state, full_logits
from tests.helpers.hf_deepseek_tiny import hf_deepseek_v3, with_mtp
from tests.helpers.hf_tiny import VOCAB, edit_hf_config, megafab_logits

PLAIN_ROPE = dict(rope_type="default", rope_theta=5000.0)
CASES = {"yarn-qlora": lambda: hf_deepseek_v3(),
         "yarn-no-qlora": lambda: hf_deepseek_v3(q_lora_rank=None),
         "yarn-rotate-half": lambda: hf_deepseek_v3(rope_interleave=False),
         "rope-tied-top1-ungrouped": lambda: hf_deepseek_v3(rope=PLAIN_ROPE, tied=True, num_experts_per_tok=1,
                                                            norm_topk_prob=False, n_group=1, topk_group=1)}
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))  # 40 > original 16


def _import(hf, path, **kwargs):
    hf.save_pretrained(path)
    return import_hf(str(path), **kwargs)


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

    prompt = TOKENS[0, :20].tolist()  # positions 20-27: past YaRN's original context of 16
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 20:].tolist()
    for cache in (True, False):
        assert generate(model, prompt, SamplingParams(max_new_tokens=8), use_kv_cache=cache) == theirs

    assert export_hf(sd, cfg, str(tmp_path / "out")) == "deepseek_v3"
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    if hf.config.rope_interleave:  # rotate-half exports interleaved: its pe rows are reordered
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "n_group", "topk_group", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
              "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size",
              "tie_word_embeddings")
    assert {f: written[f] for f in fields} == {f: getattr(hf.config, f) for f in fields}
    yarn = "factor" in hf.config.rope_parameters  # the export also writes YaRN's default truncate
    assert written["rope_parameters"] == {**hf.config.rope_parameters, **({"truncate": True} if yarn else {})}
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        err = (reloaded(TOKENS).logits - want).abs().max().item()
    assert err == 0 if hf.config.rope_interleave else err < 1e-5


def _logits(sd, cfg):
    return megafab_logits(model_from_state_dict(sd, cfg), TOKENS, VOCAB)


@pytest.mark.parametrize("feature", ["yarn", "mscale_all_dim", "expert_bias", "groups", "scaling", "shared",
                                     "rotate_half"])
def test_each_feature_is_in_effect(feature, tmp_path):
    hf = hf_deepseek_v3(rope_interleave=feature != "rotate_half")
    sd, cfg = _import(hf, tmp_path)
    got = _logits(sd, cfg)
    m, moe = cfg.model, cfg.moe
    if feature == "yarn":
        plain = dataclasses.replace(m, rope_type="rope", rotary_scaling_factor=1.0)
        cfg = dataclasses.replace(cfg, model=plain)
    elif feature == "mscale_all_dim":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, mscale_all_dim=0.0))
    elif feature == "expert_bias":
        sd = {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in sd.items()}
    elif feature == "groups":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(moe, moe_router_num_groups=None,
                                                               moe_router_group_topk=None))
    elif feature == "scaling":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(moe, moe_router_topk_scaling_factor=None))
    elif feature == "shared":
        sd = {k: (torch.zeros_like(v) if "shared_experts.linear_fc2" in k else v) for k, v in sd.items()}
    else:  # rotate-half's pe rows taken as they are stored, not interleaved from their halves
        edit_hf_config(tmp_path, rope_interleave=True)
        sd, _ = import_hf(str(tmp_path))
    delta = (_logits(sd, cfg) - got).abs().max().item()
    assert delta > 1e-3, delta
    print(f"{feature} off changes the logits by {delta:.3f}")


def test_imported_config_values(tmp_path):
    _, cfg = _import(hf_deepseek_v3(), tmp_path)
    m, moe = cfg.model, cfg.moe
    assert (m.multi_latent_attention, m.qk_layernorm, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim,
            m.qk_pos_emb_head_dim, m.v_head_dim, m.norm_epsilon) == (True, True, 24, 16, 16, 8, 12, 1e-6)
    assert (m.rope_type, m.rotary_base, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast, m.yarn_beta_slow, m.mscale, m.mscale_all_dim) == \
        ("yarn", 5000, 4.0, 16, 32, 1, 0.9, 0.7)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size,
            moe.moe_shared_expert_intermediate_size, tuple(moe.moe_layer_freq)) == (8, 4, 12, 24, (0, 1, 1))
    assert (moe.moe_router_score_function, moe.moe_router_enable_expert_bias, moe.moe_router_num_groups,
            moe.moe_router_group_topk, moe.moe_router_topk_scaling_factor, moe.moe_router_dtype) == \
        ("sigmoid", True, 4, 2, 2.5, "fp32")


def _megafab_mtp_logits(model, tokens):
    """Depth 1's logits [b, s, V] of megafab's MTP (model/mtp.py's path without the loss)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        x = model.embedding(tokens, positions)
        angles = model.rotary(positions, torch.float32)
        for layer in model.decoder.layers.values():
            x = layer(x, angles, None)
        hidden = model.decoder.final_layernorm(x)  # [s, b, h]
        depth1 = model.mtp.layers["0"](hidden, model.embedding(roll_left(tokens), positions), angles, None)
        return hidden, model.logits(depth1).transpose(0, 1)[..., :VOCAB]


def test_mtp_exports_as_deepseek_layer_that_transformers_mtp_reads(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    hf = hf_deepseek_v3()
    sd, cfg = with_mtp(*_import(hf, tmp_path / "hf"))
    model = model_from_state_dict(sd, cfg)
    export_hf(sd, cfg, str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    mtp_keys = {k[len("model.layers.3."):] for k in exported if k.startswith("model.layers.3.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
            "mlp.gate.e_score_correction_bias"} <= mtp_keys
    main = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    with torch.no_grad():
        assert (main(TOKENS).logits - hf(TOKENS).logits).abs().max().item() == 0  # the MTP layer is left out
    # transformers' pattern names DeepSeek's layer 61; this tiny model's MTP layer is layer 3
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    hidden, ours = _megafab_mtp_logits(model, TOKENS)
    positions = torch.arange(1, TOKENS.shape[1]).expand(TOKENS.shape[0], -1)
    with torch.no_grad():
        out = mtp.forward_layer(0, hidden.transpose(0, 1)[:, :-1], positions, None, input_ids=TOKENS[:, 1:])
        theirs = mtp._project_to_logits(out)
    err = (ours[:, :-1] - theirs).abs().max().item()
    assert err < 1e-5, err
    print(f"MTP depth-1 logits vs transformers' MtpModel: {err:.1e}")
    sd_back, cfg_back = import_hf(str(tmp_path / "out"))  # the import leaves the MTP layer out
    assert cfg_back.model.mtp_num_layers is None and not any(k.startswith("mtp.") for k in sd_back)


@pytest.mark.parametrize("changes,field", [
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"topk_group": 1}, "n_group 4, topk_group 1"),
    ({"norm_topk_prob": False}, "norm_topk_prob False"),
    ({"rope_parameters": {"mscale": 0.0}}, "mscale 0.0 with mscale_all_dim"),
    ({"rope_parameters": {"attention_factor": 0.5}}, "attention_factor=0.5"),
    ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3'"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"num_key_value_heads": 2}, "num_key_value_heads 2"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_config_values_not_reproduced_are_refused_by_name(changes, field, tmp_path):
    hf_deepseek_v3().save_pretrained(tmp_path)
    edit_hf_config(tmp_path, **changes)
    with pytest.raises(ConversionError, match=field) as e:
        import_hf(str(tmp_path))
    assert "\n" not in str(e.value)


def test_exports_that_hf_cannot_hold_are_refused_by_name(tmp_path):
    sd, cfg = _import(hf_deepseek_v3(), tmp_path / "hf")
    for moe_change, flag in (
            ({"moe_router_score_function": "softmax"}, "--moe-router-score-function softmax"),
            ({"moe_router_group_topk": 1}, "n_group 4, topk_group 1"),
            ({"moe_shared_expert_intermediate_size": 20}, "--moe-shared-expert-intermediate-size 20")):
        bad = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe_change))
        with pytest.raises(ConversionError, match=flag):
            export_hf(sd, bad, str(tmp_path / "out"))
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mscale_all_dim=0.0))
    with pytest.raises(ConversionError, match="--mscale 0.9 with --mscale-all-dim 0.0"):
        export_hf(sd, bad, str(tmp_path / "out"))


def _tp2_ep2_logits(rank, world, flat, load_dir):
    state = finetune_state(flat, world, load_dir, tp=2, ep=2, sequence_parallel=True, seq_length=40)
    with torch.no_grad():
        return full_logits(state, TOKENS)


def test_import_runs_at_tp2_ep2_with_transformers_logits(tmp_path):
    """import_hf padded for TP 2 -> torch_dist -> four gloo ranks at TP 2 (+SP) x EP 2 load it with
    --finetune: every rank's logits equal transformers' within 1e-5."""
    from megafab.convert import write_checkpoint
    from megafab.run.fork_ranks import run_ranks

    hf = hf_deepseek_v3()
    sd, cfg = _import(hf, tmp_path / "hf", tp=2, make_vocab_size_divisible_by=8)
    write_checkpoint(str(tmp_path / "imported"), sd, cfg)
    with torch.no_grad():
        want = hf(TOKENS).logits
    logits = run_ranks(_tp2_ep2_logits, 4, cfg.to_flat(), str(tmp_path / "imported"), timeout=180)
    errors = [(out[..., :VOCAB] - want).abs().max().item() for out in logits]
    assert max(errors) < 1e-5, errors
    print(f"TP 2 x EP 2 logits vs transformers: {max(errors):.1e}")


def test_convert_cli_hf_to_legacy_tp2_ep2_and_back(tmp_path, capsys):
    """megafab-convert: HF -> legacy torch files at TP 2 x EP 2 -> HF: the files are split four ways,
    load_model's logits equal transformers', megafab-generate's greedy ids transformers.generate's,
    and the final HF directory holds the original tensors."""
    import os

    from megafab.cli.convert import main as convert
    from megafab.cli.generate import main as megafab_generate
    from megafab.inference.load import load_model

    hf = hf_deepseek_v3()
    hf.save_pretrained(tmp_path / "hf")
    legacy, back = str(tmp_path / "torch22"), str(tmp_path / "hf2")
    assert convert(["convert", "--hf-dir", str(tmp_path / "hf"), "--save-dir", legacy, "--saver", "torch",
                    "--target-tensor-parallel-size", "2", "--target-expert-parallel-size", "2",
                    "--make-vocab-size-divisible-by", "8"]) == 0
    assert len(os.listdir(os.path.join(legacy, "iter_0000000"))) == 4  # TP rank x EP rank files
    assert convert(["convert", "--load-dir", legacy, "--save-dir", back, "--saver", "hf"]) == 0
    model, cfg = load_model(legacy)
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (megafab_logits(model, TOKENS, VOCAB) - want).abs().max().item() < 1e-5
    prompt = TOKENS[1, :20].tolist()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 20:].tolist()
    capsys.readouterr()
    assert megafab_generate(["--load", legacy, "--prompt", " ".join(map(str, prompt)), "--greedy",
                             "--max-new-tokens", "8", "--eod", "-1", "--print-ids"]) == 0
    ids = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ids: ")][0]
    assert [int(t) for t in ids[5:].split()] == theirs
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (tmp_path / "hf", back))
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_bf16_export_and_import_keep_the_correction_bias_float32(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = hf_deepseek_v3()
    sd, cfg = _import(hf, tmp_path / "hf")
    export_hf(sd, cfg, str(tmp_path / "out"), dtype=torch.bfloat16)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert exported[bias].dtype == torch.float32 and torch.equal(exported[bias], sd[bias.replace(
        "model.layers", "decoder.layers").replace("gate.e_score_correction_bias", "router.expert_bias")])
    assert exported["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    back, _ = import_hf(str(tmp_path / "out"), dtype=torch.bfloat16)
    assert back["decoder.layers.2.mlp.router.expert_bias"].dtype == torch.float32
    assert back["decoder.layers.2.mlp.router.weight"].dtype == torch.bfloat16


def test_layernorm_1p_model_exports_plain_norms(tmp_path):
    """A model trained with --apply-layernorm-1p stores every norm minus one, the latent norms and the
    MTP norms too: it computes transformers' logits and exports the original tensors."""
    hf = hf_deepseek_v3()
    sd, cfg = with_mtp(*_import(hf, tmp_path / "hf"))
    norms = [k for k in sd if k.endswith(("layernorm.weight", "enorm.weight", "hnorm.weight"))]
    assert any("kv_layernorm" in k for k in norms) and any(k.endswith("hnorm.weight") for k in norms)
    export_hf(sd, cfg, str(tmp_path / "plain"))
    cfg.model.apply_layernorm_1p = True
    sd_1p = {k: (v - 1 if k in norms else v) for k, v in sd.items()}
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (_logits(sd_1p, cfg) - want).abs().max().item() < 1e-5
    export_hf(sd_1p, cfg, str(tmp_path / "out"))
    plain, exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plain", "out"))
    assert plain.keys() == exported.keys()
    assert all(torch.allclose(plain[k], exported[k], rtol=0, atol=1e-6) for k in plain)
