"""lightning_train: train language models with PyTorch Lightning, from pretraining to fine-tuning."""

from lightning_train.data import TextDataModule
from lightning_train.errors import UserInputError
from lightning_train.models import GPT, GPTConfig
from lightning_train.modules import PretrainModule

__all__ = ["GPT", "GPTConfig", "PretrainModule", "TextDataModule", "UserInputError"]
__version__ = "0.1.0"
