"""One padding-row rule (Megatron's: stored rows kept, new rows copies of the last one) for
conversion and for resharding on load: a checkpoint converted for TP 2 (104 -> 112 rows by
megafab-convert) and the TP 1 checkpoint loaded into a model padded to 112 rows (resharded by the
loader) hold the same rows and train to the same losses, float64, exactly."""

import torch

from megafab.checkpoint import checkpointing
from megafab.checkpoint.vocab import padded_rows
from megafab.convert import write_checkpoint
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, train
from tests.helpers.tiny import LLAMA_STYLE

EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")  # LLAMA_STYLE: untied


def test_padded_rows_keeps_then_copies_the_last_row():
    w = torch.arange(12.0).view(4, 3)
    assert torch.equal(padded_rows(w, 6), torch.cat([w, w[3:], w[3:]]))
    assert torch.equal(padded_rows(w, 2), w[:2]) and torch.equal(padded_rows(w, 4), w)


def _convert_both_ways(rank, world, root):
    state = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE)  # 101 tokens padded to 104
    sd = {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}
    write_checkpoint(f"{root}/converted", sd, state.cfg, tp=2)  # megafab-convert repads: 112 rows
    write_checkpoint(f"{root}/tp1", sd, state.cfg, tp=1)  # 104 rows, resharded by the loader
    out = {}
    for path in ("converted", "tp1"):
        run = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE, load=f"{root}/{path}", finetune=True,
                         make_vocab_size_divisible_by=16)  # 112 rows at TP 1
        checkpointing.load_checkpoint(run)
        params = dict(run.model[0].module.named_parameters())
        out[path] = {"rows": {n: params[n].detach().clone() for n in EMBEDDINGS}, "losses": train(run, 2)}
    return sd, out


def test_converting_and_resharding_give_the_same_padded_rows_and_loss(tmp_path):
    [(sd, out)] = run_ranks(_convert_both_ways, 1, str(tmp_path), timeout=180)
    for name in EMBEDDINGS:
        converted, resharded = out["converted"]["rows"][name], out["tp1"]["rows"][name]
        assert converted.shape[0] == 112 and sd[name].shape[0] == 104
        assert torch.equal(converted, resharded), name
        assert torch.equal(converted[104:], sd[name][-1:].expand(8, -1)), name  # Megatron's rule
    assert out["converted"]["losses"] == out["tp1"]["losses"], out
