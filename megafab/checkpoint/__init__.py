"""megafab checkpoints: the one authority on their layout, for training, conversion and generation.
On disk they are Megatron-LM's (torch_dist, or the legacy torch files); megafab's earlier format is
read too. Parameter names and their grammar: megafab/param_names.py.

    layout.py          keys, global names and shapes (strided SwiGLU, tied copy, padded vocabulary);
                       ParamLayout / Shard: the boxes of each global tensor this rank holds
    boxes.py           rectangular boxes; a flat range of a row-major tensor as a few boxes
    dcp_io.py          torch.distributed.checkpoint (DCP) planners for Shards and byte objects, safe
                       metadata reading, partial-checkpoint checks
    state.py           the model, optimizer and RNG pieces of a training state, as Shards
    vocab.py           the padding-row rule (Megatron's) for conversion and for loading into a
                       differently padded vocabulary
    directory.py       SAVE/latest_checkpointed_iteration.txt + iter_NNNNNNN/, atomic commit
    formats.py         which format a directory holds (by its files); Megatron's --ckpt-format rule
    source.py          a checkpoint to load, whatever its format (CheckpointSource); the CommonRecord
                       of megafab's counters every writer stores
    megatron_keys.py   megafab (key, box) <-> Megatron (stacked key, box), as views
    megatron_dist.py   Megatron's torch_dist: common.pt, metadata.json, optimizer formats
    megatron_legacy.py Megatron's legacy mp_rank_XX[_YYY]/model_optim_rng.pt files
    megatron_args.py   the args a Megatron checkpoint records; the model-args check
    safe_pickle.py     Megatron's pickled files read without running pickled code
    checkpointing.py   save_checkpoint / load_checkpoint of a training state

Importing this package does not import DCP (seconds per rank); dcp_io does, on first save or load.
"""

from megafab.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
