"""Pipeline bubble: step time of pp=2 with 1F1B at 2, 4 and 8 microbatches, and with the interleaved,
zero-bubble and V-shaped schedules (2 stages a rank) at 4 and 8, against one process.

Two gloo ranks on CPU (one thread each) run ``lightning_train.strategies.pipeline.Pipeline`` (the
schedule ``ParallelStrategy(pipeline_parallel=2)`` runs inside Lightning's step) over one global batch:
forward and backward of every microbatch, the tied embedding's gradients summed (as in training). The
reference is the same model and batch in one process with one thread. With perfectly balanced stages and free
communication a step takes ``T1 / p`` busy time, and the schedule leaves each rank idle for
``(p - 1) / (m + p - 1)`` of the step (the bubble), so the measured bubble is ``1 - (T1 / p) / Tpp``.
Measured and ideal are paired in one run. To tell the bubble from the cost of smaller matmuls, the one
process also runs the batch as ``m`` microbatches one after another (gradients accumulated): with that
time ``T1(m)``, a pipeline with free communication and balanced stages would take
``T1(m) / p * (m + p - 1) / m``; what the pipelined step takes beyond it is communication and the
imbalance of the stages (embedding on the first, head and loss on the last). Ideal bubbles: 1F1B
``(p - 1) / (m + p - 1)``; Interleaved1F1B over ``v`` stages a rank ``(p - 1) / (v * m + p - 1)``; the
zero-bubble schedules 0 (their claim, when a forward, an input gradient and a weight gradient take equal
time).

    python benchmarks/pipeline_bubble.py            # writes docs/benchmarks/pipeline_bubble.json
    python benchmarks/pipeline_bubble.py --smoke    # seconds: 1F1B at 2 and 4 microbatches, ZBV at 4
"""

from __future__ import annotations

import os
import socket
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import base_parser, machine_info, print_table, set_threads, write_json

from lightning_train._compat import end_distributed_process
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.strategies.pipeline import (
    ZERO_BUBBLE,
    Pipeline,
    last_stage_rank,
    pipeline_stage_ids,
    split_blocks,
    stage_model,
)

