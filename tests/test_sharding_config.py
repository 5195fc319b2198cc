"""ZeRO-2/3 and optimizer-offload flags: Megatron's spellings parsed, Megatron-FSDP's strategies
mapped to megafab's engines (announced), impossible combinations refused before start-up naming
both flags."""

import subprocess
import sys

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.flags import BASE


def _problems(argv, world_size=2) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_args(BASE + argv, world_size=world_size)
    return str(info.value)


def test_fsdp2_and_offload_flags_parse():
    cfg = config_from_args(BASE + ["--use-torch-fsdp2", "--optimizer-cpu-offload", "--no-pin-cpu-grads",
                                   "--optimizer-offload-fraction", "0.25"], world_size=2)
    p, o = cfg.parallel, cfg.optimizer
    assert p.fully_sharded and p.fsdp_reshard_after_forward and not p.use_distributed_optimizer
    assert p.ddp_bucket_size is None  # no DDP buckets under FSDP2
    assert o.optimizer_cpu_offload and o.optimizer_offload_fraction == 0.25
    assert not o.pin_cpu_grads and o.pin_cpu_params
    cfg = config_from_args(BASE + ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"],
                           world_size=2)
    assert cfg.parallel.fully_sharded and not cfg.parallel.fsdp_reshard_after_forward
    # Megatron's offload scripts: fraction defaults to 1, the precision-aware flag is its code path
    cfg = config_from_args(BASE + ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                                   "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"],
                           world_size=2)
    assert cfg.optimizer.optimizer_offload_fraction == 1.0
    assert any("--overlap-cpu-optimizer-d2h-h2d" in n for n in cfg.no_effect)  # megafab always overlaps


@pytest.mark.parametrize("strategy,dist_opt,fully_sharded,reshard", [
    ("no_shard", False, False, None), ("optim", True, False, None), ("optim_grads", False, True, False),
    ("optim_grads_params", False, True, True), (None, False, True, True)])
def test_megatron_fsdp_strategies_map_to_zero_stages_with_a_note(strategy, dist_opt, fully_sharded, reshard):
    # Megatron-FSDP v1 scripts pass --use-distributed-optimizer; it is accepted with every strategy.
    argv = BASE + ["--use-megatron-fsdp", "--use-distributed-optimizer"]
    argv += ["--data-parallel-sharding-strategy", strategy] if strategy else []
    cfg = config_from_args(argv, world_size=2)
    p = cfg.parallel
    assert (p.use_distributed_optimizer, p.fully_sharded) == (dist_opt, fully_sharded)
    if reshard is not None:
        assert p.fsdp_reshard_after_forward == reshard
    assert any(f"--data-parallel-sharding-strategy {strategy or 'optim_grads_params'} runs as ZeRO-" in n
               for n in cfg.start_up_notes()), cfg.start_up_notes()


def test_impossible_combinations_are_refused_naming_both_flags():
    fsdp, offload = "--use-torch-fsdp2", "--optimizer-cpu-offload"
    cases = [  # (command line, the flags the message must name)
        ([fsdp, "--use-distributed-optimizer"], [fsdp, "--use-distributed-optimizer"]),
        ([fsdp, "--use-megatron-fsdp"], [fsdp, "--use-megatron-fsdp"]),
        ([fsdp, "--ddp-bucket-size", "1000"], [fsdp, "--ddp-bucket-size"]),
        ([fsdp, "--overlap-param-gather", "--overlap-grad-reduce"], [fsdp, "--overlap-param-gather"]),
        ([fsdp, "--compile"], [fsdp, "--compile"]),
        (["--optimizer-offload-fraction", "0.5"], ["--optimizer-offload-fraction", offload]),
        (["--no-pin-cpu-params"], ["--no-pin-cpu-params", offload]),
        (["--use-precision-aware-optimizer"], ["--use-precision-aware-optimizer", offload]),
        (["--data-parallel-sharding-strategy", "optim_grads", "--use-distributed-optimizer"],
         ["--data-parallel-sharding-strategy", "--use-megatron-fsdp"]),
        (["--torch-fsdp2-no-reshard-after-forward"], ["--torch-fsdp2-no-reshard-after-forward", fsdp]),
        ([fsdp, "--ckpt-format", "torch", "--save", "/tmp/x", "--no-save-optim"],
         [fsdp, "--ckpt-format torch"]),
    ]
    for argv, names in cases:
        text = _problems(argv)
        assert all(name in text for name in names), (names, text)
    # FSDP2 around Transformer Engine's FP8 layers is no rule's business (tests/model/test_te_parallel.py)
    te_fp8 = ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid"]
    assert config_from_args(BASE + [fsdp, *te_fp8], world_size=2).parallel.fully_sharded
    text = _problems(["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"])
    assert "--optimizer-offload-fraction 1.5 must be in [0, 1]" in text
    # every problem of a command line in one message
    text = _problems(["--use-torch-fsdp2", "--use-distributed-optimizer", "--optimizer-cpu-offload",
                      "--optimizer-offload-fraction", "-0.1"])
    assert "2 problem(s)" in text


def test_entry_point_refuses_before_start_up():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, "--use-torch-fsdp2",
                           "--use-distributed-optimizer"], capture_output=True, text=True, timeout=120,
                          env={"WORLD_SIZE": "2", "RANK": "0", "PATH": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--use-torch-fsdp2 and --use-distributed-optimizer cannot be combined" in proc.stderr
