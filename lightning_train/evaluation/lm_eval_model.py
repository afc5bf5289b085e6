"""``LightningTrainLM``: our models as an lm-evaluation-harness model (registered as ``"lightning_train"``).

lm_eval asks a model three things: the log-likelihood of a continuation (multiple choice), of a whole text
in windows of the model's length (perplexity), and greedy or sampled text up to a stop string. Each is
answered the way lm_eval's own Hugging Face backend (``"hf"``) answers it, with the same tokens in the same
windows, so a checkpoint scores what its ``export`` scores there (tests/test_evaluation.py):

- contexts keep their trailing spaces with the continuation (``TemplateLM._encode_pair``); an empty context
  is the end-of-text token, which an ``export`` names as its bos token too;
- a context longer than the model is cut from the left; log-probabilities are a float32 ``log_softmax``
  over the whole (padded) vocabulary;
- generation is ``models.generate.generate_batched`` (greedy unless the task samples), cut at the task's
  stop strings and at end of text.

Inputs of one batch are padded on the right: the model is causal, so padding changes no real position.

A model laid out by tensor and pipeline parallelism (a ``strategies.generation.ShardedGenerator``) answers
through the same loops: its ``logits`` and ``generate`` run on every rank of the layout, so every rank runs
every request (lm_eval sees rank 0 of 1 on each) and ends with the same answers. So does a model whose
weights FSDP shards over the ranks (DTensor parameters): each forward gathers them on every rank together.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_train.data.tokenizers import Tokenizer, load_tokenizer
from lightning_train.errors import UserInputError
from lightning_train.models.generate import generate_batched

if TYPE_CHECKING:
    from lightning_train.strategies.generation import ShardedGenerator

# (the request's strings or None for a rolling window, context tokens, continuation tokens)
TokenRequest = tuple["tuple[str, str] | None", list[int], list[int]]
# generation options lm_eval tasks pass that decoding here follows; any other is refused by name
KNOWN_GENERATION_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k"}
MAX_TOKENS_ALIASES = {"max_new_tokens", "max_tokens", "max_completion_tokens"}  # lm_eval's other names


@register_model("lightning_train")
class LightningTrainLM(TemplateLM):
    """A ``GPT`` (or any model with its ``config.block_size``, ``forward`` and ``generate``) and its
    tokenizer, scored by lm_eval: ``lm_eval.simple_evaluate(model=LightningTrainLM(model, tokenizer),
    ...)``. ``from_checkpoint`` opens any weights ``open_pretrained`` reads;
    ``simple_evaluate(model="lightning_train", model_args="checkpoint=PATH")`` does the same once this
    module is imported.

    Under a process group of several ranks (the ``DownstreamEval`` callback under DDP), lm_eval gives each
    rank its share of the requests and gathers the scores on rank 0, where ``model`` is whole on every rank;
    a ``ShardedGenerator``, or a model FSDP shards, is one model over the ranks, which all run every request
    together.

    Args:
        model: the network, on the device to evaluate on; switched to eval mode while it answers. Or a
            ``ShardedGenerator`` (``from_checkpoint`` with ``tensor_parallel``/``pipeline_parallel``).
        tokenizer: a ``Tokenizer`` or a spec for ``load_tokenizer`` ("byte", a tokenizer.json).
        batch_size: requests scored (or prompts of one length decoded) together.
        max_gen_toks: the longest generation when a task names none (lm_eval's default, 256).
    """

    def __init__(
        self,
        model: nn.Module | ShardedGenerator,
        tokenizer: Tokenizer | str,
        batch_size: int = 16,
        max_gen_toks: int = 256,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UserInputError(f"batch_size={batch_size!r} must be an int >= 1, e.g. 16")
        self.model = model
        # token ids (B, T) -> logits (B, T, vocab): a whole model's forward, a sharded one's `logits`
        self._logits: Callable[[torch.Tensor], torch.Tensor]
        if isinstance(model, nn.Module):
            self._logits, self._parts = model, [model]
            whole = not any(isinstance(p, DTensor) for p in model.parameters())
            if whole and dist.is_available() and dist.is_initialized():  # replicas: lm_eval splits requests
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        else:
            self._logits, self._parts = model.logits, list(model.stages.values())
        self.tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.batch_size, self._max_gen_toks = batch_size, int(max_gen_toks)
        self._device = next(self._parts[0].parameters()).device

    @classmethod
    def from_checkpoint(
        cls, checkpoint: str, tokenizer: str | None = None, batch_size: int = 16, max_gen_toks: int = 256,
        device: str | None = None, allow_pickle: bool = True, tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
    ) -> LightningTrainLM:
        """The model of ``checkpoint`` (our ``.ckpt``, a sharded folder read whole, an export, or a Hugging
        Face folder: ``checkpoint.open_pretrained``) on ``device`` (default: the GPU if there is one), with
        its own tokenizer unless ``tokenizer`` names one. With ``tensor_parallel`` or ``pipeline_parallel``
        above 1, run under torchrun on exactly their product of ranks, it is laid out over them as it
        trains (``strategies.generation.shard_under_torchrun``), each rank on its own GPU or the CPU."""
        from lightning_train.checkpoint.pretrained import open_pretrained

        ranks = tensor_parallel * pipeline_parallel
        if ranks > 1:
            _check_sharded_launch(tensor_parallel, pipeline_parallel, device)
        pretrained = open_pretrained(checkpoint, allow_pickle=allow_pickle)
        spec = tokenizer or pretrained.tokenizer
        if spec is None:
            raise UserInputError(
                f"{checkpoint!r} names no tokenizer; pass tokenizer=byte or a tokenizer.json"
            )
        if ranks > 1:
            from lightning_train.strategies.generation import shard_under_torchrun

            sharded = shard_under_torchrun(pretrained.build(), tensor_parallel, pipeline_parallel, "evaluate")
            return cls(sharded, spec, batch_size, max_gen_toks)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(pretrained.build().to(device), spec, batch_size, max_gen_toks)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> LightningTrainLM:
        """lm_eval's ``model_args="checkpoint=PATH,batch_size=8"``: ``from_checkpoint``'s arguments."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> LightningTrainLM:
        # lm_eval passes batch_size, max_batch_size and device; a batch size is fixed here
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        extra.pop("max_batch_size", None)
        arguments = {**arg_dict, **extra}
        accepted = set(inspect.signature(cls.from_checkpoint).parameters)
        unknown = sorted(set(arguments) - accepted)
        if unknown or "checkpoint" not in arguments:
            problem = f"unknown {unknown}" if unknown else "no checkpoint"
            raise UserInputError(
                f"model_args {sorted(arguments)}: {problem}; pass model_args='checkpoint=PATH' and any of "
                f"{sorted(accepted - {'checkpoint'})}"
            )
        return cls.from_checkpoint(**arguments)

    # ---- what TemplateLM asks of a model ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return int(self.model.config.block_size)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)  # our tokenizers add no special tokens, as in training data

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    # ---- scoring ----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, whether greedy decoding gives the continuation) for each request,
        longest first so a batch pads little; answers in the requests' order."""
        ordered = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])))
        answers = []
        with self._inference():
            for chunk in ordered.get_batched(n=self.batch_size):
                # the last max_length tokens of context + continuation, less the last: its own target
                inputs = [(req[1] + req[2])[-(self.max_length + 1):][:-1] for req in chunk]
                width = max(len(tokens) for tokens in inputs)
                padded = [tokens + [0] * (width - len(tokens)) for tokens in inputs]
                batch = torch.tensor(padded, device=self.device)
                log_probs = F.log_softmax(self._logits(batch).float(), dim=-1)
                for (strings, _, continuation), tokens, row in zip(chunk, inputs, log_probs, strict=True):
                    scored = row[len(tokens) - len(continuation): len(tokens)]
                    target = torch.tensor(continuation, device=self.device)
                    greedy = bool((scored.argmax(-1) == target).all())
                    answer = (float(scored.gather(1, target[:, None]).sum()), greedy)
                    answers.append(answer)
                    if strings is not None:  # rolling windows are cached per text by loglikelihood_rolling
                        self.cache_hook.add_partial("loglikelihood", strings, answer)
        return ordered.get_original(answers)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in disjoint windows of ``max_length`` tokens, each after
        the context the window before leaves (lm_eval's ``get_rolling_token_windows``)."""
        windows: list[TokenRequest] = []
        owners = []
        for i, (text,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += log_prob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first of its stop strings (or end of text), grouped by
        generation options; the context keeps its last ``max_length - max_gen_toks`` tokens."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        texts = [""] * len(requests)
        eos_text = self.tok.decode([self.eot_token_id])
        with self._inference():
            for indices in groups.values():
                options = self._generation_options(requests[indices[0]].args[1])
                until = handle_stop_sequences(options["until"], eos=eos_text)
                keep = self.max_length - options["max_gen_toks"]
                contexts = [self.tok_encode(requests[i].args[0])[-keep:] for i in indices]
                prompts = [tokens or [self.prefix_token_id] for tokens in contexts]
                completions = generate_batched(
                    self.model, prompts, options["max_gen_toks"], self.eot_token_id, options["temperature"],
                    options.get("top_k"), self.batch_size, self.device,
                    tokenizer_vocab_size=self.tok.vocab_size,
                )
                for i, tokens in zip(indices, completions, strict=True):
                    texts[i] = postprocess_generated_text(self.tok_decode(tokens), until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
        return texts

    def _generation_options(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """A task's ``generation_kwargs`` as lm_eval normalises them; options decoding here cannot follow
        (``top_p``, beams, ...) and a generation that leaves no room for the context are refused."""
        unknown = sorted(set(gen_kwargs) - KNOWN_GENERATION_KWARGS - MAX_TOKENS_ALIASES)
        if unknown:
            raise UserInputError(
                f"generation_kwargs {unknown} are not supported by lightning_train's decoding; a task may "
                f"set {sorted(KNOWN_GENERATION_KWARGS)}"
            )
        options = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        if not options["do_sample"]:
            options["temperature"] = 0.0
        if options["max_gen_toks"] >= self.max_length:
            raise UserInputError(
                f"max_gen_toks={options['max_gen_toks']} leaves no room for a context in the model's "
                f"block_size={self.max_length}; set max_gen_toks (the task's generation_kwargs, or "
                "LightningTrainLM's) below it"
            )
        return options

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode and no autograd while answering; the modules' modes as they were afterwards."""
        training = [module.training for module in self._parts]
        for module in self._parts:
            module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for module, mode in zip(self._parts, training, strict=True):
                module.train(mode)

    # ---- data parallel: lm_eval splits requests by rank and gathers the scores on rank 0 ----------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _check_sharded_launch(tensor_parallel: int, pipeline_parallel: int, device: str | None) -> None:
    """Refuse, before the weights are read, a sharded evaluation on more ranks than its layout (lm_eval
    would not split the documents over the replicas: each would score them all) or on a ``device`` of one
    process (each rank takes its own)."""
    ranks = tensor_parallel * pipeline_parallel
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != ranks:
        raise UserInputError(
            f"--tensor_parallel {tensor_parallel} --pipeline_parallel {pipeline_parallel} evaluates on "
            f"exactly {ranks} ranks, and torchrun started {world}; use --nproc_per_node={ranks} (documents "
            "are not split over replicas)"
        )
    if device is not None:
        raise UserInputError(
            f"--device {device} is one process's device; the ranks of --tensor_parallel {tensor_parallel} "
            f"--pipeline_parallel {pipeline_parallel} take their own (LOCAL_RANK's GPU, else the CPU): leave "
            "--device out"
        )
