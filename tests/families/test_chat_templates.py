"""Chat templates as transformers renders them: each family's template style (ChatML with
Qwen's tool and thinking branches, Gemma's turns with its role checks, Phi-3's tags,
Mistral's [INST] with loop controls and the `generation` tag) through the node's TextCodec
equals apply_chat_template, and a chat request on gRPC and on HTTP answers from exactly those
tokens. The templates are written for these tests in each family's style and Jinja idioms."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness import InProcessNode, hf_greedy
from inference_node.config import NodeConfig
from inference_node.tokenizer import ChatTemplateError, TextCodec
from lora_client.node_client import NodeClient

QWEN = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif messages[0].role != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages[::-1] %}
{%- if ns.last_query == -1 and message.role == 'user' %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'assistant' and message.reasoning_content is string and loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

PHI3 = """{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"""

MISTRAL = """{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + (messages[0]['content'] + '\\n\\n' if loop.index0 == 1 and messages[0]['role'] == 'system' else '') + message['content'] + ' [/INST]' }}{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"""

TEMPLATES = {"qwen3": QWEN, "gemma2": GEMMA, "phi3": PHI3, "mistral": MISTRAL}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? <b>&</b>"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another one, \u00e9l\u00e8ve."}],
    [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}],  # Gemma's refuses it
]


def with_template(path: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the checkpoint whose chat template is `template`."""
    out = tmp_path / "with-template"
    shutil.copytree(path, out)
    (out / "chat_template.jinja").write_text(template)
    return out


@pytest.mark.parametrize("family", list(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_node_renders_each_familys_template_as_transformers(family, conversation, tokenizer_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(TEMPLATES[family])
    messages = CONVERSATIONS[conversation]
    hf = AutoTokenizer.from_pretrained(folder)
    codec = TextCodec(folder)
    from jinja2.exceptions import TemplateError

    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as refused:  # the template's own raise_exception: the node refuses alike
        assert family == "gemma2" and conversation == 2
        with pytest.raises(ChatTemplateError, match=str(refused)):
            codec.render_chat(messages)
        return
    assert codec.render_chat(messages) == expected
    ids = hf(expected, add_special_tokens=False)["input_ids"]
    assert codec.encode_chat(messages) == ids


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_chat_requests_on_grpc_and_http_answer_from_the_templates_tokens(family, request, tmp_path) -> None:
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = with_template(request.getfixturevalue(f"tiny_{family}_path"), tmp_path,
                         QWEN if family == "qwen3" else GEMMA)
    hf_tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ids = hf_tok(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    expected = hf_greedy(hf, ids, 8, eos=False)
    node = InProcessNode(NodeConfig.of(checkpoint=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                                      max_loras=0), http=True)
    try:
        with NodeClient(node.address) as client:
            answer = client.generate(client.request("Tell me about the sea.", max_tokens=8, ignore_eos=True))
        assert answer.prompt_tokens == len(ids)
        assert list(answer.token_ids) == expected
        with openai.OpenAI(base_url=node.http_url, api_key="unused", max_retries=0, timeout=60) as api:
            reply = api.chat.completions.create(model=node.node.model_name, messages=messages, max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].message.content == hf_tok.decode(expected, skip_special_tokens=True)
    finally:
        node.stop()
