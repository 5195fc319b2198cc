"""safe_pickle reads what Megatron-LM's pickled files hold -- args with megatron-core enums and
dataclasses, numpy RNG states, tensors -- without megatron installed, and refuses anything else by
name before unpickling it."""

import argparse
import contextlib
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

from megafab.checkpoint import CheckpointError, safe_pickle


@contextlib.contextmanager
def without_registered_globals():
    """As in a process that never imported megatron-core (which registers its classes with torch)."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(saved)


@contextlib.contextmanager
def fake_megatron_module():
    """A class pickled by reference as megatron.fake.AttnBackend, gone when the file is read."""
    module = types.ModuleType("megatron.fake")

    class AttnBackend:
        def __init__(self, value):
            self.value = value

        def __reduce__(self):
            return (AttnBackend, (self.value,))

    AttnBackend.__module__, AttnBackend.__qualname__ = "megatron.fake", "AttnBackend"
    module.AttnBackend = AttnBackend
    sys.modules["megatron.fake"] = module
    try:
        yield AttnBackend
    finally:
        del sys.modules["megatron.fake"]


def test_megatron_objects_become_inert_stand_ins_and_data_loads(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    with fake_megatron_module() as backend:
        args = argparse.Namespace(num_layers=2, attention_backend=backend("auto"),
                                  params_dtype=torch.bfloat16)
        torch.save({"args": args, "rng_state": [{"np_rng_state": np.random.get_state(),
                                                  "random_rng_state": random.getstate()}],
                    "model": {"w": torch.arange(6.0).view(2, 3)}}, path)
    with without_registered_globals():
        state = safe_pickle.load(path, mmap=True)
    assert state["args"].num_layers == 2 and state["args"].params_dtype == torch.bfloat16
    stand_in = state["args"].attention_backend
    assert isinstance(stand_in, safe_pickle.MegatronObject)
    assert stand_in.qualname == "megatron.fake.AttnBackend"
    assert stand_in.args == ("auto",)
    assert state["rng_state"][0]["np_rng_state"][1].dtype == np.uint32
    assert torch.equal(state["model"]["w"], torch.arange(6.0).view(2, 3))


class _Payload:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch /tmp/megafab_pwned_by_safe_pickle')",))


def test_a_payload_is_refused_by_name_and_does_not_run(tmp_path):
    path = str(tmp_path / "common.pt")
    torch.save({"args": argparse.Namespace(x=1), "rerun_state_machine": _Payload()}, path)
    with without_registered_globals(), pytest.raises(CheckpointError, match="builtins.eval"):
        safe_pickle.load(path)
    assert not os.path.exists("/tmp/megafab_pwned_by_safe_pickle")


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "common.pt"
    torch.save({"w": torch.zeros(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="common.pt"):
        safe_pickle.load(str(path))
