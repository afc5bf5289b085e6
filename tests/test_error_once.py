"""A bad input found inside a 2-rank gloo run is one ``error:`` line at the start of a line, printed by
the rank that found it, and exit code 2 from every rank: whether both ranks find it or one alone does
(the other then only loses its peer in a collective, and says nothing), and whichever ends first: a
rank that meets the bad input after its peer has ended says nothing either. No C++ stack from torch's
store follows the line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_train.errors import UserInputError
from tests.conftest import REPO, cli_env
from tests.helpers.user_errors import MESSAGE

TWO_RANKS = [
    "--config", str(REPO / "configs" / "pretrain-tiny.yaml"),
    "--model.init_args.config.n_layer=1", "--model.init_args.config.n_embd=32",
    "--model.init_args.config.n_head=2", "--model.init_args.config.block_size=32",
    "--data.init_args.seq_len=32", "--data.init_args.batch_size=4", "--trainer.max_steps=4",
    "--trainer.limit_val_batches=0", "--trainer.accelerator=cpu", "--trainer.devices=2",
    "--trainer.strategy=lt_ddp",
]


def _fit_raising(tmp_path: Path, rank: int | None, late_rank: int | None) -> subprocess.CompletedProcess:
    """A 2-rank fit whose ``rank`` (None: every rank) raises a UserInputError after its first batch,
    ``late_rank`` seconds later than the other, with the progress bar drawn; stdout and stderr in one
    stream, as a console shows them."""
    raiser = {"class_path": "tests.helpers.user_errors.RaiseUserInputError",
              "init_args": {"at": "batch_end", "rank": rank, "late_rank": late_rank}}
    return subprocess.run(
        [sys.executable, "-m", "lightning_train", "fit", *TWO_RANKS,
         f"--trainer.default_root_dir={tmp_path / 'run'}", f"--trainer.callbacks+={json.dumps(raiser)}"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    ("rank", "late_rank"), [(None, None), (None, 1), (0, None), (1, None)],
    ids=["both-ranks", "both-ranks-rank-1-late", "rank-0-only", "rank-1-only"],
)
def test_bad_input_in_a_two_rank_run_is_one_error_line(tmp_path, rank, late_rank):
    done = _fit_raising(tmp_path, rank, late_rank)
    assert done.returncode == 2, done.stdout[-3000:]
    assert "Traceback" not in done.stdout and "TCPStore" not in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("error:") == 1, done.stdout[-3000:]
    lines = done.stdout.replace("\r", "\n").splitlines()  # a bar redrawn with \r is one line per draw
    assert f"error: {MESSAGE.format(point='batch_end')}" in lines, done.stdout[-3000:]


def test_a_single_process_error_is_claimed_without_a_process_group():
    """Outside a process group there is nobody to agree with: the process reports its own failure."""
    from lightning_train.cli._failure import claim_report, peer_failure_code

    assert claim_report(2) and peer_failure_code() is None
    assert isinstance(UserInputError("x"), ValueError)


def test_a_store_whose_host_ends_before_the_call_raises_without_torchs_stack(capfd):
    """The race the socket check leaves: rank 0 (the store's host) ends after a peer found its port open
    and before the peer's store call. The call raises and torch's C++ stack for it reaches no console;
    what else the process writes meanwhile still does (a call that succeeds)."""
    import datetime
    import socket

    import torch.distributed as dist

    from lightning_train.cli._failure import _ask_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as dist\n"
        f"store = dist.TCPStore('127.0.0.1', {port}, 2, True, timeout=datetime.timedelta(seconds=60))\n"
        "time.sleep(120)\n")])
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))

        def set_and_say() -> None:
            client.set("key", "1")
            os.write(2, b"said\n")

        assert _ask_store(set_and_say) is None
        assert capfd.readouterr().err == "said\n"
    finally:
        host.kill()
        host.wait()
    with pytest.raises(dist.DistNetworkError):
        _ask_store(lambda: client.check(["key"]))
    assert capfd.readouterr().err == ""
    with pytest.raises(dist.DistNetworkError):  # unguarded, torch prints its stack: the test can fail
        client.check(["key"])
    assert "TCPStore" in capfd.readouterr().err
