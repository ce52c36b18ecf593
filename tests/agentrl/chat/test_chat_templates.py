"""Golden tests: token-exact conversations under real chat templates (no hub).

Templates are embedded verbatim: ChatML as shipped with SmolLM2-135M-Instruct
(the `smol_tokenizer` fixture's own), Qwen2.5-Instruct (with tools) and
Llama-3.1-Instruct (with tools). Qwen and Llama are run on copies of the SmolLM2
tokenizer with the template set as `chat_template` (Llama's special tokens
added, and its pre-tokenizer regex). The "model" is simulated: each assistant
reply is the text the template renders for it, encoded, wrapped in a Completion.

For every template: multi-turn with tool calls, several tool results in a row
and a plain user follow-up; the final ids decode to exactly the text the
template renders for the whole conversation, the loss mask is 1 exactly on the
sampled ids, and retokenization_drift is 0.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agentrl.chat.conversation import Budgets, Conversation, HFChatTokenizer
from agentrl.types import Completion, Message, ToolCall

pytestmark = pytest.mark.model

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json "chat_template" (decoded).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json "chat_template" (decoded).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Llama-3's pre-tokenizer regex (tiktoken cl100k style): whitespace runs ending
# in newlines stay one piece, so "\n\n" + "{" splits the same alone and in context.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen3-style ChatML template that strips <think> from assistant turns before
# the last user message (the classic source of multi-turn re-tokenisation drift).
THINK_STRIPPING_TEMPLATE = r"""{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_query and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return the result.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*7+3"}},
                "required": ["expression"],
            },
        },
    }
]


def qwen_tokenizer(smol_tokenizer: Any) -> HFChatTokenizer:
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    return HFChatTokenizer(tok)


def llama_tokenizer(smol_tokenizer: Any, *, llama_pretokenizer: bool = True) -> HFChatTokenizer:
    from tokenizers import Regex, pre_tokenizers

    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": [
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ],
        }
    )
    if llama_pretokenizer:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    tok.chat_template = LLAMA31_TEMPLATE
    return HFChatTokenizer(tok)


def calc(expr: str, call_id: str) -> ToolCall:
    return ToolCall("calculator", {"expression": expr}, id=call_id)


def model_reply(tok: HFChatTokenizer, conv: Conversation, message: Message, *, ending: str) -> Completion:
    """What a model that follows the template would sample for `message`.

    ending="eos": the reply runs through the end-of-turn token;
    ending="stop_string": the engine stopped on a stop string before it, so
    the turn-closing text is missing from the sampled ids.
    """
    before = tok.render(conv.messages, tools=conv.tools, add_generation_prompt=True)
    after = tok.render([*conv.messages, message], tools=conv.tools)
    assert after.startswith(before), "template re-rendered the history; cannot simulate a reply"
    segment = after[len(before) :]
    end_text = tok.decode([tok.eos_ids[0]])
    cut = segment.index(end_text) + (len(end_text) if ending == "eos" else 0)
    ids = tok.encode(segment[:cut])
    if ending == "eos":
        assert ids[-1] == tok.eos_ids[0]
    n = len(ids)
    return Completion(ids, [-0.5] * n, [7] * n, "stop")


def run_script(
    tok: HFChatTokenizer, opening: list[Message], script: list[Any], *, tools: Any, ending: str
) -> tuple[Conversation, list[int]]:
    """Play `script` (assistant Messages and lists of env messages); return conv and sampled ids."""
    conv = Conversation(tok, opening, tools=tools, budgets=Budgets(max_total_tokens=100_000, max_turns=20))
    sampled: list[int] = []
    for step in script:
        if isinstance(step, Message):
            completion = model_reply(tok, conv, step, ending=ending)
            sampled.extend(completion.ids)
            conv.add_completion(completion, step)
        else:
            assert conv.add_messages(step)
    return conv, sampled


def assert_golden(tok: HFChatTokenizer, conv: Conversation, sampled: list[int], tools: Any) -> None:
    full = tok.render(conv.messages, tools=tools, add_generation_prompt=True)
    assert tok.decode(conv.token_ids) == full
    masked = [t for t, m in zip(conv.token_ids, conv.loss_mask, strict=True) if m]
    assert masked == sampled
    assert [i for i, m in enumerate(conv.loss_mask) if m] == [
        i for t in conv.turns for i in range(t.start, t.end)
    ]
    assert all(lp == -0.5 for lp, m in zip(conv.logprobs, conv.loss_mask, strict=True) if m)
    assert all(v == -1 for v, m in zip(conv.versions, conv.loss_mask, strict=True) if not m)
    assert conv.retokenization_drift() == 0.0
    assert conv.token_ids == tok.encode(full)


def hermes_script() -> tuple[list[Message], list[Any]]:
    opening = [
        Message("system", "You are a careful assistant."),
        Message("user", "What is 12*7+3, and what is 5-9?"),
    ]
    script: list[Any] = [
        Message(
            "assistant", "I will use the calculator.", tool_calls=[calc("12*7+3", "a"), calc("5-9", "b")]
        ),
        [Message("tool", "87", tool_call_id="a"), Message("tool", "-4", tool_call_id="b")],
        Message("assistant", "12*7+3 = 87 and 5-9 = -4. Answer: 87, -4"),
        [Message("user", "Thanks! Now divide 87 by 3.")],
        Message("assistant", "", tool_calls=[calc("87/3", "c")]),
        [Message("tool", "29", tool_call_id="c")],
        Message("assistant", "Answer: 29"),
        [Message("user", "Great, bye.")],
    ]
    return opening, script


