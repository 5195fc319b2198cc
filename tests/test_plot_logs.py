"""megafab-plot (tools/plot_logs.py): parses Megatron log lines and TensorBoard scalars, writes a PNG."""

import pytest

from megafab.cli import plot as plot_logs
from megafab.training.log_line import iteration_line, validation_line

# Megatron-LM's own line (no tokens/s), as printed by torchrun with --tee/rank prefixes.
MEGATRON_LINE = (
    "[default7]: [2024-05-01 10:00:00] iteration       20/     100 | consumed samples:          640 | "
    "elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 101.5 | "
    "learning rate: 2.500000E-04 | global batch size:    32 | lm loss: 5.123400E+00 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def _megafab_line(iteration, loss, lr, tokens):
    return iteration_line(iteration, 30, {
        "consumed_samples": 32 * iteration, "elapsed_ms": 100.0, "tokens_per_sec": tokens, "lr": lr,
        "global_batch_size": 32, "lm loss": loss, "loss_scale": 1.0, "grad_norm": 0.5, "skipped": 0,
        "nan": 0})


def _synthetic_log(path):
    lines = ["W1201 launcher noise", "megafab: 8 process(es), tp 2 pp 2 dp 2, cpu / gloo"]
    for it in (10, 20, 30):
        lines.append(_megafab_line(it, 8.0 - it / 10, 1e-3 * it / 30, 1000.0 + it))
        if it % 20 == 10:
            lines += ["-" * 100, validation_line("validation", f"iteration {it}", 7.5 - it / 10), "-" * 100]
    lines.append(_megafab_line(30, 4.25, 2e-4, 1500.0))  # a resumed run re-logs iteration 30: last wins
    path.write_text("\n".join(lines) + "\n")


def test_parses_megafab_lines_with_the_last_value_winning(tmp_path):
    log = tmp_path / "train.log"
    _synthetic_log(log)
    run = plot_logs.load_run(str(log))
    assert run.name == "train.log"
    assert run.points("train_loss") == ([10, 20, 30], [7.0, 6.0, 4.25])
    assert run.points("valid_loss") == ([10, 30], [pytest.approx(6.5), pytest.approx(4.5)])
    assert run.points("lr")[1] == pytest.approx([1e-3 / 3, 2e-3 / 3, 2e-4])
    assert run.points("tokens_per_sec") == ([10, 20, 30], [1010.0, 1020.0, 1500.0])
    assert run.series["tflops"] == {}


def test_parses_megatron_lm_line_with_rank_prefix():
    run = plot_logs.parse_log_lines([
        MEGATRON_LINE,
        "[default7]:  validation loss at iteration 20 | lm loss value: 5.000000E+00 | lm loss PPL: 148.4 | "])
    assert run.series["train_loss"] == {20: 5.1234}
    assert run.series["lr"] == {20: 2.5e-4}
    assert run.series["tflops"] == {20: 101.5}
    assert run.series["valid_loss"] == {20: 5.0}
    assert plot_logs._throughput_key([run]) == ("tflops", "TFLOP/s per GPU")


def test_reads_tensorboard_scalars(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    for it in (1, 2, 3):
        writer.add_scalar("lm loss", 9.0 - it, it)
        writer.add_scalar("learning-rate", 0.1 * it, it)
        writer.add_scalar("throughput/tokens-per-sec", 100.0 * it, it)
    writer.add_scalar("lm loss validation", 5.5, 3)  # Megatron's tag
    writer.close()
    run = plot_logs.load_run(str(tmp_path / "tb"), "tb run")
    assert run.name == "tb run"
    assert run.points("train_loss") == ([1, 2, 3], [8.0, 7.0, 6.0])
    assert run.points("valid_loss") == ([3], [5.5])
    assert run.points("tokens_per_sec") == ([1, 2, 3], [100.0, 200.0, 300.0])


def test_writes_png_for_several_runs(tmp_path, capsys):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    _synthetic_log(first)
    second.write_text(MEGATRON_LINE + "\n")
    out = tmp_path / "plots" / "loss.png"
    assert plot_logs.main([str(first), str(second), "--out", str(out), "--labels", "a", "b"]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
    assert "a: 3 logged iterations, last validation loss 4.500 at iteration 30" in capsys.readouterr().out


def test_user_mistakes_get_one_message(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert plot_logs.main([str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "found no Megatron 'iteration N/ T |' lines" in capsys.readouterr().err
    assert plot_logs.main([str(tmp_path / "missing.log"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
