"""Plot training/validation loss, learning rate and throughput against iterations.

Reads Megatron-format training logs (the ` iteration N/ T | ... |` and ` validation loss at
iteration N | lm loss value: ...` lines, from megafab or Megatron-LM) or TensorBoard directories,
and draws every run given on one figure so runs can be compared.

    megafab-plot runs/a/train.log runs/b/tensorboard --out compare.png --labels baseline "tp2 pp2"
    (also: python -m megafab.cli.plot, python tools/plot_logs.py)

Needs matplotlib (pip install 'megafab[plot]').
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

from megafab.errors import MegafabError
from megafab.run.report import exit_status

SERIES = ("train_loss", "valid_loss", "lr", "tokens_per_sec", "tflops")

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)")
_VALIDATION = re.compile(
    r"\bvalidation loss at iteration (\d+)\s*\|\s*lm loss value:\s*([-+0-9.eE]+|nan|inf)")
# Megatron's "key: value" fields of the iteration line -> series name.
_FIELDS = {"lm loss": "train_loss", "learning rate": "lr", "tokens per second": "tokens_per_sec",
           "throughput per GPU (TFLOP/s/GPU)": "tflops"}
# TensorBoard tags -> series name (first tag found wins): Megatron-LM's tags, which megafab writes,
# then those of megafab before it used Megatron's names.
_TB_TAGS = {"train_loss": ("lm loss",), "valid_loss": ("lm loss validation", "validation loss"),
            "lr": ("learning-rate",), "tokens_per_sec": ("throughput/tokens-per-sec",),
            "tflops": ("throughput", "throughput/tflops")}


class PlotLogsError(MegafabError):
    """A log or directory that holds nothing to plot, or a missing dependency."""


@dataclass
class Run:
    """One run's series, each {iteration: value}; a later line for the same iteration wins (resume)."""

    name: str
    series: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in SERIES})

    def points(self, key: str) -> tuple[list[int], list[float]]:
        items = sorted(self.series[key].items())
        return [i for i, _ in items], [v for _, v in items]

    def empty(self) -> bool:
        return not any(self.series.values())


def parse_log_lines(lines, name: str = "run") -> Run:
    """Parse Megatron iteration and validation lines; other lines (launcher noise, ranks) are skipped."""
    run = Run(name)
    for line in lines:
        match = _VALIDATION.search(line)
        if match:
            run.series["valid_loss"][int(match.group(1))] = float(match.group(2))
            continue
        match = _ITERATION.search(line)
        if not match:
            continue
        iteration = int(match.group(1))
        for part in match.group(2).split("|"):
            key, sep, value = part.partition(":")
            series = _FIELDS.get(key.strip())
            if sep and series:
                try:
                    run.series[series][iteration] = float(value.strip().rstrip("%"))
                except ValueError:
                    continue
    return run


def parse_log(path: str, name: str | None = None) -> Run:
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_log_lines(f, name or os.path.basename(path))


def read_tensorboard(path: str, name: str | None = None) -> Run:
    """Scalars from a TensorBoard log directory (event files may sit in subdirectories)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise PlotLogsError("reading a TensorBoard directory needs tensorboard: pip install tensorboard") \
            from err
    run = Run(name or os.path.basename(os.path.normpath(path)))
    event_dirs = sorted({root for root, _, files in os.walk(path)
                         if any(".tfevents." in f for f in files)})
    for event_dir in event_dirs:
        acc = EventAccumulator(event_dir, size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags().get("scalars", []))
        for series, candidates in _TB_TAGS.items():
            tag = next((t for t in candidates if t in tags), None)
            if tag is not None:
                for event in acc.Scalars(tag):
                    run.series[series][int(event.step)] = float(event.value)
    return run


def load_run(path: str, name: str | None = None) -> Run:
    if not os.path.exists(path):
        raise PlotLogsError(f"{path}: no such file or directory; pass a training log or a TensorBoard dir")
    run = read_tensorboard(path, name) if os.path.isdir(path) else parse_log(path, name)
    if run.empty():
        kind = "TensorBoard scalars" if os.path.isdir(path) else "Megatron 'iteration N/ T |' lines"
        raise PlotLogsError(f"{path}: found no {kind} to plot; is this the rank-last output of a run?")
    return run


def _throughput_key(runs: list[Run]) -> tuple[str, str]:
    if any(run.series["tokens_per_sec"] for run in runs):
        return "tokens_per_sec", "tokens per second"
    return "tflops", "TFLOP/s per GPU"


def plot_runs(runs: list[Run], out: str, title: str | None = None) -> None:
    """Loss (train solid, validation dashed), learning rate and throughput panels; one color per run."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlotLogsError("plotting needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr, ax_tput) = plt.subplots(1, 3, figsize=(16, 4.5))
    tput_key, tput_label = _throughput_key(runs)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        xs, ys = run.points("train_loss")
        if xs:
            ax_loss.plot(xs, ys, color=color, label=f"{run.name} train")
        xs, ys = run.points("valid_loss")
        if xs:
            ax_loss.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=4,
                         label=f"{run.name} validation")
        ax_lr.plot(*run.points("lr"), color=color, label=run.name)
        ax_tput.plot(*run.points(tput_key), color=color, label=run.name)
    for ax, label in ((ax_loss, "lm loss"), (ax_lr, "learning rate"), (ax_tput, tput_label)):
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", metavar="LOG", help="training log file or TensorBoard directory")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--labels", nargs="+", help="legend names, one per LOG (default: file names)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.logs):
        parser.error(f"--labels got {len(args.labels)} names for {len(args.logs)} logs; give one per LOG")
    def body():
        runs = [load_run(path, args.labels[i] if args.labels else None) for i, path in enumerate(args.logs)]
        plot_runs(runs, args.out, args.title)
        for run in runs:
            xs, ys = run.points("valid_loss")
            last = f", last validation loss {ys[-1]:.3f} at iteration {xs[-1]}" if xs else ""
            print(f"{run.name}: {len(run.series['train_loss'])} logged iterations{last}")
        print(f"wrote {args.out}")

    return exit_status(body)


if __name__ == "__main__":
    sys.exit(main())
