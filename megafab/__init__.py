"""megafab: Megatron-style 3D-parallel GPT training that runs the same on CPU (gloo) and GPU (NCCL)."""

__version__ = "0.1.0"
