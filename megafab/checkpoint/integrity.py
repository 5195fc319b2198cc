"""--verify-integrity (Megatron HEAD's dist_checkpointing): a torch_dist save also writes
`integrity.json` into its directory, {"algorithm": "sha256", "files": {name: hex digest}} over every
file directly in it, as Megatron's save_integrity_manifest; a load with --verify-integrity first
re-hashes them on rank 0 and stops, on every rank, at a missing manifest, a missing file or a hash
that differs, naming each. Checkpoints written either way read in both tools.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

from megafab.checkpoint.errors import CheckpointError

MANIFEST = "integrity.json"
ALGORITHM = "sha256"
CHUNK = 1 << 20


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str) -> None:
    """Rank 0, once every file of the checkpoint is written."""
    files = {name: _digest(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
             if name != MANIFEST and os.path.isfile(os.path.join(directory, name))}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=2)


def manifest_problem(directory: str) -> str | None:
    """What is wrong with `directory` against its manifest, or None."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return (f"{path} does not exist: the checkpoint was saved without --verify-integrity; load it "
                f"without --verify-integrity")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("algorithm", ALGORITHM) != ALGORITHM:
        return f"{path} uses hash algorithm {manifest['algorithm']!r}; Megatron and megafab write {ALGORITHM}"
    bad = []
    for name, want in manifest["files"].items():
        try:
            got = _digest(os.path.join(directory, name))
        except OSError as e:
            bad.append(f"{name} is missing or unreadable ({type(e).__name__})")
            continue
        if got != want:
            bad.append(f"{name} has SHA-256 {got[:16]}..., the manifest {want[:16]}...")
    if bad:
        return (f"{len(bad)} file(s) of {directory} differ from {MANIFEST}: {'; '.join(bad[:6])}"
                f"{' ...' if len(bad) > 6 else ''}; the checkpoint is damaged: load an earlier one")
    return None


def verify(directory: str, topo) -> None:
    """Collective: rank 0 checks the manifest; every rank raises what it found."""
    found = [manifest_problem(directory) if topo.rank == 0 else None]
    if dist.is_initialized() and topo.world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        raise CheckpointError(f"--verify-integrity: {found[0]}")
