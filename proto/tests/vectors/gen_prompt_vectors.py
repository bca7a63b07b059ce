#!/usr/bin/env python3
"""Regenerates the expected strings and token ids in proto/tests/prompt.rs.

Renders the Qwen3 chat template with jinja2 configured the way HF transformers'
apply_chat_template does (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, HF's tojson and raise_exception) and tokenizes with HF `tokenizers`.
Needs: pip install tokenizers jinja2. Model dir: $KVROUTE_MODEL_DIR or .cache/models/qwen3.
"""
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

d = os.environ.get("KVROUTE_MODEL_DIR", ".cache/models/qwen3")
cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(m):
    raise jinja2.exceptions.TemplateError(m)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
template = env.from_string(cfg["chat_template"])

# Messages as the template sees them after vLLM-style normalisation (tool-call arguments parsed).
CASES = [
    ("multi_turn", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 equals 4."},
        {"role": "user", "content": "And 3+3?"}], None, {}),
    ("think_history", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."}], None, {}),
    ("no_thinking", [{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
    ("tools", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}],
     [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
       "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}], {}),
    ("reasoning_after_query", [
        {"role": "user", "content": "Compute"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42"}], None, {}),
]

for name, messages, tools, kwargs in CASES:
    ctx = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ctx.update(kwargs)
    text = template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True, **ctx)
    print("=== " + name)
    print(json.dumps(text, ensure_ascii=False))
    print(tok.encode(text, add_special_tokens=False).ids)

for s in ["Hello world", " The quick brown fox jumps over the lazy dog.", "naïve café 日本語 🤖",
          "x = 12345678;\n\n\tif (a<b) { return; }  ", "<|im_start|>user\nhi<|im_end|>", "I'm can't we'll"]:
    print(json.dumps(s, ensure_ascii=False), tok.encode(s, add_special_tokens=True).ids)
