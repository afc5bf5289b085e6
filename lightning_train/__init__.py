"""lightning_train: train language models with PyTorch Lightning, from pretraining to fine-tuning.

The names below are imported on first use (``_lazy.py``): ``from lightning_train import GPT`` does not
import Lightning. Importing the package changes nothing global: no warning filter, import hook or
TF32 switch (the CLI installs what it needs when it runs, ``cli/__init__.py``)."""

from lightning_train._lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(globals(), {
    "GPT": "lightning_train.models.gpt",
    "FinetuneModule": "lightning_train.modules.finetune",
    "GPTConfig": "lightning_train.models.gpt",
    "LoRAConfig": "lightning_train.models.lora",
    "PretrainModule": "lightning_train.modules.pretrain",
    "SFTDataModule": "lightning_train.data.sft",
    "TextDataModule": "lightning_train.data.text",
    "UserInputError": "lightning_train.errors",
})
