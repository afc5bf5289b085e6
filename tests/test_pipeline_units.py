"""The pipeline's pure parts, in one process: the stage split, a stage's model, and the optimizer state a
stage finds in a one-process checkpoint (the multi-rank behaviour is tests/test_pipeline_parallel.py)."""

import re

import pytest
import torch

from lightning_train.checkpoint.optimizer_state import name_optimizer_states, optimizer_state_by_name
from lightning_train.errors import UserInputError
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.strategies.memory import estimate_layout
from lightning_train.strategies.pipeline import (
    check_pipeline,
    check_stages,
    check_zero_bubble,
    last_stage_rank,
    pipeline_stage_ids,
    split_blocks,
    stage_model,
)


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"vocab_size": 320, "n_layer": 4, "n_head": 2, "n_embd": 32, **overrides}))


def test_split_balances_parameters_with_the_embedding_and_head_counted():
    assert split_blocks(_model(), 2) == [range(0, 2), range(2, 4)]
    # a vocabulary as large as three blocks: the first stage (embedding) and the last (head) get fewer
    # blocks than the middle one
    big_vocab = _model(vocab_size=2048, n_layer=6, tie_embeddings=False)
    assert split_blocks(big_vocab, 3) == [range(0, 1), range(1, 5), range(5, 6)]
    assert split_blocks(_model(), 2, split_points=[3]) == [range(0, 3), range(3, 4)]


@pytest.mark.parametrize(
    ("stages", "points", "message"),
    [
        (5, None, "5 pipeline stages need at least 5 blocks; the model has n_layer=4"),
        (2, [0], "pipeline_split_points=[0] must be 1 increasing block indices in 1..3"),
        (3, [2, 2], "pipeline_split_points=[2, 2] must be 2 increasing block indices in 1..3"),
    ],
)
def test_bad_splits_name_the_value_and_the_fix(stages, points, message):
    with pytest.raises(UserInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_blocks(_model(), stages, points)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_parallel": 0}, "pipeline_parallel=0: use an int >= 1"),
        ({"schedule": "ZigZag"}, "pipeline_schedule='ZigZag' is not one of 1F1B, GPipe"),
        ({"microbatches": 0}, "microbatches=0: use an int >= 1"),
        ({"virtual_stages": 0}, "virtual_stages=0: use an int >= 1"),
        ({"schedule": "Interleaved1F1B"}, "pipeline_schedule='Interleaved1F1B' with virtual_stages=1"),
        ({"virtual_stages": 2}, "pipeline_schedule='1F1B' with virtual_stages=2"),
        ({"schedule": "InterleavedZeroBubble"},
         "pipeline_schedule='InterleavedZeroBubble' with virtual_stages=1"),
        ({"schedule": "ZBVZeroBubble", "virtual_stages": 3},
         "pipeline_schedule='ZBVZeroBubble' with virtual_stages=3: the V-shaped schedules run exactly 2 "
         "stages per rank; set virtual_stages=2"),
        ({"schedule": "DualPipeV", "virtual_stages": 2, "microbatches": 3},
         "pipeline_schedule='DualPipeV' with microbatches=3: it needs one per stage at least; use "
         "microbatches >= 4"),
        ({"pipeline_parallel": 1, "split_points": [2]}, "pipeline_split_points needs pipeline_parallel >= 2"),
        ({"schedule": "Interleaved1F1B", "virtual_stages": 2, "microbatches": 5},
         "pipeline_schedule='Interleaved1F1B' with microbatches=5: it runs them in 2 rounds, which must "
         "divide them; use a multiple of pipeline_parallel (2)"),
    ],
)
def test_bad_pipeline_options_name_the_value_and_the_fix(options, message):
    given = {"pipeline_parallel": 2, "schedule": "1F1B", "microbatches": None, "virtual_stages": 1,
             "split_points": None, **options}
    with pytest.raises(UserInputError, match=re.escape(message)):
        check_pipeline(**given)


def test_a_model_too_shallow_for_its_stages_is_refused_naming_n_layer():
    too_shallow = "2 pipeline stages need at least 2 blocks; the model has n_layer=1: lower pipeline_parallel"
    with pytest.raises(UserInputError, match=re.escape(too_shallow)):
        check_stages(2, n_layer=1, split_points=None)
    with pytest.raises(UserInputError, match=re.escape("pipeline_split_points=[4] must be 1 increasing block "
                                                       "indices in 1..3")):
        check_stages(2, n_layer=4, split_points=[4])


def test_a_stage_keeps_the_whole_models_names_and_modules():
    model = _model()
    first = stage_model(model, range(0, 2), first=True, last=False)
    last = stage_model(model, range(2, 4), first=False, last=True)
    whole = dict(model.named_parameters())
    for stage in (first, last):
        for name, param in stage.named_parameters():
            assert whole[name] is param  # the model's own tensors, under the model's names
    assert first.lm_head is None and last.pos_embed is None
    assert last.embed is model.embed  # tied: the head's weight is the embedding's
    tokens = torch.randint(0, 320, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens))  # the stages compose to the model


