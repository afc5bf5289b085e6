from lightning_train.modules.finetune import FinetuneModule
from lightning_train.modules.pretrain import PretrainModule

__all__ = ["FinetuneModule", "PretrainModule"]
