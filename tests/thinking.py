"""Thinking-model fixtures as plain builders: the SmolLM2 tokenizer (deep-copied) given each
family's marker tokens and a chat template written here that reproduces the family's format,
and `tiny_model`, a random-weight Llama over such a tokenizer.

The templates are ours, written to render what the families' own templates render for the
cases kvserve meets (system, user, assistant with reasoning or tool calls, tool results, the
generation prompt), including what each does with earlier turns' thinking:

* Qwen3: `<|im_start|>role\\n...<|im_end|>`; thinking on by default, `enable_thinking=False`
  ends the generation prompt with `<think>\\n\\n</think>\\n\\n`. Assistant turns before the last
  user query lose their thinking (`reasoning_content`, or a `<think>` block in `content`);
  turns after it (a tool-calling loop) keep it. `preserve_thinking=True` (as Qwen3.6 reads it)
  keeps every turn's. Calls: `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`.
* DeepSeek-R1: `<｜User｜>`/`<｜Assistant｜>`; the generation prompt ends `<think>\\n` (the model
  starts inside); history keeps only what follows `</think>`; no switch to turn thinking off.
* gpt-oss (harmony): a system message with `Reasoning: {reasoning_effort}` (default medium),
  the request's system message as the developer's instructions, assistant turns as
  `<|start|>assistant<|channel|>final<|message|>...<|end|>`, calls on the commentary channel
  ending `<|call|>`, generation prompt `<|start|>assistant`. Thinking comes from a message's
  `thinking` field (not `reasoning_content`) and is rendered only for a tool-call turn with no
  later final answer.
* GLM-4.5: `[gMASK]<sop>`, `<|user|>`/`<|assistant|>`/`<|observation|>`; earlier assistant turns
  render an empty `<think></think>`, turns after the last user keep theirs;
  `enable_thinking=False` appends `/nothink` to user turns and ends the generation prompt
  `<|assistant|>\\n<think></think>`. Calls: `<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`.
  NOTE: with thinking on the prompt ends `<|assistant|>` and the model writes `\\n<think>`.
* SmolLM3: a metadata system message (`Reasoning Mode: /think` or `/no_think`, from
  `enable_thinking` or a `/think`/`/no_think` in the system message); assistant history is its
  `content` (`reasoning_content` is dropped); `/no_think` puts `<think>\\n\\n</think>\\n` after
  each assistant header and at the end of the generation prompt.
"""

from __future__ import annotations

import copy

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, LlamaConfig

from server.model_loader import LoadedModel
from tests.device import DEVICE, DTYPE

