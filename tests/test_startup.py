"""Start-up: the help and the tools answer without importing Lightning or torchmetrics (whose import alone
takes seconds), and ``from lightning_train import GPT`` stays as cheap as torch. Checked as a user runs
them, ``python -m lightning_train ...`` in a fresh interpreter, by the modules it imported, not a time
(benchmarks/startup.py measures the seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_main

HEAVY = ("lightning", "torchmetrics", "transformers", "torch._dynamo")
# At the interpreter's exit, the heavy modules it imported, on stderr's last line.
REPORT_IMPORTS = (
    "import atexit, json, runpy, sys\n"
    "atexit.register(lambda: print('imported:', json.dumps([m for m in {watched!r} if m in sys.modules]),"
    " file=sys.stderr))\n"
    "sys.argv = ['lightning_train', *{args!r}]\n"
    "runpy.run_module('lightning_train', run_name='__main__', alter_sys=True)\n"
)


def imported(args: list[str], cwd: Path, watched: tuple[str, ...] = HEAVY) -> list[str]:
    """Run ``python -m lightning_train ARGS``; which of ``watched`` it imported (it must succeed)."""
    script = REPORT_IMPORTS.format(watched=watched, args=args)
    result = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=cli_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("imported: "), result.stderr[-3000:]
    return json.loads(last.removeprefix("imported: "))


def test_the_check_sees_lightning_when_it_is_imported(tmp_path):
    """The check can fail: ``fit --help`` builds the Trainer's parser, so it imports Lightning."""
    assert "lightning" in imported(["fit", "--help"], tmp_path)


def test_top_level_help_imports_not_even_torch(tmp_path):
    assert imported(["--help"], tmp_path, (*HEAVY, "torch")) == []


@pytest.mark.parametrize("tool", ["prepare", "generate", "export", "consolidate", "report", "dashboard"])
def test_tool_help_imports_not_even_torch(tool, tmp_path):
    """``export`` and ``consolidate`` take their options from the library's functions, whose module imports
    torch only when they run."""
    assert imported([tool, "--help"], tmp_path, (*HEAVY, "torch")) == []


def test_the_package_face_imports_torch_only(tmp_path):
    script = ("import sys\nfrom lightning_train import GPT, GPTConfig, UserInputError\n"
              "GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64))\n"
              f"print([m for m in {HEAVY!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


TINY_FIT = (
    "fit", "--config", str(REPO / "configs" / "pretrain-tiny.yaml"),
    "--model.init_args.config.n_layer=1", "--model.init_args.config.n_embd=32",
    "--model.init_args.config.n_head=2", "--model.init_args.config.block_size=16",
    "--data.init_args.seq_len=16", "--data.init_args.batch_size=4", "--trainer.max_steps=4",
    "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false", "--model.init_args.warmup_steps=1",
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run of a tiny model (in this process): a checkpoint and metrics for the tools to read."""
    work = tmp_path_factory.mktemp("startup")
    code, _, err = run_main(*TINY_FIT, f"--trainer.default_root_dir={work}/run")
    assert code == 0, err[-3000:]
    return work


def test_a_one_device_fit_imports_neither_sharded_checkpoints_nor_pipelining(tmp_path):
    """torch.distributed.checkpoint and .pipelining (about 0.1 s each) are for runs that shard or pipeline;
    a one-device fit that saves and validates does not import them, nor the transformers and matplotlib
    that torchmetrics imports with itself when they are installed (1.7 CPU seconds; _compat's
    torchmetrics_without_heavy_extras), nor the s3fs Lightning imports to check local paths (0.3 s)."""
    watched = ("torch.distributed.checkpoint", "torch.distributed.pipelining", "transformers", "matplotlib",
               "s3fs", "lightning")
    loaded = imported([*TINY_FIT, f"--trainer.default_root_dir={tmp_path}/run"], tmp_path, watched)
    assert loaded == ["lightning"]  # the control: the watch sees what the fit imported
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def tool_runs(work: Path) -> dict[str, list[str]]:
    checkpoint = str(work / "run" / "checkpoints" / "last.ckpt")
    (work / "text.txt").write_text("def loads(s):\n    return s\n" * 50)
    return {
        "prepare": ["prepare", "--inputs", f"[{work / 'text.txt'}]", "--output_dir", str(work / "tokens")],
        "export": ["export", "--checkpoint", checkpoint, "--output", str(work / "hf")],
        "consolidate": ["consolidate", "--checkpoint", checkpoint, "--output", str(work / "st")],
        "generate": ["generate", "--checkpoint", checkpoint, "--prompt", "def ", "--max_new_tokens", "4"],
        "report": ["report", str(work / "run")],
        "dashboard": ["dashboard", "--run_dir", str(work / "run")],
    }


@pytest.mark.parametrize("tool", ["prepare", "generate", "export", "consolidate", "report", "dashboard"])
def test_tool_runs_without_lightning_or_torchmetrics(tool, tiny_run):
    """Each tool does its real work on a real run folder and checkpoint, still without Lightning."""
    assert imported(tool_runs(tiny_run)[tool], tiny_run) == []


# Process-wide state a library import could change: warning filters and format, import hooks, log filters,
# the TF32 switches. Lightning and torch are imported first: their own settings are theirs.
GLOBAL_STATE = (
    "import logging, sys, warnings\n"
    "import lightning, torch\n"
    "def snapshot():\n"
    "    loggers = {name: [repr(f) for f in logging.getLogger(name).filters]\n"
    "               for name in sorted(logging.root.manager.loggerDict)}\n"
    "    return {'filters': [repr(f) for f in warnings.filters], 'format': warnings.formatwarning,\n"
    "            'meta_path': [repr(finder) for finder in sys.meta_path], 'log_filters': loggers,\n"
    "            'tf32': (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,\n"
    "                     torch.get_float32_matmul_precision())}\n"
    "before = snapshot()\n"
    "{imports}\n"
    "after = snapshot()\n"
    "print(sorted(key for key in before if before[key] != after[key]))\n"
)


@pytest.mark.parametrize(("imports", "changed"), [
    ("import lightning_train\n"
     "from lightning_train import GPT, GPTConfig, PretrainModule, TextDataModule\n"
     "import lightning_train.callbacks, lightning_train.checkpoint, lightning_train.loggers\n"
     "import lightning_train.modules, lightning_train.plugins\n"
     "config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64)\n"
     "PretrainModule(config).configure_model()",
     []),
    # the control: what the CLI installs as it starts is seen
    ("from lightning_train._warnings import silence_known_noise, plain_package_warnings\n"
     "silence_known_noise()\nplain_package_warnings()", ["filters", "format", "log_filters"]),
], ids=["the-package-changes-nothing", "the-cli-setup-is-seen"])
def test_importing_the_package_changes_nothing_global(imports, changed, tmp_path):
    """``import lightning_train`` (and its library packages, and building a module's model) leaves the
    process's warning filters, import hooks, log filters and TF32 settings as they were; the CLI switches
    on what it needs when it runs."""
    result = subprocess.run([sys.executable, "-c", GLOBAL_STATE.replace("{imports}", imports)], cwd=tmp_path,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(changed)
