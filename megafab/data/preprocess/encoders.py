"""Text -> token ids exactly as Megatron-LM's tools/preprocess_data.py computes them, on the fastest engine.

Megatron (megatron.core.tokenizers, Megatron-LM main and core >= 0.17) calls `tokenizer.tokenize(text)`
(what that is per --tokenizer-type: _reference). Special-token strings written in the text are
parsed into their ids, as Megatron does; `special_tokens_as_text=True` (--special-tokens-as-text)
encodes them as ordinary text instead, since a web page containing '<|endoftext|>' would split a
document.

Engines, chosen on merit (build_encoder; measured in benchmarks/README.md, Data): gigatoken (Rust
BPE and SentencePiece-BPE kernels), used when installed and it reproduces the reference ids on a
probe set of edge cases; reference, the library Megatron itself ends up calling, always available.
Each engine's `encode(texts) -> list of uint32/int64 numpy arrays` runs on the calling thread (one
worker process = one core); parallelism comes from worker processes (pipeline.py) or Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megafab.data.errors import DataError
from megafab.data.tokenizers import build_tokenizer

ENGINES = ("auto", "gigatoken", "reference")

# Strings on which a fast engine must reproduce the reference ids before it is trusted.
PROBES = (
    "",
    " ",
    "  \n\t ",
    "a  b   c",
    "line one\r\nline two\r\n",
    "héllo wörld — 日本語 🎉",
    "12345 678.9",
    "<|endoftext|>",
    "x<|endoftext|>y",
    "a </s> b <s>",
    "<pad><unk>",
    "\u2028\x00",
    "The quick brown fox jumps over the lazy dog. " * 8,
)


@dataclass(frozen=True)
class TokenizerSpec:
    """What to build in every worker (picklable): Megatron's tokenizer flags plus megafab's choices."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    special_tokens_as_text: bool = False
    engine: str = "auto"


class Encoder:
    """One engine bound to one tokenizer: encode(texts) -> ids per text; name says which engine."""

    def __init__(self, name: str, encode_one: Callable[[str], np.ndarray], vocab_size: int, eod: int):
        self.name = name
        self._encode_one = encode_one
        self.vocab_size = vocab_size
        self.eod = eod

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [self._encode_one(text) for text in texts]


# ---- reference engines (what Megatron calls) -------------------------------------------------------


def _gpt2_tokenizers(spec: TokenizerSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(spec.vocab_file, spec.merge_file))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if not spec.special_tokens_as_text:
        tok.add_special_tokens(["<|endoftext|>"])  # transformers' GPT-2 tokenizer registers it so
    return tok


def _tokenizer_json(path: str) -> str:
    """A tokenizer.json file, or the one inside a saved tokenizer directory."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def _hf_file_tokenizers(spec: TokenizerSpec, path: str | None = None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path or spec.tokenizer_model)
    if spec.special_tokens_as_text:
        tok.encode_special_tokens = True
    return tok


def _as_ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def _reference(spec: TokenizerSpec, vocab_size: int, eod: int) -> Encoder:
    """What Megatron's `tokenizer.tokenize(text)` is, per --tokenizer-type:
      GPT2BPETokenizer          transformers' GPT-2 tokenizer from vocab.json + merges.txt, called as
                                `tokenizer(text).input_ids`: special-token strings in the text
                                ('<|endoftext|>') are parsed into their ids, no bos/eos is added.
      HuggingFaceTokenizer      `AutoTokenizer(path)(text).input_ids`: the same parsing, plus whatever
                                the post-processor adds (a Llama-3 tokenizer.json puts
                                <|begin_of_text|> before every document).
      GPTSentencePieceTokenizer `encode_as_ids(text)`: SentencePiece never matches control pieces
                                (<s>, </s>) from text; user-defined pieces are matched.
      NullTokenizer             whitespace-separated integers.
    Engines: tokenizers (GPT-2 BPE, tokenizer.json), transformers (a saved tokenizer directory),
    sentencepiece."""
    kind = spec.tokenizer_type
    if kind == "GPT2BPETokenizer":
        tok = _gpt2_tokenizers(spec)
        return Encoder(
            "tokenizers", lambda t: _as_ids(tok.encode(t, add_special_tokens=True).ids), vocab_size, eod
        )
    if kind == "HuggingFaceTokenizer" and os.path.isdir(spec.tokenizer_model):
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(spec.tokenizer_model, local_files_only=True)
        split = {"split_special_tokens": True} if spec.special_tokens_as_text else {}
        return Encoder("transformers", lambda t: _as_ids(hf(t, **split).input_ids), vocab_size, eod)
    if kind == "HuggingFaceTokenizer":
        tok = _hf_file_tokenizers(spec)
        return Encoder(
            "tokenizers", lambda t: _as_ids(tok.encode(t, add_special_tokens=True).ids), vocab_size, eod
        )
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tokenizer = build_tokenizer(kind, tokenizer_model=spec.tokenizer_model)
        return Encoder("sentencepiece", lambda t: _as_ids(tokenizer.tokenize(t)), vocab_size, eod)
    if kind == "NullTokenizer":

        def null(text: str) -> np.ndarray:
            try:
                return np.array(text.split(), dtype=np.int64)
            except ValueError:
                raise DataError(
                    f"NullTokenizer: text {text[:60]!r} is not whitespace-separated integer ids; "
                    "pass token ids, or choose a real --tokenizer-type"
                ) from None

        return Encoder("null", null, vocab_size, eod)
    raise DataError(f"--tokenizer-type {kind!r} has no preprocess encoder")


# ---- gigatoken ------------------------------------------------------------------------------------


def _without_specials(tokenizer_json: str, drop) -> str:
    config = json.loads(tokenizer_json)
    config["added_tokens"] = [t for t in config.get("added_tokens") or [] if not drop(t)]
    return json.dumps(config)


def _post_processor_wrap(tok) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a single text (bos/eos)."""
    plain = tok.encode("x", add_special_tokens=False).ids
    full = tok.encode("x", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise DataError(f"--tokenizer-model {tok}: its post-processor does not wrap a text; cannot use gigatoken")


def _gigatoken(spec: TokenizerSpec, vocab_size: int, eod: int) -> Encoder | None:
    """The gigatoken engine for spec, or None where gigatoken does not cover this tokenizer. Its Rust
    kernels run GPT-2 BPE far faster than the tokenizers library (benchmarks/README.md, Data)."""
    import gigatoken

    kind = spec.tokenizer_type
    prefix: list[int] = []
    suffix: list[int] = []
    if kind == "GPT2BPETokenizer":
        backend = gigatoken.Tokenizer(_gpt2_tokenizers(spec))
    elif kind == "HuggingFaceTokenizer" and os.path.isfile(_tokenizer_json(spec.tokenizer_model)):
        tok = _hf_file_tokenizers(spec, _tokenizer_json(spec.tokenizer_model))
        prefix, suffix = _post_processor_wrap(tok)
        text = tok.to_str()
        if spec.special_tokens_as_text:
            text = _without_specials(text, lambda t: t.get("special"))
        backend = gigatoken.Tokenizer.from_json(text)
    elif kind == "GPTSentencePieceTokenizer":
        import sentencepiece
        from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

        sp = sentencepiece.SentencePieceProcessor(model_file=spec.tokenizer_model)
        try:
            data = sentencepiece_to_tokenizer_json(open(spec.tokenizer_model, "rb").read())
        except Exception:  # noqa: BLE001 - gigatoken covers BPE models only; unigram raises
            return None
        # SentencePiece never matches control pieces (<s>, </s>, <pad>) from text; gigatoken would.
        controls = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)}
        backend = gigatoken.Tokenizer.from_json(_without_specials(data, lambda t: t["content"] in controls))
    else:
        return None
    encode = backend.backend.encode
    if prefix or suffix:
        head, tail = np.asarray(prefix, np.uint32), np.asarray(suffix, np.uint32)
        return Encoder("gigatoken", lambda t: np.concatenate([head, encode(t), tail]), vocab_size, eod)
    return Encoder("gigatoken", encode, vocab_size, eod)


