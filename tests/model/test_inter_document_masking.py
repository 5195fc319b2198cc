"""--dataloader-inter-document-masking in the model: megafab's document mask equals megatron-core
0.16.1 fed as Megatron-LM HEAD's pretrain_gpt.py feeds it (the micro-batch flattened to one packed
sequence, PackedSeqParams(qkv_format="thd") from the merged cu_seqlens, its own THD RoPE with positions
restarting in each document), float64 within 1e-12 in the per-token loss and every gradient.
megatron-core's local DotProductAttention takes no PackedSeqParams (THD runs in Transformer Engine's
varlen kernels, absent on CPU), so the test gives it the mask TE's "padding_causal" THD attention
computes: causal within each cu_seqlens segment. No attention crosses an end of document: perturbing
a document's tokens leaves every other document's outputs unchanged (plain causal attention changes
them). The rules: p2p CP and MTP refused, --attention-backend flash on CUDA refused, --reset-* no-effect."""

from __future__ import annotations

import pytest
import torch

from megafab.arguments import config_from_args
from megafab.config.core import ConfigError
from megafab.data.packed_documents import attach_document_mask, document_ids
from megafab.model.attention_backend import attention_backend_problems
from megafab.model.gpt import masked_mean_loss
from tests.helpers import mcore
from tests.helpers.flags import BASE
from tests.helpers.mcore_moe import megatron_moe_on_cpu
from tests.helpers.mcore_mtp import exact_cross_entropy
from tests.helpers.packed_documents import packed_batch
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, reference_model, tiny_config

STYLES = {"rope": dict(LLAMA_STYLE, rotary_percent=1.0, num_layers=2, seq_length=32),
          "learned_absolute": dict(GPT2_STYLE, num_layers=2, seq_length=32)}


@pytest.fixture(scope="module")
def megatron_cpu():
    with megatron_moe_on_cpu():
        yield


def packed(m, micro_batch=2, seed=0):
    tokens, labels, mask = batch(m, micro_batch=micro_batch, seed=seed)
    return dict(tokens=tokens, labels=labels, loss_mask=mask, **packed_batch(m.seq_length, micro_batch, seed))


def merged_cu_seqlens(cu: torch.Tensor, s: int) -> torch.Tensor:
    """Megatron-LM HEAD's _merge_cu_seqlens_across_micro_batch: each row's padding stripped, row i
    offset by i * s, the rows joined (one leading zero)."""
    rows = [row[: int((row == s).nonzero()[0]) + 1] for row in cu]
    return torch.cat([rows[0]] + [r[1:] + i * s for i, r in enumerate(rows) if i > 0])


def thd_as_mask(forward):
    """megatron-core's DotProductAttention.forward taking PackedSeqParams as TE's THD attention does."""
    def wrapped(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q
            t = query.shape[0]
            docs = torch.searchsorted(cu[1:].long(), torch.arange(t), right=True)
            allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (docs[:, None] == docs[None, :])
            attention_mask = ~allowed[None, None]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # [t, 1, n, d]
        return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
    return wrapped


@pytest.mark.parametrize("style", STYLES)
def test_equals_megatron_core_fed_as_megatron_lm_head_feeds_it(megatron_cpu, monkeypatch, style):
    from megatron.core import tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    m = tiny_config(style=STYLES[style]).model
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy", exact_cross_entropy)
    monkeypatch.setattr(DotProductAttention, "forward", thd_as_mask(DotProductAttention.forward))
    theirs = mcore.gpt_model(m, dtype=torch.float64).double().train()
    if m.position_embedding_type == "rope":  # megatron-core's frequencies are float32: give it float64 ones
        channels = torch.arange(0, m.kv_channels, 2, dtype=torch.float64)
        theirs.rotary_pos_emb.inv_freq = 1.0 / (m.rotary_base ** (channels / m.kv_channels))
    ours = reference_model(m)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            params[name].copy_(p)
    mb = packed(m)
    b, s = mb["tokens"].shape
    cu = merged_cu_seqlens(mb["cu_seqlens"], s)
    max_seqlen = int(mb["max_seqlen"].max())
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                          max_seqlen_kv=max_seqlen)
    ref = theirs(mb["tokens"].reshape(1, -1), mb["position_ids"].reshape(1, -1), None,
                 labels=mb["labels"].reshape(1, -1), packed_seq_params=thd).view(b, s)
    masked_mean_loss(ref, mb["loss_mask"]).backward()
    fed = attach_document_mask(mb)
    loss = ours(fed["tokens"], fed["position_ids"], labels=fed["labels"],
                attention_mask=fed["attention_mask"])
    masked_mean_loss(loss, mb["loss_mask"]).backward()
    assert (ref - loss).abs().max().item() < 1e-12
    for name, p in theirs.named_parameters():
        assert (p.grad - params[name].grad).abs().max().item() < 1e-12, name
    with torch.no_grad():  # the masking is in effect: plain causal attention computes otherwise
        assert (ours(mb["tokens"], labels=mb["labels"]) - loss).abs().max().item() > 1e-3


@pytest.mark.parametrize("style", STYLES)
def test_no_attention_crosses_an_end_of_document(style):
    m = tiny_config(style=STYLES[style]).model
    model = reference_model(m)
    mb = attach_document_mask(packed(m, micro_batch=2, seed=3))
    docs = document_ids(packed(m, micro_batch=2, seed=3)["cu_seqlens"], m.seq_length)
    changed = mb["tokens"].clone()
    first = docs == 0
    changed[first] = (changed[first] + 7) % m.vocab_size
    with torch.no_grad():
        def outputs(tokens, **kw):
            return model(tokens, mb["position_ids"], labels=mb["labels"], **kw)
        before, after = outputs(mb["tokens"], attention_mask=mb["attention_mask"]), \
            outputs(changed, attention_mask=mb["attention_mask"])
        assert torch.equal(before[~first], after[~first])  # documents 1, 2, ... untouched, bit for bit
        assert (before[first] - after[first]).abs().min().item() > 0  # document 0 itself changed
        causal = outputs(mb["tokens"]) - outputs(changed)  # without the flag: later documents see it
        assert causal[~first].abs().max().item() > 1e-3


def _flags(*extra):
    return BASE + ["--dataloader-inter-document-masking", *extra]


@pytest.mark.parametrize("extra,world,message", [
    (["--context-parallel-size", "2"], 2, "--cp-comm-type p2p: megafab's K/V ring has causal or full blocks"),
    (["--mtp-num-layers", "1"], 1, "--dataloader-inter-document-masking with --mtp-num-layers"),
])
def test_rules(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(_flags(*extra), world_size=world)


def test_allowed_layouts_and_no_effect_flags():
    for comm in ("allgather", "a2a"):
        cfg = config_from_args(_flags("--context-parallel-size", "2", "--cp-comm-type", comm), world_size=2)
        assert cfg.data.dataloader_inter_document_masking and cfg.parallel.cp_comm_type == comm
    cfg = config_from_args(_flags("--reset-position-ids", "--reset-attention-mask", "--context-parallel-size",
                                  "2", "--cp-comm-type", "a2a"), world_size=2)
    said = " ".join(cfg.no_effect)
    assert "--reset-position-ids (--dataloader-inter-document-masking" in said
    assert "--reset-attention-mask (--dataloader-inter-document-masking" in said
    cuda_flash = tiny_config(dataloader_inter_document_masking=True, attention_backend="flash", bf16=True)
    problems = attention_backend_problems(cuda_flash, "cuda")
    assert any("--dataloader-inter-document-masking" in p for p in problems)
    assert not attention_backend_problems(cuda_flash, "cpu")
