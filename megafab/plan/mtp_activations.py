"""Multi-token prediction's activations (model/mtp.py) on the last pipeline stage, per micro-batch.

Each depth keeps what one transformer layer of the decoder's last layer's kind keeps (its input is
eh_proj's output), its embedding's output (enorm's input) and the [embedding, hidden] concatenation
(eh_proj's input), e*s*b*3h / r, enorm's and hnorm's statistics, and one more set of the logits
terms (its final norm, the output layer's input, the fp32 softmax: the planner's `logits`). hnorm's
input is kept already: the previous depth's output-layer input (at depth 1 the decoder's). They are
alive with the micro-batch's logits, until its loss's backward, so the planner adds them there.
Under uniform full recompute (model/mtp.py) a depth keeps only its embedding's output and its
output (the output layer's input) beside the softmax; its backward rebuilds one depth at a time.
"""

from __future__ import annotations

from megafab.plan.activations import norm_stats_bytes
from megafab.plan.state_memory import BYTES


def mtp_activation_bytes(cfg, layer: int, logits: int) -> int:
    """The MTP depths' activations of one micro-batch; layer: one layer's bytes of the decoder's
    last layer's kind, logits: the main logits term (final norm, output-layer input, softmax)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    depths = m.mtp_num_layers or 0
    if not depths:
        return 0
    s, b, h = m.seq_length // p.context_parallel_size, t.micro_batch_size, m.hidden_size
    r = p.tensor_model_parallel_size if p.sequence_parallel else 1
    e = BYTES[cfg.precision.params_dtype_name]
    own = (3 * e * s * b * h + 2 * norm_stats_bytes(m, s, b)) // r
    if m.recompute_granularity == "full" and m.recompute_method == "uniform":
        return depths * (logits - norm_stats_bytes(m, s, b) // r)  # embedding output for final-norm input
    return depths * (layer + own + logits)
