import math

import pytest
import torch

from megafab.optim.lr_scheduler import OptimizerParamScheduler, SchedulerConfigError


def _opt():
    p = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [p], "wd_mult": 1.0},
                              {"params": [], "wd_mult": 0.0, "lr_mult": 0.5}])


def _lrs(steps, batch, **kw):
    opt = _opt()
    sched = OptimizerParamScheduler(opt, **kw)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step(batch)
        out.append(opt.param_groups[0]["lr"])
    return out, opt, sched


def test_linear_warmup_then_cosine_decay_in_samples():
    lrs, _, _ = _lrs(12, 10, max_lr=1.0, min_lr=0.1, lr_warmup_samples=20, lr_decay_samples=100,
                     lr_decay_style="cosine", lr_warmup_init=0.2)
    for i, lr in enumerate(lrs):
        n = 10 * i
        if n <= 20:
            want = 0.2 + 0.8 * n / 20
        elif n > 100:
            want = 0.1
        else:
            want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (n - 20) / 80))
        assert lr == pytest.approx(want, abs=1e-15), n


def test_linear_constant_and_inverse_square_root():
    lin, _, _ = _lrs(5, 25, max_lr=2.0, min_lr=0.0, lr_decay_samples=100, lr_decay_style="linear")
    assert lin == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0, 0.0])
    const, _, _ = _lrs(3, 50, max_lr=3.0, lr_warmup_samples=50, lr_decay_samples=100,
                       lr_decay_style="constant")
    assert const == pytest.approx([0.0, 3.0, 3.0, 3.0])
    isr, _, _ = _lrs(3, 16, max_lr=1.0, min_lr=0.1, lr_warmup_samples=4, lr_decay_samples=1000,
                     lr_decay_style="inverse-square-root")
    assert isr[1:] == pytest.approx([max(0.1, math.sqrt(4) / math.sqrt(16 * k)) for k in (1, 2, 3)])


@pytest.mark.parametrize("style,coeff", [
    ("linear", lambda q: 1 - q), ("cosine", lambda q: 0.5 * (1 + math.cos(math.pi * q))),
    ("exponential", lambda q: 2 * 0.5 ** q - 1), ("minus_sqrt", lambda q: 1 - math.sqrt(q))])
def test_wsd_is_flat_then_anneals_over_its_decay_stretch(style, coeff):
    lrs, _, _ = _lrs(10, 10, max_lr=1.0, min_lr=0.0, lr_decay_samples=100, lr_decay_style="WSD",
                     wsd_decay_fraction=0.4, lr_wsd_decay_style=style)
    for i, lr in enumerate(lrs):
        n = 10 * i
        want = 1.0 if n <= 60 else coeff((n - 60) / 40)
        assert lr == pytest.approx(want, abs=1e-12), (style, n)


def test_group_multipliers_weight_decay_increment_and_state_round_trip():
    _, opt, sched = _lrs(2, 10, max_lr=1.0, lr_decay_samples=100, lr_decay_style="constant",
                         start_wd=0.0, end_wd=0.1, wd_incr_samples=40, wd_incr_style="linear")
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * 20 / 40)
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[1]["lr"] == 0.5
    other = OptimizerParamScheduler(_opt(), max_lr=1.0, lr_decay_samples=100, start_wd=0.0, end_wd=0.1,
                                    wd_incr_samples=40, wd_incr_style="linear")
    other.load_state_dict(sched.state_dict())
    assert other.num_samples == 20 and other.get_wd() == sched.get_wd()


def test_every_bad_setting_is_named_in_one_message():
    with pytest.raises(SchedulerConfigError) as info:
        OptimizerParamScheduler(_opt(), max_lr=1.0, min_lr=2.0, lr_decay_samples=10,
                                lr_warmup_samples=10, lr_decay_style="step")
    text = str(info.value)
    assert "--lr-decay-style 'step'" in text and "--min-lr 2.0" in text and "--lr-warmup-samples 10" in text
