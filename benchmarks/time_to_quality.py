"""Time to quality and tokens per CPU second, whole processes on the default corpus at one shape: our ``fit``
of ``configs/pretrain-tiny.yaml``, LitGPT's own ``litgpt pretrain`` (its venv, ``--litgpt-python``) and
nanoGPT's ``train.py`` loop (``nanogpt_peer.py``, nanoGPT's own CPU recipe, its GPT-2 block and the same
Llama-style block), each its own process with one thread, the systems' order alternating between repeats.

Per repeat and system:

- **tokens per CPU second** of the training steps: the CPU seconds (``RUSAGE_CHILDREN``, user + system) of a
  run of ``N2`` steps minus those of a run of ``N1`` steps, over the tokens of ``N2 - N1`` steps. Start-up,
  the sanity check and the final checkpoint cancel; neither run validates or checkpoints in between.
- **steps to the target**: a run validating every ``eval`` steps on the same validation tokens (the fixed
  windows our validation reads, written to ``val_starts.json``), the first step whose loss is ``<=`` the
  target (the default config's TimeToQuality target). Ours stops there (TimeToQuality), nanoGPT's loop too
  (``--target``); LitGPT's runs its schedule out and its printed validations are read.
- **CPU seconds to quality**: steps to the target x the CPU seconds a step of that repeat; start-up,
  validation and checkpoints not included (each run's whole CPU is in the JSON too).

Ratios are ours / theirs, per repeat (paired in one run), as median (min-max).

    python benchmarks/time_to_quality.py                 # 3 repeats; docs/benchmarks/time_to_quality.json
    python benchmarks/time_to_quality.py --smoke         # a tiny model, a few steps (no LitGPT if absent)
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from common import REPO, base_parser, machine_info, print_table, ratio_cell, summarize, write_json
from throughput import SMOKE_SHAPE, build_cli, peer_shape
from whole_process import CONFIG, PEER, package_env, timed_process

from lightning_train.data.loading import spread

LITGPT_PYTHON = Path("/work/venv-litgpt/bin/python")
PEERS = {"nanogpt, GPT-2 block": "gpt2", "nanogpt, same block": "llama"}
OURS, LITGPT = "lightning_train", "litgpt"


def corpus(overrides: list[str], folder: Path) -> dict[str, Any]:
    """The shape, token files, target and evaluation the config resolves to; writes ``val_starts.json``:
    the token offsets of the windows our validation reads (``limit_val_batches`` batches, spread)."""
    shape, train_bin = peer_shape(overrides, "llama")
    with tempfile.TemporaryDirectory() as root:
        cli = build_cli(overrides, root, steps=1)
        data, trainer = cli.datamodule, cli.trainer
        data.setup("fit")
        val_batches = int(trainer.limit_val_batches)
        indices = spread(len(data.val_set), val_batches * shape["batch_size"])  # as val_loader picks them
        eval_every = int(trainer.val_check_interval)
    starts = [int(i) * shape["block_size"] for i in indices]
    (folder / "val_starts.json").write_text(json.dumps(starts))
    config = yaml.safe_load((REPO / CONFIG).read_text())
    [target] = [c["init_args"]["target"] for c in config["trainer"]["callbacks"]
                if c["class_path"].endswith("TimeToQuality")]
    val_bin = train_bin.with_name(train_bin.name.replace("train", "val"))
    return {"shape": shape, "train": train_bin, "val": val_bin,
            "val_starts": folder / "val_starts.json", "val_batches": val_batches, "eval_every": eval_every,
            "target": target, "max_steps": config["trainer"]["max_steps"]}


# ---- one run of each system: {"cpu", "wall", "val": [[step, loss], ...]} ----------------------------------
def run_ours(setup: dict, overrides: list[str], steps: int, quality: bool, threads: int) -> dict:
    config = yaml.safe_load((REPO / CONFIG).read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("TimeToQuality"):
            callback["init_args"]["target"] = setup["target"] if quality else -1.0  # -1: never stops
    cadence = [] if quality else [f"--trainer.val_check_interval={steps + 1}"]  # none between the steps
    with tempfile.TemporaryDirectory() as cwd:
        derived = Path(cwd) / "config.yaml"
        derived.write_text(yaml.safe_dump(config, sort_keys=False))
        command = [sys.executable, "-m", "lightning_train", "fit", "--config", str(derived),
                   f"--trainer.max_steps={steps}", "--run_name", "bench", *overrides, *cadence]
        record = timed_process(command, cwd, package_env(REPO, threads))
        logs = Path(cwd) / "runs" / "bench" / "version_0"
        rows = []  # no metrics.csv: nothing was logged (a few steps, no validation)
        if (logs / "metrics.csv").exists():
            with open(logs / "metrics.csv") as file:
                rows = [row for row in csv.DictReader(file) if row.get("val/loss")]
        # the CSV logs a validation at the step before it (global_step - 1): the steps done are one more
        val = [[int(row["step"]) + 1, float(row["val/loss"])] for row in rows]
        reached = json.loads((logs / "time_to_quality.json").read_text())
        if quality and reached["reached"] and steps_to(setup["target"], val) != reached["step"]:
            raise RuntimeError(f"metrics.csv's validations {val} disagree with TimeToQuality's {reached}")
    return {**record, "val": val}


def run_peer(setup: dict, block: str, steps: int, quality: bool, threads: int) -> dict:
    shape = {**setup["shape"], "block": block}
    with tempfile.TemporaryDirectory() as cwd:
        result = Path(cwd) / "result.json"
        command = [
            sys.executable, str(PEER), "--shape", json.dumps(shape), "--out-dir", cwd,
            "--result", str(result), "--train-bin", str(setup["train"]), "--val-bin", str(setup["val"]),
            "--recipe", "nanogpt",
            "--val-starts", str(setup["val_starts"]), f"--eval-iters={setup['val_batches']}",
            f"--max-iters={steps}", f"--eval-interval={setup['eval_every'] if quality else steps + 1}",
        ] + (["--target", str(setup["target"])] if quality else [])
        record = timed_process(command, cwd, {**os.environ, "OMP_NUM_THREADS": str(threads)})
        done = json.loads(result.read_text())
    return {**record, "val": done["val_history"]}


def litgpt_config(setup: dict, steps: int, quality: bool, out_dir: str) -> dict:
    """``litgpt pretrain``'s config at our shape and recipe: the Llama-style block LitGPT names LLaMAMLP +
    RMSNorm + rotary; LitGPT pads the vocabulary to its ``padding_multiple`` (512) as it always does."""
    shape, ours = setup["shape"], yaml.safe_load((REPO / CONFIG).read_text())["model"]["init_args"]
    eval_every = setup["eval_every"] if quality else steps + 1
    tokens = shape["batch_size"] * shape["block_size"]
    return {
        "model_name": "lightning-train-pretrain-tiny",
        "model_config": {
            "name": "lightning-train-pretrain-tiny", "block_size": shape["block_size"],
            "vocab_size": shape["vocab_size"], "n_layer": shape["n_layer"], "n_head": shape["n_head"],
            "n_query_groups": shape["n_head"], "n_embd": shape["n_embd"], "rotary_percentage": 1.0,
            "parallel_residual": False, "bias": False, "norm_class_name": "RMSNorm", "norm_eps": 1e-5,
            "mlp_class_name": "LLaMAMLP", "intermediate_size": shape["hidden"], "rope_base": 10000,
        },
        "out_dir": out_dir, "precision": "32-true", "devices": 1, "num_nodes": 1, "logger_name": "csv",
        "seed": 1234,
        "data": {"class_path": "litgpt_data.TokenFile", "init_args": {
            "train_bin": str(setup["train"]), "val_bin": str(setup["val"]),
            "val_starts": str(setup["val_starts"])}},
        "train": {"save_interval": eval_every, "log_interval": 10, "global_batch_size": shape["batch_size"],
                  "micro_batch_size": shape["batch_size"], "max_tokens": steps * tokens, "max_norm": 1.0,
                  "min_lr": ours["min_lr"], "lr_warmup_steps": ours["warmup_steps"],
                  "tie_embeddings": True, "max_seq_length": shape["block_size"]},
        "eval": {"interval": eval_every, "max_iters": setup["val_batches"], "initial_validation": False,
                 "final_validation": False},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {
            "lr": ours["learning_rate"], "weight_decay": ours["weight_decay"], "betas": [0.9, 0.95]}},
    }


def run_litgpt(setup: dict, python: Path, steps: int, quality: bool, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        config = Path(cwd) / "pretrain.yaml"
        config.write_text(yaml.safe_dump(litgpt_config(setup, steps, quality, str(Path(cwd) / "out"))))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCH_COMPILE_DISABLE": "1",  # compile off
               "PYTHONPATH": str(REPO / "benchmarks")}
        log = Path(cwd) / "stdout.txt"
        command = ["/bin/sh", "-c", f'exec "{python}" -m litgpt pretrain --config "{config}" > "{log}"']
        record = timed_process(command, cwd, env)
        printed = log.read_text()
    found = re.findall(r"iter (\d+): val loss ([0-9.]+)", printed)
    return {**record, "val": [[int(step), float(loss)] for step, loss in found]}


# ---- the comparison ------------------------------------------------------------------------------------
def steps_to(target: float, val: list[list[float]]) -> int | None:
    return next((int(step) for step, loss in val if loss <= target), None)


def measure(systems: dict[str, Any], setup: dict, repeats: int, lengths: tuple[int, int],
            max_steps: dict[str, int], quality_runs: int) -> dict[str, list[dict]]:
    """Per system, one record a repeat: the two throughput runs, the quality run (the first
    ``quality_runs`` repeats run one) and what they give."""
    records: dict[str, list[dict]] = {name: [] for name in systems}
    tokens = setup["shape"]["batch_size"] * setup["shape"]["block_size"]
    for repeat in range(repeats):
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for name in order:
            run = systems[name]
            short, long = run(lengths[0], False), run(lengths[1], False)
            # seeded, one thread: a quality run repeats its losses exactly, so later repeats reuse the last;
            # --quality-runs 0: tokens per CPU second only
            quality = {"val": []} if not quality_runs else (
                run(max_steps[name], True) if repeat < quality_runs else records[name][-1]["quality"])
            cpu_per_step = (long["cpu"] - short["cpu"]) / (lengths[1] - lengths[0])
            steps = steps_to(setup["target"], quality["val"])
            records[name].append({
                "short": short, "long": long, "quality": quality, "cpu_per_step": cpu_per_step,
                "tokens_per_cpu_s": tokens / cpu_per_step, "steps_to_target": steps,
                "cpu_to_target": None if steps is None else steps * cpu_per_step,
            })
            print(f"repeat {repeat}: {name}: {tokens / cpu_per_step:,.0f} tokens/CPU s, "
                  f"steps to {setup['target']}: {steps}, val {quality['val']}", flush=True)
    return records


def summarize_records(records: dict[str, list[dict]]) -> dict[str, Any]:
    """Each system's medians (min-max), and ours / each other system per repeat."""
    keys = ("tokens_per_cpu_s", "steps_to_target", "cpu_to_target")
    result: dict[str, Any] = {"systems": {}, "ratios": {}}
    for name, runs in records.items():
        result["systems"][name] = {key: _stats([run[key] for run in runs]) for key in keys}
    for name, runs in records.items():
        if name == OURS:
            continue
        pairs = list(zip(records[OURS], runs, strict=True))
        result["ratios"][name] = {key: _stats([_ratio(ours[key], theirs[key]) for ours, theirs in pairs])
                                  for key in keys}
    return result


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None else ours / theirs


