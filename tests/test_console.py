"""What a person sees: the default commands' whole console (stdout and stderr) holds only lines they want.

Every command runs as a real subprocess with the user's warning settings, so these tests see what a
terminal shows (pyproject's pytest ``filterwarnings`` only applies inside the test process). A noisy
line fails the test with the whole console in the message.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Python and torch warnings ("path.py:12: UserWarning: ..."), deprecations, Lightning's tips, glog-style
# "W1201 10:17:39.81 ..." lines from torch's logging.
NOISE = re.compile(r"warning|deprecat|\bTip\b|\.py:\d+: |^[WE]\d{4} \d", re.IGNORECASE | re.MULTILINE)
# A short default run: two validations, a checkpoint at the end.
SHORT = ["--trainer.max_steps=20", "--trainer.val_check_interval=10", "--trainer.limit_val_batches=2"]


def env() -> dict[str, str]:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    environ.pop("PYTHONWARNINGS", None)  # a user's shell has none
    return environ


def run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_train", *args], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def fit(root: Path, *args: str, config: str = "pretrain-tiny.yaml") -> list[str]:
    """The arguments of ``fit --config configs/CONFIG`` writing its run into ``root``."""
    return ["fit", "--config", str(REPO / "configs" / config), f"--trainer.default_root_dir={root}", *args]


def console(result: subprocess.CompletedProcess) -> str:
    """stdout + stderr as the terminal ends up showing them: each carriage-return redraw replaced by
    its last state."""
    text = result.stdout + result.stderr
    return "\n".join(line.split("\r")[-1] for line in text.splitlines())


def assert_clean(result: subprocess.CompletedProcess, code: int = 0) -> str:
    text = console(result)
    assert result.returncode == code, text
    noisy = [m.group(0) for m in NOISE.finditer(text)]
    assert not noisy, f"noise {noisy} in the console:\n{text}"
    return text


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The default config, shortened: its run folder and its console."""
    root = tmp_path_factory.mktemp("pretrain")
    result = run(*fit(root, *SHORT), cwd=root)
    return root, assert_clean(result)


def test_default_fit_console_is_clean(pretrained: tuple[Path, str]) -> None:
    root, text = pretrained
    assert "Run finished: max_steps=20 reached" in text and (root / "checkpoints" / "last.ckpt").is_file()
    assert "LossScaleMonitor" not in text  # fp32: no callback that says it has nothing to do


def test_lora_finetune_and_generate_console_is_clean(pretrained: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = pretrained
    result = run(*fit(
        tmp_path, f"--model.init_args.init_from={root / 'checkpoints' / 'last.ckpt'}",
        "--model.init_args.lora.rank=8", "--trainer.max_steps=6", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1", "--data.init_args.eval_prompts=4", config="finetune-tiny.yaml",
    ), cwd=tmp_path)
    assert "Run finished: max_steps=6 reached" in assert_clean(result)
    result = run("generate", "--checkpoint", str(tmp_path / "checkpoints" / "last.ckpt"),
                 "--prompt", "get_user_name in CamelCase: ", "--max_new_tokens", "8", cwd=tmp_path)
    assert assert_clean(result).startswith("get_user_name in CamelCase: ")


def test_sharded_checkpoint_and_consolidate_console_is_clean(tmp_path: Path) -> None:
    fsdp = ("--trainer.strategy=lt_fsdp", "--trainer.max_steps=2", "--trainer.limit_val_batches=0")
    assert_clean(run(*fit(tmp_path, *fsdp), cwd=tmp_path))
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()  # sharded, so consolidate reads it with torch.distributed.checkpoint
    result = run("consolidate", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "export"),
                 cwd=tmp_path)
    out = tmp_path / "export"
    assert assert_clean(result).strip() == f"wrote {out / 'model.safetensors'} and {out / 'config.json'}"


def test_sigterm_console_is_clean(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_train", *fit(tmp_path, "--trainer.limit_val_batches=0")],
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while not any("Epoch 0:" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.2)  # training has started: Lightning's signal handlers and ours are in place
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=90)
    reader.join(timeout=10)
    result = subprocess.CompletedProcess(process.args, code, "".join(lines), "")
    text = assert_clean(result, code=75)
    assert "exiting with code 75" in text and (tmp_path / "checkpoints" / "preempted.ckpt").is_file()


