"""megafab checkpoints: the one authority on their layout, for training, conversion and generation.

    layout.py         keys, global names and shapes (strided SwiGLU, tied copy, padded vocabulary);
                      ParamLayout / Shard: the boxes of each global tensor this rank holds
    boxes.py          rectangular boxes; a flat range of a row-major tensor as a few boxes
    dcp_io.py         torch.distributed.checkpoint (DCP) planners for Shards, safe metadata reading
    state.py          the model, optimizer and RNG pieces of a training state, as Shards
    vocab.py          loading into a differently padded vocabulary
    directory.py      SAVE/latest_checkpointed_iteration.txt + iter_NNNNNNN/, atomic commit
    checkpointing.py  save_checkpoint / load_checkpoint of a training state

Importing this package does not import DCP (seconds per rank); dcp_io does, on first save or load.
"""

from megafab.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
