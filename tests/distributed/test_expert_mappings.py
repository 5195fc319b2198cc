"""The MoE dispatchers' collectives (uneven SP gather / reduce-scatter, the EP all-to-all), forward
and backward, against the result computed by hand; one rank sends no rows."""

import torch
import torch.distributed as dist

from megafab.distributed import mappings as m
from megafab.run.fork_ranks import run_ranks

SIZES = [2, 3]  # rows of rank 0, rank 1
SENDS = [[1, 2], [0, 0]]  # SENDS[r][q]: rows rank r sends rank q (all_to_all)


def _tensor(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _pair(fn, x, grad):
    leaf = x.clone().requires_grad_(True)
    y = fn(leaf)
    (y * grad).sum().backward()
    return y.detach(), leaf.grad


def _chunk(t: torch.Tensor, sizes: list[int], i: int) -> torch.Tensor:
    return t.split(sizes)[i]


def _check(rank, world):
    group, total, errors = dist.new_group([0, 1]), sum(SIZES), []

    def close(a, b):
        errors.append(a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12))

    xs = [_tensor(10 + r, SIZES[r]) for r in range(world)]
    grads = [_tensor(20 + r, total) for r in range(world)]
    y, dx = _pair(lambda x: m.gather_from_sequence_parallel_region(x, group, output_split_sizes=SIZES),
                  xs[rank], grads[rank])
    close(y, torch.cat(xs))
    close(dx, sum(_chunk(g, SIZES, rank) for g in grads))
    _, dx = _pair(lambda x: m.gather_from_sequence_parallel_region(x, group, False, output_split_sizes=SIZES),
                  xs[rank], grads[rank])
    close(dx, _chunk(grads[rank], SIZES, rank))

    full = [_tensor(30 + r, total) for r in range(world)]
    part_grads = [_tensor(40 + r, SIZES[r]) for r in range(world)]
    y, dx = _pair(lambda x: m.reduce_scatter_to_sequence_parallel_region(x, group, input_split_sizes=SIZES),
                  full[rank], part_grads[rank])
    close(y, sum(_chunk(f, SIZES, rank) for f in full))
    close(dx, torch.cat(part_grads))

    received = [SENDS[r][rank] for r in range(world)]
    ins = [_tensor(50 + r, sum(SENDS[r])) for r in range(world)]
    outs_grad = [_tensor(60 + q, sum(SENDS[r][q] for r in range(world))) for q in range(world)]
    y, dx = _pair(lambda x: m.all_to_all(x, received, SENDS[rank], group), ins[rank], outs_grad[rank])
    close(y, torch.cat([_chunk(ins[r], SENDS[r], rank) for r in range(world)]))
    sent_back = [_chunk(outs_grad[q], [SENDS[r][q] for r in range(world)], rank) for q in range(world)]
    close(dx, torch.cat(sent_back))
    return errors


def test_uneven_collectives_and_all_to_all():
    for errors in run_ranks(_check, 2, timeout=60):
        assert errors and all(errors), errors
