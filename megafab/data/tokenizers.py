"""Tokenizers behind Megatron's --tokenizer-type; each offers tokenize, detokenize, vocab_size, eod, pad.

Everything loads from local files: nothing downloads. The files each type reads are TOKENIZER_FILES;
`file_problems` says why a given path cannot be one (missing, a directory, empty, unreadable), and
building a tokenizer turns every library's complaint about a file of the wrong kind into one
DataError naming the flag, the file and what the type reads (the start-up probe reports both).
"""

from __future__ import annotations

import base64
import json
import os

from megafab.data.errors import DataError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
_SENTENCEPIECE = (("--tokenizer-model", "tokenizer_model",
                   "a SentencePiece model file (tokenizer.model, as sentencepiece's trainer writes it)"),)
# (flag, the data config's field, what the file is) of every file a tokenizer type reads
TOKENIZER_FILES = {
    "GPT2BPETokenizer": (("--vocab-file", "vocab_file", "GPT-2's vocab.json (a JSON object token -> id)"),
                         ("--merge-file", "merge_file", "GPT-2's merges.txt (one 'a b' merge per line)")),
    "SentencePieceTokenizer": _SENTENCEPIECE, "GPTSentencePieceTokenizer": _SENTENCEPIECE,
    "Llama2Tokenizer": _SENTENCEPIECE,
    "HuggingFaceTokenizer": (("--tokenizer-model", "tokenizer_model",
                              "a tokenizer.json file or a directory written by save_pretrained"),),
    "TikTokenizer": (("--tokenizer-model", "tokenizer_model", "Megatron's tiktoken vocabulary .json (a "
                                                              "JSON list of rank/token_bytes/token_str)"),),
    "NullTokenizer": (),
}
# any of these makes a directory one transformers' AutoTokenizer may load
HF_DIRECTORY_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                      "spiece.model")


def unusable(tokenizer_type: str, flag: str, path: str, wrong: str) -> str:
    """One line: the flag, the file, what is wrong with it, and what this type reads instead."""
    what = next((w for f, _, w in TOKENIZER_FILES.get(tokenizer_type, ()) if f == flag), "its file")
    return f"{flag} {path}: {wrong}; --tokenizer-type {tokenizer_type} reads {what}"


def _reason(error: BaseException) -> str:
    """A library's complaint, short: its first line."""
    return ((str(error).strip().splitlines() or [type(error).__name__])[0])[:160]


def file_problem(tokenizer_type: str, flag: str, path: str) -> str | None:
    """Why `path` given to `flag` cannot be the file this type reads, before any library opens it
    (missing, a directory where a file belongs, a directory with no tokenizer, empty, unreadable)."""
    if not os.path.exists(path):
        return unusable(tokenizer_type, flag, path, "no such file or directory")
    if os.path.isdir(path):
        if tokenizer_type != "HuggingFaceTokenizer":
            return unusable(tokenizer_type, flag, path, "is a directory, not a file")
        if not any(os.path.isfile(os.path.join(path, n)) for n in HF_DIRECTORY_FILES):
            return unusable(tokenizer_type, flag, path, f"the directory holds no tokenizer (none of "
                                                        f"{', '.join(HF_DIRECTORY_FILES)})")
        return None
    try:
        with open(path, "rb") as f:
            empty = not f.read(1)
    except OSError as e:
        return unusable(tokenizer_type, flag, path, f"cannot be read ({e.strerror or _reason(e)})")
    return unusable(tokenizer_type, flag, path, "is empty (0 bytes)") if empty else None


def file_problems(tokenizer_type: str, **paths: str | None) -> list[str]:
    """file_problem of every file this type reads that `paths` (field name -> path) gives."""
    return [problem for flag, name, _ in TOKENIZER_FILES.get(tokenizer_type, ())
            if paths.get(name) is not None
            and (problem := file_problem(tokenizer_type, flag, paths[name])) is not None]


