"""A checkpoint directory, Megatron's layout, committed atomically.

    SAVE/latest_checkpointed_iteration.txt     "100"  (written last)
    SAVE/iter_0000100/
        .metadata, __<rank>_0.distcp             DCP: model + optimizer tensors, global shapes
        common.json                              iteration, samples, counters, scheduler, scaler,
                                                 layout and the flat config (vocab_size included)
        rng/rank_00000.pt ...                    per global rank RNG streams (tensors, ints, lists)

Atomic save: every rank writes into SAVE/iter_0000100.tmp; rank 0 then renames it to iter_0000100
and replaces the tracker file (write a temp file, os.replace). A process killed at any point
leaves the tracker naming the previous complete checkpoint; a stale .tmp is removed by the next
save.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from megafab.checkpoint.errors import CheckpointError
from megafab.checkpoint.integrity import write_manifest

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
FORMAT_VERSION = 1


ITERATION_DIR = re.compile(r"iter_(\d{7})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_of_directory(path: str) -> int | None:
    """4 for '.../iter_0000004' (a --load that names one checkpoint, not the save directory)."""
    match = ITERATION_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


RELEASE = "release"  # Megatron's tracker text for a released checkpoint, stored in SAVE/release/


def read_tracker(save_dir: str) -> int | str | None:
    """The iteration the tracker file names, RELEASE, or None when there is no checkpoint."""
    path = os.path.join(save_dir, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number or 'release'; fix or delete "
                              f"the file (it must name an existing iter_NNNNNNN directory)") from None


def latest_iteration(save_dir: str) -> int | None:
    """The iteration the tracker file names (0 for a release), or None when there is no checkpoint."""
    tracked = read_tracker(save_dir)
    return 0 if tracked == RELEASE else tracked


def existing_iteration_dir(root: str, iteration: int | str) -> str:
    """The directory of a committed iteration (its .old twin if a re-save was killed mid-commit);
    iteration RELEASE: SAVE/release."""
    path = os.path.join(root, RELEASE) if iteration == RELEASE else iteration_dir(root, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        return path + ".old"
    if not os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {iteration} but {path} does "
                              f"not exist; restore that directory or fix the tracker file")
    return path


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def retain_interval(ck, root: str) -> int | None:
    """--save-retain-interval for saves to --save (not to a non-persistent directory)."""
    return ck.save_retain_interval if root == ck.save else None


def commit_checkpoint(root: str, iteration: int, retain_interval: int | None = None,
                      manifest: bool = False) -> int | None:
    """Rank 0: make the temporary directory the checkpoint (with manifest, --verify-integrity, its
    integrity.json written first), then point the tracker at it; with retain_interval
    (--save-retain-interval), then delete the checkpoint the tracker named before unless it is this
    one, a multiple of the interval, or a symbolic link (Megatron's rule); returns its iteration then."""
    previous = read_tracker(root) if retain_interval else None
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if manifest:
        write_manifest(tmp)
    old = final + ".old"
    if os.path.exists(final):  # re-saving an iteration: keep the old one reachable until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)
    if isinstance(previous, int) and 0 < previous != iteration and previous % retain_interval:
        retired = iteration_dir(root, previous)
        if not os.path.islink(retired):
            shutil.rmtree(retired, ignore_errors=True)
            return previous
    return None
