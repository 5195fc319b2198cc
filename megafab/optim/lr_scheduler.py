"""Learning-rate and weight-decay schedule counted in samples, as Megatron's OptimizerParamScheduler.

With n = samples consumed so far, W = warmup samples, D = decay samples:
  * n <= W (W > 0):  lr = init + (max - init) * n / W
  * constant:        lr = max
  * n > D:           lr = min
  * inverse-square-root: lr = max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))
  * otherwise r = (n - W) / (D - W) and lr = min + c * (max - min) with linear c = 1 - r,
    cosine c = (1 + cos(pi r)) / 2, WSD c = 1 until its last wsd_decay_samples (_wsd_coeff).
Weight decay goes from start_wd to end_wd over wd_incr_samples (constant | linear | cosine).
Each param group's lr is lr * group["lr_mult"], its weight decay wd * group["wd_mult"]; a group
with "max_lr" / "min_lr" (--decoupled-lr / --decoupled-min-lr) uses those bounds instead.
"""

from __future__ import annotations

import math

from megafab.config.schema import DECAY_STYLES, WSD_DECAY_STYLES
from megafab.errors import MegafabError

WD_STYLES = ("constant", "linear", "cosine")


class SchedulerConfigError(MegafabError):
    """A schedule setting that cannot work; the message names every problem."""


