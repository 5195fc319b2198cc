"""Sharded checkpoints reshard on load: distributed optimizer DP 2 -> DP 4 -> plain optimizer DP 1
(float64: the resumed losses equal the uninterrupted run's), and TP 1 <-> TP 2 where the padded
vocabulary changes (Megatron's padding rule: stored rows kept, new rows copies of the last one, zero
optimizer state for them)."""

import torch

from megafab.checkpoint import CheckpointError, checkpointing, dcp_io, directory
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import make_state, read_everything, train
from tests.helpers.tiny import LLAMA_STYLE


# ---- DP and optimizer changes ---------------------------------------------------------------------
def _straight(rank, world, path):
    state = make_state(tp=1, dp=2, dist_opt=True, save=path)
    train(state, 2)
    checkpointing.save_checkpoint(state)
    return train(state, 2)


def _dp4_resave_then_train(rank, world, src, dst):
    state = make_state(tp=1, dp=4, dist_opt=True, load=src, save=dst)
    assert checkpointing.load_checkpoint(state) == 2
    checkpointing.save_checkpoint(state)
    return train(state, 2)


def _plain_dp1(rank, world, src):
    state = make_state(tp=1, dp=1, dist_opt=False, load=src)
    assert checkpointing.load_checkpoint(state) == 2
    return train(state, 2)


def test_distributed_optimizer_dp2_to_dp4_to_plain_dp1_continues_the_same_losses(tmp_path):
    a, b = str(tmp_path / "dp2"), str(tmp_path / "dp4")
    expected = run_ranks(_straight, 2, a, timeout=180)[0]
    got_dp4 = run_ranks(_dp4_resave_then_train, 4, a, b, timeout=180)[0]
    got_dp1 = run_ranks(_plain_dp1, 1, b, timeout=180)[0]
    for got in (got_dp4, got_dp1):
        assert len(got) == 2
        for x, y in zip(got, expected):
            assert abs(x - y) <= 1e-10 * abs(y), (got, expected)
    # DP 2 and DP 4 (different boxes per rank) stored the same global tensors
    first, second = (read_everything(directory.iteration_dir(d, 2)) for d in (a, b))
    assert sorted(first) == sorted(second) and any(k.endswith(".exp_avg_sq") for k in first)
    for k in first:
        assert torch.equal(first[k], second[k]), k
    chunks = dcp_io.read_metadata(directory.iteration_dir(b, 2)).state_dict_metadata
    assert len(chunks["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"].chunks) >= 4


def _sgd(rank, world, path, dp, dist_opt, load):
    state = make_state(tp=1, dp=dp, dist_opt=dist_opt, optimizer="sgd", sgd_momentum=0.9,
                       save=None if load else path, load=path if load else None)
    if load:
        assert checkpointing.load_checkpoint(state) == 2
        return train(state, 2)
    train(state, 2)
    checkpointing.save_checkpoint(state)
    return train(state, 2)


def test_sgd_momentum_from_distributed_dp2_continues_in_plain_dp1(tmp_path):
    path = str(tmp_path / "sgd")
    expected = run_ranks(_sgd, 2, path, 2, True, False, timeout=180)[0]
    [got] = run_ranks(_sgd, 1, path, 1, False, True, timeout=180)
    for x, y in zip(got, expected):
        assert abs(x - y) <= 1e-10 * abs(y), (got, expected)
    stored = read_everything(directory.iteration_dir(path, 2))
    assert stored["optim.decoder.layers.0.mlp.linear_fc1.weight.momentum_buffer"].abs().sum() > 0
    assert not any(k.endswith(".exp_avg") for k in stored)


# ---- a different padded vocabulary ---------------------------------------------------------------
EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")  # LLAMA_STYLE: untied


def _save_tp1(rank, world, path):
    state = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE, save=path)
    assert state.cfg.model.padded_vocab_size == 104
    train(state, 2)
    checkpointing.save_checkpoint(state)


def _full(param, topo):
    parts = [torch.empty_like(param) for _ in range(topo.tp)]
    torch.distributed.all_gather(parts, param.detach().contiguous(), group=topo.group("tp"))
    return torch.cat(parts)


def _load_padded(rank, world, src, tp, divisible_by, dp=1, dist_opt=False, dtype=torch.float64, steps=2):
    state = make_state(tp=tp, dp=dp, dist_opt=dist_opt, style=LLAMA_STYLE, dtype=dtype, load=src,
                   make_vocab_size_divisible_by=divisible_by)
    chunk = state.model[0].module
    params = {n: p for n, p in chunk.named_parameters() if n in EMBEDDINGS}
    initial = {n: _full(p, state.topology).clone() for n, p in params.items()}
    assert checkpointing.load_checkpoint(state) == 2
    loaded = {n: _full(p, state.topology) for n, p in params.items()}
    opt = {}
    for n, p in params.items():
        e = next(e for e in state.optimizer.entries if e.model_param is p)
        adam = state.optimizer.optimizer.state[e.main]
        lo, hi = e.param_range or (0, p.numel())
        opt[n] = {"range": (lo, hi), "rows": p.shape[0], "main": e.main.detach().clone().view(-1),
                  "model": p.detach().clone().view(-1)[lo:hi],
                  **{k: adam[k].clone().view(-1) for k in ("exp_avg", "exp_avg_sq")}}
    return {"padded": state.cfg.model.padded_vocab_size, "initial": initial, "loaded": loaded, "opt": opt,
            "tp_rank": state.topology.tp_rank, "losses": train(state, steps)}


