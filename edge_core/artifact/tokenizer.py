"""Does this checkpoint bring a chat template, and where? (Read from its files; the tokenizer is never loaded.)

transformers keeps a model's chat template in ``chat_template.jinja`` (its
current layout), ``chat_template.json``, or the ``chat_template`` key of
``tokenizer_config.json`` (older checkpoints); vLLM's renderer finds it the
same way. A base model has none: its prompt is sent as it is.
"""

from __future__ import annotations

import json
import os

#: Files that hold a chat template on their own.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
#: tokenizer_config.json is small; one larger than this is not read for a template.
MAX_TOKENIZER_CONFIG_BYTES = 8 << 20


def chat_template_source(model_dir: str | os.PathLike[str]) -> str | None:
    """The file that carries ``model_dir``'s chat template, or None when it has none (or is not a directory)."""
    root = os.fspath(model_dir)
    if not os.path.isdir(root):
        return None
    for name in TEMPLATE_FILES:
        if os.path.isfile(os.path.join(root, name)):
            return name
    config = os.path.join(root, "tokenizer_config.json")
    try:
        if os.path.getsize(config) > MAX_TOKENIZER_CONFIG_BYTES:
            return None
        with open(config, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    template = data.get("chat_template") if isinstance(data, dict) else None
    return "tokenizer_config.json" if template else None
