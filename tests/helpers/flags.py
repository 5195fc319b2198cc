"""The tiny GPT's sizes, declared once (every tiny model of the tests starts here and overrides what it
needs: tiny.py's tiny_config, the flag lists of the configuration and end-to-end tests), and a small
valid model's flags that configuration tests add their flags to."""

TINY_GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)


def tiny_flags(**sizes) -> list[str]:
    """TINY_GPT with `sizes` overriding (or adding) fields, as Megatron flags in that order:
    tiny_flags(num_layers=2) == ["--num-layers", "2", "--hidden-size", "32", ...]."""
    return [arg for name, value in {**TINY_GPT, **sizes}.items()
            for arg in (f"--{name.replace('_', '-')}", str(value))]


BASE = tiny_flags(hidden_size=64, num_attention_heads=8, seq_length=32) + [
    "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "1000"]


def planned_gpt(extra: list[str], world: int):
    """The step-time tests' GPT (4 layers, hidden 64, 8 micro-batches of 1) as a --dry-run config."""
    from megafab.arguments import config_from_args

    return config_from_args(
        tiny_flags(hidden_size=64, seq_length=32)
        + ["--max-position-embeddings", "32", "--vocab-size", "256", "--micro-batch-size", "1",
           "--global-batch-size", "8", "--make-vocab-size-divisible-by", "1", "--dry-run"] + extra,
        world_size=world)