SIZES = {  # model, global batch, sequence length, timed steps, warmup steps (4 blocks: one a virtual stage)
    "full": ({"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 320, "block_size": 128}, 16, 128, 8, 2),
    "smoke": ({"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64, "block_size": 16}, 8, 16, 2, 1),
}
MICROBATCHES = (2, 4, 8)
STAGES = 2  # pipeline ranks
# 2 stages a rank, measured at 4 and 8 microbatches (DualPipeV needs one a stage)
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_MICROBATCHES = (4, 8)
VIRTUAL_STAGES = 2


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _batch(config: GPTConfig, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def one_process_step_seconds(size: str, microbatches: int = 1) -> list[float]:
    """Seconds per forward + backward of the whole batch in this process, as ``microbatches`` chunks run
    one after another (gradients accumulated)."""
    model_kwargs, batch, seq_len, steps, warmup = SIZES[size]
    torch.manual_seed(0)
    config = GPTConfig(**model_kwargs)
    model, (input_ids, labels) = GPT(config), _batch(config, batch, seq_len)
    seconds = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        for ids, targets in zip(input_ids.chunk(microbatches), labels.chunk(microbatches), strict=True):
            (_loss(model(ids), targets) / microbatches).backward()
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def _ideal_bubble(schedule: str, microbatches: int) -> float:
    if schedule in ZERO_BUBBLE:
        return 0.0
    virtual = VIRTUAL_STAGES if schedule == "Interleaved1F1B" else 1
    return (STAGES - 1) / (virtual * microbatches + STAGES - 1)


def _pipeline_rank(rank: int, size: str, schedule: str, microbatches: int, port: int, results: Any) -> None:
    set_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, init_method=f"tcp://127.0.0.1:{port}")
    try:
        model_kwargs, batch, seq_len, steps, warmup = SIZES[size]
        torch.manual_seed(0)
        config = GPTConfig(**model_kwargs)
        model = GPT(config)
        virtual = 1 if schedule == "1F1B" else VIRTUAL_STAGES
        num_stages = STAGES * virtual
        splits, ids = split_blocks(model, num_stages), pipeline_stage_ids(rank, STAGES, virtual, schedule)
        stages = [stage_model(model, splits[i], i == 0, i == num_stages - 1) for i in ids]
        world = dist.group.WORLD
        tied = world if last_stage_rank(STAGES, schedule) != 0 else None  # V: one rank holds both ends
        pipeline = Pipeline(stages, ids, num_stages, schedule, microbatches, world, tied, torch.device("cpu"))
        input_ids, labels = _batch(config, batch, seq_len)
        seconds = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            pipeline.train_step(input_ids, labels, _loss)
            if step >= warmup:
                seconds.append(time.perf_counter() - start)
        if rank == 0:
            results.put(seconds)
    except BaseException:
        traceback.print_exc()
        end_distributed_process(1)
    end_distributed_process(0)  # not interpreter teardown, where Gloo's threads can abort a finished rank


def pipeline_step_seconds(size: str, microbatches: int, schedule: str = "1F1B") -> list[float]:
    """Seconds per pipelined step (rank 0's clock; every step ends with a broadcast from the last stage)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_pipeline_rank, args=(size, schedule, microbatches, port, results), nprocs=STAGES,
                       start_method="spawn")
    return results.get()


def _measure(size: str, schedule: str, microbatches: int, pairs: int) -> tuple[dict[str, Any], list[Any]]:
    """One row: the schedule's step beside the one-process references, ``pairs`` times."""
    measured = []
    for _ in range(pairs):  # the references right beside each pipelined run: the same machine load
        one = statistics.median(one_process_step_seconds(size))
        chunked = statistics.median(one_process_step_seconds(size, microbatches))
        pp = statistics.median(pipeline_step_seconds(size, microbatches, schedule))
        measured.append((one, chunked, pp))
    ideal = _ideal_bubble(schedule, microbatches)
    # a pipeline of free communication and balanced stages over the chunked work: T1(m)/p / (1 - ideal)
    expected = [chunked / STAGES / (1 - ideal) for _, chunked, _ in measured]
    result = {
        "one_process_step_s": [one for one, _, _ in measured],
        "one_process_chunked_step_s": [chunked for _, chunked, _ in measured],
        "pipeline_step_s": [pp for _, _, pp in measured],
        "speedup": statistics.median(one / pp for one, _, pp in measured),
        "bubble_measured": statistics.median(1 - (one / STAGES) / pp for one, _, pp in measured),
        "bubble_ideal": ideal,
        "pipeline_over_expected": statistics.median(
            pp / e for (_, _, pp), e in zip(measured, expected, strict=True)
        ),
    }
    row = [
        schedule, microbatches, *(f"{statistics.median(m[i] for m in measured) * 1e3:.0f}" for i in range(3)),
        f"{result['speedup']:.2f}x", f"{result['bubble_measured']:.2f}", f"{ideal:.2f}",
        f"{result['pipeline_over_expected']:.2f}x",
    ]
    return result, row


def main() -> None:
    parser = base_parser("pipeline_bubble", __doc__.split("\n")[0], pairs=3)
    args = parser.parse_args()
    size = "smoke" if args.smoke else "full"
    pairs = 1 if args.smoke else args.pairs
    set_threads(1)  # each rank has one thread; so has the one-process reference
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, results, schedules = [], {}, {}
    # --smoke: each kind of placement once (one stage a rank, and the V), every launch is seconds
    for microbatches in MICROBATCHES[:2] if args.smoke else MICROBATCHES:  # 1F1B: "results"
        results[str(microbatches)], row = _measure(size, "1F1B", microbatches, pairs)
        rows.append(row)
    for schedule in ("ZBVZeroBubble",) if args.smoke else MULTI_STAGE:  # 2 stages a rank: "schedules"
        schedules[schedule] = {}
        for microbatches in MULTI_STAGE_MICROBATCHES[:1] if args.smoke else MULTI_STAGE_MICROBATCHES:
            schedules[schedule][str(microbatches)], row = _measure(size, schedule, microbatches, pairs)
            rows.append(row)
    table = print_table(
        ["schedule", "microbatches", "1 process ms/step", "1 process, m chunks", "pp=2 ms/step", "speed-up",
         "bubble measured", "bubble ideal", "pp=2 / ideal pipeline"],
        rows,
    )
    model_kwargs, batch, seq_len, steps, warmup = SIZES[size]
    write_json(args.out, {
        "benchmark": "pipeline_bubble", "smoke": args.smoke, "pairs": pairs,
        "stages": STAGES, "schedule": "1F1B", "virtual_stages": VIRTUAL_STAGES,
        "setup": {"model": model_kwargs, "global_batch": batch, "seq_len": seq_len, "steps": steps,
                  "warmup_steps": warmup},
        "results": results, "schedules": schedules, "table": table, "machine": machine_info(1),
    })


if __name__ == "__main__":
    main()
