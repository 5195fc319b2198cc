"""FSDP2 checkpoints are megafab's DCP checkpoints: the same keys, global shapes and dtypes as the
distributed optimizer's, written and read as each rank's own dim-0 rows.

FSDP2 at DP 4 (with optimizer offload) -> DP 2 distributed optimizer, and DP 2 plain DDP -> FSDP2
at DP 4, continue with the losses of the run that never stopped (float64: 1e-10); a bf16 FSDP2
checkpoint stores bf16 weights and fp32 masters like a bf16 distributed-optimizer one, and its
masters come back exactly; no rank allocates the unsharded state to save or load.
"""

import torch

from benchmarks.bench_util import peak_cpu_bytes
from megafab.checkpoint import checkpointing, dcp_io, directory, megatron_keys
from megafab.checkpoint.state import named_parameters
from megafab.distributed.fsdp import local_tensor
from megafab.optim.memory import measure_memory
from megafab.run.fork_ranks import run_ranks
from tests.helpers.checkpoint import assert_losses_close, make_state, read_everything, train, train_save_train
from tests.helpers.tiny import LLAMA_STYLE

FSDP = dict(dist_opt=False, use_torch_fsdp2=True, ddp_bucket_size=None)


def _fsdp4_straight(rank, world, path, offload):
    extra = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5) if offload else {}
    state = make_state(tp=1, dp=4, save=path, style=LLAMA_STYLE, **FSDP, **extra)
    return train_save_train(state)


def _resume(rank, world, path, dp, layout):
    state = make_state(tp=1, dp=dp, load=path, style=LLAMA_STYLE, **layout)
    assert checkpointing.load_checkpoint(state) == 2
    return train(state, 2)


def _ddp2_straight(rank, world, path):
    state = make_state(tp=1, dp=2, dist_opt=False, save=path, style=LLAMA_STYLE)
    return train_save_train(state)


def test_fsdp2_dp4_and_ddp_dp2_checkpoints_continue_in_each_other_layout(tmp_path):
    fsdp, ddp = str(tmp_path / "fsdp4"), str(tmp_path / "ddp2")
    expected = run_ranks(_fsdp4_straight, 4, fsdp, True, timeout=240)[0]
    dist_opt2 = run_ranks(_resume, 2, fsdp, 2, dict(dist_opt=True), timeout=240)[0]
    assert_losses_close(dist_opt2, expected[2:])
    ddp_straight = run_ranks(_ddp2_straight, 2, ddp, timeout=240)[0]
    assert_losses_close(ddp_straight, expected)  # same math in both layouts
    fsdp4 = run_ranks(_resume, 4, ddp, 4, FSDP, timeout=240)[0]
    assert_losses_close(fsdp4, expected[2:])
    # The same global tensors under the same keys; FSDP2's from each of the 4 ranks' rows.
    a, b = (read_everything(directory.iteration_dir(d, 2)) for d in (fsdp, ddp))
    assert sorted(a) == sorted(b) and any(k.endswith(".exp_avg_sq") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-12), k
    stored = dcp_io.read_metadata(directory.iteration_dir(fsdp, 2)).state_dict_metadata
    fc1, layer = megatron_keys.megatron_name("decoder.layers.0.mlp.linear_fc1.weight")
    for key in (fc1, megatron_keys.megatron_optim_key("exp_avg", fc1)):  # torch_dist stacks the layers
        assert len([c for c in stored[key].chunks if c.offsets[0] == layer]) == 4, key


def _bf16_fsdp_save(rank, world, path):
    state = make_state(tp=1, dp=2, save=path, dtype=torch.bfloat16, **FSDP)
    train(state, 2)
    checkpointing.save_checkpoint(state)
    return [(e.name, local_tensor(e.model_param).clone().view(-1)) for e in state.optimizer.entries]


def _bf16_load(rank, world, path, layout):
    state = make_state(tp=1, dp=2, load=path, dtype=torch.bfloat16, **layout)
    checkpointing.load_checkpoint(state)
    masters = [(e.name, e.main.clone()) for e in state.optimizer.entries]
    return masters, train(state, 1)


def test_bf16_fsdp2_checkpoint_stores_bf16_weights_and_fp32_masters(tmp_path):
    path = str(tmp_path / "bf16")
    saved = run_ranks(_bf16_fsdp_save, 2, path, timeout=240)
    stored = read_everything(directory.iteration_dir(path, 2))
    weights = [k for k in stored if k.startswith("model.")]
    assert weights and all(stored[k].dtype == torch.bfloat16 for k in weights)
    mains = [k for k in stored if k.endswith(".main_param")]
    names = sorted(k[len("model."):] for k in weights)
    assert sorted(k[len("optim."):-len(".main_param")] for k in mains) == names
    assert all(stored[k].dtype == torch.float32 for k in mains)
    for k in weights:  # the weights are the masters rounded, as Megatron's bf16 model holds them
        assert torch.equal(stored[k], stored["optim." + k[len("model."):] + ".main_param"].bfloat16()), k
    # FSDP2 reads its fp32 masters back exactly; a distributed-optimizer run continues from them.
    loaded = run_ranks(_bf16_load, 2, path, FSDP, timeout=240)
    for (before, (after, _)) in zip(saved, loaded):
        for (name, shard), (name2, main) in zip(before, after):
            assert name == name2 and torch.equal(shard, main), name
    dist_opt = run_ranks(_bf16_load, 2, path, dict(dist_opt=True), timeout=240)
    for (_, fsdp_loss), (_, dist_loss) in zip(loaded, dist_opt):
        assert abs(fsdp_loss[0] - dist_loss[0]) < 2e-2 * abs(dist_loss[0])  # bf16 compute


SIZES = dict(hidden_size=128, num_layers=2, ffn_hidden_size=512)


def _peaks(rank, world, path):
    state = make_state(tp=1, dp=4, save=path, dtype=torch.float32, **FSDP, **SIZES)
    train(state, 1)
    numel = sum(p.numel() for _, p in named_parameters(state))
    unsharded = 3 * 4 * numel  # weights + exp_avg + exp_avg_sq of every parameter
    save_peak = peak_cpu_bytes(lambda: checkpointing.save_checkpoint(state))
    fresh = make_state(tp=1, dp=4, load=path, dtype=torch.float32, **FSDP, **SIZES)
    load_peak = peak_cpu_bytes(lambda: checkpointing.load_checkpoint(fresh))
    own = measure_memory(fresh.model, fresh.optimizer).optimizer_bytes
    same = all(torch.equal(local_tensor(a), local_tensor(b))
               for a, b in zip(state.model[0].parameters(), fresh.model[0].parameters()))
    return unsharded, save_peak, load_peak, own, same


def test_fsdp2_save_and_load_never_hold_unsharded_tensors(tmp_path):
    for unsharded, save_peak, load_peak, own, same in run_ranks(_peaks, 4, str(tmp_path), timeout=240):
        assert same
        assert own <= unsharded / 6 + 4096, (own, unsharded)  # this rank's quarter of the moments
        assert save_peak < unsharded / 4, (save_peak, unsharded)
        assert load_peak < own + unsharded / 8, (load_peak, own, unsharded)
