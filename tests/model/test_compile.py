"""--compile (megafab's own flag): each TransformerLayer runs through torch.compile, same math.

Compiled kernels fuse and reorder float32 ops, so loss and grads match eager to float32 rounding
(relative 1e-4 here), not bit for bit. Parameter names must not change (checkpoints stay valid).
"""

import torch
import torch._inductor.config

from megafab.arguments import config_from_args
from megafab.model.gpt import GPTModel
from tests.helpers.flags import tiny_flags
from tests.helpers.tiny import GPT2_STYLE, batch, context, tiny_config


def _loss_and_grads(model_cfg, style_batch):
    model = GPTModel(model_cfg, context(dtype=torch.float32))
    tokens, labels, mask = style_batch
    per_token = model(tokens, labels=labels)
    loss = (per_token * mask.float()).sum() / mask.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_parity(style):
    # compile in this process: a worker pool costs more than it saves on a busy 2-core machine.
    # (config.patch, not monkeypatch: undoing a setattr on inductor's config hides the entry.)
    with torch._inductor.config.patch(compile_threads=1):
        _compare(style)


def _compare(style):
    eager_cfg = tiny_config(style=style, num_layers=2).model
    compiled_cfg = tiny_config(style=style, num_layers=2, compile_layers=True).model
    data = batch(eager_cfg)
    eager_loss, eager_grads = _loss_and_grads(eager_cfg, data)
    compiled_loss, compiled_grads = _loss_and_grads(compiled_cfg, data)
    assert compiled_grads.keys() == eager_grads.keys()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_flag_is_parsed_and_off_by_default():
    base = tiny_flags(num_layers=2) + [
        "--max-position-embeddings", "16", "--vocab-size", "64", "--micro-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    assert config_from_args(base, world_size=1).model.compile_layers is False
    assert config_from_args(base + ["--compile"], world_size=1).model.compile_layers is True


def test_compiled_layers_match_eager_gpt2_style():
    """The benchmark's shape. (A Llama-style variant passed too, but a second compilation costs
    a minute of the suite on 2 cores.)"""
    _check_parity(GPT2_STYLE)