def test_interleaved_stages_loop_over_the_ranks():
    assert [pipeline_stage_ids(rank, 2, 2) for rank in (0, 1)] == [[0, 2], [1, 3]]
    assert [pipeline_stage_ids(rank, 2, 2, "InterleavedZeroBubble") for rank in (0, 1)] == [[0, 2], [1, 3]]
    assert last_stage_rank(2, "Interleaved1F1B") == 1


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_shaped_stages_turn_back_to_rank_0(schedule):
    """As torch places them (its stage-to-rank map, style "v"): rank 0 runs the first and the last stage."""
    from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

    for pp in (2, 4):
        placed = [pipeline_stage_ids(rank, pp, 2, schedule) for rank in range(pp)]
        torch_placed = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")
        assert placed == [list(stages) for stages in torch_placed.values()]
        assert last_stage_rank(pp, schedule) == 0
    assert placed == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_v_shaped_memory_estimate_puts_the_embedding_and_head_on_rank_0():
    """ZBV: the fullest rank is 0, with blocks 0 and 3, the embedding and the head; interleaved, rank 1
    holds the head beside blocks 1 and 3 (the loop's placement)."""
    model = _model(vocab_size=2048, tie_embeddings=False)
    options = {"pipeline_parallel": 2, "batch_size": 8, "seq_len": 16, "microbatches": 8, "virtual_stages": 2}
    zbv = estimate_layout(model, schedule="ZBVZeroBubble", **options)
    interleaved = estimate_layout(model, schedule="Interleaved1F1B", **options)
    embed, head = model.embed.weight.numel(), model.lm_head.weight.numel()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    norm = sum(p.numel() for p in model.norm.parameters())
    states = 4 * 4  # fp32 weight, gradient and AdamW's two moments
    assert (zbv.pipeline_rank, zbv.state_bytes) == (0, (embed + head + norm + 2 * block) * states)
    assert (interleaved.pipeline_rank, interleaved.state_bytes) == (1, (head + norm + 2 * block) * states)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checkpointing": True},
         "pipeline_schedule='ZBVZeroBubble' does not work with activation_checkpointing"),
        ({"compiled": True}, "pipeline_schedule='ZBVZeroBubble' does not work with compile"),
        ({"data_parallel": 2}, "pipeline_schedule='ZBVZeroBubble' with 2 data-parallel (FSDP) ranks"),
        ({"tensor_parallel": 2},
         "pipeline_schedule='ZBVZeroBubble' with tensor_parallel=2 and tied embeddings"),
        ({"schedule": "InterleavedZeroBubble", "checkpointing": True},
         "pipeline_schedule='InterleavedZeroBubble' does not work with activation_checkpointing"),
    ],
)
def test_zero_bubble_refuses_what_it_cannot_train(options, message):
    given = {"schedule": "ZBVZeroBubble", "data_parallel": 1, "tensor_parallel": 1, "tied": True,
             "checkpointing": False, "compiled": False, **options}
    with pytest.raises(UserInputError, match=re.escape(message)):
        check_zero_bubble(**given)


@pytest.mark.parametrize("microbatches", [None, 1, 2, 3, 4, 6, 8])
def test_microbatch_counts_torchs_interleaved_schedules_take_are_not_refused(microbatches):
    for schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        check_pipeline(2, schedule, microbatches, virtual_stages=2, split_points=None)


def test_what_zero_bubble_trains_is_not_refused():
    check_zero_bubble("ZBVZeroBubble", 1, 2, tied=False, checkpointing=False, compiled=False)  # untied TP
    check_zero_bubble("InterleavedZeroBubble", 1, 2, tied=True, checkpointing=False, compiled=False)
    check_zero_bubble("1F1B", 4, 2, tied=True, checkpointing=True, compiled=True)  # not a zero-bubble one


def test_a_stage_finds_its_own_optimizer_state_in_a_one_process_checkpoint():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 320, (2, 8))).sum().backward()
    optimizer.step()
    checkpoint = {"optimizer_states": [optimizer.state_dict()]}
    name_optimizer_states(checkpoint, model, [optimizer])
    last = stage_model(model, range(2, 4), first=False, last=True)
    stage_optimizer = torch.optim.AdamW(last.parameters())
    keyed = optimizer_state_by_name(checkpoint["optimizer_states"][0], last, stage_optimizer)
    names = [name for name, _ in last.named_parameters()]
    assert sorted(keyed["state"]) == sorted(names)
    assert keyed["param_groups"][0]["params"] == names
    torch.testing.assert_close(keyed["state"]["blocks.3.mlp.down.weight"]["exp_avg"],
                               optimizer.state[model.blocks[3].mlp.down.weight]["exp_avg"])
