"""Turn worked demonstration conversations into SFT samples (assistant tokens only).

Demonstrations are text the model never sampled, so here — unlike in rollouts —
rendering and tokenising is the right thing: the whole conversation is rendered
with the chat template once, and the loss mask is 1 exactly on the tokens of
each assistant reply (found by rendering the conversation up to the reply with
a generation prompt, and up to and including it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.chat.conversation import ChatTokenizer
from agentrl.types import Message, TrainSample, new_id


class DemonstrationError(ValueError):
    """A demonstration the chat template cannot split into prompt and reply spans."""


def demonstration_sample(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reward: float = 1.0,
) -> TrainSample:
    """An SFT sample: input ids of the rendered demo, mask 1 on assistant replies."""
    ids = tokenizer.encode(tokenizer.render(messages, tools=tools))
    mask = [0] * len(ids)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        start = len(tokenizer.encode(tokenizer.render(messages[:i], tools=tools, add_generation_prompt=True)))
        end_ids = tokenizer.encode(tokenizer.render(messages[: i + 1], tools=tools))
        if end_ids != ids[: len(end_ids)]:
            raise DemonstrationError(
                f"assistant message {i}: the template renders the conversation prefix differently "
                "from the whole conversation, so its tokens cannot be located"
            )
        # the reply's own end-of-turn token is learned; the template's trailing newline is not
        end = len(end_ids)
        while end > start and tokenizer.decode(ids[end - 1 : end]).strip() == "":
            end -= 1
        mask[start:end] = [1] * (end - start)
        spans.append((start, end))
    if not spans:
        raise DemonstrationError("a demonstration needs at least one assistant message")
    return TrainSample(
        input_ids=ids,
        loss_mask=mask,
        behaviour_logprobs=[0.0] * len(ids),
        versions=[-1] * len(ids),
        reward=reward,
        turn_spans=spans,
        turn_rewards=[0.0] * len(spans),
        group_id="demonstrations",
        trajectory_id=new_id(),
    )
