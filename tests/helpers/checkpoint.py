"""Shared by the checkpoint tests: a float64 TrainState of any layout (a MoE one too), a training
loop whose global samples do not depend on the DP size, and every tensor of a saved checkpoint."""

import torch

from megafab import checks
from megafab.checkpoint import checkpointing
from megafab.checkpoint.megatron_dist import TorchDistSource
from megafab.config import Config
from megafab.distributed.random import RNGStatesTracker, model_parallel_seed
from megafab.distributed.topology import build_topology
from megafab.training.build import TrainState, build_model, build_optimizer, build_scheduler
from megafab.training.step import train_step
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, batch, tiny_config

GLOBAL_BATCH = 4


def make_state(tp, dp, dist_opt, style=GPT2_STYLE, dtype=torch.float64, save=None, load=None, pp=1,
               **overrides):
    flat = dict(tp=tp, pp=pp, style=style, dp=dp, vocab_size=101, make_vocab_size_divisible_by=8,
                micro_batch_size=1, global_batch_size=GLOBAL_BATCH, use_distributed_optimizer=dist_opt,
                ddp_bucket_size=700, lr=1e-2, train_iters=10, bf16=dtype == torch.bfloat16, save=save,
                load=load)
    cfg = tiny_config(**{**flat, **overrides})
    topo = build_topology(tp=tp, pp=pp)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


# A MoE GPT's settings: 4 experts top-2, sigmoid scores with the aux-loss-free expert bias, a shared
# expert, alltoall (the MoE checkpoint tests).
MOE = dict(num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
           moe_shared_expert_intermediate_size=24, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, moe_layer_freq=(0, 1, 1, 1))


def moe_state(dp, dist_opt, ep=1, save=None, load=None, tp=1, **overrides):
    flat = dict(style=LLAMA_STYLE, dp=dp, vocab_size=101, make_vocab_size_divisible_by=8, micro_batch_size=1,
                global_batch_size=GLOBAL_BATCH, use_distributed_optimizer=dist_opt, ddp_bucket_size=700,
                lr=1e-2, train_iters=10, save=save, load=load, expert_model_parallel_size=ep, **MOE)
    cfg = tiny_config(tp=tp, sequence_parallel=tp > 1, **{**flat, **overrides})
    topo = build_topology(tp=tp, ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=torch.float64)
    optimizer = build_optimizer(cfg, topo, model)
    return TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))


def finetune_state(flat: dict, world: int, load_dir: str, tp=1, pp=1, ep=1, dtype=torch.float32, **overrides):
    """One rank's TrainState of `world` ranks at TP x PP x EP that loads `load_dir` with --finetune
    (a converted checkpoint); the model flags are `flat` (Config.to_flat of an import)."""
    run = dict(micro_batch_size=1, global_batch_size=world // (tp * pp), train_iters=1, lr=1e-3,
               mock_data=True, padded_vocab_size=None, load=load_dir, finetune=True,
               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    cfg = Config.from_flat({**flat, **run, **overrides})
    checks.finalize(cfg, world_size=world)
    topo = build_topology(tp=tp, pp=pp, ep=ep)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(cfg.training.seed, topo.tp_rank, topo.pp_rank, topo.device, tracker)
    model = build_model(cfg, topo, tracker, dtype=dtype)
    optimizer = build_optimizer(cfg, topo, model)
    state = TrainState(cfg, topo, tracker, model, optimizer, build_scheduler(cfg, optimizer))
    checkpointing.load_checkpoint(state)
    return state


def train(state, steps: int) -> list[float]:
    """Global sample g of step s is batch(seed=1000 s + g) whatever the DP size."""
    m = state.cfg.training.num_micro_batches
    losses = []
    for _ in range(steps):
        s = state.iteration
        mbs = []
        for k in range(m):
            tokens, labels, mask = batch(state.cfg.model, 1, seed=1000 * s + state.topology.dp_rank * m + k)
            mbs.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
        losses.append(train_step(state, iter(mbs))["lm loss"])
    return losses


def train_save_train(state, before: int = 2, after: int = 2) -> list[float]:
    """The uninterrupted run: `before` steps, a save (--save), `after` steps more; every loss."""
    first = train(state, before)
    checkpointing.save_checkpoint(state)
    return first + train(state, after)


def assert_losses_close(got: list[float], expected: list[float], rtol: float = 1e-10) -> None:
    """A resumed run's losses are the uninterrupted run's (float64: up to summation order)."""
    assert len(got) == len(expected)
    for x, y in zip(got, expected):
        assert abs(x - y) <= rtol * abs(y), (got, expected)


def read_everything(path):
    """Every tensor of a torch_dist checkpoint, under megafab keys (model.* / optim.*)."""
    return TorchDistSource(path).read_all()


@torch.no_grad()
def full_logits(state, tokens):
    """Logits [b, s, V_padded] of the state's model (one chunk per rank, any TP, PP through p2p) on
    the last stage's ranks; None on the others."""
    import torch.distributed as dist

    topo = state.topology
    model = state.model[0].module.eval()
    b, s = tokens.shape
    positions = torch.arange(s).expand_as(tokens)
    if topo.is_first_stage:
        out = model(tokens, positions)
    else:
        hidden = torch.empty(s, b, state.cfg.model.hidden_size, dtype=next(model.parameters()).dtype)
        dist.recv(hidden, src=topo.prev_pp_rank)
        model.set_input_tensor(hidden)
        out = model(None, positions)
    if not topo.is_last_stage:
        dist.send(out.contiguous(), dst=topo.next_pp_rank)
        return None
    if topo.tp > 1:
        parts = [torch.empty_like(out) for _ in range(topo.tp)]
        dist.all_gather(parts, out.contiguous(), group=topo.group("tp"))
        out = torch.cat(parts, dim=-1)
    return out.transpose(0, 1)  # [b, s, V]


@torch.no_grad()
def perturb(state, scale=0.05):
    """Give every weight (biases and norms included) values off its initialization, the same for
    every copy of a tensor (TP replicas, the tied embedding's two stages): noise keyed by the
    stored name and this rank's TP block."""
    from megafab.checkpoint.layout import param_layout
    from megafab.checkpoint.state import named_parameters

    topo = state.topology
    for name, p in named_parameters(state):
        layout = param_layout(name, p, topo.tp, topo.tp_rank)
        seed = sum(map(ord, layout.name)) * 1009 + sum(layout.block_offsets)
        g = torch.Generator().manual_seed(seed)
        p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    for chunk in state.model:
        chunk.module.train()
