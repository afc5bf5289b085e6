"""lightning_train: train language models with PyTorch Lightning, from pretraining to fine-tuning."""

from lightning_train._warnings import silence_known_noise
from lightning_train.data import SFTDataModule, TextDataModule
from lightning_train.errors import UserInputError
from lightning_train.models import GPT, GPTConfig
from lightning_train.models.lora import LoRAConfig
from lightning_train.modules import FinetuneModule, PretrainModule

__all__ = [
    "GPT",
    "FinetuneModule",
    "GPTConfig",
    "LoRAConfig",
    "PretrainModule",
    "SFTDataModule",
    "TextDataModule",
    "UserInputError",
]
__version__ = "0.1.0"

silence_known_noise()  # filters scoped to known dependency messages; see _warnings.py
