"""Tokenizer and data iterators for a training run, with Megatron's sample counts."""

from __future__ import annotations

import torch.distributed as dist

from megafab.checks.probes import tokenizer_of
from megafab.data.builder import build_gpt_datasets
from megafab.data.samplers import build_data_iterator
from megafab.training.batch_size import train_iterations
from megafab.training.run_record import dataset_lines


def attach_tokenizer(cfg):
    """The run's tokenizer (no process group needed); the config was sized from it before it was
    finalized (megafab.arguments, start_up=True), so the two agree."""
    return tokenizer_of(cfg.data, cfg.model.vocab_size)


def sample_counts(cfg, train_iters: int) -> tuple[int, int, int]:
    """Megatron's: train = iters * gbs; valid = (iters // eval_interval + 1) * eval_iters * eval gbs;
    test = eval_iters * eval gbs (--eval-global-batch-size, default --global-batch-size)."""
    t = cfg.training
    train = t.train_samples or train_iters * t.global_batch_size
    valid = (train_iters // t.eval_interval + 1) * t.eval_iters * t.eval_global_batch_size
    return train, valid, t.eval_iters * t.eval_global_batch_size


def build_datasets(cfg, topo, tokenizer=None) -> list:
    """(train, valid, test) datasets; every data file is opened and checked here, so a run builds
    them before its model (a bad file is reported before minutes of model building)."""
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
        mmap_bin_files=d.mmap_bin_files, inter_document_masking=d.dataloader_inter_document_masking)
    if topo.rank == 0:
        print("\n".join(dataset_lines(targets, datasets)), flush=True)
    return datasets


def build_data_iterators(cfg, topo, consumed_train_samples: int, tokenizer=None,
                         consumed_valid_samples: int = 0, datasets: list | None = None):
    """Iterators over `datasets` (built here when not given) from the consumed sample counts."""
    d, t = cfg.data, cfg.training
    datasets = datasets if datasets is not None else build_datasets(cfg, topo, tokenizer)
    # Validation restarts from its first batch once a resumed run has evaluated on all of it.
    valid = consumed_valid_samples % len(datasets[1]) if datasets[1] is not None and len(datasets[1]) else 0
    consumed = [consumed_train_samples, valid, 0]
    micro = [t.micro_batch_size, t.eval_micro_batch_size, t.eval_micro_batch_size]  # Megatron HEAD's loaders
    return tuple(build_data_iterator(ds, consumed[i], micro[i], topo.dp_rank, topo.dp,
                                     num_workers=d.num_workers) for i, ds in enumerate(datasets))
