from lightning_train.models.gpt import GPT, Block, GPTConfig, KVCache

__all__ = ["GPT", "Block", "GPTConfig", "KVCache"]