@pytest.mark.parametrize("ending", ["eos", "stop_string"])
def test_chatml_smollm2_golden(smol_tokenizer: Any, ending: str) -> None:
    tok = HFChatTokenizer(smol_tokenizer)  # SmolLM2's own ChatML template: tools via the fallback
    opening, script = hermes_script()
    conv, sampled = run_script(tok, opening, script, tools=TOOLS, ending=ending)
    text = tok.decode(conv.token_ids)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7+3"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n87<|im_end|>\n<|im_start|>tool\n-4<|im_end|>" in text
    assert_golden(tok, conv, sampled, TOOLS)


@pytest.mark.parametrize("ending", ["eos", "stop_string"])
def test_qwen25_golden_with_tools(smol_tokenizer: Any, ending: str) -> None:
    tok = qwen_tokenizer(smol_tokenizer)
    assert tok.tools_in_template
    opening, script = hermes_script()
    conv, sampled = run_script(tok, opening, script, tools=TOOLS, ending=ending)
    text = tok.decode(conv.token_ids)
    assert "# Tools" in text and '"name": "calculator"' in text
    # consecutive tool results share one user turn in Qwen2.5
    assert (
        "<|im_start|>user\n<tool_response>\n87\n</tool_response>\n<tool_response>\n-4\n</tool_response><|im_end|>"
        in text
    )
    assert_golden(tok, conv, sampled, TOOLS)


@pytest.mark.parametrize("ending", ["eos", "stop_string"])
def test_llama31_golden_with_tools(smol_tokenizer: Any, ending: str) -> None:
    tok = llama_tokenizer(smol_tokenizer)
    eot = tok.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert tok.eos_ids[0] == eot
    opening = [Message("system", "You are a careful assistant."), Message("user", "What is 12*7+3?")]
    script: list[Any] = [
        Message("assistant", "", tool_calls=[calc("12*7+3", "a")]),
        [Message("tool", "87", tool_call_id="a"), Message("tool", "note: exact integer", tool_call_id="a")],
        Message("assistant", "Answer: 87"),
        [Message("user", "And 87 divided by 3?")],
        Message("assistant", "", tool_calls=[calc("87/3", "b")]),
        [Message("tool", "29", tool_call_id="b")],
        Message("assistant", "Answer: 29"),
        [Message("user", "Thanks.")],
    ]
    conv, sampled = run_script(tok, opening, script, tools=TOOLS, ending=ending)
    text = tok.decode(conv.token_ids)
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython"
    )
    assert '{"name": "calculator", "parameters": {"expression": "12*7+3"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"87"<|eot_id|>' in text
    assert_golden(tok, conv, sampled, TOOLS)


def test_drift_flags_a_tokenizer_that_merges_across_the_turn_boundary(smol_tokenizer: Any) -> None:
    """SmolLM2's GPT-2 pre-tokenizer under the Llama template: the prompt ends in
    "\\n\\n" (one token alone) and the reply starts with "{"; re-tokenising the whole
    text splits "\\n\\n{" differently. The ids still decode to the exact text, and
    the drift metric reports the difference instead of hiding it."""
    tok = llama_tokenizer(smol_tokenizer, llama_pretokenizer=False)
    opening = [Message("user", "What is 2+2?")]
    script: list[Any] = [
        Message("assistant", "", tool_calls=[calc("2+2", "a")]),
        [Message("tool", "4", tool_call_id="a")],
    ]
    conv, _ = run_script(tok, opening, script, tools=TOOLS, ending="eos")
    assert tok.decode(conv.token_ids) == tok.render(conv.messages, tools=TOOLS, add_generation_prompt=True)
    assert 0.0 < conv.retokenization_drift() < 0.05


def test_think_stripping_template_keeps_sampled_reasoning(smol_tokenizer: Any) -> None:
    tok_ = copy.deepcopy(smol_tokenizer)
    tok_.chat_template = THINK_STRIPPING_TEMPLATE
    tok = HFChatTokenizer(tok_)
    conv = Conversation(tok, [Message("user", "2+2?")])
    reply = Message("assistant", "<think>\nadd them\n</think>\n\nAnswer: 4")
    sampled_text = reply.content + "<|im_end|>"
    ids = tok.encode(sampled_text)
    conv.add_completion(Completion(ids, [0.0] * len(ids), [1] * len(ids), "stop"), reply)
    assert conv.add_messages([Message("user", "and 3+3?")])
    text = tok.decode(conv.token_ids)
    # the sampled reasoning stays in the training ids, and the delta is clean
    assert text.endswith(
        "add them\n</think>\n\nAnswer: 4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # re-rendering would drop it: that is drift, measured, not silently trained on
    assert "add them" not in tok.render(conv.messages, add_generation_prompt=True)
    assert conv.retokenization_drift() > 0.1
