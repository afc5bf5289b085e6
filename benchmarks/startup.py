"""Start-up, as whole processes: each tool's ``--help`` against ``python -c "import torch"``, and ``fit`` of
the default config until its first training step against Lightning's own minimal ``Trainer.fit`` (a
one-layer model, no logger, no checkpoints) until its first step.

Goals (issue 22): every tool's ``--help`` <= 1.3x ``import torch``; ``fit`` at its first step no later
than the minimal ``Trainer.fit`` (<= 1.0x). Each pair starts both processes back to back (alternating
which goes first); a process's CPU seconds are its own and its children's (``RUSAGE_CHILDREN``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup.py             # 5 pairs, ~3 minutes
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REPO,
    base_parser,
    compare_clocks,
    machine_info,
    paired,
    print_table,
    ratio_cell,
    write_json,
)

TOOLS = ["prepare", "generate", "export", "consolidate", "report", "dashboard"]
FIRST_STEP_CALLBACK = "common.FirstStepClock"  # both fits load it (benchmarks/ is on their PYTHONPATH)
MINIMAL_FIT = """
import lightning as L, torch
from common import FirstStepClock

class Minimal(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[FirstStepClock()])
trainer.fit(Minimal(), torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=2))
"""


def run_process(command: list[str], cwd: Path, env: dict[str, str]) -> dict[str, float]:
    """Wall and CPU seconds of one whole process (it must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu}


def run_to_first_step(command: list[str], cwd: Path, env: dict[str, str]) -> dict[str, float]:
    """Wall and CPU seconds from the process's start to its first training step."""
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as record:
        started = time.time()
        done = subprocess.run(command, cwd=cwd, env={**env, "FIRST_STEP_RECORD": record.name},
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        at_wall, at_cpu = map(float, Path(record.name).read_text().split())
    return {"wall": at_wall - started, "cpu": at_cpu}


def main() -> None:
    parser = base_parser("startup", __doc__.split("\n\n")[0])
    args = parser.parse_args()
    pairs = 1 if args.smoke else args.pairs
    tools = ["--help", "prepare"] if args.smoke else ["--help", *TOOLS]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    python = sys.executable
    info = machine_info(args.threads)
    results: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cwd = Path(work)
        import_torch = [python, "-c", "import torch"]
        for tool in tools:
            command = [python, "-m", "lightning_train", *([tool] if tool == "--help" else [tool, "--help"])]
            readings = paired(lambda: run_process(import_torch, cwd, env),
                              lambda command=command: run_process(command, cwd, env), pairs)
            name = f"{tool} (top level)" if tool == "--help" else f"{tool} --help"
            results[name] = compare_clocks("import torch", name, readings, "s")
            rows.append([name, *_cells(results[name]), "<= 1.3x"])
        minimal = [python, "-c", MINIMAL_FIT]
        config = str(REPO / "configs" / "pretrain-tiny.yaml")
        fit = [python, "-m", "lightning_train", "fit", "--config", config,
               f"--trainer.default_root_dir={cwd}/runs", "--trainer.max_steps=1",
               "--trainer.limit_val_batches=0", f"--trainer.callbacks+={FIRST_STEP_CALLBACK}"]

        def our_fit() -> dict[str, float]:
            reading = run_to_first_step(fit, cwd, env)
            subprocess.run(["rm", "-rf", str(cwd / "runs")], check=True)  # each launch a new run
            return reading

        readings = paired(lambda: run_to_first_step(minimal, cwd, env), our_fit, pairs)
        name = "fit pretrain-tiny.yaml, to its first step"
        results[name] = compare_clocks("minimal Trainer.fit", name, readings, "s")
        rows.append([name, *_cells(results[name]), "<= 1.0x"])
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    table = print_table(["process", "baseline wall s", "wall s", "wall ratio", "CPU ratio", "goal"], rows)
    write_json(args.out, {"benchmark": "startup", "smoke": args.smoke, "machine": info,
                          "setup": {"pairs": pairs, "tools": tools}, "results": results, "table": table})


def _cells(by_clock: dict[str, dict[str, Any]]) -> list[Any]:
    wall, cpu = by_clock["wall"], by_clock["cpu"]
    return [wall["a_stats"]["median"], wall["b_stats"]["median"], ratio_cell(wall["ratio_b_over_a"]),
            ratio_cell(cpu["ratio_b_over_a"])]


if __name__ == "__main__":
    main()