def test_package_warnings_read_warning_colon(tmp_path: Path) -> None:
    """The package's own warnings say ``warning: ...`` without Python's source-path prefix."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"not a checkpoint")
    result = run(*fit(tmp_path, "--resume", "auto", "--trainer.max_steps=1", "--trainer.limit_val_batches=0"),
                 cwd=tmp_path)
    text = console(result)
    # nothing valid to resume and a checkpoint it would overwrite: refused, the file kept
    assert result.returncode == 2 and "none passed verification" in text, text
    assert (checkpoints / "last.ckpt").read_bytes() == b"not a checkpoint"
    lines = [line for line in text.splitlines() if "skipping checkpoint" in line]
    assert lines and all(line.startswith(f"warning: skipping checkpoint {checkpoints / 'last.ckpt'}: ")
                         for line in lines), text


def test_prepare_ends_with_what_it_wrote(tmp_path: Path) -> None:
    """The closing summary names the folder, files, tokens and split, and the bar's token count is
    meta.json's (the end-of-text marks where one document's pieces go to both splits included)."""
    text = "".join(f"line {i}: some text of a rather long document, cut into pieces\n" for i in range(4000))
    (tmp_path / "big.txt").write_text(text)  # ~260 kB: several pieces, some of them go to val
    (tmp_path / "small.txt").write_text("a small document\n")
    out = tmp_path / "tokens"
    result = run("prepare", "--inputs", f"[{tmp_path / 'big.txt'}, {tmp_path / 'small.txt'}]",
                 "--output_dir", str(out), "--val_fraction", "0.1", cwd=tmp_path)
    shown = assert_clean(result)
    meta = json.loads((out / "meta.json").read_text())
    split = {s: sum(x["num_tokens"] for x in meta["shards"] if x["split"] == s) for s in ("train", "val")}
    assert split["val"] > 0 and meta["total_tokens"] > len(text) + 18  # eos marks of the split pieces
    bar = [line for line in shown.splitlines() if line.startswith("tokenizing")]
    assert bar and f" {meta['total_tokens']:,} tokens" in bar[-1], shown
    summary = shown.splitlines()[-5:]
    assert summary[0].startswith(f"wrote {out} ({meta['total_tokens']:,} tokens from 2 files, "), shown
    assert re.fullmatch(rf"  train +{split['train']:,} tokens +\d+\.\d%  train_00000\.bin", summary[1]), shown
    assert re.fullmatch(rf"  val +{split['val']:,} tokens +\d+\.\d%  val_00000\.bin", summary[2]), shown
    assert shown.splitlines()[-1].endswith(f"--data.init_args.data_dir {out}")


def test_filters_drop_only_the_known_messages(tmp_path: Path) -> None:
    """Each filter names one message of one module or logger: another warning from the same place, or the
    same text from elsewhere, still reaches the console."""
    script = tmp_path / "noise.py"
    script.write_text(textwrap.dedent("""\
        import logging, warnings
        from lightning_train._warnings import silence_known_noise
        silence_known_noise()  # what the CLI does as it starts

        vital = "torchdata.stateful_dataloader.stateful_dataloader"
        warnings.warn_explicit("'set_vital' is deprecated, please do not call", UserWarning, "x.py", 1, vital)
        warnings.warn_explicit("a real torchdata warning", UserWarning, "x.py", 2, vital)
        warnings.warn_explicit("'set_vital' is deprecated (elsewhere)", UserWarning, "y.py", 3, "mine")
        tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        tips.addHandler(logging.StreamHandler())
        tips.setLevel(logging.INFO)
        tips.info("💡 Tip: For seamless cloud uploads, try installing [litmodels](https://x)")
        tips.info("Seed set to 1234")
        ao = logging.getLogger("torchao")
        ao.warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load this library")
        ao.warning("Failed to load /x/torchao/_C_something_new.so: a real problem")
    """))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    shown = result.stderr
    assert "a real torchdata warning" in shown and "'set_vital' is deprecated (elsewhere)" in shown
    assert "Seed set to 1234" in shown and "_C_something_new.so: a real problem" in shown
    assert "please do not call" not in shown and "Tip" not in shown and "cutlass" not in shown, shown
