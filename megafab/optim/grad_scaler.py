"""Loss scalers for fp16: the loss is multiplied by `scale` before backward, grads divided after.

DynamicGradScaler follows Megatron exactly:
  * a step whose grads hold inf/nan is skipped; it resets the growth counter and uses up one unit of
    hysteresis; only when hysteresis is used up (tracker <= 0) is the scale multiplied by
    `backoff_factor` (never below `min_scale`), and it keeps backing off on every further bad step;
  * `growth_interval` clean steps in a row multiply the scale by `growth_factor` and refill the
    hysteresis tracker.

`scaler_problems` states the scaler's rules once: the config check asks it before start
(megafab.checks), the constructors assert the same rules.
"""

from __future__ import annotations


def scaler_problems(*, loss_scale: float | None = None, initial_scale: float = 2.0 ** 32,
                    min_scale: float = 1.0, growth_interval: int = 1000, hysteresis: int = 2,
                    growth_factor: float = 2.0, backoff_factor: float = 0.5) -> list[str]:
    """Every reason the fp16 loss scaler of these settings cannot run, one line each; with
    `loss_scale` (a constant scale) the dynamic settings are unused and not checked."""
    if loss_scale is not None:
        return [] if loss_scale > 0 else [
            f"--loss-scale is {loss_scale}; it must be positive (or unset for dynamic scaling)"]
    out = []
    if not initial_scale > 0:
        out.append(f"--initial-loss-scale {initial_scale} must be positive (Megatron's default is 2^32)")
    elif not 0 < min_scale <= initial_scale:
        out.append(f"--min-loss-scale {min_scale} must be in (0, --initial-loss-scale {initial_scale}]; "
                   f"the dynamic scale never falls below it (Megatron's default is 1)")
    if not growth_factor > 1:
        out.append(f"loss-scale growth factor {growth_factor} must be > 1")
    if not 0 < backoff_factor < 1:
        out.append(f"loss-scale backoff factor {backoff_factor} must be in (0, 1)")
    if growth_interval < 1:
        out.append(f"--loss-scale-window {growth_interval} must be >= 1 (the clean steps before the "
                   f"scale grows; Megatron's default is 1000)")
    if hysteresis < 1:
        out.append(f"--hysteresis {hysteresis} must be >= 1 (the overflows tolerated before the scale "
                   f"backs off; Megatron's default is 2)")
    return out


class ConstantGradScaler:
    """A fixed loss scale (Megatron's `--loss-scale`)."""

    def __init__(self, scale: float):
        problems = scaler_problems(loss_scale=scale)
        if problems:  # the config check refuses these before start; code that builds one directly
            raise ValueError(problems[0])
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_inf: bool):
        pass

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict):
        self._scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic loss scaler (defaults 2^32, x2 every 1000 clean steps, x0.5, hysteresis 2)."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        problems = scaler_problems(initial_scale=initial_scale, min_scale=min_scale,
                                   growth_interval=growth_interval, hysteresis=hysteresis,
                                   growth_factor=growth_factor, backoff_factor=backoff_factor)
        if problems:  # the config check refuses these before start; code that builds one directly
            raise ValueError("loss scaler: " + "; ".join(problems))
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict):
        self._scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