QWEN3_TEMPLATE = r"""
{%- set ns = namespace(last_query=messages|length - 1, searching=true) -%}
{%- for m in messages[::-1] -%}
    {%- set text = m.content if m.content is string else '' -%}
    {%- if ns.searching and m.role == 'user' and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
        {%- set ns.searching = false -%}
        {%- set ns.last_query = messages|length - 1 - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or (loop.index0 > ns.last_query and (loop.last or reasoning)) -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + content -}}
        {%- endif -%}
        {%- for call in m.tool_calls or [] -%}
            {%- set f = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

DEEPSEEK_R1_TEMPLATE = r"""
{%- set ns = namespace(system='', in_tool=false) -%}
{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role in ('user', 'assistant') and ns.in_tool -%}
        {{- '<｜tool▁outputs▁end｜>' -}}
        {%- set ns.in_tool = false -%}
    {%- endif -%}
    {%- if m.role == 'user' -%}
        {{- '<｜User｜>' + content -}}
    {%- elif m.role == 'assistant' -%}
        {%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
        {{- '<｜Assistant｜>' + content -}}
        {%- if m.tool_calls -%}
            {{- '<｜tool▁calls▁begin｜>' -}}
            {%- for call in m.tool_calls -%}
                {%- set f = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}{{- '\n' -}}{%- endif -%}
                {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + f.name + '\n```json\n' + (f.arguments if f.arguments is string else f.arguments | tojson) + '\n```<｜tool▁call▁end｜>' -}}
            {%- endfor -%}
            {{- '<｜tool▁calls▁end｜>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
    {%- elif m.role == 'tool' -%}
        {%- if ns.in_tool -%}{{- '\n' -}}{%- else -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- endif -%}
        {%- set ns.in_tool = true -%}
        {{- '<｜tool▁output▁begin｜>' + content + '<｜tool▁output▁end｜>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if ns.in_tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\n' -}}{%- endif -%}
"""

GPT_OSS_TEMPLATE = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.enum is defined -%}{{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- elif spec.type == 'string' -%}{{- 'string' -}}
    {%- elif spec.type in ('number', 'integer') -%}{{- 'number' -}}
    {%- elif spec.type == 'boolean' -%}{{- 'boolean' -}}
    {%- elif spec.type == 'array' -%}{{- 'any[]' -}}
    {%- elif spec.type == 'object' -%}{{- 'object' -}}
    {%- else -%}{{- 'any' -}}
    {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\n' -}}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if messages[0].role in ('system', 'developer') -%}
    {%- set instructions = messages[0].content -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set instructions = '' -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- '<|start|>developer<|message|>' -}}
    {%- if instructions -%}{{- '# Instructions\n\n' + instructions + '\n\n' -}}{%- endif -%}
    {%- if tools -%}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
        {%- for tool in tools -%}
            {%- set f = tool.function -%}
            {{- '// ' + (f.description or '') + '\ntype ' + f.name + ' = ' -}}
            {%- if f.parameters and f.parameters.properties -%}
                {{- '(_: {\n' -}}
                {%- for name, spec in f.parameters.properties.items() -%}
                    {{- name + ('' if name in (f.parameters.required or []) else '?') + ': ' + ts_type(spec) + ',\n' -}}
                {%- endfor -%}
                {{- '}) => any;\n\n' -}}
            {%- else -%}
                {{- '() => any;\n\n' -}}
            {%- endif -%}
        {%- endfor -%}
        {{- '} // namespace functions' -}}
    {%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- set last = namespace(tool='') -%}
{%- for m in rest -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'assistant' -%}
        {%- if m.tool_calls -%}
            {%- set later = namespace(final=false) -%}
            {%- for n in rest[loop.index:] -%}
                {%- if n.role == 'assistant' and not n.tool_calls -%}{%- set later.final = true -%}{%- endif -%}
            {%- endfor -%}
            {%- set analysis = m.thinking if m.thinking is string and m.thinking else content -%}
            {%- if analysis and not later.final -%}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' -}}
            {%- endif -%}
            {%- for call in m.tool_calls -%}
                {%- set f = call.function if call.function is defined else call -%}
                {{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' + (f.arguments if f.arguments is string else f.arguments | tojson) + '<|call|>' -}}
                {%- set last.tool = f.name -%}
            {%- endfor -%}
        {%- elif loop.last and not add_generation_prompt -%}
            {%- if m.thinking is string and m.thinking -%}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}
            {%- endif -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|return|>' -}}
        {%- else -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' -}}
        {%- endif -%}
    {%- elif m.role == 'tool' -%}
        {{- '<|start|>functions.' + last.tool + ' to=assistant<|channel|>commentary<|message|>' + (content | tojson) + '<|end|>' -}}
    {%- elif m.role == 'user' -%}
        {{- '<|start|>user<|message|>' + content + '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

GLM45_TEMPLATE = r"""
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
    {%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' -%}
        {{- '<|user|>\n' + content -}}
        {%- if enable_thinking is defined and not enable_thinking and not content.endswith('/nothink') -%}{{- '/nothink' -}}{%- endif -%}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|assistant|>' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '\n<think>' + reasoning.strip() + '</think>' -}}
        {%- else -%}
            {{- '\n<think></think>' -}}
        {%- endif -%}
        {%- if content.strip() -%}{{- '\n' + content.strip() -}}{%- endif -%}
        {%- for call in m.tool_calls or [] -%}
            {%- set f = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>' + f.name -}}
            {%- if f.arguments is mapping -%}
                {%- for k, v in f.arguments.items() -%}
                    {{- '\n<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- '\n</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- elif m.role == 'system' -%}
        {{- '<|system|>\n' + content -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}{{- '\n<think></think>' -}}{%- endif -%}
{%- endif -%}
"""

SMOLLM3_TEMPLATE = r"""
{%- set ns = namespace(mode='/think' if enable_thinking is not defined or enable_thinking else '/no_think', instructions='') -%}
{%- if messages[0].role == 'system' -%}
    {%- set system = messages[0].content -%}
    {%- if '/no_think' in system -%}{%- set ns.mode = '/no_think' -%}{%- elif '/think' in system -%}{%- set ns.mode = '/think' -%}{%- endif -%}
    {%- set ns.instructions = system.replace('/no_think', '').replace('/think', '').rstrip() -%}
{%- endif -%}
{{- '<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: ' + ns.mode + '\n\n## Custom Instructions\n\n' -}}
{%- if ns.instructions -%}
    {{- ns.instructions + '\n\n' -}}
{%- elif ns.mode == '/think' -%}
    {{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face. Think the question through step by step before answering, and structure your response as: <think> Thought section </think> Solution section.\n\n' -}}
{%- else -%}
    {{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n' -}}
{%- endif -%}
{%- if tools -%}
    {{- '### Tools\n\nYou may call one or more functions to assist with the user query.\nYou are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n' -}}
    {%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
    {{- '</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if ns.mode == '/no_think' -%}{{- '<think>\n\n</think>\n' -}}{%- endif -%}
        {{- content.lstrip('\n') -}}
        {%- for call in m.tool_calls or [] -%}
            {%- set f = call.function if call.function is defined else call -%}
            {{- '<tool_call>\n' + ({'name': f.name, 'arguments': f.arguments} | tojson) + '\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if ns.mode == '/no_think' -%}{{- '<think>\n\n</think>\n' -}}{%- endif -%}
{%- endif -%}
"""

# family -> the tokens that end an assistant turn (its generation_config's eos_token_id)
END_OF_TURN = {
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "deepseek_r1": ("<｜end▁of▁sentence｜>",),
    "gpt_oss": ("<|return|>", "<|call|>"),
    "glm45": ("<|user|>", "<|observation|>", "<|endoftext|>"),
    "smollm3": ("<|im_end|>",),
}
DEEPSEEK_TOOL_MARKERS = [
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]


def _family(base, name: str, template: str, *, special: list[str], plain: list[str], eos: str, bos: str | None = None):
    """A copy of `base` with `special` added as special tokens, `plain` as added non-special
    ones (decoded text keeps them, as Qwen3's `<think>`), the family's template and end token;
    `name_or_path` is `tiny-<family>` (tiny_model reads the family from it)."""
    tok = copy.deepcopy(base)
    if special:
        tok.add_special_tokens({"additional_special_tokens": special}, replace_extra_special_tokens=False)
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = template.strip()
    tok.name_or_path = f"tiny-{name}"
    return tok


def qwen3_tokenizer(base):
    """Qwen3: `<think>`, `</think>`, `<tool_call>`... as added non-special tokens; ChatML."""
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    return _family(base, "qwen3", QWEN3_TEMPLATE, special=["<|im_start|>", "<|im_end|>"], plain=plain, eos="<|im_end|>")


def deepseek_r1_tokenizer(base):
    """DeepSeek-R1: fullwidth-bar chat and tool markers (special), `<think>`/`</think>` (not)."""
    special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", *DEEPSEEK_TOOL_MARKERS]
    return _family(base, "deepseek_r1", DEEPSEEK_R1_TEMPLATE, special=special, plain=["<think>", "</think>"],
                   eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>")


def gpt_oss_tokenizer(base):
    """gpt-oss: the harmony tokens, all special; `<|return|>` ends the answer."""
    return _family(base, "gpt_oss", GPT_OSS_TEMPLATE, special=HARMONY_TOKENS, plain=[], eos="<|return|>")


def glm45_tokenizer(base):
    """GLM-4.5: `[gMASK]`, `<sop>` and role tokens (special); think, tool and argument tags."""
    special = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<tool_response>", "</tool_response>"]
    return _family(base, "glm45", GLM45_TEMPLATE, special=special, plain=plain, eos="<|endoftext|>")


def smollm3_tokenizer(base):
    """SmolLM3: ChatML with `<think>`/`</think>` and `<tool_call>`/`</tool_call>` added."""
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    return _family(base, "smollm3", SMOLLM3_TEMPLATE, special=["<|im_start|>", "<|im_end|>"], plain=plain, eos="<|im_end|>")


BUILDERS = {
    "qwen3": qwen3_tokenizer,
    "deepseek_r1": deepseek_r1_tokenizer,
    "gpt_oss": gpt_oss_tokenizer,
    "glm45": glm45_tokenizer,
    "smollm3": smollm3_tokenizer,
}


def family_tokenizer(base, family: str):
    """The `family` builder's tokenizer (families: BUILDERS' keys, the reasoning parser names)."""
    return BUILDERS[family](base)


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn for a tokenizer built here."""
    family = tokenizer.name_or_path.removeprefix("tiny-")
    return [tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN[family]]


def tiny_model(tokenizer, seed: int = 0) -> LoadedModel:
    """A random-weight 2-layer Llama (hidden 64) over `tokenizer`'s whole vocabulary, on the test
    device (tests/device.py), whose config and generation config end a turn on the family's end tokens."""
    eos = end_of_turn_ids(tokenizer)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).eval().to(DEVICE)
    model.generation_config.eos_token_id = eos
    return LoadedModel(model, tokenizer, tokenizer.name_or_path, DEVICE, DTYPE, 2048)
