"""Model families are known in one place: ``edge_core/artifact/families.py``.

Its pattern table decides every layer's type; the KV planner reads it
(``tests/test_kv.py`` checks the sizes that follow). Here: no other module
compares a ``model_type`` with a family name, and the table's order is the
precedence its docstring states.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edge_core.artifact.families import PATTERN_RULES, layer_pattern, traits_of
from edge_core.errors import ArtifactError

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ROOT / "edge_core" / "artifact" / "families.py"


def _mentions_model_type(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and n.id == "model_type")
               or (isinstance(n, ast.Attribute) and n.attr == "model_type")
               or (isinstance(n, ast.Constant) and n.value == "model_type") for n in ast.walk(node))


def _family_names(node: ast.AST) -> bool:
    """A string literal, or a literal collection of strings: a family named in place."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return (isinstance(node, (ast.Tuple, ast.Set, ast.List)) and bool(node.elts)
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts))


def family_checks(path: Path) -> list[str]:
    """``file:line`` of every comparison of a model_type with a family name written in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        compared = (isinstance(node, ast.Compare) and _mentions_model_type(node.left)
                    and any(_family_names(c) for c in node.comparators))
        prefixed = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "startswith" and _mentions_model_type(node.func.value))
        if compared or prefixed:
            found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}")
    return found


def test_only_the_families_module_names_model_families():
    sources = [p for base in ("edge_core", "plugins") for p in (ROOT / base).rglob("*.py")
               if "tests" not in p.parts and "demo" not in p.parts and p != FAMILIES]
    assert [hit for path in sources for hit in family_checks(path)] == []
    assert family_checks(FAMILIES), "the scan finds the family rules where they are"


def test_a_rule_that_derives_its_pattern_wins_over_a_listed_one():
    # Jamba's model derives attention layers from attn_layer_period; a stale list does not count.
    config = {"model_type": "jamba", "num_hidden_layers": 8, "attn_layer_period": 4, "attn_layer_offset": 1,
              "layer_types": ["attention"] * 8}
    pattern = layer_pattern(config)
    assert pattern.names == ["attention" if i % 4 == 1 else "mamba" for i in range(8)]
    assert (pattern.source, pattern.evidence) == ("attn_layer_period/offset", "E")
    assert [r.name for r in PATTERN_RULES].index("jamba") < [r.name for r in PATTERN_RULES].index("listed")


def test_a_listed_pattern_is_detected_and_a_family_default_estimated():
    listed = layer_pattern({"model_type": "qwen3_next", "num_hidden_layers": 4,
                            "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    default = layer_pattern({"model_type": "qwen3_next", "num_hidden_layers": 4})
    assert listed.names == default.names
    assert (listed.evidence, default.evidence) == ("D", "E")


def test_a_garbled_pattern_names_its_field():
    with pytest.raises(ArtifactError, match="attn_type_list") as info:
        layer_pattern({"model_type": "minimax", "num_hidden_layers": 2, "attn_type_list": [1, 2]})
    assert info.value.code == "config_unreadable"


def test_traits_default_to_none_and_name_the_families_that_differ():
    assert traits_of({"model_type": "llama"}) == traits_of({})
    assert traits_of({"model_type": "cohere2"}).extra_window_tokens == 1
    assert traits_of({"model_type": "qwen3_5_moe_text"}).ssm_dtype_field == "mamba_ssm_dtype"
