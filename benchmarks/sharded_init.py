"""Peak host memory of building a model, per rank: one process (built on the CPU) against fsdp and tp on 2
CPU ranks (built on the meta device, each rank materialising its own shards), for a ~55 M-parameter GPT,
initialised fresh, then loaded from a Hugging Face folder of it (``FinetuneModule(init_from=...)``: each
rank reads only its slices, ``checkpoint/slices.py``).

Each layout is one launch of ``tests/helpers/meta_init_run.py`` (the run the tests use): every rank reads
its resident-memory high-water mark (``VmHWM``) in its ``setup`` hook, before ``configure_model``, and again
when the first step starts; the rise is what building, laying out and initialising the model cost it
(AdamW's state comes with the first step, after). Goal (issue 37): <= 0.6x the model's bytes on 2 ranks.
The HF folder is this GPT exported (``save_hf``, Llama layout) in safetensors shards of 50 MB.

    python benchmarks/sharded_init.py            # ~3 minutes on an idle 2-core machine
    python benchmarks/sharded_init.py --smoke    # a tiny model: checks it runs
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import base_parser, machine_info, print_table, write_json

RUN = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "meta_init_run.py"
CONFIG = {"vocab_size": 8192, "n_layer": 16, "n_head": 8, "n_embd": 512, "block_size": 16}
SMOKE = {"vocab_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 16}
LAYOUTS = {
    "one process": ["--devices=1"], "fsdp, 2 ranks": ["--devices=2"],
    "tp=2": ["--devices=2", "--tp=2"],
}
SOURCES = ("fresh init", "HF folder")


def measure(args: list[str], config: dict, init_from: Path | None) -> list[dict]:
    """Each rank's report of one launch."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        command = [sys.executable, str(RUN), str(out), f"--config={json.dumps(config)}", "--no_weights"]
        command += args + ([f"--init_from={init_from}"] if init_from else [])
        subprocess.run(command, check=True, capture_output=True, cwd=folder)
        return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def hf_folder(config: dict, folder: Path) -> Path:
    """The GPT of ``config`` (seeded) as a Hugging Face folder in safetensors shards."""
    import torch

    from lightning_train.checkpoint.model_folder import save_hf
    from lightning_train.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    save_hf(GPT(GPTConfig(**config)), folder, None, max_shard_size=50 * 10**6)
    return folder


def main() -> None:
    parser = base_parser("sharded_init", __doc__.splitlines()[0], pairs=1)
    args = parser.parse_args()
    config = SMOKE if args.smoke else CONFIG
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as folder:
        sources = dict(zip(SOURCES, (None, hf_folder(config, Path(folder) / "hf")), strict=True))
        for source, init_from in sources.items():
            for name, layout in LAYOUTS.items():
                reports = measure(layout, config, init_from)
                results[f"{source}: {name}"] = reports
                model = reports[0]["model_param_bytes"]
                worst = max(report["rss_rise"] for report in reports)
                built_on = reports[0]["built_on"][0]
                rows.append([source, name, f"{model / 1e6:.0f}", built_on, f"{worst / 1e6:.0f}",
                             f"{worst / model:.2f}x"])
    header = ["weights", "layout", "model MB", "built on", "peak rise, worst rank (MB)", "of the model"]
    print_table(header, rows)
    if not args.smoke:
        write_json(args.out, {"machine": machine_info(), "config": config, "results": results})


if __name__ == "__main__":
    main()
