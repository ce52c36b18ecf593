"""`reward_model`: score finished conversations with an HF sequence-classification model.

Any `AutoModelForSequenceClassification` checkpoint works (Skywork/ArmoRM-style
reward models, or one you trained). Concurrent `score` calls from many episodes
are gathered into batches (up to `batch_size`, waiting at most `max_wait_ms` for
a batch to fill) and run on one worker thread owned by this object, so the event
loop never blocks on a forward pass. torch/transformers are imported only there.

Use it alone as an env's reward, or mixed with verifiers through
`agentrl.envkit.rewards.weighted([("rm", 0.3, rm), ("math", 1.0, verifier)], ...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.types import Message


class RewardModelConfig(BaseModel):
    """Config of the `reward_model` reward plugin."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="local directory (or hub id where reachable) of the reward model")
    batch_size: int = Field(16, ge=1, description="most conversations scored in one forward pass")
    max_wait_ms: float = Field(5.0, ge=0.0, description="how long a partial batch waits for company")
    max_length: int = Field(2048, ge=8, description="tokens per conversation; longer ones are cut on the left")
    device: str = Field("cpu", description="torch device of the reward model, e.g. cpu, cuda, cuda:1")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "fp32", description="weight dtype when loading; auto: the checkpoint's own"
    )
    label_index: int = Field(0, ge=0, description="which output logit is the reward")
    transform: Literal["none", "sigmoid", "tanh"] = Field("none", description="applied to the logit")
    scale: float = Field(1.0, description="reward = scale * transform(logit) + offset")
    offset: float = Field(0.0, description="added after scale: reward = scale * transform(logit) + offset")
    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="chat: tokenizer's chat template; plain: 'role: content' lines; auto: chat if present"
    )
    timeout_s: float = Field(120.0, gt=0.0, description="deadline for one score() call")


class RewardModelReward:
    """A batched, off-event-loop reward from a sequence-classification model."""

    name: ClassVar[str] = "reward_model"
    description: ClassVar[str] = "HF sequence-classification reward model, batched off the event loop"
    Config: ClassVar[type[RewardModelConfig]] = RewardModelConfig

    def __init__(self, config: RewardModelConfig | None = None, **params: Any) -> None:
        if config is not None and params:
            raise TypeError("pass either a RewardModelConfig or keyword params, not both")
        self.config = config if config is not None else RewardModelConfig(**params)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self._model: Any = None
        self._tokenizer: Any = None
        self._pending: list[tuple[str, asyncio.Future[float]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._full = asyncio.Event()
        self.stats: dict[str, int] = {"batches": 0, "items": 0}
        self.worker_threads: set[int] = set()

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        text = await self._render(messages)
        value = await asyncio.wait_for(self._submit(text), self.config.timeout_s)
        return RewardResult(value=value, breakdown={"reward_model": value})

    async def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Score already-rendered texts (all queued at once, so they share batches)."""
        futures = [self._submit(t) for t in texts]
        return list(await asyncio.wait_for(asyncio.gather(*futures), self.config.timeout_s))

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- batching ---------------------------------------------------------

    def _submit(self, text: str) -> asyncio.Future[float]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[float] = loop.create_future()
        self._pending.append((text, future))
        if self._flusher is None or self._flusher.done():
            self._full = asyncio.Event()
            self._flusher = loop.create_task(self._flush())
        if len(self._pending) >= self.config.batch_size:
            self._full.set()
        return future

    async def _flush(self) -> None:
        """Wait for a batch to fill (or the wait to end), run it, repeat while work is queued."""
        while self._pending:
            if len(self._pending) < self.config.batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.config.max_wait_ms / 1000)
            batch = self._pending[: self.config.batch_size]
            self._pending = self._pending[self.config.batch_size :]
            self._full = asyncio.Event()
            if len(self._pending) >= self.config.batch_size:
                self._full.set()
            texts = [t for t, _ in batch]
            try:
                values = await asyncio.get_running_loop().run_in_executor(self._executor, self._forward, texts)
            except Exception as e:  # every waiter learns why
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), value in zip(batch, values, strict=True):
                if not fut.done():
                    fut.set_result(value)

    # -- worker thread ----------------------------------------------------

    async def _render(self, messages: Sequence[Message]) -> str:
        tokenizer = await asyncio.get_running_loop().run_in_executor(self._executor, self._load_tokenizer)
        use_chat = self.config.template == "chat" or (
            self.config.template == "auto" and getattr(tokenizer, "chat_template", None)
        )
        if use_chat:
            rendered: str = tokenizer.apply_chat_template([m.to_chat() for m in messages], tokenize=False)
            return rendered
        return "\n".join(f"{m.role}: {m.content}" for m in messages)

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from agentrl.engines.models import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.config.model))
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            tokenizer.truncation_side = "left"  # keep the end of the conversation: the answer
            self._tokenizer = tokenizer
        return self._tokenizer

    def _load_model(self) -> Any:
        if self._model is None:
            import torch
            from transformers import AutoModelForSequenceClassification

            from agentrl.engines.models import resolve_model

            dtypes = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
            model = AutoModelForSequenceClassification.from_pretrained(
                resolve_model(self.config.model), dtype=dtypes[self.config.dtype]
            )
            tokenizer = self._load_tokenizer()
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tokenizer.pad_token_id
            if self.config.label_index >= model.config.num_labels:
                raise ValueError(
                    f"label_index={self.config.label_index} but the model has {model.config.num_labels} labels"
                )
            self._model = model.to(self.config.device).eval()
        return self._model

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        self.worker_threads.add(threading.get_ident())
        model, tokenizer = self._load_model(), self._load_tokenizer()
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.config.max_length,
            add_special_tokens=False,
        ).to(self.config.device)
        with torch.inference_mode():
            logits = model(**enc).logits[:, self.config.label_index].float().tolist()
        self.stats["batches"] += 1
        self.stats["items"] += len(texts)
        return [self._transform(x) for x in logits]

    def _transform(self, x: float) -> float:
        if self.config.transform == "sigmoid":
            x = 1.0 / (1.0 + math.exp(-x))
        elif self.config.transform == "tanh":
            x = math.tanh(x)
        return self.config.scale * x + self.config.offset
