"""A small valid model's flags that configuration tests add their flags to."""

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "1000"]
