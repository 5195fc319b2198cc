"""Tokenizer and data iterators for a training run, with Megatron's sample counts."""

from __future__ import annotations

import torch.distributed as dist

from megafab.config import pad_vocab_size
from megafab.data.builder import build_gpt_datasets
from megafab.data.samplers import build_data_iterator
from megafab.data.tokenizers import build_tokenizer
from megafab.training.batch_size import train_iterations
from megafab.training.run_record import dataset_lines


def attach_tokenizer(cfg):
    """Build the tokenizer (no process group needed) and size the vocabulary from it."""
    d, m = cfg.data, cfg.model
    kind = d.tokenizer_type or "NullTokenizer"
    tokenizer = build_tokenizer(kind, d.vocab_file, d.merge_file, d.tokenizer_model, m.vocab_size,
                                d.tiktoken_pattern, d.tiktoken_num_special_tokens, d.tokenizer_special_tokens)
    m.vocab_size = tokenizer.vocab_size
    m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by,
                                         cfg.parallel.tensor_model_parallel_size)
    return tokenizer


def sample_counts(cfg, train_iters: int) -> tuple[int, int, int]:
    """Megatron's: train = iters * gbs; valid = (iters // eval_interval + 1) * eval_iters * gbs;
    test = eval_iters * gbs."""
    t = cfg.training
    gbs = t.global_batch_size
    train = t.train_samples or train_iters * gbs
    valid = (train_iters // t.eval_interval + 1) * t.eval_iters * gbs
    return train, valid, t.eval_iters * gbs


def build_data_iterators(cfg, topo, consumed_train_samples: int, tokenizer=None):
    d, t = cfg.data, cfg.training
    tokenizer = tokenizer or attach_tokenizer(cfg)
    targets = sample_counts(cfg, train_iterations(cfg))
    datasets = build_gpt_datasets(
        data_path=d.data_path, split=d.split or "969,30,1", seq_length=cfg.model.seq_length,
        seed=t.seed, num_samples=targets, tokenizer=tokenizer,
        cache_path=d.data_cache_path, eod_mask_loss=d.eod_mask_loss,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        mock=d.mock_data, train_data_path=d.train_data_path, valid_data_path=d.valid_data_path,
        test_data_path=d.test_data_path, barrier=dist.barrier, is_builder=topo.rank == 0,
        mmap_bin_files=d.mmap_bin_files)
    if topo.rank == 0:
        print("\n".join(dataset_lines(targets, datasets)), flush=True)
    consumed = [consumed_train_samples, 0, 0]
    return tuple(build_data_iterator(ds, consumed[i], t.micro_batch_size, topo.dp_rank, topo.dp,
                                     num_workers=d.num_workers) for i, ds in enumerate(datasets))
