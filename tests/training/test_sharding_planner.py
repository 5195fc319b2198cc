"""The planner's FSDP2 and optimizer-offload rows (megafab.plan.state_memory) against the tensors
that really exist after a step: weights, grads, device optimizer state and host bytes per rank."""

import pytest

from megafab.plan.planner import format_plan, plan
from megafab.run.fork_ranks import run_ranks
from tests.helpers.driver import measured_after_one_step
from tests.helpers.tiny import tiny_config

VARIANTS = {
    "fsdp2": dict(use_torch_fsdp2=True),
    "fsdp2-offload": dict(use_torch_fsdp2=True, optimizer_cpu_offload=True),
    "megatron-fsdp-16-bit-mains": dict(use_megatron_fsdp=True, megatron_fsdp_main_params_dtype="auto"),
    "fsdp2-offload-fp32": dict(use_torch_fsdp2=True, optimizer_cpu_offload=True, bf16=False),
    "distopt-offload": dict(use_distributed_optimizer=True, optimizer_cpu_offload=True),
    "ddp-offload": dict(optimizer_cpu_offload=True),
    "ddp-bf16-grads": dict(grad_reduce_in_bf16=True),
    "distopt-bf16-grads": dict(use_distributed_optimizer=True, grad_reduce_in_bf16=True),
    "distopt-offload-bf16-grads": dict(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                       grad_reduce_in_bf16=True),
}


def _measured_and_planned(rank, world, variant):
    flat = dict(dp=world, bf16=True, global_batch_size=2 * world, hidden_size=64, num_layers=2,
                ffn_hidden_size=256, vocab_size=101)
    flat.update(VARIANTS[variant])
    report, stage = measured_after_one_step(tiny_config(**flat))
    return (report.num_params, stage.params,
            (report.weights_bytes, report.grads_bytes, report.optimizer_bytes, report.host_bytes),
            (stage.weights_bytes, stage.grads_bytes, stage.optimizer_bytes, stage.host_bytes))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_bytes_match_measured_within_two_percent(variant):
    for real, params, measured, planned in run_ranks(_measured_and_planned, 2, variant, timeout=120):
        print(f"{variant}: measured w/g/opt/host {measured} planned {planned}")
        assert params == real
        for kind, m, p in zip(("weights", "grads", "optimizer", "host"), measured, planned):
            assert abs(m - p) <= 0.02 * max(m, p) + 1024, (variant, kind, measured, planned)


def test_fsdp2_is_zero3_bytes_and_the_plan_prints_device_and_host():
    base = dict(dp=4, bf16=True, global_batch_size=8, hidden_size=64, num_layers=2)
    per_param = {}
    for name, flags in (("ddp", {}), ("fsdp2", dict(use_torch_fsdp2=True)),
                        ("offload", dict(use_torch_fsdp2=True, optimizer_cpu_offload=True,
                                         optimizer_offload_fraction=0.5))):
        cfg = tiny_config(**base, **flags)
        stage = plan(cfg)[0]
        per_param[name] = (stage.state_bytes / stage.params, stage.host_bytes / stage.params, cfg, stage)
    assert per_param["ddp"][0] == 18  # bf16 weights, fp32 grads, fp32 master + Adam
    assert per_param["fsdp2"][0] == 16 / 4  # ZeRO-3: 16 / d
    # offload half: device keeps 2/d + 2/d + half of 12/d, the host the other half of (4+8+4+2+2)/d
    assert per_param["offload"][0] == pytest.approx((2 + 2 + 6) / 4)
    assert per_param["offload"][1] == pytest.approx(10 / 4)
    _, _, cfg, stage = per_param["offload"]
    assert stage.fsdp_transient_bytes > 0 and stage.fsdp_held_bytes > 0
    text = format_plan(cfg, [stage])
    assert "FSDP2 (ZeRO-3), optimizer CPU offload 0.5" in text and "host" in text, text
    assert "FSDP2 root gathered/unsharded" in text, text


def test_sharded_state_divides_over_dp_times_cp():
    """FSDP2 and the distributed optimizer shard over DP x CP (Megatron's dp-cp group): DP 2 x CP 2
    plans the state of DP 4."""
    base = dict(bf16=True, global_batch_size=8, hidden_size=64, num_layers=2)
    for flags in (dict(use_torch_fsdp2=True), dict(use_distributed_optimizer=True),
                  dict(use_torch_fsdp2=True, optimizer_cpu_offload=True)):
        dp4 = plan(tiny_config(dp=4, **base, **flags))[0]
        cp2 = plan(tiny_config(dp=4, context_parallel_size=2, **base, **flags))[0]
        assert (cp2.weights_bytes, cp2.grads_bytes, cp2.optimizer_bytes, cp2.host_bytes) == \
            (dp4.weights_bytes, dp4.grads_bytes, dp4.optimizer_bytes, dp4.host_bytes), flags
