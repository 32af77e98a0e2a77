"""Files someone else could write are never run as code, and weight loads stay in the run's weight root.

Pure tests, no engine or trainer: the engine's worker methods refuse a path outside the weight root before they
touch the model; a pickle whose unpickling would write a marker file is planted where each loader reads (a
Megatron checkpoint's common.pt, .metadata, a .distcp byte item and RNG file, a CUDA IPC manifest, a weight
directory) and the marker never appears; staging makes new private directories and files and follows no link.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.run_sections import weight_sync_of
from vime.engine.in_vllm.cuda_ipc import read_manifests
from vime.engine.in_vllm.weight_loading import update_files
from vime.engine.in_vllm.worker_extension import WeightReceiver
from vime.engine.protocol.ipc_codec import encode_rebuild_args
from vime.engine.protocol.weight_files import MANIFEST, STAGE_FILE, WEIGHT_ROOT_ENV
from vime.transport.weights import staging
from vime.transport.weights.base import DriverSetup
from vime.transport.weights.cuda_ipc.driver import CudaIpcDriver
from vime.transport.weights.disk.rank import write_stage_file
from vime.transport.weights.staging import stage_dir, write_new_file

WEIGHTS = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.ones(4))]


class Payload:
    """Unpickling this writes `marker`: what a planted pickle would do (with os.system instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.fixture
def marker(tmp_path) -> Path:
    probe = tmp_path / "payload_works"
    pickle.loads(pickle.dumps(Payload(probe)))  # the payload does run code when unpickled
    assert probe.exists()
    return tmp_path / "code_ran"


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """The weight root, as the engine's environment names it."""
    monkeypatch.setenv(WEIGHT_ROOT_ENV, str(tmp_path / "root"))
    return tmp_path / "root"


# ---- loads confined to the weight root ------------------------------------------------------------------------
def test_a_load_path_outside_the_weight_root_is_refused(tmp_path, root):
    staged = Path(stage_dir(str(root), "vime_weights_1_"))
    write_stage_file(staged, 0, WEIGHTS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_stage_file(elsewhere, 0, WEIGHTS)
    (root / "link").symlink_to(elsewhere)  # inside by name, outside once resolved
    assert update_files(str(staged), STAGE_FILE) == [staged.resolve() / "model-pp0.safetensors"]

    worker = WeightReceiver()
    worker.device = torch.device("cuda", 0)  # never used: the path is refused first
    for path in (elsewhere, root / "link", root, staged / ".." / ".." / "elsewhere", Path("/etc")):
        with pytest.raises(PermissionError, match="outside the weight root"):
            worker.vime_load_weights(str(path))
        with pytest.raises(PermissionError, match="outside the weight root"):
            worker.vime_load_ipc_weights(str(path))


def test_the_engine_is_given_the_runs_weight_root(tmp_path):
    from vime.engine.control.engine import engine_env

    args = SimpleNamespace(update_weight_dir=str(tmp_path / "w"), rollout_num_gpus_per_engine=1,
                           cpu_kv_cache_space=1)
    assert engine_env(args, tmp_path / "token")[WEIGHT_ROOT_ENV] == str(tmp_path / "w")


# ---- planted pickles run nothing ------------------------------------------------------------------------------
def test_a_weight_directory_loads_only_the_writers_files(root, marker):
    staged = Path(stage_dir(str(root), "vime_weights_1_"))
    write_stage_file(staged, 0, WEIGHTS)
    torch.save(Payload(marker), staged / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"\['pytorch_model.bin'\], which vime did not write"):
        WeightReceiver().vime_load_weights(str(staged))
    (staged / "pytorch_model.bin").unlink()
    (staged / "model-pp1.safetensors").symlink_to(staged / "model-pp0.safetensors")
    with pytest.raises(ValueError, match="model-pp1.safetensors"):
        update_files(str(staged), STAGE_FILE)
    (staged / "model-pp1.safetensors").unlink()
    (staged / "model-pp1.safetensors").write_bytes(pickle.dumps(Payload(marker)))  # an expected name, a pickle
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError):
        safe_open(str(update_files(str(staged), STAGE_FILE)[1]), "pt")
    assert not marker.exists()


def test_a_planted_ipc_manifest_is_refused(root, marker):
    staged = Path(stage_dir(str(root), "vime_ipc_1_"))
    (staged / "stage_0.json").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match="not a CUDA IPC manifest that vime wrote"):
        read_manifests(str(staged))
    (staged / "stage_0.json").write_text(json.dumps([{"name": "w", "args": [["pickle", "gASV"]]}]))
    with pytest.raises(ValueError, match="unknown argument kind"):
        read_manifests(str(staged))
    assert not marker.exists()


