"""Library defaults (edge_core/artifact/library_defaults.py and the readers under it).

gemma-3-4b-it's text_config names six fields; its heads, KV heads, head_dim
and sliding pattern are Gemma3TextConfig's defaults (issue 10). edge reads
them from transformers' source with ast (``transformers_source.py`` finds the
class, ``config_class.py`` reads it, ``derivation.py`` replicates its layer
pattern), importing nothing; the expected values come from transformers'
class, imported here in the test process. A fake transformers tree covers the
source shapes edge follows and the ones it refuses to.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from factories import llama_like_tensors, tiny_config, write_checkpoint

from edge_core.artifact import read_manifest
from edge_core.errors import ArtifactError

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="the defaults come from transformers' source")

GEMMA3_TEXT_TENSORS = {"language_model.model.embed_tokens.weight": ("BF16", [262208, 2560]),
                       "vision_tower.vision_model.embeddings.patch_embedding.weight": ("BF16", [1152, 3, 14, 14])}


def _gemma3_checkpoint(root: Path) -> Path:
    from published_configs import PUBLISHED

    return write_checkpoint(root, PUBLISHED["google/gemma-3-4b-it"], GEMMA3_TEXT_TENSORS)


#: A fresh interpreter runs `edge plan --json` once and reports the children it
#: started (audit events), the runtimes it imported, and the plan call's wall time.
_PLAN_PROBE = """
import contextlib, io, json, sys, time
CHILD_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"}
children = []
sys.addaudithook(lambda event, args: children.append(event) if event in CHILD_EVENTS else None)
from edge_core.cli import main
out = io.StringIO()
started = time.perf_counter()
with contextlib.redirect_stdout(out):
    main(["plan", "--json", "--model", sys.argv[1]])
elapsed_s = time.perf_counter() - started
manifest = json.loads(out.getvalue())["manifest"]
print(json.dumps({"children": children, "elapsed_s": elapsed_s,
                  "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch", "vllm")),
                  "defaults": manifest["config_defaults"], "source": manifest["config_defaults_source"]}))
