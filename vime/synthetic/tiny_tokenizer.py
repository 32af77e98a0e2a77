"""The tiny models' tokenizer: byte-level BPE trained on a synthetic corpus (digits one by one, simple English,
code-ish symbols, tool calls), with ChatML's special tokens and a chat template. No downloads; deterministic from
the seed."""

from __future__ import annotations

import random
from pathlib import Path

# Chat template in the ChatML style used by Qwen; enough for prompts, multi-turn and tool turns. With `tools` it
# lists them in a system turn, one `name(parameters)` line each (short: the tiny tokenizer spends a token on a few
# characters, and a model learns the call format from its SFT data), and renders an assistant's tool calls as Qwen
# does (`<tool_call>{...}</tool_call>`, what vime.agents.tool_parsing parses back); without tools or tool calls it
# renders exactly plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n' }}{%- endif %}"
    "{{- '# Tools\n' }}"
    "{%- for tool in tools %}"
    "{%- set function = tool['function'] if tool['function'] is defined else tool %}"
    "{%- set parameters = function['parameters'] if function['parameters'] is defined else {} %}"
    "{%- set names = parameters['properties'] if parameters['properties'] is defined else {} %}"
    "{{- function['name'] + '(' + (names | list | join(', ')) + ')\n' }}"
    "{%- endfor %}"
    "{%- if tool_choice == 'required' %}{{- 'Call a tool.\n' }}"
    "{%- elif tool_choice is mapping %}{{- 'Call ' + tool_choice['function']['name'] + '.\n' }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- arguments if arguments is string else arguments | tojson }}{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Synthetic text covering digits, arithmetic, simple English and code-ish symbols."""
    rng = random.Random(seed)
    words = (
        "the a an of to and is in it you that he was for on are as with his they at be this have from or one "
        "had by word but not what all were we when your can said there use each which she do how their if "
        "will up other about out many then them these so some her would make like him into time has look two "
        "more write go see number no way could people my than first water been call who oil its now find long "
        "down day did get come made may part answer question what is sum plus minus times equals result user "
        "assistant system tool call python code def return print import true false none error test pass"
    ).split()
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.4:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*"])
            lines.append(f"What is {a} {op} {b}? The answer is \\boxed{{{eval(f'{a}{op}{b}')}}}.")
        elif kind < 0.8:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + ".")
        else:
            lines.append(f'{{"name": "calc", "arguments": {{"x": {rng.randint(0, 99)}}}}} def f(x): return x * 2')
    return lines


def build_tokenizer(out: Path, vocab_size: int, seed: int, extra_special: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on `_corpus(seed)`, with ChatML's special tokens and `extra_special` (a
    vision-language model's image tokens), saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one by one so that arithmetic is learnable by a tiny model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:] + list(extra_special),
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast
