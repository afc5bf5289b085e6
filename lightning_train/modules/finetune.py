"""FinetuneModule: start from trained weights, then full, LoRA or partially frozen fine-tuning.

``init_from`` is a Lightning ``.ckpt`` of this package, a ``.safetensors`` file (or folder) with its
``config.json``, or a local Hugging Face folder of a family in docs/models.md; the config and tokenizer
come from it (a model folder's own tokenizer and chat template, through transformers). A source with no
tokenizer gets the byte tokenizer, with a warning.
Batches are the pretraining ones (``{"input_ids", "labels"}``, label -100 ignored), e.g. from
``SFTDataModule``, whose held-out prompts drive the ``val/exact_match`` metric; ``val/token_accuracy`` is
the share of response tokens (labels not -100) whose argmax prediction is right.

Weights are loaded in ``configure_model``, right after the model is built, when the parameters are real
tensors (one process, ddp). A strategy that builds the model on the meta device (fsdp, hsdp, tp, pp)
materialises this rank's shards during its ``setup`` and calls ``init_weights`` (another strategy: the load
waits for ``on_fit_start``), before Lightning restores a resumed checkpoint, which then wins. There each
rank reads only the slices it keeps: safetensors' ``get_slice`` for HF folders and our exports, DCP for
our sharded folders, a memory-mapped ``.ckpt``, a LoRA fine-tune's adapters folded in a box at a time
(``checkpoint/slices.py``), so no rank holds the full state dict.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric

from lightning_train._compat import attached_trainer
from lightning_train.checkpoint import open_pretrained, save_safetensors
from lightning_train.checkpoint.model_folder import save_tokenizer
from lightning_train.checkpoint.slices import load_slices
from lightning_train.errors import UserInputError
from lightning_train.models.generate import generate_batched
from lightning_train.models.gpt import GPT, GPTConfig
from lightning_train.models.lora import (
    LoRAConfig,
    adapted_layers,
    apply_lora,
    lora_layers,
    merge_lora,
    reset_lora,
)
from lightning_train.models.weights import load_into
from lightning_train.modules.pretrain import PretrainModule


class FinetuneModule(PretrainModule):
    """Fine-tunes a GPT loaded from ``init_from``.

    Args:
        init_from: the starting weights (see the module docstring); None trains ``config`` from scratch.
        config: the model's shape; leave None to take it from ``init_from``.
        tokenizer: ``"byte"``, a ``tokenizer.json`` path or a model folder; None: the source's, else
            ``"byte"`` with a warning (an SFTDataModule without its own tokenizer uses this one).
        lora: train low-rank adapters instead of the weights (see ``LoRAConfig``); None: full fine-tuning.
        freeze_embeddings: keep the token (and position) embeddings fixed; a tied lm_head with them.
        freeze_blocks: keep the first N transformer blocks fixed.
        allow_pickle: read pickle-format checkpoints (always with ``torch.load(weights_only=True)``);
            False accepts safetensors sources only.
        eval_max_new_tokens: longest greedy generation for ``val/exact_match``.
        packed_attention: the kernel that attends packed rows (``GPTConfig.packed_attention``), set here
            because a kernel is no part of ``init_from``'s weights; None: the config's.
        The remaining arguments are PretrainModule's, with fine-tuning defaults: a 10x lower LR, a short
        warmup and no weight decay.

    Example (LoRA on the default task, from exported weights; then the merged model is exported):

        >>> import tempfile
        >>> from pathlib import Path
        >>> import lightning as L
        >>> from lightning_train import GPT, FinetuneModule, GPTConfig, LoRAConfig, SFTDataModule
        >>> from lightning_train.checkpoint import save_safetensors
        >>> tmp = Path(tempfile.mkdtemp())
        >>> config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=258)
        >>> weights = save_safetensors(GPT(config), tmp / "pretrained")
        >>> module = FinetuneModule(weights, lora=LoRAConfig(rank=4), eval_max_new_tokens=8)
        >>> trainer = L.Trainer(
        ...     max_steps=3, accelerator="cpu", limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        ... )
        >>> trainer.fit(module, SFTDataModule(seq_len=64, batch_size=4, eval_prompts=4))
        >>> sorted({n.split(".")[-3] for n, p in module.model.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
        >>> sorted(p.name for p in module.export(tmp / "finetuned").iterdir())  # adapters merged
        ['config.json', 'model.safetensors']
    """

    def __init__(
        self,
        init_from: str | None = None,
        config: GPTConfig | None = None,
        tokenizer: str | None = None,
        lora: LoRAConfig | None = None,
        freeze_embeddings: bool = False,
        freeze_blocks: int = 0,
        allow_pickle: bool = True,
        eval_max_new_tokens: int = 64,
        packed_attention: Literal["auto", "sdpa", "flex"] | None = None,
        learning_rate: float = 1e-4,
        min_lr: float = 1e-5,
        warmup_steps: int = 20,
        decay_steps: int | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        compile: bool = False,
        float8: bool = False,
    ) -> None:
        if isinstance(config, dict):  # as saved in this module's checkpoints (load_from_checkpoint)
            config = GPTConfig(**config)
        self._pretrained = open_pretrained(init_from, config, allow_pickle) if init_from else None
        if self._pretrained is not None:
            config, tokenizer = self._pretrained.config, tokenizer or self._pretrained.tokenizer
            if tokenizer is None:  # recorded, so that `generate` and `export` of this run find it too
                tokenizer = "byte"
                rank_zero_warn(
                    f"{init_from} holds no tokenizer (no tokenizer.json or tokenizer.model): the byte "
                    "tokenizer is used (ids 0..255 are the UTF-8 bytes, 256 ends a response); set "
                    "model.tokenizer to the model's tokenizer.json or folder to train with its own"
                )
        if config is None:
            raise UserInputError("FinetuneModule needs init_from (the starting weights) or a model config")
        if packed_attention is not None:
            config = dataclasses.replace(config, packed_attention=packed_attention)
        if isinstance(lora, dict):  # what a command-line override like --model.lora.rank 8 may give
            lora = LoRAConfig(**lora)
        n_layer = config.n_layer
        if not 0 <= freeze_blocks <= n_layer:
            raise UserInputError(f"freeze_blocks={freeze_blocks} must be between 0 and n_layer={n_layer}")
        super().__init__(
            config, learning_rate=learning_rate, min_lr=min_lr, warmup_steps=warmup_steps,
            decay_steps=decay_steps, weight_decay=weight_decay, betas=betas, eps=eps, compile=compile,
            float8=float8,
        )
        self.tokenizer_spec, self.lora = tokenizer, lora
        # The resolved values (LightningCLI records hyper-parameters as given, e.g. `config: null`), so
        # that a checkpoint of this module is a complete source for init_from and `generate`, and the
        # logged hparams name the tokenizer an SFTDataModule without its own shares (Lightning refuses a
        # `tokenizer` key of model and data that differ, e.g. "byte" and None).
        # Plain dicts: LightningCLI reads them back with torch.load(weights_only=True) on `--ckpt_path`.
        lora_hparams = dataclasses.asdict(lora) if lora is not None else None
        self.save_hyperparameters(
            {"config": dataclasses.asdict(self.config), "tokenizer": tokenizer, "lora": lora_hparams}
        )
        self.val_token_accuracy = MeanMetric()
        self._weights_pending = False

    # ---- building (PretrainModule.configure_model calls this, then applies float8, compile) ----
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Load ``init_from`` into the built network, add the LoRA adapters, freeze what is asked."""
        # on the meta device: materialised later by the strategy, weights and adapters set in on_fit_start
        self._weights_pending = any(p.is_meta for p in model.parameters())
        if self._pretrained is not None and not self._weights_pending:
            load_into(model, self._pretrained.read_state_dict(), self._pretrained.source)
            self._pretrained = None  # loaded: let the source's (memory-mapped) tensors go
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        self._freeze(model)
        return model

    def _freeze(self, model: nn.Module) -> None:
        frozen = list(model.blocks[: self.hparams.freeze_blocks])
        if self.hparams.freeze_embeddings:
            frozen += [model.embed] + ([model.pos_embed] if model.pos_embed is not None else [])
        for module in frozen:
            module.requires_grad_(False)
        if not any(p.requires_grad for p in model.parameters()):
            raise UserInputError("every parameter is frozen; lower freeze_blocks or unset freeze_embeddings")

    def init_weights(self) -> None:
        """Set the model a strategy materialised from the meta device (``initialize.materialize`` calls this
        instead of drawing initial weights): this rank's slices of ``init_from``, or the GPT's own
        initialisation without one; the LoRA adapters start afresh."""
        if self._pretrained is None:
            self.model.init_weights()  # from scratch: the GPT's own values
        else:
            self.model.init_buffers()  # the rope tables; the weights come from init_from next
        self._load_pending_weights()

    def on_fit_start(self) -> None:
        self._load_pending_weights()  # a strategy that materialised the model without init_weights()

    def on_validation_start(self) -> None:
        if not self.trainer.ckpt_path:  # a checkpoint given to validate() provides the weights
            self._load_pending_weights()

    def _load_pending_weights(self) -> None:
        """Load ``init_from`` into a model the strategy has materialised (and maybe sharded), and start
        the LoRA adapters afresh (the strategy initialised them as plain layers)."""
        if not self._weights_pending:
            return
        pretrained = self._pretrained
        if pretrained is not None:
            load_slices(self.model, pretrained.slices(), self.config, pretrained.source)
        if self.lora is not None:  # (peft, which imports transformers, only when there are adapters)
            reset_lora(self.model)  # A random, B zero: the model starts as it was loaded
        self._weights_pending, self._pretrained = False, None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, with the fix, a checkpoint whose adapters sit on other layers than this model's (a
        fine-tune from before per-projection adapters: one adapter on the fused qkv)."""
        super().on_load_checkpoint(checkpoint)
        if self.model is None or "state_dict" not in checkpoint:
            return
        saved = adapted_layers(checkpoint["state_dict"])
        ours = adapted_layers(name for name, _ in self.model.named_parameters())
        if saved != ours:
            fix = f"model.lora.target_modules: [{', '.join(saved)}]" if saved else "model.lora: null"
            raise UserInputError(
                f"the checkpoint has LoRA adapters on {saved or 'no layer'}, this model on "
                f"{ours or 'no layer'}; resume it with {fix} (on the command line with --resume CKPT: "
                "--ckpt_path re-applies the settings the checkpoint recorded), or start a new fine-tune "
                "from it with model.init_from (its adapters are merged)"
            )

    # ---- evaluation ----------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        # Metric states reset under validate()'s inference mode become inference tensors, which a later
        # fit() (validating under no_grad) cannot update in place: give them fresh, normal tensors.
        with torch.inference_mode(False):
            self.val_loss.reset()
            self.val_token_accuracy.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits, labels = self.logits(batch["input_ids"], batch.get("position_ids")), batch["labels"]
        scored = labels != -100
        count = scored.sum()
        if logits is None:  # a pipeline stage without the head: the last stage's ranks count this batch
            for metric in (self.val_loss, self.val_token_accuracy):
                metric.update(torch.zeros((), device=labels.device), weight=0)
            return
        if count == 0:
            return
        self.val_loss.update(self._loss(logits, labels), weight=count)
        if isinstance(logits, DTensor):  # sharded by vocabulary (tensor parallelism): the argmax needs all
            logits = logits.full_tensor()
        correct = ((logits.argmax(dim=-1) == labels) & scored).sum()
        self.val_token_accuracy.update(correct / count, weight=count)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.log("val/token_accuracy", self.val_token_accuracy)  # a Metric: synced by torchmetrics
        datamodule = getattr(self.trainer, "datamodule", None)
        examples = getattr(datamodule, "eval_examples", None)
        if examples and not self.trainer.sanity_checking:
            # Every rank scores every held-out prompt (sharded models need all ranks in each forward), so
            # the mean over ranks that sync_dist takes is the score itself.
            score = self.exact_match(examples, datamodule.eos_id)
            self.log("val/exact_match", score, prog_bar=True, sync_dist=True)

    @torch.no_grad()
    def exact_match(
        self, examples: list[tuple[list[int], list[int]]], eos_id: int, batch_size: int = 32
    ) -> float:
        """Fraction of ``(prompt_ids, response_ids)`` whose greedy continuation is exactly the response
        followed by ``eos_id``. Under tensor or pipeline parallelism the strategy's generator runs it on the
        model as laid out (every rank calls this with the same examples)."""
        was_training = self.model.training
        self.model.eval()
        limit = min(self.hparams.eval_max_new_tokens, max(len(r) for _, r in examples) + 1)
        strategy = self.trainer.strategy if attached_trainer(self) else None
        sharded = strategy.generator() if hasattr(strategy, "generator") else None  # ParallelStrategy's
        completions = generate_batched(
            sharded or self.model, [p for p, _ in examples], limit, eos_id, batch_size=batch_size,
            device=self.device,
        )
        self.model.train(was_training)
        responses = [response for _, response in examples]
        return sum(c == r for c, r in zip(completions, responses, strict=True)) / len(examples)

    # ---- export ----------------------------------------------------------------------------------
    def merged_model(self) -> GPT:
        """A plain ``GPT`` copy of the current weights with LoRA adapters folded in (unsharded models)."""
        return merge_lora(copy.deepcopy(self.model)) if lora_layers(self.model) else copy.deepcopy(self.model)

    def export(self, output_dir: str | Path) -> Path:
        """Write ``model.safetensors`` + ``config.json`` (loadable as ``init_from``) of the merged model,
        with the tokenizer's files when it is a Hugging Face one (a model folder's: its chat template too);
        returns the folder."""
        output_dir = save_safetensors(self.merged_model(), output_dir)
        if self.tokenizer_spec and self.tokenizer_spec != "byte":
            save_tokenizer(self.tokenizer_spec, output_dir, self.config.block_size)
        return output_dir

