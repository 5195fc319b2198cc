"""megafab.timers (levels, Megatron's report formats) and megafab.progress (totals, the DCP and merge
hooks), without a training run."""

import re

import numpy as np
import pytest
import torch

from megafab import progress as progress_module
from megafab.timers import NULL_TIMER, Timers, format_timers


def test_timer_levels_and_report():
    timers = Timers(log_level=1)
    assert timers("forward-compute", 2) is NULL_TIMER  # above --timing-log-level: free
    with timers("forward-backward", 1):
        sum(range(10000))
    text, maxima = timers.report(iterations=2)
    assert text.splitlines()[0] == "(min, max) time across ranks (ms):"
    assert re.fullmatch(r"    forward-backward \.{31}: \(([\d.]+), \1\)", text.splitlines()[1])
    assert set(maxima) == {"forward-backward"} and maxima["forward-backward"] > 0
    assert timers.report(iterations=2) == (None, {})  # reset after each report
    assert Timers(log_level=0).report(iterations=1) == (None, {})


def test_formats_across_ranks():
    names = ("forward-backward", "forward-recv")
    ms = torch.tensor([[10.0, 0.0], [12.5, 3.0]], dtype=torch.float64)  # rank 0 never receives
    assert format_timers(names, ms, [0, 1], "minmax").splitlines()[1:] == [
        "    forward-backward ...............................: (10.00, 12.50)",
        "    forward-recv ...................................: (3.00, 3.00)"]
    assert format_timers(names, ms, [0], "max").splitlines() == [
        "max time across ranks (ms):", "    forward-backward ...............................: 12.50"]
    assert format_timers(names, ms, [1], "all").splitlines() == [
        "times across ranks (ms):", "  forward-recv:", "     rank  1: 3.00"]


class Recorder:
    """Stands in for the tqdm-backed Progress: remembers totals and updates."""
    made = []

    def __init__(self, total, desc, unit="B", enabled=None):
        self.total, self.desc, self.done, self.closed = total, desc, 0, False
        Recorder.made.append(self)

    def update(self, amount, **postfix):
        self.done += amount

    def close(self):
        self.closed = True


@pytest.fixture
def recorder(monkeypatch):
    Recorder.made = []
    return Recorder


def test_progress_counts_an_iterable(recorder, monkeypatch):
    monkeypatch.setattr(progress_module, "Progress", recorder)
    assert list(progress_module.progress(range(5), desc="layers")) == [0, 1, 2, 3, 4]
    bar = recorder.made[0]
    assert (bar.total, bar.done, bar.closed) == (5, 5, True)


def test_progress_is_quiet_off_a_terminal(capsys):
    bar = progress_module.Progress(10, "quiet")  # pytest's stderr is not a terminal
    bar.update(10)
    bar.close()
    assert capsys.readouterr().err == ""
    shown = progress_module.Progress(10, "shown", unit="layer", enabled=True)  # as on a terminal
    shown.update(10)
    shown.close()
    err = capsys.readouterr().err
    assert "shown" in err and "10/10" in err and "layer" in err


def test_merge_reports_every_byte(recorder, monkeypatch, tmp_path):
    from megafab.data import indexed_dataset as idx

    monkeypatch.setattr(idx, "Progress", recorder)
    prefixes = []
    for i in range(3):
        prefix = str(tmp_path / f"part{i}")
        writer = idx.IndexedDatasetWriter(idx.data_file_path(prefix), np.uint16)
        writer.add_document(np.arange(100 * (i + 1), dtype=np.uint16), [100 * (i + 1)])
        writer.finalize(idx.index_file_path(prefix))
        prefixes.append(prefix)
    idx.merge_datasets(prefixes, str(tmp_path / "all"))
    bar = recorder.made[0]
    assert bar.total == bar.done == 2 * (100 + 200 + 300) and bar.closed


def test_checkpoint_save_and_load_report_every_byte(recorder, monkeypatch, tmp_path):
    from megafab.checkpoint import dcp_io
    from megafab.checkpoint.layout import Shard

    monkeypatch.setattr(dcp_io, "Progress", recorder)
    monkeypatch.setattr(dcp_io, "LARGE", 0)
    a, b = torch.arange(12.0).reshape(3, 4), torch.arange(5.0)
    shards = {"a": Shard.whole(a), "b": Shard.whole(b)}
    dcp_io.save_shards(shards, str(tmp_path / "ck"))
    saved = recorder.made[-1]
    assert saved.desc == "checkpoint save" and saved.total == saved.done == a.nbytes + b.nbytes
    into = {"a": Shard.whole(torch.zeros(3, 4)), "b": Shard.whole(torch.zeros(5))}
    dcp_io.load_shards(into, str(tmp_path / "ck"))
    loaded = recorder.made[-1]
    assert loaded.desc == "checkpoint load" and loaded.total == loaded.done == a.nbytes + b.nbytes
    assert torch.equal(into["a"].views[0], a) and loaded.closed
