"""--context-parallel-size and --cp-comm-type: derived sizes and every rule checked before start-up."""

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.flags import BASE


def problems(argv, world):
    with pytest.raises(ConfigError) as info:
        config_from_args(BASE + argv, world_size=world)
    return info.value.problems


def test_data_parallel_size_excludes_cp_and_comm_type_spellings():
    cfg = config_from_args(BASE + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"],
                           world_size=8)
    p = cfg.parallel
    assert (p.context_parallel_size, p.data_parallel_size, p.cp_comm_type) == (2, 2, "p2p")
    assert cfg.training.global_batch_size == 4  # micro-batch x DP: CP ranks share samples
    for spelling in ("allgather", "all_gather"):
        cfg = config_from_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", spelling],
                               world_size=2)
        assert cfg.parallel.cp_comm_type == "allgather"
    cfg = config_from_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "a2a"],
                           world_size=2)  # Megatron's per-layer list, all equal
    assert cfg.parallel.cp_comm_type == "a2a"


def test_every_cp_problem_is_reported_at_once():
    found = problems(["--context-parallel-size", "4", "--seq-length", "36", "--max-position-embeddings", "64",
                      "--transformer-impl", "transformer_engine", "--reset-attention-mask"], world=6)
    text = "\n".join(found)
    assert ("world size 6 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 4"
            in text)
    assert "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8" in text
    assert "use --transformer-impl local" in text
    assert "drop --reset-attention-mask" in text


def test_sequence_must_split_into_whole_chunks_over_cp_and_tp_under_sp():
    found = problems(["--context-parallel-size", "2", "--tensor-model-parallel-size", "4",
                      "--sequence-parallel", "--seq-length", "40", "--max-position-embeddings", "40"],
                     world=8)
    assert any("--seq-length 40 is not divisible by 2 x --context-parallel-size 2 x "
               "--tensor-model-parallel-size 4 (--sequence-parallel) = 16" in p for p in found), found
    config_from_args(BASE + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4",
                             "--sequence-parallel"], world_size=8)  # 32 = 2 x 2 x 4 x 2


def test_a2a_needs_heads_and_query_groups_that_split_over_cp():
    found = problems(["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--tensor-model-parallel-size",
                      "4", "--group-query-attention", "--num-query-groups", "4"], world=16)
    text = "\n".join(found)
    assert "--num-attention-heads 8 / TP 4 = 2 is not divisible by --context-parallel-size 4" in text
    assert "--num-query-groups 4 / TP 4 = 1 is not divisible by --context-parallel-size 4" in text
    # p2p and allgather have no such rule
    config_from_args(BASE + ["--context-parallel-size", "4", "--tensor-model-parallel-size", "4",
                             "--group-query-attention", "--num-query-groups", "4"], world_size=16)


def test_comm_types_megafab_lacks_are_refused_by_name():
    assert any("--cp-comm-type 'a2a+p2p' is not supported" in p
               for p in problems(["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], world=2))
    assert any("--cp-comm-type p2p a2a: per-layer CP communication types are not supported" in p
               for p in problems(["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], world=2))
    assert any("--hierarchical-context-parallel-sizes: refused" in p
               for p in problems(["--hierarchical-context-parallel-sizes", "2", "2"], world=4))


def test_dry_run_plans_a_cp_layout_and_a_bad_one_exits_2(capsys, monkeypatch):
    import pretrain_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the world the plan is for

    assert pretrain_gpt.main(BASE + ["--context-parallel-size", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "CP 2" in out and "K/V exchange" in out
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(BASE + ["--context-parallel-size", "3", "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megafab: error:") and "not divisible by 2 x --context-parallel-size 3" in err