def _need_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: file not found")
    problem = file_problem(tokenizer_type, flag, path)
    if problem is not None:
        raise DataError(problem)
    return path


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from vocab.json + merges.txt; eod is <|endoftext|>."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        kind = "GPT2BPETokenizer"
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
            raise DataError(unusable(kind, "--vocab-file", vocab_file,
                                     f"not a JSON vocabulary ({_reason(e)})")) from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise DataError(unusable(kind, "--vocab-file", vocab_file, "not a JSON object of token -> id"))
        if "<|endoftext|>" not in vocab:
            raise DataError(unusable(kind, "--vocab-file", vocab_file, "has no <|endoftext|> token (not a "
                                                                       "GPT-2 vocabulary?)"))
        _check_merges(merge_file)
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
            raise DataError(f"--vocab-file {vocab_file} and --merge-file {merge_file} do not make a BPE "
                            f"tokenizer ({_reason(e)}); give GPT-2's vocab.json and the merges.txt made "
                            f"with it") from None
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        # As transformers' GPT-2 tokenizer (Megatron's): '<|endoftext|>' written in text is that token.
        self._tok.add_special_tokens(["<|endoftext|>"])
        self.vocab_size = len(vocab)
        self.eod = vocab["<|endoftext|>"]
        self.pad = None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _check_merges(merge_file: str) -> None:
    """A merges.txt is UTF-8 text of 'a b' lines (an optional '#version' line first)."""
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as e:
        raise DataError(unusable("GPT2BPETokenizer", "--merge-file", merge_file,
                                 f"not text ({_reason(e)})")) from None
    for number, line in enumerate(lines, start=1):
        if line and not (number == 1 and line.startswith("#version")) and len(line.split(" ")) != 2:
            raise DataError(unusable("GPT2BPETokenizer", "--merge-file", merge_file,
                                     f"line {number} {line[:40]!r} is not one merge 'a b'"))


