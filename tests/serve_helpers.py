"""What the serve tests share: a package whose tokenizer has a chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A BOS first, a refusal of unknown roles, block tags on lines of their own (trim_blocks and
# lstrip_blocks decide what whitespace survives) and the generation prompt, as real templates
# have; short markers, as the test pair's context is 128 tokens
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
{{ message['role'][0] }}: {{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}
a:
{% endif %}"""


def with_chat_template(checkpoint: Path, out: Path) -> Path:
    """A copy of a Hugging Face checkpoint whose tokenizer_config.json has CHAT_TEMPLATE."""
    shutil.copytree(checkpoint, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return out


def with_template(package: Path, out: Path, source: str) -> Path:
    """A copy of an exported package whose chat_template.jinja is ``source``."""
    shutil.copytree(package, out)
    (out / "chat_template.jinja").write_text(source)
    return out


def with_normalizer(package: Path, out: Path, normalizer: dict) -> Path:
    """A copy of an exported package whose tokenizer has ``normalizer`` (its vocabulary, and
    so its fingerprint, unchanged)."""
    shutil.copytree(package, out)
    path = out / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["normalizer"] = normalizer
    path.write_text(json.dumps(raw))
    return out