"""


def plan_in_a_fresh_interpreter(model: Path) -> dict:
    """Benchmark-style: plan ``model`` in a new interpreter; what it started and imported, and how long it took."""
    proc = subprocess.run([sys.executable, "-c", _PLAN_PROBE, str(model)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"edge plan {model.name}: {report['elapsed_s'] * 1000:.0f} ms in a fresh interpreter "
          f"({len(report['defaults'])} library defaults)")
    return report


def test_gemma3_text_config_fills_transformers_defaults(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the defaults come from transformers")
    from published_configs import PUBLISHED

    published = PUBLISHED["google/gemma-3-4b-it"]["text_config"]
    reference = transformers.Gemma3TextConfig(**{k: v for k, v in published.items() if k != "model_type"})
    m = read_manifest(_gemma3_checkpoint(tmp_path))
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "layer_types"):
        assert name not in published
        assert m.config[name] == getattr(reference, name), name
        assert m.config_defaults[name] == getattr(reference, name), name
    assert (reference.num_attention_heads, reference.num_key_value_heads, reference.head_dim) == (8, 4, 256)
    # The six published fields stand as written; none of them is listed as a default.
    assert not set(published) & set(m.config_defaults)
    assert all(m.config[k] == v for k, v in published.items())
    assert m.config_defaults_source == f"transformers {transformers.__version__} Gemma3TextConfig defaults, read from its source"
    assert m.to_dict()["config_defaults"] == m.config_defaults
    from edge_core.plan.kv import kv_layout

    layout = kv_layout(m.config)
    assert (layout.num_kv_heads, layout.head_dim) == (4, 256)
    assert [l.index for l in layout.layers if l.kind == "full"] == [5, 11, 17, 23, 29]
    assert layout.windows_tokens() == (1024,)


#: Families whose configuration classes declare their defaults in the shapes edge
#: reads: annotated literals, and a layer pattern derived from the layer count.
FAMILIES = ("gemma2", "gemma3_text", "cohere2", "gpt_oss", "exaone4", "qwen2", "llama", "mistral", "granite")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_source_defaults_are_what_transformers_class_gives(model_type):
    pytest.importorskip("transformers", reason="the reference is transformers' own class")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from edge_core.artifact.library_defaults import read_library_defaults
    from edge_core.artifact.transformers_source import transformers_dir

    cls = CONFIG_MAPPING[model_type]
    text = {"model_type": model_type, "hidden_size": cls().hidden_size, "num_hidden_layers": 9}
    reference = cls(**{k: v for k, v in text.items() if k != "model_type"})
    found = read_library_defaults(transformers_dir(), text, text, None)
    assert found.values["num_attention_heads"] == reference.num_attention_heads
    for name, value in found.values.items():
        expected = getattr(reference, name)
        assert value == (list(expected) if isinstance(expected, tuple) else expected), name


@needs_transformers
def test_library_defaults_are_read_from_the_configuration_source_only():
    from published_configs import PUBLISHED

    from edge_core.artifact.config import resolve_text_config
    from edge_core.artifact.library_defaults import fill_library_defaults

    raw = PUBLISHED["google/gemma-3-4b-it"]
    text, key = resolve_text_config(raw)
    _, defaults = fill_library_defaults(text, raw, key)
    assert defaults.files == ("models/gemma3/configuration_gemma3.py",)


@needs_transformers
def test_planning_a_config_that_needs_defaults_starts_no_child_and_imports_no_runtime(tmp_path):
    gemma = _gemma3_checkpoint(tmp_path / "gemma")
    full = write_checkpoint(tmp_path / "llama", tiny_config(), llama_like_tensors(tiny_config()))
    plain = plan_in_a_fresh_interpreter(full)
    assert (plain["defaults"], plain["source"], plain["children"], plain["imported"]) == ({}, None, [], [])
    filled = plan_in_a_fresh_interpreter(gemma)
    # No child interpreter, and neither transformers nor torch in edge's process.
    assert filled["children"] == [] and filled["imported"] == []
    assert filled["defaults"]["num_attention_heads"] == 8 and filled["source"].endswith("read from its source")
    # A sanity bound only: the goal (a plan in well under half a second) is a
    # benchmark's, printed above; the child interpreter this replaced took 3 s.
    assert filled["elapsed_s"] < 10


def test_without_transformers_a_default_relying_config_is_refused_with_the_remedy(tmp_path, monkeypatch):
    # find_spec answers None for a None entry in sys.modules: transformers looks absent.
    monkeypatch.setitem(sys.modules, "transformers", None)
    from edge_core.plan.kv import estimate_kv

    m = read_manifest(_gemma3_checkpoint(tmp_path))
    assert m.config_defaults == {} and "transformers is not installed" in m.config_defaults_source
    with pytest.raises(ArtifactError) as err:
        estimate_kv(m.config, max_model_len=1024)
    assert err.value.code == "config_unreadable" and "num_attention_heads" in err.value.message
    assert "pip install transformers" in err.value.remedy and "edge then fills" in err.value.remedy


def test_a_missing_layer_count_is_never_a_default(tmp_path):
    # A library's layer count (LlamaConfig: 32) is not this checkpoint's; it stays a refusal.
    from edge_core.plan.kv import estimate_kv

    config = tiny_config()
    del config["num_hidden_layers"], config["num_attention_heads"]
    m = read_manifest(write_checkpoint(tmp_path, config, {"w": ("BF16", [4, 4])}))
    assert m.config_defaults == {} and m.config_defaults_source is None
    with pytest.raises(ArtifactError) as err:
        estimate_kv(m.config, max_model_len=16)
    assert "num_hidden_layers" in err.value.message and "transformers" not in err.value.remedy


# A fake transformers tree: the shapes edge reads, in files that would fail
# (or touch a sentinel file) if anything imported or ran them.

_FAKE_AUTO = """
raise ImportError("edge must read this file, not import it")
from .auto_mappings import CONFIG_MAPPING_NAMES, SPECIAL_MODEL_TYPE_TO_MODULE_NAME
CONFIG_MAPPING_NAMES.update({"old-toy": "OldToyConfig"})
CONFIG_MAPPING_NAMES = OrderedDict(**{"toy_extra": "ToyExtraConfig"}, **CONFIG_MAPPING_NAMES)
DEPRECATED_MODELS = ["old_toy"]
"""
_FAKE_MAPPINGS = """
from collections import OrderedDict
CONFIG_MAPPING_NAMES = OrderedDict([("toy", "ToyConfig"), ("toy_text", "ToyTextConfig")])
SPECIAL_MODEL_TYPE_TO_MODULE_NAME = OrderedDict([("toy_text", "toy")])
"""
# transformers 5.x: annotated class-level defaults, derivations in __post_init__.
_FAKE_TOY = """
import os
from ...configuration_utils import PreTrainedConfig

