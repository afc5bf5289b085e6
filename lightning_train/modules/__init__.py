from lightning_train.modules.pretrain import PretrainModule

__all__ = ["PretrainModule"]