class GPTSentencePieceTokenizer:
    """A SentencePiece model used as is; eod is its eos id, pad its pad id (None when absent)."""

    add_bos = False

    def __init__(self, model_file: str):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError/its own
            raise DataError(unusable(type(self).__name__, "--tokenizer-model", model_file,
                                     f"not a SentencePiece model ({_reason(e)})")) from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        if self.eod < 0:
            raise DataError(unusable(type(self).__name__, "--tokenizer-model", model_file,
                                     "the model has no eos piece to end documents"))

    def tokenize(self, text: str) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos] + ids if self.add_bos and self.bos >= 0 else ids

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2's SentencePiece: every document starts with bos."""

    add_bos = True


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """SentencePiece with Megatron's extra special tokens (<CLS> <SEP> <EOD> <MASK> <PAD> <BOS> <EOS>).

    A special token already in the model keeps its id; the others are appended after the model's
    pieces. eod is <EOD>. Special tokens written in the text are not parsed.
    """

    SPECIAL = ("<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>", "<BOS>", "<EOS>")

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.special_ids: dict[str, int] = {}
        size = self._sp.get_piece_size()
        for token in self.SPECIAL:
            existing = self._sp.piece_to_id(token)
            if existing != self._sp.unk_id() or token == self._sp.id_to_piece(self._sp.unk_id()):
                self.special_ids[token] = existing
            else:
                self.special_ids[token] = size
                size += 1
        self.vocab_size = size
        self.eod = self.special_ids["<EOD>"]
        self.pad = self.special_ids["<PAD>"]
        self._names = {v: k for k, v in self.special_ids.items() if v >= self._sp.get_piece_size()}

    def detokenize(self, ids) -> str:
        base = self._sp.get_piece_size()
        return "".join(self._names[i] if i >= base else self._sp.decode([int(i)]) for i in ids) \
            if any(i >= base for i in ids) else self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
    """A local tokenizer.json (tokenizers library) or a saved transformers tokenizer directory."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        kind, eos_names = "HuggingFaceTokenizer", ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                   trust_remote_code=trust_remote_code)
            except Exception as e:  # noqa: BLE001 - transformers fails in many ways on a bad directory
                raise DataError(unusable(kind, "--tokenizer-model", path,
                                         f"transformers cannot load a tokenizer from it ({_reason(e)})")) \
                    from None
            self._encode = lambda text: hf.encode(text, add_special_tokens=False)
            self._decode = lambda ids: hf.decode(ids)
            self.vocab_size = len(hf)
            vocab = hf.get_vocab()
            eos = hf.eos_token_id if hf.eos_token_id is not None else \
                next((vocab[t] for t in eos_names if t in vocab), None)
            pad = hf.pad_token_id
        else:
            from tokenizers import Tokenizer

            try:
                tok = Tokenizer.from_file(path)
            except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
                raise DataError(unusable(kind, "--tokenizer-model", path,
                                         f"not a tokenizer.json ({_reason(e)})")) from None
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
            vocab = tok.get_vocab(with_added_tokens=True)
            eos = next((vocab[t] for t in eos_names if t in vocab), None)
            pad = next((vocab[t] for t in ("<pad>", "<|pad|>", "[PAD]") if t in vocab), None)
        if eos is None:
            raise DataError(unusable(kind, "--tokenizer-model", path, f"no end-of-document token (eos: none "
                                                                      f"of {', '.join(eos_names)})"))
        self.eod, self.pad = eos, pad

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def detokenize(self, ids) -> str:
        return self._decode([int(i) for i in ids])


# Megatron-LM's pre-tokenization regexes (--tiktoken-pattern v1 / v2); a different regex splits text
# differently, so these must be Megatron's byte for byte.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_SPECIAL = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


class TikTokenizer:
    """megatron-core's TikTokenizer from a local vocabulary file (nothing downloads).

    The file is Megatron's JSON list [{"rank": i, "token_bytes": base64, "token_str": ...}] (the
    first 256 ranks are the single bytes). Ids 0 .. num_special_tokens-1 are special tokens (the
    named ones, then <SPECIAL_i> fillers); BPE rank r gets id r + num_special_tokens; the vocabulary
    is cut to vocab_size ids (default 2**17). eod is </s>.
    """

    def __init__(self, path: str, pattern: str, vocab_size: int | None = None, num_special_tokens: int = 1000,
                 special_tokens: list[str] | None = None):
        import tiktoken

        vocab_size = vocab_size or 2**17
        named = list(special_tokens or TIKTOKEN_SPECIAL)
        missing = [t for t in TIKTOKEN_SPECIAL if t not in named]
        if missing or len(set(named)) != len(named) or not len(named) <= num_special_tokens < vocab_size:
            raise DataError(f"TikTokenizer special tokens {named}: they must be unique, include "
                            f"{TIKTOKEN_SPECIAL}, and number at most --tiktoken-num-special-tokens "
                            f"{num_special_tokens} (< vocabulary size {vocab_size})")
        specials = named + [f"<SPECIAL_{i}>" for i in range(len(named), num_special_tokens)]
        try:
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
            ranks = {base64.b64decode(e["token_bytes"]): int(e["rank"]) + num_special_tokens
                     for e in entries[:vocab_size - num_special_tokens]}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(unusable("TikTokenizer", "--tokenizer-model", path,
                                     f"not a Megatron tiktoken vocabulary ({_reason(e)})")) from None
        if sorted(ranks.values()) != list(range(num_special_tokens, vocab_size)):
            raise DataError(f"--tokenizer-model {path}: holds {len(ranks)} BPE ranks, fewer than the "
                            f"{vocab_size - num_special_tokens} that --vocab-size {vocab_size} minus "
                            f"{num_special_tokens} special tokens needs (or its ranks are not 0, 1, 2, ...)")
        try:
            self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
                                          mergeable_ranks=ranks,
                                          special_tokens={t: i for i, t in enumerate(specials)})
        except Exception as e:  # noqa: BLE001 - tiktoken's own checks of the ranks raise several kinds
            raise DataError(unusable("TikTokenizer", "--tokenizer-model", path,
                                     f"tiktoken refuses its ranks ({_reason(e)})")) from None
        self.num_special_tokens = num_special_tokens
        self.vocab_size = vocab_size
        self.eod, self.bos, self.pad = specials.index("</s>"), specials.index("<s>"), specials.index("<pad>")

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def detokenize(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


class NullTokenizer:
    """Text is whitespace-separated ids; vocab_size ids plus one eod (= vocab_size)."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or vocab_size <= 0:
            raise DataError(f"NullTokenizer needs --vocab-size > 0, got {vocab_size}")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)
        self.pad = None

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None,
                    tiktoken_pattern: str | None = None, num_special_tokens: int = 1000,
                    special_tokens: list[str] | None = None, trust_remote_code: bool = False):
    """The tokenizer named by Megatron's --tokenizer-type, from local files (trust_remote_code: a
    HuggingFace directory's own tokenizer code may run, as Megatron's --trust-remote-code)."""
    if tokenizer_type == "TikTokenizer":
        if tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got "
                            f"{tiktoken_pattern!r}")
        path = _need_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return TikTokenizer(path, tiktoken_pattern, vocab_size, num_special_tokens, special_tokens)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_need_file(vocab_file, "--vocab-file", tokenizer_type),
                                _need_file(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        cls = {"SentencePieceTokenizer": SentencePieceTokenizer,
               "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
               "Llama2Tokenizer": Llama2Tokenizer}[tokenizer_type]
        return cls(_need_file(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_file(tokenizer_model, "--tokenizer-model", tokenizer_type),
                                    trust_remote_code)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise DataError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                    f"{', '.join(TOKENIZER_TYPES)}")