open(os.environ["EDGE_SENTINEL"], "w").close()


class ToyTextConfig(PreTrainedConfig):
    model_type = "toy_text"
    attribute_map = {"n_kv": "num_key_value_heads"}
    vocab_size: int = 32_000
    intermediate_size: int = 1024
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = os.getpid()
    sliding_window: int | None = 4096
    use_sliding_window: bool = False
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            every = kwargs.get("global_every", 3)
            self.layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        super().__post_init__(**kwargs)


class ToyConfig(PreTrainedConfig):
    model_type = "toy"
    sub_configs = {"text_config": ToyTextConfig}
"""
# transformers 4.x: __init__ keyword defaults passed through to self.<name>.
_FAKE_OLD_TOY = """
from ....configuration_utils import PretrainedConfig

raise SystemExit("edge must read this file, not import it")


class OldToyConfig(PretrainedConfig):
    model_type = "old-toy"

    def __init__(self, vocab_size=1000, num_attention_heads=4, num_key_value_heads=None, head_dim=32,
                 num_hidden_layers=4, sliding_window_pattern=2, layer_types=None, **kwargs):
        self.vocab_size = vocab_size
        self.num_attention_heads = num_attention_heads
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_hidden_layers = num_hidden_layers
        self.sliding_window_pattern = sliding_window_pattern
        self.layer_types = layer_types
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if bool((i + 1) % self.sliding_window_pattern)
                                else "full_attention" for i in range(self.num_hidden_layers)]
        super().__init__(**kwargs)
