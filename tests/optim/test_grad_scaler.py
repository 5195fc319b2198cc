import pytest

from megafab.optim import ConstantGradScaler, DynamicGradScaler


def test_megatron_defaults():
    s = DynamicGradScaler()
    assert (s.scale, s.min_scale, s.growth_factor, s.backoff_factor, s.growth_interval, s.hysteresis) == (
        2.0 ** 32, 1.0, 2.0, 0.5, 1000, 2)


def test_scale_halves_only_after_hysteresis_and_grows_after_the_window():
    s = DynamicGradScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0  # first overflow only uses up hysteresis
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(found_inf=True)
    assert s.scale == 256.0  # hysteresis stays used up: every further overflow backs off
    s.update(False)
    s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 512.0 and s.hysteresis_tracker == 2  # growth refills hysteresis
    s.update(True)
    assert s.scale == 512.0


def test_overflow_resets_the_growth_window():
    s = DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=5)
    s.update(False)
    s.update(True)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0


def test_never_below_min_scale_and_state_round_trips():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0
    t = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_constant_scaler_never_moves_and_bad_settings_are_named():
    s = ConstantGradScaler(128.0)
    s.update(True)
    assert s.scale == 128.0
    with pytest.raises(ValueError, match="--hysteresis 0 must be >= 1"):
        DynamicGradScaler(hysteresis=0)
    with pytest.raises(ValueError, match="--loss-scale is -1"):
        ConstantGradScaler(-1)
