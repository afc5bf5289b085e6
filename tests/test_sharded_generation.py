"""Generation on a sharded model (``strategies.generation``) on real gloo ranks: greedy and sampled, with and
without the KV cache, under tp=2, pp=2 (one stage a rank, the interleaved loop, the V) and tp=2 x pp=2, gives
one process's tokens, as does the ``generate`` tool under torchrun; and a chunk fed onto a KV cache (what a
tensor-parallel decode step does) gives the full forward's logits."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_train._compat import end_distributed_process
from lightning_train.checkpoint import save_safetensors
from lightning_train.models.generate import generate_batched
from lightning_train.models.gpt import GPT, GPTConfig, KVCache
from tests.conftest import REPO, run_cli, run_torchrun

# (tensor_parallel, pipeline_parallel, schedule, virtual_stages); on 4 ranks, 2 replicas where tp x pp = 2
LAYOUTS = {
    "tp2": (2, 1, "1F1B", 1),
    "pp2": (1, 2, "1F1B", 1),
    "pp2-loop": (1, 2, "Interleaved1F1B", 2),  # rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    "pp2-V": (1, 2, "ZBVZeroBubble", 2),  # rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
    "tp2xpp2": (2, 2, "1F1B", 1),
}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13], [14, 15, 16]]  # lengths 1, 3, 4, 5
# init_std 0.4: weights large enough that greedy decoding does not just repeat the last token
CONFIG = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
          "init_std": 0.4}


def test_a_chunk_onto_the_kv_cache_gives_the_full_forwards_logits():
    """T > 1 tokens after cached ones attend to the whole past and causally among themselves."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).eval()
    tokens = torch.randint(0, 64, (2, 9))
    cache = KVCache(model.config.n_layer)
    model(tokens[:, :4], cache)
    chunk = model(tokens[:, 4:], cache)
    torch.testing.assert_close(chunk, model(tokens)[:, 4:], rtol=1e-5, atol=1e-5)
    cache.crop(6)  # forget positions 6.. and compute them again
    torch.testing.assert_close(model(tokens[:, 6:], cache), model(tokens)[:, 6:], rtol=1e-5, atol=1e-5)
    assert cache.length == 9


def _runs(generator: object, eos_id: int) -> dict[str, list[list[int]]]:
    """Greedy with and without the cache, and sampled with a seed (with the cache: one process's cached and
    uncached draws are equal, tests/test_generate.py), through generate_batched: prompts of 4 lengths, an
    eos cutoff, a padded vocabulary's last rows never drawn, block_size reached."""
    common = {"max_new_tokens": 12, "eos_id": eos_id, "tokenizer_vocab_size": 60}
    runs = {
        "greedy": generate_batched(generator, PROMPTS, **common),
        "greedy-uncached": generate_batched(generator, PROMPTS, use_cache=False, **common),
    }
    torch.manual_seed(7)
    runs["sampled"] = generate_batched(generator, PROMPTS, temperature=0.8, top_k=20, **common)
    return runs


def _worker(out_dir: str) -> None:
    """Run by torchrun on 4 gloo ranks: every layout's completions next to one process's."""
    from lightning_train.strategies.generation import shard_for_generation

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).eval()
    # greedy's 4th token of prompt 0
    eos_id = generate_batched(model, PROMPTS[:1], 4, eos_id=None, tokenizer_vocab_size=60)[0][3]
    report = {"eos_id": eos_id, "one-process": _runs(model, eos_id)}
    for name, (tp, pp, schedule, virtual) in LAYOUTS.items():
        generator = shard_for_generation(copy.deepcopy(model), tp, pp, schedule, virtual)
        report[name] = _runs(generator, eos_id)
    torch.save(report, Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    end_distributed_process(0)


@pytest.mark.slow
def test_sharded_generation_gives_one_processs_tokens(tmp_path):
    """On each of the 4 ranks, for each layout: greedy completions with the KV cache and without, and
    sampled ones (same seed), equal one process's token for token."""
    result = run_torchrun(4, "-m", "tests.test_sharded_generation", str(tmp_path), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(4):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        reference = report["one-process"]
        eos = report["eos_id"]
        assert reference["greedy"] == reference["greedy-uncached"]
        assert reference["sampled"] != reference["greedy"]  # sampling is real
        assert any(len(c) < 12 for c in reference["greedy"])  # the eos cutoff happened
        assert len({t for c in reference["greedy"] for t in c}) > 10  # not one token repeated
        assert all(t < 60 and t != eos for c in reference["sampled"] for t in c)
        for name in LAYOUTS:
            assert report[name] == reference, (rank, name)


@pytest.mark.slow
def test_generate_command_runs_sharded_under_torchrun(tmp_path):
    """`generate --tensor_parallel 2 --pipeline_parallel 2` on 4 torchrun ranks samples one process's text
    (rank 0 prints it); without torchrun it is one error line naming the launch."""
    torch.manual_seed(0)
    config = GPTConfig(**{**CONFIG, "vocab_size": 320, "block_size": 32})
    save_safetensors(GPT(config), tmp_path / "model")
    args = ["generate", "--checkpoint", str(tmp_path / "model"), "--prompt", '["def ", "import os", "x"]',
            "--max_new_tokens", "12", "--temperature", "0.8", "--top_k", "40", "--tokenizer", "byte"]
    single = run_cli(*args, cwd=tmp_path, timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    sharded = run_torchrun(4, "-m", "lightning_train", *args, "--tensor_parallel", "2", "--pipeline_parallel",
                           "2", cwd=tmp_path, timeout=240)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout == single.stdout and single.stdout.count("import os") == 1
    alone = run_cli(*args, "--tensor_parallel", "2", cwd=tmp_path, timeout=120)
    assert alone.returncode == 2
    assert alone.stderr.strip().splitlines()[-1] == (
        "error: --tensor_parallel 2 --pipeline_parallel 1 runs on 2 ranks; start it with torchrun "
        "--nproc_per_node=2 -m lightning_train generate ..."
    )


if __name__ == "__main__":  # the worker, started by torchrun
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(sys.argv[1])
