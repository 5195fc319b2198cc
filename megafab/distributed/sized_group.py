"""A process group's size and a rank's place in it, without a process group.

Layers read their groups at build time only through mappings.group_size / group_rank (how many ranks
split a weight, which shard this rank keeps, which experts it holds). A SizedGroup answers those two
questions, so a model can be built on the meta device for any layout in one process, with no
torch.distributed initialized: the planner counts what a rank of that layout holds this way
(megafab.plan.inventory). It carries no communication: a forward through such a model fails.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SizedGroup:
    size: int
    rank: int = 0

    def __post_init__(self):
        assert 0 <= self.rank < self.size, (self.rank, self.size)