def test_a_checkpoints_pickles_run_no_code(tmp_path, marker, monkeypatch):
    """Each file Megatron's and torch DCP's loaders unpickle, through the readers `load_checkpoint` calls, inside
    `no_code_from_files`; a user's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD does not reopen them."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from vime.trainer.megatron.checkpoint import no_code_from_files, read_rng_state

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    clean, bad = tmp_path / "clean", tmp_path / "bad"
    dcp.save({"w": torch.arange(6.0), "obj": (1, "x")}, checkpoint_id=str(clean))
    dcp.save({"w": torch.arange(6.0), "obj": Payload(marker)}, checkpoint_id=str(bad))  # a .distcp byte item
    with no_code_from_files():
        state = {"w": torch.zeros(6), "obj": None}
        dcp.load(state, checkpoint_id=str(clean))  # DCP's own metadata and byte items still load
        assert torch.equal(state["w"], torch.arange(6.0)) and state["obj"] == (1, "x")
        with pytest.raises(CheckpointException) as failed:
            dcp.load({"w": torch.zeros(6), "obj": None}, checkpoint_id=str(bad))
        (error, _), = failed.value.failures.values()
        assert isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error)

        (bad / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(pickle.UnpicklingError, match="builtins.exec, which is not part of torch DCP"):
            FileSystemReader(str(bad)).read_metadata()

        torch.save(Payload(marker), bad / "common.pt")
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            TorchCommonLoadStrategy().load_common(bad)
    torch.save(Payload(marker), tmp_path / "rank_0.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        read_rng_state(tmp_path / "rank_0.pt")
    assert not marker.exists()
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"  # the switch is the load's only
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


# ---- staging: new private directories and files, no link followed ---------------------------------------------
def test_staging_reuses_nothing_and_follows_no_link(tmp_path, root):
    for kind in ("weights", "recovery"):  # the names update directories used to have, made by someone else first
        planted = root / f"vime_{kind}_{os.getpid()}_1"
        planted.mkdir(parents=True)
        (planted / "model-pp1.safetensors").write_bytes(b"planted")
    args = SimpleNamespace(update_weight_dir=str(root), update_weight_transport="disk", use_fault_tolerance=True,
                           rollout_external_engine_addrs=["http://elsewhere:1"], train_timeout=60.0)
    sync = weight_sync_of(args)
    made = [sync.transport.prepare(1), CudaIpcDriver(DriverSetup.of(args)).prepare(1),
            sync._write_recovery_copy(SimpleNamespace(actors=[]), 1)]
    for staged in map(Path, made):
        assert staged.parent == root and not any(staged.iterdir()), staged  # new and empty, never the planted one
        assert stat.S_IMODE(staged.stat().st_mode) == 0o700
    staged = Path(made[0])

    target = tmp_path / "target"
    target.write_text("keep")
    (staged / ".model-pp0.safetensors.tmp").symlink_to(target)  # the temporary name, taken by a link
    with pytest.raises(FileExistsError, match="exists before vime created it"):
        write_stage_file(staged, 0, WEIGHTS)
    assert target.read_text() == "keep" and not (staged / "model-pp0.safetensors").exists()
    (staged / ".model-pp0.safetensors.tmp").unlink()
    (staged / "model-pp0.safetensors").symlink_to(target)  # the final name: the link itself is replaced
    written = write_stage_file(staged, 0, WEIGHTS)
    assert target.read_text() == "keep"
    assert stat.S_ISREG(written.lstat().st_mode) and stat.S_IMODE(written.stat().st_mode) == 0o600


def test_the_default_root_must_be_this_users_private_directory(tmp_path, monkeypatch):
    default = tmp_path / "vime-uid"
    monkeypatch.setattr(staging, "default_weight_root", lambda: str(default))
    default.mkdir(mode=0o777)
    default.chmod(0o777)  # made open (by someone else, or a umask): others could read or swap the weights
    with pytest.raises(PermissionError, match="not a private directory of this user"):
        stage_dir(str(default), "vime_weights_1_")
    default.rmdir()
    (tmp_path / "theirs").mkdir(mode=0o700)
    default.symlink_to(tmp_path / "theirs")
    with pytest.raises(PermissionError, match="not a private directory of this user"):
        stage_dir(str(default), "vime_weights_1_")
    default.unlink()
    assert Path(stage_dir(str(default), "vime_weights_1_")).parent == default  # made here: 0700, ours
    assert stat.S_IMODE(default.stat().st_mode) == 0o700


def test_stage_files_are_safetensors_exactly(tmp_path):
    """vime's streaming writer against safetensors' reader: every dtype it writes, odd shapes, the format tag."""
    from safetensors import safe_open

    weights = [("f32", torch.randn(3, 5)), ("bf16", torch.randn(7).bfloat16()), ("i64", torch.arange(4)),
               ("bool", torch.tensor([True, False, True])), ("scalar", torch.tensor(2.5)), ("empty", torch.zeros(0, 3)),
               ("f16_view", torch.randn(4, 6).half()[:, 1:3]), ("u8", torch.arange(9, dtype=torch.uint8))]
    written = write_stage_file(tmp_path, 3, weights)
    assert written.name == "model-pp3.safetensors"
    with safe_open(str(written), "pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(n for n, _ in weights)
        for name, t in weights:
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    with pytest.raises(TypeError, match="safetensors has no torch.complex64"):
        write_stage_file(tmp_path, 4, [("c", torch.zeros(2, dtype=torch.complex64))])
    assert not list(tmp_path.glob("*pp4*"))  # a failed write leaves nothing behind


# ---- the CUDA IPC manifest (its GPU half: tests/gpu/test_cuda_ipc.py) -------------------------------------------
def test_ipc_manifest_round_trips_as_plain_json(root):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (torch.Tensor, torch.Size([4, 8]), (8, 1), 0, torch.UntypedStorage, torch.bfloat16, 0,
            b"\x00\x01handle\xff", 64, 128, False, b"ref\x00", 16, b"\x02event", True)
    staged = Path(stage_dir(str(root), "vime_ipc_1_"))
    entries = [{"name": "w", "args": encode_rebuild_args((rebuild_cuda_tensor, args))}]
    write_new_file(staged, "stage_0.json", lambda f: f.write(json.dumps(entries).encode()))
    assert [p.name for p in update_files(str(staged), MANIFEST)] == ["stage_0.json"]
    assert read_manifests(str(staged)) == [("w", list(args))]

    def refused(bad_args, match):
        (staged / "stage_0.json").write_text(json.dumps([{"name": "w", "args": bad_args}]))
        with pytest.raises(ValueError, match=match):
            read_manifests(str(staged))

    encoded = entries[0]["args"]
    refused(encoded[:-1], "not rebuild_cuda_tensor's arguments")  # one short
    refused([encoded[4], *encoded[1:]], "not rebuild_cuda_tensor's arguments")  # a storage class as the tensor's
    refused([*encoded[:3], ["plain", "os.system"], *encoded[4:]], "unknown argument kind")
    refused([["class", "os.system"], *encoded[1:]], "none of the classes")
