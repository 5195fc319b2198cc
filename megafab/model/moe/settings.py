"""The MoE layer's settings: the configuration's MoE section (megafab/config/moe.py), under the name
the layer, the router and the tests use. One declaration of every field and rule, in config/."""

from megafab.config.moe import (
    BALANCING_TYPES,
    DISPATCHERS,
    DROP_POLICIES,
    ROUTER_DTYPES,
    SCORE_FUNCTIONS,
    parse_moe_layer_freq,
)
from megafab.config.moe import MoEConfig as MoESettings

__all__ = ["BALANCING_TYPES", "DISPATCHERS", "DROP_POLICIES", "MoESettings", "ROUTER_DTYPES",
           "SCORE_FUNCTIONS", "parse_moe_layer_freq"]
