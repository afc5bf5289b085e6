"""GPU: tokens/s and MFU of a Llama-3-8B-shaped block stack under tensor parallelism, tp = 1, 2, 4, ... up
to the GPUs present (CUDA only: without CUDA it says so in one line, exit code 2).

The stack: Llama 3 8B's shape (n_embd 4096, 32 query heads, 8 key/value heads, SwiGLU 14336 wide,
vocabulary 128256 untied, rope theta 500000) with ``--layers`` blocks (4 by default: the whole model's
32 do not fit one GPU's training state, a stack of them measures the same per-layer work). For each tp
a fresh ``torchrun --standalone --nproc_per_node=tp`` runs the worker: a ``tp`` device mesh, the GPT
built on every GPU with the same seed, ``apply_tensor_parallel`` (the plan ``ParallelStrategy`` applies,
sequence parallelism included), then training steps on random tokens: bf16 autocast over fp32 weights,
the float32 cross-entropy, AdamW. All tp ranks read the same batch, so a tp group's tokens/s is the
batch's tokens per step time; MFU = tokens/s x ``GPT.flops_per_token`` / (tp x the GPU's dense bf16
peak, ``gpu.peak_flops``). Not timed: gradient clipping (Lightning's is not DTensor-aware) and
``torch.compile``.

    python benchmarks/model_parallel_gpu.py                       # every tp the GPUs allow
    python benchmarks/model_parallel_gpu.py --tp 1,8 --layers 8   # chosen sizes
    python benchmarks/model_parallel_gpu.py --dry-run --gpus 8    # on CPU: the plan, per-rank bytes

``--dry-run`` runs the same torchrun workers on CPU (gloo) with the stack on the meta device: no
weights, no training, the parameter bytes each rank holds for each tp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import RESULTS_DIR, clock, machine_info, per_step, print_table, synchronize, write_json
from torch.distributed.device_mesh import init_device_mesh

from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.strategies.memory import measured_state_bytes
from lightning_train.strategies.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    reduce_partial_grads,
    vocab_parallel_loss,
)

LLAMA3_8B = {"vocab_size": 128256, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "intermediate_size": 14336,
             "rope_theta": 500000.0, "tie_embeddings": False}
GiB = 2**30


def llama3_stack(layers: int, seq_len: int) -> GPTConfig:
    return GPTConfig(n_layer=layers, block_size=seq_len, **LLAMA3_8B)


def tp_sizes(gpus: int, config: GPTConfig, given: str | None) -> list[int]:
    """The tp sizes to run: ``given`` ("1,2,8"), else every power of two up to ``gpus`` that divides the
    key/value heads. Refuses a size the GPUs or the heads cannot take."""
    if given is None:
        sizes = [2**i for i in range(gpus.bit_length()) if config.n_kv_head % 2**i == 0]
    else:
        try:
            sizes = [int(size) for size in given.split(",")]
        except ValueError:
            raise UserInputError(f"--tp {given!r}: give sizes separated by commas, e.g. --tp 1,2,4") from None
    for size in sizes:
        if not 1 <= size <= gpus:
            raise UserInputError(f"--tp {size} needs {size} GPUs, there are {gpus}: use sizes <= {gpus}")
        check_tensor_parallel(size, config)
    return sizes


def worker(args: argparse.Namespace) -> None:
    """One rank of one tp size (under torchrun); rank 0 writes ``args.result``."""
    device = torch.device("meta") if args.dry_run else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":  # before NCCL starts, so it binds each rank to its own GPU
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    dist.init_process_group("gloo" if args.dry_run else "nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu" if args.dry_run else "cuda", (tp,), mesh_dim_names=("tp",))
    config = llama3_stack(args.layers, args.seq_len)
    torch.manual_seed(0)  # the same weights on every rank before they are sharded
    with device:
        model = GPT(config)
    # of the whole model, before sharding
    flops_per_token, num_params = model.flops_per_token(args.seq_len), model.num_params()
    if tp > 1:
        apply_tensor_parallel(model, mesh)
    # the fused kernel takes plain CUDA tensors; DTensors take the foreach path (as PretrainModule picks)
    fused = {"fused": True} if tp == 1 and device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), **fused)
    result: dict[str, Any] = {"tp": tp, "flops_per_token": flops_per_token, "num_params": num_params}
    if not args.dry_run:
        result.update(train(model, optimizer, config, args, device))
    result.update(measured_state_bytes(model, optimizer))
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


def train(
    model: GPT, optimizer: torch.optim.Optimizer, config: GPTConfig, args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """``args.warmup + args.steps`` training steps on random tokens (the same on every tp rank); the last
    ``args.steps`` timed."""
    generator = torch.Generator(device).manual_seed(1)
    shape = (args.warmup + args.steps, args.batch_size, args.seq_len + 1)
    tokens = torch.randint(0, config.vocab_size, shape, device=device, generator=generator)
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(len(tokens)):
        if step == args.warmup:
            synchronize(device)
            start = clock()
        optimizer.zero_grad(set_to_none=True)  # here, not after the step: the last gradients get counted
        # as ParallelStrategy: logits sharded by vocabulary under tp, the loss and its backward vocab-parallel
        with vocab_parallel_loss() if dist.get_world_size() > 1 else nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[step, :, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[step, :, 1:].flatten())
            loss.backward()
        reduce_partial_grads(model)  # the sequence-parallel norms' gradients, as ParallelStrategy does
        optimizer.step()
    synchronize(device)
    seconds = per_step(start, clock(), args.steps)["wall"]
    last_loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # a replicated DTensor under tp
    return {"seconds_per_step": seconds, "tokens_per_second": args.batch_size * args.seq_len / seconds,
            "last_loss": last_loss.item(), "peak_memory_bytes": torch.cuda.max_memory_allocated(device)}


def launch(tp: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """A fresh ``torchrun`` of ``tp`` ranks; rank 0's result."""
    result = Path(folder) / f"tp{tp}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}", __file__,
        "--worker", "--result", str(result), "--layers", str(args.layers), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
        *(["--dry-run"] if args.dry_run else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"tp={tp} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/model_parallel_gpu.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tp", default=None, help="tp sizes, e.g. 1,2,4 (default: 1, 2, 4, ... the GPUs)")
    parser.add_argument("--layers", type=int, default=4, help="Llama-3-8B blocks in the stack")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences a step (all tp ranks read them)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak_tflops", type=float, default=None, help="one GPU's dense bf16 peak, TFLOP/s")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: the stack on meta, per-rank bytes")
    parser.add_argument("--gpus", type=int, default=None, help="with --dry-run: the GPUs to plan for (8)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON to write (default docs/benchmarks/model_parallel_gpu.json; none for "
                             "--dry-run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        if args.layers < 1 or args.seq_len < 1 or args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
            raise UserInputError("--layers, --seq-len, --batch-size and --steps must be >= 1, --warmup >= 0")
        if not args.dry_run and not torch.cuda.is_available():
            raise UserInputError(
                "no CUDA device here: benchmarks/model_parallel_gpu.py trains on GPUs "
                "(--dry-run plans on CPU without them)"
            )
        gpus = (args.gpus or 8) if args.dry_run else torch.cuda.device_count()
        config = llama3_stack(args.layers, args.seq_len)
        sizes = tp_sizes(gpus, config, args.tp)
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        results = [launch(tp, args, folder) for tp in sizes]
    return report(args, config, results)


def report(args: argparse.Namespace, config: GPTConfig, results: list[dict[str, Any]]) -> int:
    """Print the table of ``results`` (one per tp) and write the JSON (a dry run: only to ``--out``)."""
    for r in results:  # a dry run has no gradients nor AdamW moments yet: 3 more fp32 copies of the weights
        r["state_bytes"] = 4 * r["param_bytes"] if args.dry_run else (
            r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
    if args.dry_run:
        headers = ["tp", "parameters per rank (GiB)", "+ grads + AdamW (GiB)", "of tp=1"]
        first = results[0]["param_bytes"]
        rows = [[r["tp"], r["param_bytes"] / GiB, r["state_bytes"] / GiB, f"{r['param_bytes'] / first:.3f}x"]
                for r in results]
    else:
        from gpu import peak_flops  # imported here: it loads the CLI, which a dry run does not need

        peak = peak_flops(torch.device("cuda", 0), args.peak_tflops)
        headers = ["tp (GPUs)", "tokens/s", "tokens/s per GPU", "MFU", "state per rank (GiB)", "peak (GiB)"]
        rows = []
        for r in results:
            r["mfu"] = r["tokens_per_second"] * r["flops_per_token"] / (r["tp"] * peak) if peak else None
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "unknown peak"
            rows.append([r["tp"], r["tokens_per_second"], r["tokens_per_second"] / r["tp"], mfu,
                         r["state_bytes"] / GiB, r["peak_memory_bytes"] / GiB])
    print(f"Llama-3-8B-shaped stack: {args.layers} layers, {results[0]['num_params']:,} parameters, "
          f"{args.batch_size} x {args.seq_len} tokens a step")
    print_table(headers, rows)
    out = args.out or (None if args.dry_run else RESULTS_DIR / "model_parallel_gpu.json")
    if out is not None:
        setup = {"model": vars(config), "batch_size": args.batch_size, "seq_len": args.seq_len,
                 "timed_steps": args.steps, "warmup_steps": args.warmup,
                 "dtype": "bf16 autocast, fp32 weights"}
        write_json(out, {"benchmark": "model_parallel_gpu", "dry_run": args.dry_run, "setup": setup,
                         "results": results, "machine": machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