def schedule_problems(*, max_lr: float, min_lr: float = 0.0, lr_warmup_samples: int = 0,
                      lr_decay_samples: int | None, lr_decay_style: str = "linear",
                      wsd_decay_samples: int | None = None, lr_wsd_decay_style: str = "exponential",
                      start_wd: float = 0.01, end_wd: float = 0.01,
                      wd_incr_style: str = "constant") -> list[str]:
    """Every reason this schedule (lengths in samples) cannot run; the config check asks it before
    start with the command line's values (config/derive.py's scheduler_samples). lr_decay_samples
    None: the lengths are not known yet (no global batch size); only the other rules are checked."""
    problems = []
    if lr_decay_style not in DECAY_STYLES:
        problems.append(f"--lr-decay-style {lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    if not 0.0 <= min_lr <= max_lr:
        problems.append(f"--min-lr {min_lr} must be in [0, --lr {max_lr}]")
    known = lr_decay_samples is not None
    if known and lr_decay_samples <= 0:
        problems.append(f"--lr-decay-samples {lr_decay_samples} must be positive")
    if lr_warmup_samples < 0:
        problems.append(f"--lr-warmup-samples {lr_warmup_samples} must not be negative")
    elif known and lr_warmup_samples >= max(lr_decay_samples, 1):
        problems.append(f"the learning-rate warmup ({lr_warmup_samples} samples) is not shorter than the "
                        f"decay ({lr_decay_samples} samples = --lr-decay-samples, or --lr-decay-iters / "
                        f"--train-iters x global batch); shorten the warmup (--lr-warmup-samples "
                        f"{lr_warmup_samples}, or -iters / -fraction) or lengthen the decay")
    if lr_decay_style == "WSD":
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            problems.append(f"--lr-wsd-decay-style {lr_wsd_decay_style!r} is not one of "
                            f"{', '.join(WSD_DECAY_STYLES)}")
        if wsd_decay_samples is None or known and not 0 < wsd_decay_samples <= lr_decay_samples:
            problems.append(f"--lr-decay-style WSD needs --lr-wsd-decay-samples (or --lr-wsd-decay-iters) in "
                            f"(0, --lr-decay-samples {lr_decay_samples}], got {wsd_decay_samples}")
    if wd_incr_style not in WD_STYLES:
        problems.append(f"--weight-decay-incr-style {wd_incr_style!r} is not one of {WD_STYLES}")
    elif wd_incr_style == "constant" and start_wd != end_wd:
        problems.append(f"constant weight decay needs --start-weight-decay {start_wd} == "
                        f"--end-weight-decay {end_wd}; set both or choose linear/cosine")
    return problems


class OptimizerParamScheduler:
    """Sets lr and weight decay of `optimizer.param_groups` from the samples consumed.

    Arguments (all counts in samples): max_lr, min_lr, lr_warmup_samples, lr_decay_samples,
    lr_decay_style, lr_warmup_init, wsd_decay_samples (or wsd_decay_fraction of lr_decay_samples),
    lr_wsd_decay_style, start_wd, end_wd, wd_incr_samples, wd_incr_style.
    """

    def __init__(self, optimizer, *, max_lr: float, min_lr: float = 0.0, lr_warmup_samples: int = 0,
                 lr_decay_samples: int, lr_decay_style: str = "linear", lr_warmup_init: float = 0.0,
                 wsd_decay_samples: int | None = None, wsd_decay_fraction: float | None = None,
                 lr_wsd_decay_style: str = "exponential", start_wd: float = 0.01, end_wd: float = 0.01,
                 wd_incr_samples: int = 0, wd_incr_style: str = "constant"):
        if lr_decay_style == "WSD" and wsd_decay_samples is None and wsd_decay_fraction is not None:
            wsd_decay_samples = round(wsd_decay_fraction * lr_decay_samples)
        problems = schedule_problems(
            max_lr=max_lr, min_lr=min_lr, lr_warmup_samples=lr_warmup_samples,
            lr_decay_samples=lr_decay_samples, lr_decay_style=lr_decay_style,
            wsd_decay_samples=wsd_decay_samples, lr_wsd_decay_style=lr_wsd_decay_style,
            start_wd=start_wd, end_wd=end_wd, wd_incr_style=wd_incr_style)
        if problems:
            raise SchedulerConfigError("; ".join(problems))
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.lr_warmup_init = float(max_lr), float(min_lr), float(lr_warmup_init)
        self.lr_warmup_samples, self.lr_decay_samples = lr_warmup_samples, lr_decay_samples
        self.lr_decay_style, self.lr_wsd_decay_style = lr_decay_style, lr_wsd_decay_style
        self.wsd_decay_samples = wsd_decay_samples
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_samples, self.wd_incr_style = wd_incr_samples, wd_incr_style
        self.num_samples = 0
        self.step(0)

    def get_lr(self, group: dict | None = None) -> float:
        """The schedule's lr now; a param group with its own max_lr / min_lr (--decoupled-lr) runs
        the same shape between its own bounds."""
        group = group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        n, warmup, decay = self.num_samples, self.lr_warmup_samples, self.lr_decay_samples
        if warmup > 0 and n <= warmup:
            return self.lr_warmup_init + (max_lr - self.lr_warmup_init) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        ratio = (n - warmup) / (decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, n: int) -> float:
        """WSD's c: 1 until the last `wsd_decay_samples` of D, then over that stretch with its own
        ratio q: linear 1 - q, cosine (1 + cos(pi q)) / 2, exponential 2 * 0.5^q - 1, minus_sqrt
        1 - sqrt(q)."""
        anneal_start = self.lr_decay_samples - self.wsd_decay_samples
        if n <= anneal_start:
            return 1.0
        q = (n - anneal_start) / self.wsd_decay_samples
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - q
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * q) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, q) - 1.0
        return 1.0 - math.sqrt(q)

    def get_wd(self) -> float:
        n = self.num_samples
        if n > self.wd_incr_samples or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = n / self.wd_incr_samples
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment_samples: int):
        """Advance by the samples of one step (the global batch size) and set lr / wd."""
        self.num_samples += increment_samples
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    _FIELDS = ("max_lr", "min_lr", "lr_warmup_init", "lr_warmup_samples", "lr_decay_samples",
               "lr_decay_style", "lr_wsd_decay_style", "wsd_decay_samples", "start_wd", "end_wd",
               "wd_incr_samples", "wd_incr_style", "num_samples")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._FIELDS}

    # What the command line sets (the rest is the position in the schedule), with the flags that set it.
    SETTINGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_init": "--lr-warmup-init",
                "lr_warmup_samples": "--lr-warmup-iters/-samples/-fraction",
                "lr_decay_samples": "--lr-decay-iters/-samples, else --train-iters x global batch",
                "lr_decay_style": "--lr-decay-style", "lr_wsd_decay_style": "--lr-wsd-decay-style",
                "wsd_decay_samples": "--lr-wsd-decay-iters/-samples", "start_wd": "--weight-decay",
                "end_wd": "--weight-decay", "wd_incr_samples": "the weight-decay ramp (Megatron's "
                "--start/--end-weight-decay)", "wd_incr_style": "the weight-decay ramp's style"}

    def differences(self, state: dict) -> list[tuple[str, object, object]]:
        """(setting, this schedule's value, `state`'s value) for every setting that differs."""
        def same(a, b):
            if isinstance(a, float) or isinstance(b, float):
                return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
            return a == b
        # A constant weight decay has no ramp: its length (Megatron stores one anyway) means nothing.
        ramp = not (self.wd_incr_style == "constant" and state["wd_incr_style"] == "constant")
        return [(k, getattr(self, k), state[k]) for k in self.SETTINGS
                if (ramp or k != "wd_incr_samples") and not same(getattr(self, k), state[k])]

    def load_state_dict(self, state: dict, keep_settings: bool = False):
        """Restore the position in the schedule, and the checkpoint's settings unless `keep_settings`
        (Megatron's --override-opt_param-scheduler)."""
        for k in self._FIELDS:
            if not (keep_settings and k in self.SETTINGS):
                setattr(self, k, state[k])
        self.step(0)
