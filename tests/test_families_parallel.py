"""Every model family under every layout: fsdp, tp=2 and pp=2 on 2 real gloo ranks and tp2 x pp2 on 4 give
one process's losses and gradients, as the GPT's parity tests check them (tests/test_tensor_parallel.py,
tests/test_pipeline_parallel.py). A layout starts its ranks once (torchrun) and fits each family's tiny model
in turn (tests/helpers/families_parallel.py). The parallel column of docs/models.md comes from here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lightning_train.errors import UserInputError
from lightning_train.models.config import GPTConfig
from lightning_train.strategies.tensor_parallel import check_tensor_parallel
from tests.conftest import REPO, cli_env

pytest.importorskip("transformers")
from tests.helpers.families_parallel import FAMILIES, LAYOUTS, family_config  # noqa: E402


def _launch(layout: str, out: Path) -> None:
    devices = LAYOUTS[layout][0]
    command = ["-m", "tests.helpers.families_parallel", layout, str(out), *FAMILIES]
    if devices > 1:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}", *command]
    result = subprocess.run([sys.executable, *command], cwd=REPO, env=cli_env(), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    _launch("single", out)
    return out


@pytest.mark.slow  # 17 fits on each rank: 35-45 s on 2 ranks, 2 minutes on 4 (2 CPU cores)
@pytest.mark.parametrize("layout", ["fsdp", "tp2", "pp2", "tp2xpp2"])
def test_every_family_matches_one_process(tmp_path, single, layout):
    """For 5 steps of each family (clipped at 0.5, below every norm, so clipping is real): the loss over the
    global batch and the gradient norm, on every rank, to a relative 1e-5 of one process's; and at the first
    step (the same weights everywhere) the gradient of every parameter, gathered whole, to 1e-5 of its norm,
    the ranks' stages holding every parameter together. (Weights after the steps are not compared: AdamW
    turns the rounding of a near-zero gradient element into a step of the learning rate on that element.)
    Under tp and pp, greedy generation (KV cache and none) on the model as the layout splits it gives one
    process's 12 tokens, past every sliding window."""
    _launch(layout, tmp_path)
    problems = []
    for name in FAMILIES:
        reference = json.loads((single / name / "rank0.json").read_text())
        assert len(reference["losses"]) == 5 and min(reference["grad_norms"]) > 0.5
        expected = load_file(single / name / "rank0.safetensors")
        reports = sorted((tmp_path / name).glob("rank*.json"))
        assert len(reports) == LAYOUTS[layout][0], name
        held, worst = set(), dict.fromkeys(("losses", "grad_norms", "gradients"), 0.0)
        for report_file in reports:
            report = json.loads(report_file.read_text())
            for key in ("losses", "grad_norms"):
                differences = [abs(a - b) / b for a, b in zip(report[key], reference[key], strict=True)]
                worst[key] = max(worst[key], *differences)
            grads = load_file(report_file.with_suffix(".safetensors"))
            held |= set(grads)
            for key, grad in grads.items():
                difference = ((grad - expected[key]).norm() / expected[key].norm()).item()
                worst["gradients"] = max(worst["gradients"], difference)
                if difference > 1e-5:
                    problems.append(f"{name} {report_file.stem} gradient of {key}: {difference:.1e}")
        assert held == set(expected), name
        print(f"{layout} {name}: " + ", ".join(f"{key} {value:.1e}" for key, value in worst.items()))
        problems += [f"{name} {key}: {worst[key]:.1e}" for key in ("losses", "grad_norms")
                     if worst[key] > 1e-5]
    assert not problems, "\n".join(problems)
    if layout != "fsdp":  # generation on the model as tp/pp split it (fsdp generates with the whole model)
        for rank in range(LAYOUTS[layout][0]):
            report = json.loads((tmp_path / f"generations-rank{rank}.json").read_text())
            assert set(report) == set(FAMILIES)
            for name, completions in report.items():
                reference = completions["one process, cached"]
                assert len(reference) == 17 and len(set(reference[5:])) > 4, name  # not one token repeated
                assert all(tokens == reference for tokens in completions.values()), (rank, name, completions)


def test_the_families_are_distinct_blocks():
    """What the layouts are tested on: every family's block, the q/k norms and norm placements among them."""
    configs = [family_config(name) for name in FAMILIES]
    assert len({repr(config) for config in configs}) == len(FAMILIES) == 17
    assert {config.qk_norm for config in configs} == {"none", "head", "projection"}
    assert {config.block_norms for config in configs} == {"pre", "post", "both"}
    assert {config.position for config in configs} == {"rope", "learned"}
    for config in configs:
        check_tensor_parallel(2, config)  # every family splits over 2 ranks


def test_a_projection_qk_norm_that_is_a_layernorm_is_refused_under_tensor_parallel():
    """No family has it (OLMo-2's is an RMSNorm): its mean and variance over heads on several ranks are not
    summed by ProjectionNorm, so one line names it and what to use."""
    config = GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_embd=32, norm="layernorm", qk_norm="projection")
    check_tensor_parallel(1, config)
    with pytest.raises(UserInputError, match=r"qk_norm='projection'\) only as an RMSNorm, not with "
                                             r"norm='layernorm'; use norm='rmsnorm' or qk_norm='head'"):
        check_tensor_parallel(2, config)
