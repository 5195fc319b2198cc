"""Tokenizer files for an exported HF directory, from the tokenizer the training config names."""

from __future__ import annotations

import json
import os
import shutil

from megafab.config import DataConfig
from megafab.data.tokenizers import build_tokenizer

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _megafab_tokenizer(d: DataConfig):
    if d.tokenizer_type in (None, "NullTokenizer"):
        return None
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                           trust_remote_code=d.trust_remote_code)


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
    return None


def _save_sentencepiece(d: DataConfig, out_dir: str) -> None:
    """tokenizer.model + a LlamaTokenizer config matching megafab's tokenizer (BOS only for
    Llama2Tokenizer, Megatron's appended special tokens with their ids, eos = the eod token), then
    the converted tokenizer.json that transformers writes from it."""
    from transformers import AutoTokenizer

    ours = _megafab_tokenizer(d)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(d.tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": bool(ours.add_bos),
                   "add_eos_token": False, "legacy": True}, f, indent=1)
    hf = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    appended = [ours._names[i] for i in range(len(hf), ours.vocab_size)] if hasattr(ours, "_names") else []
    if appended:
        hf.add_special_tokens({"additional_special_tokens": appended})
    hf.eos_token = hf.convert_ids_to_tokens(ours.eod)
    hf.save_pretrained(out_dir)


def save_tokenizer_files(d: DataConfig, out_dir: str) -> bool:
    """Write the tokenizer's files into out_dir; False when the tokenizer has none (NullTokenizer)."""
    if d.tokenizer_type in SENTENCEPIECE_TYPES:
        _save_sentencepiece(d, out_dir)
        return True
    hf = _hf_tokenizer(d)
    if hf is None:
        return False
    hf.save_pretrained(out_dir)
    return True
