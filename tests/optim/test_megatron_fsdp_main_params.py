"""--megatron-fsdp-main-params-dtype (Megatron-LM HEAD) on FSDP2 (--use-megatron-fsdp, DP 2, a bf16
model computing in bf16): fp32 (the default) keeps FSDP2's shards as fp32 masters, stepped in place with
fp32 Adam state (values finer than bf16 after a step); auto (or bf16, the model's dtype) keeps the
shards in bf16 and steps them as the main params: no fp32 copy anywhere, bf16 Adam state. The
rules: it needs --use-megatron-fsdp, a 16-bit value must be the model's, the FSDP2 strategies only,
and no optimizer offload (one line each)."""

import pytest

from megafab.config.core import ConfigError
from megafab.run.fork_ranks import run_ranks
from megafab.training.step import train_step
from tests.helpers.driver import MICRO, driver_state, make_samples, micro_batches
from tests.helpers.tiny import LLAMA_STYLE, tiny_config

FSDP = dict(use_megatron_fsdp=True, bf16=True, dp=2)


def _step(rank, world, value):
    cfg = tiny_config(style=LLAMA_STYLE, micro_batch_size=MICRO, global_batch_size=MICRO * world, lr=1e-2,
                      megatron_fsdp_main_params_dtype=value, **FSDP)
    state = driver_state(cfg)
    entries = state.optimizer.entries
    before = {e.name: e.main.detach().clone() for e in entries}
    samples = make_samples(cfg.model, MICRO * world)
    metrics = train_step(state, micro_batches(samples, 0, state.topology.dp_rank, world, 1))
    adam = state.optimizer.torch_optimizer_of(entries[0]).state[entries[0].main]
    moved = max((e.main.float() - before[e.name].float()).abs().max().item() for e in entries)
    # what the main params hold beyond bf16 (0 when they are bf16 themselves)
    beyond = max((e.main.float() - e.main.bfloat16().float()).abs().max().item() for e in entries)
    return dict(main={str(e.main.dtype) for e in entries}, copies={e.is_copy for e in entries},
                shard={str(e.model_values().dtype) for e in entries}, adam=str(adam["exp_avg"].dtype),
                compute={str(c.compute_dtype) for c in state.model}, moved=moved, beyond=beyond,
                loss=metrics["lm loss"])


@pytest.mark.parametrize("value", ["fp32", "auto", "bf16"])
def test_main_params_dtype_sets_what_the_optimizer_steps(value):
    for out in run_ranks(_step, 2, value, timeout=180):
        assert out["compute"] == {"torch.bfloat16"} and out["moved"] > 0 and out["loss"] > 0
        assert out["copies"] == {False}  # the optimizer steps FSDP2's shards in place
        want = "torch.float32" if value == "fp32" else "torch.bfloat16"
        assert out["shard"] == out["main"] == {want} and out["adam"] == want
        assert (out["beyond"] > 0) == (value == "fp32")  # fp32 masters keep what bf16 rounds away


@pytest.mark.parametrize("overrides,message", [
    (dict(bf16=True), "--megatron-fsdp-main-params-dtype auto needs --use-megatron-fsdp"),
    (dict(FSDP, megatron_fsdp_main_params_dtype="fp16"),
     "--megatron-fsdp-main-params-dtype fp16 with a bf16 model: megafab's main params are fp32 masters"),
    (dict(FSDP, data_parallel_sharding_strategy="optim", use_distributed_optimizer=True),
     "--megatron-fsdp-main-params-dtype auto with --data-parallel-sharding-strategy optim"),
    (dict(FSDP, optimizer_cpu_offload=True),
     "--megatron-fsdp-main-params-dtype auto with --optimizer-cpu-offload"),
])
def test_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**{"megatron_fsdp_main_params_dtype": "auto", **overrides})
