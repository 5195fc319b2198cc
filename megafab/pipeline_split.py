"""Which transformer layers each pipeline stage (and virtual chunk) holds: Megatron's split.

Model chunks are numbered in Megatron's global order, chunk-major: (chunk 0, stage 0), (chunk 0,
stage 1), ..., (chunk 1, stage 0), ...; layers are consecutive in that order. What varies is how
many layers each (stage, chunk) holds:

  * even:     num_layers / (pp * vpp) everywhere;
  * --decoder-first/last-pipeline-num-layers F / L: the first (last) stage holds F (L) layers,
    F / vpp per chunk; the stages in between share the rest evenly;
  * --account-for-embedding/loss-in-pipeline-split: the embedding (the output layer + loss) counts
    as one layer, so (num_layers + 1 [+ 1]) is split evenly and the first chunk of the first stage
    (the last chunk of the last stage) builds one transformer layer fewer.

Pure arithmetic, no torch: config validation, the model builder and the planner share it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    num_layers: int
    pp: int
    vpp: int = 1
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @classmethod
    def from_config(cls, cfg) -> PipelineSplit:
        m, p = cfg.model, cfg.parallel
        return cls(m.num_layers, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1,
                   p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers,
                   p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def problems(self) -> list[str]:
        """Every reason this split cannot be built, as Megatron's rules state them."""
        n, pp, vpp = self.num_layers, self.pp, self.vpp
        out = []
        accounts = self.account_for_embedding or self.account_for_loss
        if self.uneven and accounts:
            out.append("--decoder-first/last-pipeline-num-layers cannot be combined with "
                       "--account-for-embedding/loss-in-pipeline-split; choose one way to balance stages")
            return out
        if self.uneven:
            middle_layers, middle_stages = n, pp
            for flag, value in (("--decoder-first-pipeline-num-layers", self.first),
                                ("--decoder-last-pipeline-num-layers", self.last)):
                if value is None:
                    continue
                if value <= 0:
                    out.append(f"{flag} {value} must be positive")
                elif value % vpp:
                    out.append(f"{flag} {value} is not divisible by the {vpp} virtual stages per "
                               f"pipeline rank; every model chunk of that stage must hold the same layers")
                middle_layers -= value
                middle_stages -= 1
            if middle_stages < 0:
                out.append(f"--decoder-first- and --decoder-last-pipeline-num-layers need at least 2 "
                           f"pipeline stages; --pipeline-model-parallel-size is {pp}")
            elif bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
                out.append(f"{middle_layers} transformer layers remain for the {middle_stages} middle "
                           f"pipeline stage(s) after the first/last stage layers (--num-layers {n}); "
                           f"every middle stage needs layers and every layer a stage")
            elif middle_stages and middle_layers % (middle_stages * vpp):
                out.append(f"the {middle_layers} layers left for the {middle_stages} middle pipeline "
                           f"stage(s) do not split evenly over them x {vpp} virtual stages; change "
                           f"--decoder-first/last-pipeline-num-layers or --num-layers")
            return out
        total = n + int(self.account_for_embedding) + int(self.account_for_loss)
        what = f"--num-layers {n}"
        if accounts:
            what += f" + {total - n} (embedding/loss counted as layers)"
        if total % (pp * vpp):
            out.append(f"{what} is not divisible by pipeline stages x virtual stages = {pp} x {vpp}; "
                       f"every model chunk must hold the same number of layers (or use "
                       f"--decoder-first/last-pipeline-num-layers for uneven stages)")
        elif accounts and total // (pp * vpp) < 1:
            out.append(f"{what} leaves no room for the embedding/loss in a chunk of "
                       f"{total // (pp * vpp)} layers; use fewer stages")
        return out

    def counts(self) -> list[list[int]]:
        """Transformer layers per [pp_rank][chunk] (assumes problems() is empty)."""
        return [list(row) for row in self._layout[0]]

    def layer_range(self, pp_rank: int, chunk: int) -> tuple[int, int]:
        """Global layer numbers [start, end) of model chunk `chunk` on pipeline rank `pp_rank`."""
        counts, starts = self._layout
        return starts[pp_rank][chunk], starts[pp_rank][chunk] + counts[pp_rank][chunk]

    @functools.cached_property
    def _layout(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        return _table(self)  # once per instance (hashing the split per call costs as much)

    def _counts(self) -> list[list[int]]:
        pp, vpp = self.pp, self.vpp
        if self.uneven:
            middle_layers = self.num_layers - (self.first or 0) - (self.last or 0)
            middle_stages = pp - (self.first is not None) - (self.last is not None)
            per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
            if self.first is not None:
                per_rank[0] = self.first
            if self.last is not None:
                per_rank[-1] = self.last
            return [[layers // vpp] * vpp for layers in per_rank]
        total = self.num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        table = [[total // (pp * vpp)] * vpp for _ in range(pp)]
        if self.account_for_embedding:
            table[0][0] -= 1
        if self.account_for_loss:
            table[-1][-1] -= 1
        return table


@functools.lru_cache(maxsize=4096)
def _table(split: PipelineSplit) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(layers, first global layer) per [pp_rank][chunk], once per split (the layout search asks for
    them per layer of every candidate); chunks in Megatron's global order, chunk-major."""
    counts = split._counts()
    starts = [[0] * split.vpp for _ in range(split.pp)]
    start = 0
    for chunk in range(split.vpp):
        for rank in range(split.pp):
            starts[rank][chunk] = start
            start += counts[rank][chunk]
    return tuple(map(tuple, counts)), tuple(map(tuple, starts))