def _stats(values: list[float | None]) -> dict[str, Any]:
    """``summarize`` of the values there are, and how many runs had none (the target not reached)."""
    present = [v for v in values if v is not None]
    return {**(summarize(present) if present else {}), "missing": len(values) - len(present)}


def _cell(stats: dict[str, Any], ratio: bool = False) -> str:
    if "median" not in stats:
        return "not reached"
    text = ratio_cell(stats) if ratio else f"{stats['median']:,.0f} ({stats['min']:,.0f}-{stats['max']:,.0f})"
    return text + (f", {stats['missing']} not reached" if stats["missing"] else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser("time_to_quality", __doc__.splitlines()[0], pairs=3)
    parser.add_argument("--litgpt-python", type=Path, default=LITGPT_PYTHON, help="LitGPT's venv python")
    parser.add_argument("--lengths", type=int, nargs=2, default=[10, 90], metavar=("N1", "N2"),
                        help="the two throughput runs' steps")
    parser.add_argument("--nanogpt-max-iters", type=int, default=2000, help="nanoGPT's CPU recipe's")
    parser.add_argument("--quality-runs", type=int, default=1,
                        help="repeats that run to the target (seeded runs repeat their losses exactly); "
                        "0: tokens per CPU second only")
    args = parser.parse_args(argv)
    smoke_cadence = ["--trainer.val_check_interval=2", "--trainer.limit_val_batches=2"]
    overrides = [*SMOKE_SHAPE, *smoke_cadence] if args.smoke else []
    repeats, lengths = (1, (2, 4)) if args.smoke else (args.pairs, tuple(args.lengths))
    machine = machine_info(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        setup = corpus(overrides, Path(folder))
        if args.smoke:
            setup["target"] = 5.5  # a tiny model's few steps: about where it starts (ln 258 = 5.55)
        max_steps = {OURS: 6 if args.smoke else setup["max_steps"]}
        systems: dict[str, Any] = {
            OURS: lambda steps, quality: run_ours(setup, overrides, steps, quality, args.threads)}
        litgpt = args.litgpt_python.exists()
        if litgpt:
            max_steps[LITGPT] = max_steps[OURS]  # the same schedule as ours, run out
            systems[LITGPT] = lambda steps, quality: run_litgpt(
                setup, args.litgpt_python, steps, quality, args.threads)
        else:
            print(f"LitGPT not measured: no {args.litgpt_python} (see benchmarks/README.md)", flush=True)
        for name, block in PEERS.items():
            max_steps[name] = 6 if args.smoke else args.nanogpt_max_iters
            systems[name] = lambda steps, quality, block=block: run_peer(
                setup, block, steps, quality, args.threads)
        records = measure(systems, setup, repeats, lengths, max_steps, args.quality_runs)
    result = summarize_records(records)
    rows = []
    for name in systems:
        own, ratio = result["systems"][name], result["ratios"].get(name)
        rows.append([name, _cell(own["tokens_per_cpu_s"]), _cell(own["steps_to_target"]),
                     _cell(own["cpu_to_target"]), *([_cell(ratio[key], True) for key in
                     ("tokens_per_cpu_s", "steps_to_target", "cpu_to_target")] if ratio else ["", "", ""])])
    print_table(["system", "tokens / CPU s", f"steps to {setup['target']}", "CPU s to it",
                 "ours / it: tokens/CPU s", "steps", "CPU s to quality"], rows)
    setup_json = {key: str(value) if isinstance(value, Path) else value for key, value in setup.items()}
    payload = {
        "benchmark": "time_to_quality",
        "goal": "CPU s to quality <= 0.5x nanoGPT's, <= 0.8x LitGPT's; tokens/CPU s >= 1.0x LitGPT's",
        "smoke": args.smoke,
        "setup": {**setup_json, "overrides": overrides, "lengths": list(lengths), "max_steps": max_steps,
                  "repeats": repeats, "quality_runs": args.quality_runs,
                  "litgpt": litgpt},
        "machine": {**machine, "load_average_after": machine_info()["load_average_1_5_15"]},
        "results": result,
        "runs": records,
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