def _agrees(fast: Encoder, reference: Encoder) -> bool:
    return all(
        np.array_equal(a, b) for a, b in zip(fast.encode(list(PROBES)), reference.encode(list(PROBES)))
    )


# Encoders built in this process, by spec and the state of its files: the tool's own check, its
# in-process worker and the forked workers (which inherit this dict) build the tokenizer once.
_built: dict[tuple, Encoder] = {}


def _cache_key(spec: TokenizerSpec, vocab_size: int, eod: int) -> tuple:
    files = []
    for path in (spec.vocab_file, spec.merge_file, spec.tokenizer_model):
        try:
            stat = os.stat(_tokenizer_json(path)) if path else None
        except OSError:
            stat = None
        files.append((path, stat and stat.st_mtime_ns, stat and stat.st_size))
    return spec, vocab_size, eod, tuple(files)


def build_encoder(spec: TokenizerSpec, vocab_size: int, eod: int, note=None) -> Encoder:
    """The engine for spec: gigatoken when asked or when auto finds it exact on the probes (special
    tokens, whitespace, CRLF, non-ASCII, digits), else the reference. note(message) reports a
    fallback (stderr by default). Built once per process."""
    key = _cache_key(spec, vocab_size, eod)
    if key not in _built:
        encoder = _build_encoder(spec, vocab_size, eod, note)
        engine = "gigatoken" if encoder.name == "gigatoken" else "reference"
        resolved = dataclasses.replace(spec, engine=engine)
        _built[key] = _built[_cache_key(resolved, vocab_size, eod)] = encoder
    return _built[key]


def _build_encoder(spec: TokenizerSpec, vocab_size: int, eod: int, note) -> Encoder:
    if spec.engine not in ENGINES:
        raise DataError(f"--tokenizer-engine {spec.engine}: choose one of {', '.join(ENGINES)}")
    note = note or (lambda message: print(f"note: {message}", file=sys.stderr, flush=True))
    reference = _reference(spec, vocab_size, eod)
    if spec.engine == "reference":
        return reference
    try:
        fast = _gigatoken(spec, vocab_size, eod)
        reason = (
            None if fast is not None else f"gigatoken does not cover {spec.tokenizer_type} with this model"
        )
    except ImportError:
        fast, reason = None, "gigatoken is not installed (pip install gigatoken, or pip install -e '.[data]')"
    except (RuntimeError, ValueError) as e:  # e.g. a BPE that is not byte-level: gigatoken cannot load it
        fast, reason = None, f"gigatoken cannot load this tokenizer ({str(e).splitlines()[0]})"
    if fast is not None and not _agrees(fast, reference):
        fast, reason = None, "gigatoken's ids differ from the reference tokenizer's on the probe texts"
    if fast is None:
        if spec.engine == "gigatoken":
            raise DataError(f"--tokenizer-engine gigatoken: {reason}; use --tokenizer-engine reference")
        note(f"tokenizing with {reference.name} ({reason}); it is slower than gigatoken")
        return reference
    return fast
