"""Start-up checks of what a configuration names on this machine: the data prefixes' .idx files,
the tokenizer files (opened: the tokenizer is built from them here), a writable --save, the
environment --deterministic-mode reads; and the
tokenizer's vocabulary size, which the config needs before it is finalized (the padded vocabulary
is derived from it).

Not rules (checks/rules.py is pure): the entry point runs `start_up_problems` with its machine
checks, before any process group, so these problems join the rule problems in one message.
"""

from __future__ import annotations

import os

from megafab.checks.run_rules import DATA_PATH_FLAGS
from megafab.data.blend_spec import parse_blend
from megafab.data.errors import DataError
from megafab.data.tokenizers import TOKENIZER_FILES, build_tokenizer, file_problems
from megafab.run import determinism


def start_up_problems(cfg) -> list[str]:
    """Every file the configuration names that is missing or unusable here, and (--deterministic-mode)
    every environment variable set to a value that is not deterministic."""
    env = determinism.env_problems(os.environ) if cfg.training.deterministic_mode else []
    return data_file_problems(cfg) + tokenizer_file_problems(cfg) + save_directory_problems(cfg) + env


def data_file_problems(cfg) -> list[str]:
    out = []
    for flag in DATA_PATH_FLAGS:
        try:
            blend = parse_blend(getattr(cfg.data, flag))
        except DataError:
            continue  # a rule reports it
        for prefix in blend[0] if blend else []:
            if not os.path.exists(prefix + ".idx"):
                out.append(f"data prefix {prefix}: {prefix}.idx not found (a Megatron dataset is "
                           f"PREFIX.bin + PREFIX.idx, e.g. made by tools/preprocess_data.py)")
    return out


def tokenizer_file_problems(cfg) -> list[str]:
    """Each file the tokenizer reads: missing, a directory where a file belongs, empty, unreadable,
    or of the wrong kind (the tokenizer is built from them; kept for tokenizer_vocab_size)."""
    d = cfg.data
    files = TOKENIZER_FILES.get(d.tokenizer_type, ())
    given = {name: getattr(d, name) for _, name, _ in files}
    if not files or None in given.values():
        return []  # no file to read (NullTokenizer), or a flag missing: data_problems says which
    problems = file_problems(d.tokenizer_type, **given)
    if problems or d.tokenizer_type == "TikTokenizer" and d.tiktoken_pattern is None:
        return problems
    try:
        _built(d, cfg.model.vocab_size)
    except DataError as e:
        return [str(e)]
    return []


def save_directory_problems(cfg) -> list[str]:
    save = cfg.checkpoint.save
    problem = unwritable_directory(save) if save else None
    return [f"--save {save}: {problem} (found now, not at the first save)"] if problem else []


def unwritable_directory(path: str) -> str | None:
    """Why `path` cannot be made and written as a directory, or None when it can."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


def _tokenizer_settings(d) -> tuple:
    return (d.tokenizer_type or "NullTokenizer", d.vocab_file, d.merge_file, d.tokenizer_model,
            d.tiktoken_pattern, d.tiktoken_num_special_tokens,
            tuple(d.tokenizer_special_tokens) if d.tokenizer_special_tokens else None, d.trust_remote_code)


# The tokenizers this process built, by (settings, the vocabulary size asked for), and those it sized
# a configuration with, by (settings, vocabulary size): the probe builds a tokenizer once, and the data
# pipeline tokenizes with the very tokenizer the padded vocabulary was derived from.
_BUILT: dict[tuple, object] = {}
_SIZED: dict[tuple, object] = {}


def tokenizer_vocab_size(cfg) -> int:
    """The vocabulary size of the run's tokenizer (NullTokenizer, --vocab-size ids plus one eod,
    without --tokenizer-type), built here from the files the flags name."""
    tokenizer = _built(cfg.data, cfg.model.vocab_size)
    _SIZED[_tokenizer_settings(cfg.data) + (tokenizer.vocab_size,)] = tokenizer
    return tokenizer.vocab_size


def tokenizer_of(data_cfg, vocab_size: int | None):
    """The tokenizer a configuration was sized with (tokenizer_vocab_size, before finalize); for a
    configuration built in code and never sized, the tokenizer its flags name."""
    sized = _SIZED.get(_tokenizer_settings(data_cfg) + (vocab_size,))
    return sized if sized is not None else _build(data_cfg, vocab_size)


def _built(data_cfg, vocab_size: int | None):
    key = _tokenizer_settings(data_cfg) + (vocab_size,)
    if key not in _BUILT:
        _BUILT[key] = _build(data_cfg, vocab_size)
    return _BUILT[key]


def _build(data_cfg, vocab_size: int | None):
    kind, vocab_file, merge_file, model, pattern, num_special, special, trust = _tokenizer_settings(data_cfg)
    return build_tokenizer(kind, vocab_file, merge_file, model, vocab_size, pattern, num_special,
                           list(special) if special else None, trust)