def _check_rows(result, saved):
    """Megatron's padding rule (megafab.checkpoint.vocab): the stored rows up to the new size are the
    checkpoint's, further rows copies of its last row (weights and fp32 main params alike); their
    Adam moments start at zero."""
    padded = result["padded"]
    for name in EMBEDDINGS:
        stored = saved["model." + name]
        rows_stored = stored.shape[0]
        assert rows_stored != padded
        kept = min(rows_stored, padded)
        loaded = result["loaded"][name]
        assert loaded.shape[0] == padded
        assert torch.equal(loaded[:kept], stored[:kept].to(loaded.dtype))
        assert torch.equal(loaded[kept:], stored[-1:].to(loaded.dtype).expand(padded - kept, -1))
        o = result["opt"][name]
        h = stored.shape[1]
        owned = torch.arange(*o["range"])  # flat indices into this rank's TP block
        rows = result["tp_rank"] * o["rows"] + owned // h  # their global rows and columns
        cols = owned % h
        old = rows < rows_stored
        for kind in ("exp_avg", "exp_avg_sq"):
            want = saved[f"optim.{name}.{kind}"][rows[old], cols[old]]
            assert torch.equal(o[kind][old], want.to(o[kind].dtype)), kind
            assert torch.all(o[kind][~old] == 0), kind
            assert o[kind][old].abs().sum() > 0
        if f"optim.{name}.main_param" in saved:
            main = saved[f"optim.{name}.main_param"]
            assert torch.equal(o["main"][old], main[rows[old], cols[old]])
            assert torch.equal(o["main"][~old], main[-1, cols[~old]])


def test_tp1_to_tp2_with_a_different_padded_vocabulary_keeps_real_rows_and_trains_alike(tmp_path):
    """TP 1 pads 101 tokens to 104 rows, TP 2 to 112. The TP 2 run and a TP 1 run padded to 112
    (--make-vocab-size-divisible-by 16), both from the 104-row checkpoint, train alike."""
    src = str(tmp_path / "tp1")
    run_ranks(_save_tp1, 1, src, timeout=180)
    saved = read_everything(directory.iteration_dir(src, 2))
    tp2 = run_ranks(_load_padded, 2, src, 2, 8, timeout=180)
    [tp1_wide] = run_ranks(_load_padded, 1, src, 1, 16, timeout=180)
    for result in tp2 + [tp1_wide]:
        assert result["padded"] == 112
        _check_rows(result, saved)
    for x, y in zip(tp2[0]["losses"], tp1_wide["losses"]):
        assert abs(x - y) <= 1e-10 * abs(y), (tp2[0]["losses"], tp1_wide["losses"])


def _save_tp2_bf16(rank, world, path):
    state = make_state(tp=2, dp=1, dist_opt=True, style=LLAMA_STYLE, dtype=torch.bfloat16, save=path)
    assert state.cfg.model.padded_vocab_size == 112
    train(state, 2)
    checkpointing.save_checkpoint(state)


def test_tp2_to_tp1_dp2_distributed_optimizer_bf16_with_fewer_padding_rows(tmp_path):
    """The other direction, in bf16 (fp32 main params in the checkpoint), into DP 2 ranges."""
    src = str(tmp_path / "tp2")
    run_ranks(_save_tp2_bf16, 2, src, timeout=180)
    saved = read_everything(directory.iteration_dir(src, 2))
    results = run_ranks(_load_padded, 2, src, 1, 8, 2, True, torch.bfloat16, 1, timeout=180)
    for result in results:
        assert result["padded"] == 104
        _check_rows(result, saved)
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def _other_vocabulary(rank, world, path):
    state = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE, save=path)
    checkpointing.save_checkpoint(state)
    other = make_state(tp=1, dp=1, dist_opt=False, style=LLAMA_STYLE, load=path, vocab_size=90)
    try:
        checkpointing.load_checkpoint(other)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_different_real_vocabulary_is_refused_by_name(tmp_path):
    [message] = run_ranks(_other_vocabulary, 1, str(tmp_path), timeout=120)
    assert message and "vocabulary of 101 tokens" in message and "has 90 tokens" in message, message
    assert message.startswith(str(tmp_path)), message  # names the checkpoint
