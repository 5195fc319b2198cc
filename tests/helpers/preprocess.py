"""Megatron's tokenizer flags for the tiny tokenizers of tests/data/fixtures."""

from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "data" / "fixtures"
TOKENIZERS = {
    "gpt2": [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(FIXTURES / "gpt2_tiny" / "vocab.json"),
        "--merge-file",
        str(FIXTURES / "gpt2_tiny" / "merges.txt"),
    ],
    "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(FIXTURES / "hf_tiny")],
    "hf_file": [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(FIXTURES / "hf_tiny" / "tokenizer.json"),
    ],
    "sp": [
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        str(FIXTURES / "sp_tiny.model"),
    ],
}
