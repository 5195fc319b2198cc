"""Megatron torch_dist checkpoints of a GPT with multi-token prediction, megatron-core 0.16.1 as the
oracle (fp32): its dist_checkpointing.save of a GPTModel with an MTP block loads into megafab at PP 2
(mtp.layers.* and the last stage's copy of the word embedding included) with every tensor equal,
and megafab's save at PP 2 loads into megatron-core (strict: every key it asks for) with megafab's
values."""

import dataclasses

import torch

from megafab.checkpoint import checkpointing
from megafab.checkpoint.state import named_parameters
from megafab.run.fork_ranks import run_ranks
from tests.helpers import mcore
from tests.helpers.checkpoint import make_state, perturb
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

DEPTHS = 2
TIED = dict(LLAMA_STYLE, untie_embeddings_and_output_weights=False)


def _mcore_mtp_model(m, seed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = dataclasses.replace(mcore.transformer_config(m), mtp_num_layers=DEPTHS)
    spec = get_gpt_layer_local_spec(normalization=m.normalization)
    torch.manual_seed(seed)
    model = GPTModel(config, spec, vocab_size=m.padded_vocab_size,
                     max_sequence_length=m.max_position_embeddings, parallel_output=False,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                     position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent,
                     rotary_base=m.rotary_base,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _mcore_save(rank, world, style, root):
    mcore.init_parallel(tp=1)
    m = tiny_config(style=style, mtp_num_layers=DEPTHS).model
    model = _mcore_mtp_model(m, seed=7)
    common = {"args": mcore.megatron_args(m, 1, 1, mtp_num_layers=DEPTHS), "iteration": 10,
              "checkpoint_version": 3.0}
    mcore.save(model, root, common=common)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _megafab(rank, world, style, root, save: bool):
    where = {"save": root} if save else {"load": root, "finetune": True}
    state = make_state(tp=1, dp=1, pp=2, dist_opt=False, style=style, dtype=torch.float32,
                       mtp_num_layers=DEPTHS, **where)
    if save:
        perturb(state)
        checkpointing.save_checkpoint(state)
    else:
        assert checkpointing.load_checkpoint(state) == 10
    return {n: p.detach().clone() for n, p in named_parameters(state)}


def _mcore_load(rank, world, style, path):
    mcore.init_parallel(tp=1)
    model = _mcore_mtp_model(tiny_config(style=style, mtp_num_layers=DEPTHS).model, seed=99)
    mcore.load(model, path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_megatron_core_mtp_checkpoint_loads_into_megafab_at_pp2(tmp_path):
    root = str(tmp_path / "mcore")
    theirs = run_ranks(_mcore_save, 1, LLAMA_STYLE, root, timeout=240)[0]
    first, last = run_ranks(_megafab, 2, LLAMA_STYLE, root, False, timeout=240)
    assert "mtp.layers.1.eh_proj.weight" in last and "embedding.word_embeddings.weight" in last
    assert first.keys() | last.keys() == theirs.keys()
    for ours in (first, last):
        for name, value in ours.items():
            assert torch.equal(value, theirs[name]), name


def test_megafab_mtp_checkpoint_at_pp2_loads_into_megatron_core(tmp_path):
    root = str(tmp_path / "megafab")
    first, last = run_ranks(_megafab, 2, TIED, root, True, timeout=240)
    theirs = run_ranks(_mcore_load, 1, TIED, str(tmp_path / "megafab" / "iter_0000000"), timeout=240)[0]
    assert theirs.keys() == first.keys() | last.keys()
    for name, value in {**first, **last}.items():
        assert torch.equal(theirs[name], value), name
