"""Golden renderings for ringtmp's chat templates: what `transformers`' `apply_chat_template`
makes of a few templates (the shared SmolLM2 file's own, and templates in the styles of Llama 3,
Mistral and Llama 2 that use what published ones use: `bos_token`, `trim`, `.strip()`,
`raise_exception`, `loop.index0`, `tojson` with and without `indent`, extra variables, blocks on
lines of their own) on a few conversations, with and without the generation prompt. Writes
`templates/chat-templates.json`.

    pip install transformers gguf torch
    python3 benches/reference/chat_template_golden.py ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import json
import pathlib
import sys

from transformers import AutoTokenizer

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

BLOCKS = (
    "{% for message in messages %}\n"
    "  {% if message.role == 'system' %}\n"
    "<<SYS>>{{ message.content }}<</SYS>>\n"
    "  {% else %}\n"
    "{{ message.role | upper }}: {{ message.content }}\n"
    "  {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}\n"
)

JSON = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m | tojson }}\n{{ m | tojson(indent=2) }}\n"
    "{% if m.content.startswith('What') %}(a question){% endif %}{% endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "  You answer in one word.  "},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "  And 3 + 3 — «six»? \"quoted\" <tag> & \\ back  "},
    ],
]


def main():
    path = pathlib.Path(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    extra = {"date_string": "26 Jul 2024", "tools": [{"name": "add", "parameters": {"a": [1.5, None, True], "b": 1}}]}
    templates = {"smollm2": tok.chat_template, "llama3": LLAMA3, "mistral": MISTRAL, "blocks": BLOCKS, "json": JSON}
    cases = []
    for name, template in templates.items():
        for messages in CONVERSATIONS + [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]]:
            for prompt in (False, True):
                case = {"template": name, "messages": messages, "add_generation_prompt": prompt}
                try:
                    case["rendered"] = tok.apply_chat_template(
                        messages, chat_template=template, tokenize=False, add_generation_prompt=prompt, **extra)
                except Exception as e:  # the template refused the conversation
                    case["error"] = str(e)
                cases.append(case)
    out = pathlib.Path(__file__).parent / "templates" / "chat-templates.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "extra": extra,
        "templates": templates, "cases": cases}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
