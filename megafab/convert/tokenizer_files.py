"""Tokenizer files for an exported HF directory, from the tokenizer the training config names."""

from __future__ import annotations

import os
import shutil

from megafab.config import DataConfig

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _megafab_tokenizer(d: DataConfig):
    from megafab.data.tokenizers import build_tokenizer

    if d.tokenizer_type in (None, "NullTokenizer"):
        return None
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model)


def tokenizer_special_ids(d: DataConfig) -> dict[str, int]:
    """{"eod": id} (and "bos" for SentencePiece models that have one) of the training tokenizer."""
    tok = _megafab_tokenizer(d)
    if tok is None:
        return {}
    ids = {"eod": tok.eod}
    sp = getattr(tok, "_sp", None)
    if sp is not None and sp.bos_id() >= 0:
        ids["bos"] = sp.bos_id()
    return ids


def _hf_tokenizer(d: DataConfig):
    """A transformers tokenizer equivalent to the training one, or None (NullTokenizer / none)."""
    kind = d.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        if os.path.isdir(d.tokenizer_model):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(d.tokenizer_model, local_files_only=True)
        from transformers import PreTrainedTokenizerFast

        eod = _megafab_tokenizer(d).eod
        hf = PreTrainedTokenizerFast(tokenizer_file=d.tokenizer_model)
        hf.eos_token = hf.convert_ids_to_tokens(eod)
        return hf
    if kind == "GPT2BPETokenizer":
        from transformers import GPT2Tokenizer

        return GPT2Tokenizer(vocab_file=d.vocab_file, merges_file=d.merge_file)
    if kind in SENTENCEPIECE_TYPES:
        from transformers import LlamaTokenizer

        return LlamaTokenizer(vocab_file=d.tokenizer_model, add_bos_token=False, add_eos_token=False)
    return None


def save_tokenizer_files(d: DataConfig, out_dir: str) -> bool:
    """Write the tokenizer's files into out_dir; False when the tokenizer has none (NullTokenizer)."""
    hf = _hf_tokenizer(d)
    if hf is None:
        return False
    hf.save_pretrained(out_dir)
    sp_copy = os.path.join(out_dir, "tokenizer.model")
    if d.tokenizer_type in SENTENCEPIECE_TYPES and not os.path.exists(sp_copy):
        shutil.copyfile(d.tokenizer_model, sp_copy)
    return True
