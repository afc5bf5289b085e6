"""FP8 training: swap a model's ``nn.Linear`` layers for torchao's ``Float8Linear``, from outside the model
(as torchtitan does), so the model code stays plain.

The matmuls of the swapped layers then run in float8 on GPUs with FP8 tensor cores (compute capability
8.9+: Ada, Hopper, Blackwell) with dynamic scaling; weights, gradients and optimizer state keep their
dtype. torchao reports its gains on wide matmuls (thousands of features); on a model as small as GPT-2
124M the casts can cost what the faster matmuls save. It needs ``torch.compile`` to fuse the casts.
Convert before compiling and before a strategy shards the model; ``PretrainModule(float8=True)`` does.

    >>> from lightning_train import UserInputError
    >>> from lightning_train.models.float8 import check_float8_device, convert_to_float8
    >>> from lightning_train.models.gpt import GPT, GPTConfig
    >>> model = convert_to_float8(GPT(GPTConfig(vocab_size=258, n_layer=1, n_embd=64, n_head=4)))
    >>> [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
    ['blocks.0.attn.qkv', 'blocks.0.attn.proj', 'blocks.0.mlp.gate', 'blocks.0.mlp.up', 'blocks.0.mlp.down']
    >>> try:  # the conversion runs anywhere; the float8 matmuls need an FP8 GPU
    ...     check_float8_device("cpu")
    ... except UserInputError as error:
    ...     print(error)  # doctest: +ELLIPSIS
    float8 training needs a CUDA GPU with compute capability >= 8.9 ..., but this run is on 'cpu'; ...
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_train.errors import UserInputError

MIN_CAPABILITY = (8, 9)  # the first GPUs with FP8 tensor cores (Ada); Hopper is 9.0
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
INSTALL = "`pip install torchao`, or set model.float8=false"


def check_float8_device(device: torch.device | str) -> None:
    """Raise ``UserInputError`` unless ``device`` is a CUDA GPU with FP8 tensor cores."""
    device = torch.device(device)
    if device.type != "cuda":
        raise UserInputError(
            f"float8 training needs a CUDA GPU with compute capability >= 8.9 (H100/H200, L4, RTX 4090), "
            f"but this run is on {device.type!r}; set model.float8=false"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserInputError(
            f"float8 training needs a GPU with compute capability >= 8.9, but {name} has "
            f"{capability[0]}.{capability[1]}; set model.float8=false"
        )


def convert_to_float8(
    model: nn.Module, recipe: str = "tensorwise", skip: Sequence[str] = ("lm_head",)
) -> nn.Module:
    """Swap, in place, each ``nn.Linear`` of ``model`` whose both dimensions are multiples of 16 (what FP8
    matmuls need) and whose name is not in ``skip`` for a ``Float8Linear`` with torchao's ``recipe``.
    The output head is skipped by default: it is tied to the embedding and sensitive to precision.
    Returns ``model``."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise UserInputError(f"float8 training needs torchao, which is not installed: {INSTALL}") from err
    if recipe not in RECIPES:
        raise UserInputError(f"float8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")

    def convertible(module: nn.Module, name: str) -> bool:
        return (
            isinstance(module, nn.Linear) and name not in skip
            and module.in_features % 16 == 0 and module.out_features % 16 == 0
        )

    if not any(convertible(module, name) for name, module in model.named_modules()):
        raise UserInputError(
            "float8 training found no Linear layer with both dimensions a multiple of 16 to convert; "
            "use n_embd and intermediate_size that are multiples of 16, or set model.float8=false"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, module_filter_fn=convertible, config=config)
