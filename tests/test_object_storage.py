"""Checkpoints, run folders and prepared data on object storage (``s3://``), against a real S3 server.

The server is moto's, in server mode, in its own process on 127.0.0.1 (``tests/helpers/s3_server.py``),
with authentication on; clients find it through ``AWS_ENDPOINT_URL_S3`` and the key in the environment,
as on a cluster with a private S3-compatible store. Nothing here mocks the client.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_train.callbacks.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import cli_env, run_cli_in_process
from tests.helpers.ft_runs import MAX_STEPS, assert_same, batches, fault, write_config

pytest.importorskip("moto", reason="moto[server] (a dev dependency) runs the S3 server these tests use")
pytest.importorskip("s3fs", reason="s3fs (lightning_train[s3]) is the client under test")

from tests.helpers.s3_server import S3Server, s3_server  # noqa: E402

TINY = {"vocab_size": 258, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with s3_server() as running:
        running.create_bucket("runs")
        yield running


@pytest.fixture
def s3_env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """This process as a client of the server (fsspec's cached clients dropped, so the keys are read)."""
    import fsspec

    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    fsspec.filesystem("s3").clear_instance_cache()
    import lightning_train.storage as storage

    storage._checked_buckets.clear()
    return server


def launch(config: Path, cwd: Path, server: S3Server, *args: str, env: dict[str, str] | None = None,
           command: str = "fit") -> subprocess.CompletedProcess:
    """``python -m lightning_train fit --config CONFIG --resume auto ARGS`` in ``cwd``, in its own process
    group (a fault SIGKILLs the whole launch), as a client of ``server``; stderr merged into stdout."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", command, "--config", str(config), *args],
        cwd=cwd, env=env or cli_env(**server.env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300, start_new_session=True,
    )


def remote_state(url: str) -> dict[str, Any]:
    from lightning_train.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(url, mmap=False)
    assert checkpoint["global_step"] == MAX_STEPS
    return {"weights": checkpoint["state_dict"], "optimizer": checkpoint["optimizer_states"]}


# ---- the protocol, in one process ---------------------------------------------------------------------
def test_file_checkpoints_on_s3_are_committed_by_their_manifest(s3_env: S3Server) -> None:
    from lightning_train.checkpoint import AtomicCheckpointIO, find_resume_checkpoint, read_checkpoint
    from lightning_train.checkpoint.format import verify_checkpoint
    from lightning_train.errors import CorruptCheckpointError

    folder, io = "s3://runs/protocol/checkpoints", AtomicCheckpointIO()
    for step in (2, 4):
        io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((64,), float(step))}},
                           f"{folder}/step={step}.ckpt")
    keys = s3_env.keys("runs", "protocol/")
    assert keys == [f"protocol/checkpoints/step={s}.ckpt{e}" for s in (2, 4) for e in ("", ".manifest.json")]
    assert verify_checkpoint(f"{folder}/step=4.ckpt")["global_step"] == 4
    assert torch.equal(read_checkpoint(f"{folder}/step=4.ckpt")["state_dict"]["w"], torch.full((64,), 4.0))
    assert find_resume_checkpoint(folder) == f"{folder}/step=4.ckpt"

    # an upload whose manifest was never written (a kill before the commit) is never taken ...
    s3_env.client().put_object(Bucket="runs", Key="protocol/checkpoints/step=6.ckpt", Body=b"torn")
    assert find_resume_checkpoint(folder) == f"{folder}/step=4.ckpt"
    # ... a replaced object no longer matches its manifest: skipped with a warning, the previous one taken
    s3_env.client().put_object(Bucket="runs", Key="protocol/checkpoints/step=4.ckpt", Body=b"x" * 10)
    with pytest.warns(UserWarning, match=r"step=4.ckpt has 10 bytes, its manifest says"):
        assert find_resume_checkpoint(folder) == f"{folder}/step=2.ckpt"
    with pytest.raises(CorruptCheckpointError, match="has no manifest"):
        read_checkpoint(f"{folder}/step=6.ckpt")
    # a hostile manifest cannot make the download write outside the local copy
    hostile = {"format_version": 1, "files": {"../../outside.ckpt": {"size": 4, "sha256": "0"}}}
    s3_env.client().put_object(Bucket="runs", Key="protocol/checkpoints/step=6.ckpt.manifest.json",
                               Body=json.dumps(hostile).encode())
    with pytest.raises(CorruptCheckpointError, match="names '../../outside.ckpt', outside it"):
        read_checkpoint(f"{folder}/step=6.ckpt")

    # a write that fails half-way is aborted, not completed into a torn object
    class Failing(AtomicCheckpointIO):
        def _serialize(self, checkpoint: dict[str, Any], file: Any) -> None:
            file.write(b"half a checkpoint")
            raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        Failing().save_checkpoint({"global_step": 8}, f"{folder}/step=8.ckpt")
    assert "protocol/checkpoints/step=8.ckpt" not in s3_env.keys("runs", "protocol/")

    io.remove_checkpoint(f"{folder}/step=2.ckpt")  # retention removes the manifest with the file
    assert not [key for key in s3_env.keys("runs", "protocol/") if "step=2" in key]


def test_a_kill_mid_multipart_upload_leaves_the_previous_checkpoint(server: S3Server,
                                                                    s3_env: S3Server) -> None:
    from lightning_train.checkpoint import AtomicCheckpointIO, read_checkpoint

    url = "s3://runs/multipart/last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(4)}}, url)
    # another process replaces it with a 6 MiB object in 5 MiB parts: killed once the first part is up
    script = (
        "import sys, time\nimport lightning_train.storage as storage\n"
        "def write(f):\n    f.write(b'x' * (6 << 20)); f.flush()\n"
        "    print('part', flush=True); time.sleep(120)\n"
        f"storage.write_stream({url!r}, write)\n"
    )
    env = cli_env(**server.env(), FSSPEC_S3_DEFAULT_BLOCK_SIZE=str(5 << 20))
    writer = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "part"
        assert server.client().list_multipart_uploads(Bucket="runs").get("Uploads")  # in flight
    finally:
        writer.kill()
        writer.wait()
    assert read_checkpoint(url)["global_step"] == 1  # the previous object, matching its manifest


def test_missing_bucket_and_refused_key_are_one_error_line(s3_env: S3Server, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    config = write_config(tmp_path, tmp_path / "no-data")  # refused before the data is looked at
    commands = {
        "fit": ("fit", "--config", str(config), "--trainer.default_root_dir", "s3://{bucket}/run"),
        "consolidate": ("consolidate", "--checkpoint", "s3://{bucket}/run/checkpoints/last.ckpt",
                        "--output", str(tmp_path / "out")),
        "prepare": ("prepare", "--inputs", json.dumps([str(config)]).replace("{", "{{"),
                    "--output_dir", "s3://{bucket}/tokens"),
    }
    for bucket, secret, expected in (
        ("nobucket", s3_env.secret_key,
         r"error: the bucket of s3://nobucket/\S+ does not exist \(.*aws s3 mb.*"),
        ("runs", "not-the-secret", r"error: access to s3://runs/\S+ was refused \(.*AWS_ACCESS_KEY_ID.*"),
    ):
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        fsspec.filesystem("s3").clear_instance_cache()
        for name, args in commands.items():
            done = run_cli_in_process(*(arg.format(bucket=bucket) for arg in args), cwd=tmp_path)
            output = done.stdout + done.stderr
            errors = [line for line in output.splitlines() if line.startswith("error:")]
            assert done.returncode == 2 and len(errors) == 1, (name, output)
            assert re.fullmatch(expected, errors[0]), (name, errors[0])
            assert "Traceback" not in output and "not-the-secret" not in output
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_prepared_data_on_s3_is_committed_by_meta_json(s3_env: S3Server, tmp_path: Path) -> None:
    from lightning_train.data.shards import prepare
    from lightning_train.data.text import TextDataModule
    from lightning_train.errors import UserInputError

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"word {n} " * 20}) + "\n" for n in range(40)))
    done = run_cli_in_process("prepare", "--inputs", json.dumps([str(docs)]), "--output_dir", "s3://runs/data/tokens",
                              "--val_fraction", "0.2", "--num_workers", "0", cwd=tmp_path)
    assert done.returncode == 0 and "wrote s3://runs/data/tokens" in done.stdout, done.stderr
    keys = s3_env.keys("runs", "data/tokens/")
    assert "data/tokens/meta.json" in keys and any(key.endswith(".bin") for key in keys), keys
    with pytest.raises(UserInputError, match="already exists and is not empty"):
        prepare([str(docs)], "s3://runs/data/tokens", num_workers=0)
    prepare([str(docs)], "s3://runs/data/tokens", num_workers=0, val_fraction=0.2, overwrite=True)  # ours

    data = TextDataModule(data_dir="s3://runs/data/tokens", seq_len=16, batch_size=4)
    data.setup("fit")
    assert next(iter(data.train_dataloader()))["input_ids"].shape == (4, 16) and data.vocab_size == 258

    # shards without meta.json (a prepare cut short) are not a dataset
    s3_env.client().delete_object(Bucket="runs", Key="data/tokens/meta.json")
    with pytest.raises(UserInputError, match="has no meta.json"):
        TextDataModule(data_dir="s3://runs/data/tokens", seq_len=16, batch_size=4).setup("fit")
    # nor something --overwrite replaces: the prefix may hold anyone's objects
    with pytest.raises(UserInputError, match="is not a dataset prepare wrote"):
        prepare([str(docs)], "s3://runs/data/tokens", num_workers=0, overwrite=True)
    assert s3_env.keys("runs", "data/tokens/") == [key for key in keys if not key.endswith("meta.json")]


# ---- the CLI, in real processes -----------------------------------------------------------------------
def _grep_secret(secret: str, folder: Path, server: S3Server, texts: list[str]) -> list[str]:
    """Where the secret key appears: files under ``folder``, objects in the bucket, console output."""
    found = [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    client = server.client()
    found += [key for key in server.keys("runs")
              if secret.encode() in client.get_object(Bucket="runs", Key=key)["Body"].read()]
    return found + [f"output {i}" for i, text in enumerate(texts) if secret in text]


def test_fit_on_s3_preempted_then_killed_mid_upload_resumes_like_an_uninterrupted_local_run(
        server: S3Server, s3_env: S3Server, tmp_path: Path, data_dir: Path) -> None:
    from lightning_train.checkpoint import find_resume_checkpoint, verify_checkpoint

    local = write_config(tmp_path / "local", data_dir)
    reference = launch(local, tmp_path / "local", server, "--resume", "auto")
    assert reference.returncode == 0, reference.stdout[-3000:]
    expected = torch.load(tmp_path / "local/run/checkpoints/last.ckpt", weights_only=True)

    # preempted (SIGTERM) after step 4: its checkpoint goes to s3, exit 75; resumed, the background upload
    # of step 9's checkpoint is half written when SIGKILL hits the launch
    folder, url = tmp_path / "s3", "s3://runs/ft/run"
    config = write_config(folder, data_dir, callbacks=(fault(["train:4"], folder, "SIGTERM"),), plugins=(
        {"class_path": "tests.helpers.ft_callbacks.KillDuringWriteIO",
         "init_args": {"step": 9, "marker_dir": str(folder / "markers"), "async_save": True}},))
    args = ("--resume", "auto", "--trainer.default_root_dir", url)
    preempted = launch(config, folder, server, *args)
    assert preempted.returncode == PREEMPTED_EXIT_CODE, preempted.stdout[-3000:]
    assert verify_checkpoint(f"{url}/checkpoints/preempted.ckpt")["global_step"] == 5
    killed = launch(config, folder, server, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert f"resuming from {url}/checkpoints/preempted.ckpt" in killed.stdout
    keys = server.keys("runs", "ft/run/")
    assert not [key for key in keys if "step=9" in key] and "ft/run/checkpoints/epoch=0-step=6.ckpt" in keys
    newest = find_resume_checkpoint(f"{url}/checkpoints")  # what --resume auto takes: a checkpoint of step 6
    assert verify_checkpoint(newest)["global_step"] == 6

    wandb = {"class_path": "lightning_train.loggers.WandbLogger",
             "init_args": {"offline": True, "project": "s3", "save_dir": str(folder / "wandb")}}
    resumed = launch(config, folder, server, *args, "--trainer.logger", json.dumps(wandb))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {newest}" in resumed.stdout
    actual = remote_state(f"{url}/checkpoints/last.ckpt")
    assert_same(actual, {"weights": expected["state_dict"], "optimizer": expected["optimizer_states"]})
    assert batches(folder) == batches(tmp_path / "local")

    # a new fit into the run is refused: its checkpoints on s3 are found
    again = run_cli_in_process("fit", "--config", str(config), "--trainer.default_root_dir", url, cwd=folder)
    assert again.returncode == 2 and "already holds a run" in again.stderr + again.stdout

    # the launches logged on local disk (the CSV one in runs/<run name>); the saved configs keep the URL
    for saved in (folder / "runs/run/version_0/config.yaml", folder / "wandb/config.yaml"):
        assert f"default_root_dir: {url}" in saved.read_text()
    assert list((folder / "wandb").rglob("*.wandb"))
    outputs = [preempted.stdout, killed.stdout, resumed.stdout]
    assert _grep_secret(server.secret_key, tmp_path, server, outputs) == []


def test_sharded_folders_on_s3_resume_asynchronously_and_export(
        server: S3Server, s3_env: S3Server, tmp_path: Path, data_dir: Path) -> None:
    from lightning_train.checkpoint.sharded import read_whole_sharded_checkpoint

    config, url = write_config(tmp_path, data_dir, devices=2), "s3://runs/dcp/run"
    sharded = ("--trainer.strategy", "lt_fsdp", "--trainer.callbacks", "[]",
               "--trainer.default_root_dir", url)
    first = launch(config, tmp_path, server, *sharded, "--trainer.max_steps", "4")
    assert first.returncode == 0, first.stdout[-3000:]
    assert "dcp/run/checkpoints/last.ckpt/manifest.json" in server.keys("runs", "dcp/")

    # resumed on two ranks from the folder on s3, saving (after validation at step 8) in the background
    # into a fresh data prefix; the launch waits for that write before it exits
    resumed = launch(config, tmp_path, server, *sharded, "--trainer.max_steps", "8", "--resume", "auto",
                     "--async_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {url}/checkpoints/last.ckpt" in resumed.stdout
    last = "dcp/run/checkpoints/last.ckpt/"
    keys = [key.removeprefix(last) for key in server.keys("runs", last)]
    assert {"manifest.json", "v8/.metadata", "v8/meta.pt", "v8/__0_0.distcp", "v8/__1_0.distcp"} <= set(keys)
    assert not [key for key in keys if key.startswith("v4/")]  # the previous data, removed after the commit
    assert read_whole_sharded_checkpoint(f"{url}/checkpoints/last.ckpt")["global_step"] == 8

    # the tools read s3:// too: consolidate, export to a Hugging Face folder, generate
    for tool, *args in (("consolidate", "--output", str(tmp_path / "weights")),
                        ("export", "--output", str(tmp_path / "hf")),
                        ("generate", "--prompt", "alpha", "--max_new_tokens", "4")):
        done = subprocess.run(
            [sys.executable, "-m", "lightning_train", tool, "--checkpoint", f"{url}/checkpoints/last.ckpt",
             *args], cwd=tmp_path, env=cli_env(**server.env()), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "weights/model.safetensors").is_file() and (tmp_path / "hf/config.json").is_file()
    assert done.stdout.startswith("alpha")
