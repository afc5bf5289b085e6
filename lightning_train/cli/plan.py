"""``python -m lightning_train plan --config CONFIG.yaml [--world_size N] [--rank R]``: the dry run.

One rank of the config's full layout is laid out in this process, on the meta device, over a fake process
group (``strategies/dry_run.py``), and its parameter, gradient, optimizer-state and activation bytes are
printed beside the planner's estimate. The config is the one ``fit`` takes; nothing is trained, read or
allocated. Lightning is imported after the arguments are parsed, so ``plan --help`` answers without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_train.cli._parsers import PROG, TOOLS, ToolParser
from lightning_train.errors import UserInputError


def main(args: list[str]) -> None:
    parser = ToolParser(prog=f"{PROG} plan", description=TOOLS["plan"])
    parser.add_argument(
        "--config", type=str, required=True, help="The training config, as `fit --config` takes it."
    )
    parser.add_argument(
        "--world_size", type=int, default=None,
        help="All processes of the cluster to plan for (default: the config's trainer.devices x num_nodes).",
    )
    parser.add_argument(
        "--devices_per_node", type=int, default=None,
        help="Processes of one node (default: the config's trainer.devices).",
    )
    parser.add_argument(
        "--rank", type=int, default=None,
        help="The global rank to lay out (default: the first of the stage the planner counts fullest).",
    )
    options = parser.parse_args(args)
    path = Path(options.config)
    sections = _read_config(path)
    trainer = sections.get("trainer") or {}
    devices = trainer.get("devices", 1)
    devices_per_node = options.devices_per_node or (devices if isinstance(devices, int) else None)
    world_size = options.world_size or (
        devices_per_node * trainer.get("num_nodes", 1) if devices_per_node is not None else None
    )
    if world_size is None or devices_per_node is None:
        raise UserInputError(
            f"{path}: trainer.devices={devices!r} is not a number of devices; give --world_size and "
            "--devices_per_node"
        )
    module, strategy, data = _build(path, sections)
    from lightning_train.strategies.dry_run import dry_run

    result = dry_run(
        module, strategy, world_size, devices_per_node, options.rank, data.get("batch_size"),
        data.get("seq_len"), _precision(trainer.get("precision", "32-true")),
    )
    print(describe(path, result))


def describe(path: Path, result: Any) -> str:
    """The dry run's printout: the rank and layout, then one row a kind of bytes (this rank, planner)."""
    from lightning_train.strategies.memory import format_bytes

    estimate = result.estimate
    place = ", ".join(f"{name} {index}" for name, index in result.coordinates.items())
    rows = [
        ("parameters", result.param_bytes, None),
        ("gradients", result.grad_bytes, None),
        ("optimizer state (AdamW)", result.optimizer_bytes, None),
        ("model states", result.state_bytes, estimate and estimate.state_bytes),
        ("FSDP buffers", result.fsdp_buffer_bytes, estimate and estimate.gathered_bytes),
        ("activations (estimated)", result.activation_bytes, estimate and estimate.activation_bytes),
        ("total", result.total_bytes, estimate and estimate.total_bytes),
    ]
    lines = [
        f"plan: {path}, rank {result.rank} of {result.world_size} ({place})",
        f"  layout  {result.layout}",
        f"  model   {result.num_params / 1e9:.2f}B parameters, built on the meta device; this rank holds "
        f"{result.held}",
        f"  {'':<25}{'this rank':>12}{'planner':>12}",
    ]
    for name, measured, planned in rows:
        planned_text = "" if planned is None else format_bytes(planned)
        lines.append(f"  {name:<25}{format_bytes(measured):>12}{planned_text:>12}".rstrip())
    difference = result.difference()
    lines.append(
        "  the planner has no estimate for a model that is not the GPT under tp or pp" if difference is None
        else f"  the planner's total is {difference:+.1%} of this rank's"
    )
    return "\n".join(lines)


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise UserInputError(f"--config {path} is not a file; pass the YAML config `fit --config` takes")
    try:
        sections = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise UserInputError(f"config file {path} is not valid YAML ({error}); correct it") from error
    if not isinstance(sections, dict) or "model" not in sections:
        raise UserInputError(
            f"config file {path} has no model section; pass the YAML config `fit --config` takes"
        )
    return sections


def _build(path: Path, sections: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The LightningModule and the strategy the config names, instantiated as ``fit`` would (the model not
    built: the dry run builds it on the meta device), and the data module's options (not instantiated)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_train.data  # noqa: F401  (the data modules and models a config may name briefly)
    import lightning_train.modules  # noqa: F401
    from lightning_train.strategies import ParallelStrategy

    parser = ToolParser(prog=f"{PROG} plan")
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    parser.add_subclass_arguments(LightningDataModule, "data", required=False)
    strategy = (sections.get("trainer") or {}).get("strategy", "lt_auto")
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            raise UserInputError(
                f"{path}: trainer.strategy={strategy!r} is not lightning_train's; plan lays out a "
                "lightning_train.strategies.ParallelStrategy (or lt_ddp, lt_fsdp, lt_parallel)"
            )
        strategy_object = StrategyRegistry.get(strategy)
    else:
        parser.add_subclass_arguments(ParallelStrategy, "strategy", required=True)
    given = {key: sections[key] for key in ("model", "data") if sections.get(key) is not None}
    parsed = parser.parse_object({**given, **({} if isinstance(strategy, str) else {"strategy": strategy})})
    data = parsed.pop("data", None)
    objects = parser.instantiate_classes(parsed)
    if not isinstance(strategy, str):
        strategy_object = objects.strategy
    if not isinstance(strategy_object, ParallelStrategy):
        raise UserInputError(
            f"{path}: trainer.strategy={strategy!r} is {type(strategy_object).__name__}; plan lays out a "
            "lightning_train.strategies.ParallelStrategy (or lt_ddp, lt_fsdp, lt_parallel)"
        )
    return objects.model, strategy_object, dict(data.init_args) if data is not None else {}


def _precision(value: Any) -> str:
    """The Trainer's precision in Lightning's long form ("bf16" -> "bf16-mixed", 32 -> "32-true")."""
    short = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true", "64": "64-true"}
    return short.get(str(value), str(value))