"""
#: Layer-pattern code edge must not evaluate, as ToyTextConfig's __post_init__ body.
_UNFOLLOWED = {
    "a call": "if self.layer_types is None:\n    self.layer_types = os.listdir('.')",
    "a later change": ("if self.layer_types is None:\n    self.layer_types = ['sliding_attention'] * "
                       "self.num_hidden_layers\nself.layer_types[-1] = 'full_attention'"),
    "a loop": ("if self.layer_types is None:\n    self.layer_types = []\n    for i in range(self.num_hidden_layers):\n"
               "        self.layer_types.append('full_attention')"),
    "an unbounded list": "if self.layer_types is None:\n    self.layer_types = ['full_attention'] * 1_000_000_000_000",
}


def fake_transformers(root: Path, version: str = "9.9.0", toy: str = _FAKE_TOY) -> str:
    files = {"__init__.py": f'__version__ = "{version}"\nraise ImportError("edge must not import transformers")\n',
             "models/auto/configuration_auto.py": _FAKE_AUTO, "models/auto/auto_mappings.py": _FAKE_MAPPINGS,
             "models/toy/configuration_toy.py": toy,
             "models/deprecated/old_toy/configuration_old_toy.py": _FAKE_OLD_TOY}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


TOY_TEXT = {"model_type": "toy_text", "hidden_size": 512, "num_hidden_layers": 6}
S, F = "sliding_attention", "full_attention"


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    path = tmp_path / "executed"
    monkeypatch.setenv("EDGE_SENTINEL", str(path))
    yield path
    assert not path.exists(), "a fake transformers module was executed"


def test_defaults_are_read_from_annotated_fields_and_post_init(tmp_path, sentinel):
    from edge_core.artifact.library_defaults import read_library_defaults

    found = read_library_defaults(fake_transformers(tmp_path), TOY_TEXT, TOY_TEXT, None)
    # max_position_embeddings is computed (not a literal); sliding_window is
    # reassigned in __post_init__: neither is filled.
    assert found.values == {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                            "intermediate_size": 1024, "vocab_size": 32_000, "layer_types": [S, S, F, S, S, F]}
    assert found.source == "transformers 9.9.0 ToyTextConfig defaults, read from its source"
    assert found.files == ("models/toy/configuration_toy.py",)
    assert not [m for m in sys.modules if "toy" in m]


def test_published_fields_feed_the_derivation_and_aliases(tmp_path, sentinel):
    from edge_core.artifact.library_defaults import read_library_defaults

    text = {**TOY_TEXT, "global_every": 2, "n_kv": 1}  # a kwargs-only field, and attribute_map's alias
    found = read_library_defaults(fake_transformers(tmp_path), text, text, None)
    assert found.values["layer_types"] == [S, F, S, F, S, F]
    # The config set it under the class's alias: getattr would answer 1, not the default 2.
    assert found.values["num_key_value_heads"] == 1


def test_a_wrapper_text_config_without_model_type_uses_the_wrappers_sub_config(tmp_path, sentinel):
    from edge_core.artifact.config import resolve_text_config
    from edge_core.artifact.library_defaults import read_library_defaults

    raw = {"model_type": "toy", "text_config": {k: v for k, v in TOY_TEXT.items() if k != "model_type"}}
    text, key = resolve_text_config(raw)
    found = read_library_defaults(fake_transformers(tmp_path), text, raw, key)
    assert found.values["num_attention_heads"] == 8 and "ToyTextConfig" in found.source


def test_init_keyword_defaults_are_read_the_transformers_4_way(tmp_path, sentinel):
    from edge_core.artifact.library_defaults import read_library_defaults

    text = {"model_type": "old-toy", "hidden_size": 256, "num_hidden_layers": 6}
    found = read_library_defaults(fake_transformers(tmp_path), text, text, None)
    # num_key_value_heads is rebound from the heads before it is stored: not a default.
    assert found.values == {"num_attention_heads": 4, "head_dim": 32, "vocab_size": 1000,
                            "layer_types": [S, F, S, F, S, F]}
    assert found.files == ("models/deprecated/old_toy/configuration_old_toy.py",)


@pytest.mark.parametrize("why", sorted(_UNFOLLOWED))
def test_a_layer_pattern_edge_cannot_follow_is_left_unfilled(tmp_path, sentinel, why):
    from edge_core.artifact.library_defaults import read_library_defaults

    body = textwrap.indent(_UNFOLLOWED[why], " " * 8)
    toy = _FAKE_TOY.replace(_FAKE_TOY[_FAKE_TOY.index("        self.sliding_window ="):
                                      _FAKE_TOY.index("        super().__post_init__")], body + "\n")
    found = read_library_defaults(fake_transformers(tmp_path, toy=toy), TOY_TEXT, TOY_TEXT, None)
    assert "layer_types" not in found.values and found.values["num_attention_heads"] == 8


def test_an_unknown_model_type_fills_nothing_and_says_why(tmp_path, sentinel):
    from edge_core.artifact.library_defaults import read_library_defaults

    text = {**TOY_TEXT, "model_type": "../../toy"}
    found = read_library_defaults(fake_transformers(tmp_path), text, text, None)
    assert found.values == {} and found.source == "not filled: transformers 9.9.0 has no configuration class " \
                                                   "for model_type '../../toy'"


def test_parsed_source_is_cached_per_version_and_model_type(tmp_path, sentinel):
    from edge_core.artifact.library_defaults import read_library_defaults

    package = fake_transformers(tmp_path)
    first = read_library_defaults(package, TOY_TEXT, TOY_TEXT, None)
    (tmp_path / "models/toy/configuration_toy.py").unlink()
    assert read_library_defaults(package, TOY_TEXT, TOY_TEXT, None) == first  # read once per process
    (tmp_path / "__init__.py").write_text('__version__ = "9.9.1"\n')
    again = read_library_defaults(package, TOY_TEXT, TOY_TEXT, None)
    assert again.values == {} and again.source.startswith("not filled: transformers' source under")
