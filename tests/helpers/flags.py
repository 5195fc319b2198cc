"""A small valid model's flags that configuration tests add their flags to."""

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "1000"]


def planned_gpt(extra: list[str], world: int):
    """The step-time tests' GPT (4 layers, hidden 64, 8 micro-batches of 1) as a --dry-run config."""
    from megafab.arguments import config_from_args

    return config_from_args(
        ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "256", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--make-vocab-size-divisible-by", "1", "--dry-run"] + extra,
        world_size=world)
