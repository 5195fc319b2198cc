"""--mtp-num-layers and --mtp-loss-scaling-factor parse with Megatron-LM 0.16.1's types and defaults
(its census), and what multi-token prediction cannot be combined with is refused by name."""

import json
import os

import pytest

from megafab.arguments import config_from_args
from megafab.config import ConfigError
from tests.helpers.flags import BASE

CENSUS = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "megatron_flags.json")))["flags"]


def test_mtp_flags_parse_as_megatrons():
    cfg = config_from_args(BASE, world_size=1)
    assert (cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor) == \
        (CENSUS["--mtp-num-layers"]["default"], CENSUS["--mtp-loss-scaling-factor"]["default"]) == (None, 0.1)
    cfg = config_from_args(BASE + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
                                   "--position-embedding-type", "rope"], world_size=1)
    assert (cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor) == (2, 0.3)


@pytest.mark.parametrize("flags,words", [
    (["--mtp-num-layers", "0"], "must be at least 1"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], "learned absolute positions"),
    (["--mtp-num-layers", "1", "--mtp-standalone"], "--mtp-standalone: refused"),
    (["--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"], "requires --recompute-num-layers 1"),
])
def test_what_mtp_cannot_be_combined_with_is_refused_by_name(flags, words):
    with pytest.raises(ConfigError) as info:
        config_from_args(BASE + flags, world_size=2)
    assert any(words in p for p in info.value.problems), info.value.problems
