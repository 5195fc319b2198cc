"""A toy pipeline model split exactly as the GPT model will be: embedding on virtual stage 0,
L residual blocks spread evenly over pp*vpp virtual stages, output layer + loss on the last.

    x = E[tokens]                         # [s, b, h]
    x = x + tanh(x @ W_i + b_i)           # L blocks; the add's output is what a stage sends
    loss = sum(ce(x @ U, labels) * mask) / sum(mask)

Every chunk takes views of one set of full weights made from a seed, so each layout starts from
the single-process weights with no copying between ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def full_weights(vocab: int, hidden: int, layers: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"embedding": torch.randn(vocab, hidden, generator=g, dtype=torch.float64)}
    for i in range(layers):
        w[f"layers.{i}.weight"] = torch.randn(hidden, hidden, generator=g, dtype=torch.float64) / hidden**0.5
        w[f"layers.{i}.bias"] = torch.randn(hidden, generator=g, dtype=torch.float64) * 0.1
    w["output"] = torch.randn(hidden, vocab, generator=g, dtype=torch.float64) / hidden**0.5
    return w


def make_batches(num: int, seq: int, batch: int, vocab: int, seed: int = 99) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        tokens = torch.randint(0, vocab, (seq, batch), generator=g)
        labels = torch.randint(0, vocab, (seq, batch), generator=g)
        mask = (torch.rand(seq, batch, generator=g) > 0.2).to(torch.float64)
        mask[0, 0] = 1.0
        out.append({"tokens": tokens, "labels": labels, "mask": mask})
    return out


class ToyChunk(nn.Module):
    """Layers [first_layer, first_layer + num_layers) of the toy model, one virtual stage."""

    def __init__(self, weights: dict, first_layer: int, num_layers: int, pre_process: bool,
                 post_process: bool, sleep_s: float = 0.0):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(range(first_layer, first_layer + num_layers))
        self.params = nn.ParameterDict()
        if pre_process:
            self.params["embedding"] = nn.Parameter(weights["embedding"].clone())
        for i in self.layer_ids:
            for kind in ("weight", "bias"):
                self.params[f"layers_{i}_{kind}"] = nn.Parameter(weights[f"layers.{i}.{kind}"].clone())
        if post_process:
            self.params["output"] = nn.Parameter(weights["output"].clone())
        self.input_tensor = None
        self.sleep_s = sleep_s

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def full_name(self, key: str) -> str:
        return key.replace("layers_", "layers.").replace("_weight", ".weight").replace("_bias", ".bias")

    def forward(self, tokens):
        if self.sleep_s:
            import time
            time.sleep(self.sleep_s)
        x = self.params["embedding"][tokens] if self.pre_process else self.input_tensor  # [s, b, h]
        for i in self.layer_ids:
            x = x + torch.tanh(x @ self.params[f"layers_{i}_weight"] + self.params[f"layers_{i}_bias"])
        if self.post_process:
            return x @ self.params["output"]  # [s, b, V]
        return x


def build_chunks(weights: dict, layers: int, pp: int, vpp: int, pp_rank: int, sleep_s: float = 0.0):
    """This rank's chunks, Megatron placement: chunk c holds virtual stage c*pp + pp_rank."""
    stages = pp * vpp
    assert layers % stages == 0
    per = layers // stages
    chunks = []
    for c in range(vpp):
        v = c * pp + pp_rank
        chunks.append(ToyChunk(weights, v * per, per, pre_process=v == 0, post_process=v == stages - 1,
                               sleep_s=sleep_s))
    return chunks


def masked_loss(logits, labels, mask):
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"])

    def loss_func(logits):
        loss = masked_loss(logits, batch["labels"], batch["mask"])
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def reference(weights: dict, layers: int, batches: list[dict]) -> tuple[list[float], dict]:
    """Single-process losses per micro-batch and gradients of their mean."""
    model = ToyChunk(weights, 0, layers, pre_process=True, post_process=True)
    losses = []
    for batch in batches:
        loss = masked_loss(model(batch["tokens"]), batch["labels"], batch["mask"])
        (loss / len(batches)).backward()
        losses.append(loss.item())
    grads = {model.full_name(k): p.grad.clone() for k, p in model.params.items()}
    return losses, grads
