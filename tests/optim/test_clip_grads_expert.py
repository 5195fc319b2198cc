"""Which copy of a parameter enters the grad norm (each value counted once): dense params by their
TP rank, expert params by their expert-TP rank (ETP may differ from TP). Pure: a Topology of the
layout, no process groups."""

import torch
from torch import nn

from megafab.distributed.topology import Topology
from megafab.optim.clip_grads import counts_for_norm


def _topology(rank, tp, ep, etp):
    return Topology(rank=rank, world_size=8, tp=tp, pp=1, dp=8 // tp, vpp=1, device=torch.device("cpu"),
                    backend="gloo", ep=ep, etp=etp)


def _param(expert=False, sharded=False):
    p = nn.Parameter(torch.zeros(2))
    if expert:
        p.is_expert = True
    if sharded:
        p.tensor_model_parallel = True
    return p


def test_expert_params_count_once_per_expert_tp_group():
    replicated, expert, expert_sharded = _param(), _param(expert=True), _param(expert=True, sharded=True)
    # TP 2, ETP 1, EP 4: rank 1 is TP rank 1 (a dense replica) but expert-TP rank 0 (its experts' only copy)
    topo = _topology(1, tp=2, ep=4, etp=1)
    assert (topo.tp_rank, topo.coord("etp")) == (1, 0)
    assert not counts_for_norm(replicated, topo) and counts_for_norm(expert, topo)
    # TP 1, ETP 2, EP 2: rank 1 is TP rank 0 but expert-TP rank 1 (a replica of a replicated expert param)
    topo = _topology(1, tp=1, ep=2, etp=2)
    assert (topo.tp_rank, topo.coord("etp")) == (0, 1)
    assert counts_for_norm(replicated, topo) and not counts_for_norm(expert, topo)
    assert counts_for_norm(expert_sharded, topo)  # an ETP shard counts on every expert-TP rank
