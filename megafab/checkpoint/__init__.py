"""megafab checkpoints: the one authority on their layout, for training, conversion and generation.
On disk they are Megatron-LM's (torch_dist, or the legacy torch files); megafab's earlier format is
read too. Parameter names and their grammar: megafab/param_names.py.

    layout.py, boxes.py  keys, global names and shapes; ParamLayout / Shard: the boxes a rank holds
    state.py             a training state's model, optimizer and RNG pieces, as Shards
    dcp_io.py            torch.distributed.checkpoint planners, safe metadata reading, partial checks
    directory.py         SAVE/latest_checkpointed_iteration.txt + iter_NNNNNNN/, atomic commit
    formats.py, source.py  which format a directory holds; CheckpointSource, the CommonRecord
    megatron_*.py        Megatron's keys (as views), torch_dist, legacy files and recorded args
    vocab.py, safe_pickle.py  the padding-row rule; Megatron's pickles read without running code
    checkpointing.py     save_checkpoint / load_checkpoint of a training state
    async_save.py, dcp_async.py, non_persistent.py  --async-save; Megatron's non-persistent saves
    staging_arena.py, writer_process.py  --async-save's shared host staging and writer process

Importing this package does not import DCP (seconds per rank); dcp_io does, on first save or load.
"""

from megafab.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
