"""The fast header checks of edge_core.artifact.header reach the careful checks' verdicts, never a kinder one.

``fast_columns`` decodes a header's raw bytes into typed entries, asks the
rest of each question of a whole column and only ever accepts;
``careful_header`` parses the JSON, walks the tensors and names the first
problem. For any header the fast pass accepts, the careful pass must accept
it too, with the same columns; everything else must fall through to the
careful pass. The headers here are bytes, as a shard holds them: laid out as
writers lay them out (``__metadata__`` first or not at all, compact or
indented), and broken at the byte level as well as field by field.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from factories import llama_like_tensors, tiny_config, write_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_core.artifact import SAFETENSORS_DTYPES, TensorInfo, read_manifest
from edge_core.artifact.checkpoint import check_tensors
from edge_core.artifact.header import (
    FAST_DIM_LIMIT,
    FAST_MAX_DIMS,
    ShardTensors,
    careful_header,
    fast_columns,
    read_header,
)
from edge_core.errors import ArtifactError

BITS = {code: bits for code, (bits, _) in SAFETENSORS_DTYPES.items()}


def header_bytes(entries: dict, metadata: dict | None = None, style: str = "compact") -> bytes:
    """``entries`` as a shard's header: ``metadata`` first when given (where writers put it), in one layout."""
    document = entries if metadata is None else {"__metadata__": metadata, **entries}
    if style == "compact":  # the safetensors writer's
        return json.dumps(document, separators=(",", ":")).encode()
    return json.dumps(document, indent=2 if style == "indented" else None).encode()


def careful(raw: bytes, data_bytes: int):
    """The careful verdict: the columns, or the refusal's message."""
    try:
        return careful_header("/m", "model.safetensors", raw, data_bytes)
    except ArtifactError as exc:
        return exc.message


def assert_same_raw_verdict(raw: bytes, data_bytes: int) -> bool:
    """True when the fast pass accepted (and agreed); False when it left the header to the careful pass."""
    fast = fast_columns("model.safetensors", raw, data_bytes)
    if fast is None:
        return False
    assert careful(raw, data_bytes) == fast
    return True


def assert_same_verdict(entries: dict, data_bytes: int, metadata: dict | None = None, style: str = "compact") -> bool:
    return assert_same_raw_verdict(header_bytes(entries, metadata, style), data_bytes)


def tiled(specs: list[tuple[str, list[int]]]) -> tuple[dict, int]:
    """A header placing ``(dtype, shape)`` tensors end to end, the way writers do; its data bytes."""
    entries, offset = {}, 0
    for i, (dtype, shape) in enumerate(specs):
        elements = 1
        for dim in shape:
            elements *= dim
        nbytes = elements * BITS[dtype] // 8
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return entries, offset


# Whole-byte tensors of the common dtypes (any shape), and sub-byte ones whose element count keeps them whole.
whole = st.tuples(st.sampled_from(["F32", "BF16", "I8", "U8", "F64", "F8_E4M3"]),
                  st.lists(st.integers(0, 5), max_size=3))
packed = st.tuples(st.just("F4"), st.lists(st.integers(1, 4), min_size=1, max_size=2).map(lambda s: [2, *s]))
valid_specs = st.lists(whole | packed, min_size=1, max_size=6)

#: A value that is wrong somewhere a field can be.
odd_values = st.sampled_from([True, False, None, 2.0, -1, "4", [], {}, [1, 2, 3], 2**63, 2**64 + 1, "BF16"])
fields = st.sampled_from(["dtype", "shape", "data_offsets", "shape[0]", "data_offsets[0]", "data_offsets[1]"])


@st.composite
def mutated_headers(draw):
    entries, data_bytes = tiled(draw(valid_specs))
    names = list(entries)
    for _ in range(draw(st.integers(0, 2))):
        victim = entries[draw(st.sampled_from(names))]
        # a copy: sampled_from hands out the same list each time, and one put inside itself cannot be dumped
        field, value = draw(fields), copy.deepcopy(draw(odd_values))
        if "[" in field:
            key, index = field[:-3], int(field[-2])
            if isinstance(victim.get(key), list) and len(victim[key]) > index:
                victim[key][index] = value
        else:
            victim[field] = value
    if draw(st.booleans()):  # some writers (and attackers) list tensors out of offset order
        order = draw(st.permutations(names))
        entries = {name: entries[name] for name in order}
    return entries, max(0, data_bytes + draw(st.sampled_from([0, 0, 0, 1, -1])))


#: What a header's ``__metadata__`` may be: absent, a writer's, or something the loader refuses or that trips a count.
metadata_values = st.sampled_from([None, {"format": "pt"}, {}, {"format": "pt", "note": 'a "quoted" \\ value'},
                                   {"format": 1}, {"nested": {"a": "b"}}, {"dtype": "BF16"}, {"list": ["x"]}])
styles = st.sampled_from(["compact", "spaced", "indented"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=mutated_headers(), metadata=metadata_values, style=styles)
def test_fast_checks_never_accept_what_the_careful_ones_refuse(header, metadata, style):
    entries, data_bytes = header
    assert_same_verdict(entries, data_bytes, metadata, style)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=valid_specs, metadata=st.sampled_from([None, {"format": "pt"}, {}]), style=styles)
def test_a_writer_s_header_with_or_without_metadata_is_taken_by_the_fast_checks(specs, metadata, style):
    entries, data_bytes = tiled(specs)
    assert assert_same_verdict(entries, data_bytes, metadata, style)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=valid_specs, metadata=st.sampled_from([None, {"format": "pt"}]), edits=st.lists(
    st.tuples(st.integers(0, 10**6), st.sampled_from(["delete", "insert", "replace"]),
              st.sampled_from(list(b'{}[]",:\\ 0123456789-.aeEtu') + [0x0B, 0xFF])), min_size=1, max_size=3))
def test_no_byte_level_damage_is_accepted_by_the_fast_checks_alone(specs, metadata, edits):
    entries, data_bytes = tiled(specs)
    raw = bytearray(header_bytes(entries, metadata))
    for position, edit, byte in edits:
        at = position % (len(raw) + 1)
        if edit == "insert":
            raw[at:at] = bytes([byte])
        elif at < len(raw):
            raw[at:at + 1] = b"" if edit == "delete" else bytes([byte])
    assert_same_raw_verdict(bytes(raw), data_bytes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=valid_specs, shuffle=st.randoms(use_true_random=False))
def test_a_valid_header_in_any_order_is_taken_by_the_fast_checks(specs, shuffle):
    entries, data_bytes = tiled(specs)
    names = list(entries)
    shuffle.shuffle(names)
    assert assert_same_verdict({name: entries[name] for name in names}, data_bytes)


@pytest.mark.parametrize("entries, data_bytes", [
    # Offsets tile and shape products match only if floats, bools or negatives were read as numbers.
    ({"w": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}}, 16),
    ({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, 16),
    ({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, 16),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]}}, 16),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [False, 16]}}, 16),
    # Two tensors sharing bytes, a gap, a trailing byte.
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, 4),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}}, 5),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, 3),
    # A sub-byte tensor ending mid-byte: 3 F4 elements are 12 bits.
    ({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2),
    # Past the fast pass's bounds: a long shape, a huge dimension (valid: an empty tensor).
    ({"w": {"dtype": "U8", "shape": [1] * (FAST_MAX_DIMS + 1), "data_offsets": [0, 1]}}, 1),
    ({"w": {"dtype": "U8", "shape": [0, FAST_DIM_LIMIT], "data_offsets": [0, 0]}}, 0),
    ({"w": {"dtype": "U8", "shape": [10**30, 10**30], "data_offsets": [0, 16]}}, 16),
    ({}, 0),
])
def test_each_case_the_fast_checks_leave_to_the_careful_ones(entries, data_bytes):
    assert not assert_same_verdict(entries, data_bytes)


W = b'"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'


@pytest.mark.parametrize("raw, refusal", [
    # Metadata anywhere but first is the careful pass's to read (valid here, so it accepts).
    (b'{' + W + b',"__metadata__":{"format":"pt"}}', None),
    # The metadata twice (the loader keeps the last), or a tensor-shaped second one.
    (b'{"__metadata__":{"format":"pt"},"__metadata__":{"format":"np"},' + W + b'}', None),
    (b'{"__metadata__":{"format":"pt"},' + W + b',"__metadata__":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}}',
     "appears twice"),
    # No comma after the metadata; a vertical tab where JSON allows only space, tab and line ends.
    (b'{"__metadata__":{"format":"pt"}' + W + b'}', "not JSON"),
    (b'{\x0b"__metadata__":{"format":"pt"},' + W + b'}', "not JSON"),
    (b'{"__metadata__":{"format":"pt"}\x0b,' + W + b'}', "not JSON"),
    # A control character inside a metadata string; a value that is not a string; metadata alone.
    (b'{"__metadata__":{"format":"p\nt"},' + W + b'}', "not JSON"),
    (b'{"__metadata__":{"format":2},' + W + b'}', "map of strings"),
    (b'{"__metadata__":{"format":"pt"}}', "trailing bytes"),
    # A tensor named twice, or a field given twice, where the last of each alone would tile the data.
    (b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},' + W + b'}', "appears twice"),
    (b'{"w":{"dtype":"U8","shape":[1],"shape":[2],"data_offsets":[0,2]}}', "appears twice"),
    (b'{"w":{"dtype":"BF16","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', "appears twice"),
    # The same tensor name twice, once spelt with an escape.
    (b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\\u0077":{"dtype":"U8","shape":[1],'
     b'"data_offsets":[1,2]}}', "appears twice"),
])
def test_each_header_layout_the_fast_checks_leave_to_the_careful_ones(raw, refusal):
    assert fast_columns("model.safetensors", raw, 2) is None
    verdict = careful(raw, 2)
    if refusal is None:
        assert isinstance(verdict, ShardTensors) and verdict.names == ["w"]
    else:
        assert isinstance(verdict, str) and refusal in verdict, verdict


def test_a_key_twice_in_the_metadata_is_kept_as_the_loader_keeps_it():
    # The loader reads the metadata into a map, the last value winning; neither pass refuses it.
    assert assert_same_raw_verdict(b'{"__metadata__":{"format":"pt","format":"np"},' + W + b'}', 2)


def test_sub_byte_empty_and_scalar_tensors_are_taken_by_the_fast_checks():
    entries = {"packed": {"dtype": "F4", "shape": [4, 3], "data_offsets": [0, 6]},
               "empty": {"dtype": "BF16", "shape": [0, 128], "data_offsets": [6, 6]},
               "scalar": {"dtype": "F32", "shape": [], "data_offsets": [6, 10]}}
    assert assert_same_verdict(entries, 10)


# ---------------------------------------------------------------- the reference set's largest checkpoints


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    import reference_set as ref

    out = {}
    for entry in ref.ENTRIES:
        if entry.repo in ("deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-Next-80B-A3B-Instruct"):
            out[entry.repo] = ref.write_published(entry, tmp_path_factory.mktemp(entry.name))
    return out


@pytest.mark.parametrize("repo", ["deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-Next-80B-A3B-Instruct"])
def test_every_shard_of_the_largest_checkpoints_takes_the_fast_path(published, repo):
    root = published[repo]
    for name in sorted(n for n in os.listdir(root) if n.endswith(".safetensors")):
        shard = read_header(str(root), name)  # the data sections are sparse holes of ~40-170 GB
        assert assert_same_raw_verdict(shard.raw, shard.data_bytes), name


# ---------------------------------------------------------------- the tensor table


def test_the_tensor_table_lists_every_tensor_as_the_headers_give_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = tiny_config()
    root = write_checkpoint(tmp_path / "m", config, llama_like_tensors(config), shards=3)
    expected = []
    for name in sorted(n for n in os.listdir(root) if n.endswith(".safetensors")):
        header = json.loads(read_header(str(root), name).raw)
        expected += [TensorInfo(key, info["dtype"], tuple(info["shape"]), info["data_offsets"][1]
                                - info["data_offsets"][0], name) for key, info in header.items()]
    m = read_manifest(root)
    assert len(m.tensors) == m.tensor_count == len(expected)
    assert list(m.tensors) == expected
    assert sum(t.nbytes for t in m.tensors) == m.weight_bytes
    assert "tensors" not in m.to_dict()



# ---------------------------------------------------------------- across shards and the index


def reference_check(shards: list[ShardTensors], weight_map: dict | None) -> int | str:
    """The checks as a loop over every tensor (the reader before the column checks): the count, or what failed."""
    owner: dict[str, str] = {}
    for shard in shards:
        for key in shard.names:
            if key in owner:
                return "both"
            owner[key] = shard.name
    for key, name in (weight_map or {}).items():
        if owner.get(key) != name:
            return "does not hold"
    return len(owner) if owner else "no tensors"


def shard_of(name: str, names: list[str]) -> ShardTensors:
    return ShardTensors(name=name, names=names, dtypes=["U8"] * len(names), nbytes=[1] * len(names),
                        ndims=[1] * len(names), dims=[1] * len(names), dtype_bytes={"U8": len(names)} if names else {})


@settings(max_examples=400, deadline=None)
@given(layout=st.lists(st.lists(st.sampled_from("abcdef"), max_size=4, unique=True), min_size=1, max_size=3),
       index=st.none() | st.dictionaries(st.sampled_from("abcdefg"), st.integers(0, 3), max_size=6))
def test_the_cross_shard_checks_agree_with_a_loop_over_every_tensor(layout, index):
    shards = [shard_of(f"s{i}.safetensors", names) for i, names in enumerate(layout)]
    weight_map = None if index is None else {k: f"s{v}.safetensors" for k, v in index.items()}
    expected = reference_check(shards, weight_map)
    try:
        _, count = check_tensors("/m", shards, weight_map)
        got: int | str = count
    except ArtifactError as exc:
        got = next(needle for needle in ("both", "does not hold", "no tensors") if needle in exc.message)
    assert got == expected


def test_an_index_naming_a_tensor_no_shard_holds_is_refused_even_when_the_counts_agree():
    shards = [shard_of("s0.safetensors", ["x", "y"])]
    with pytest.raises(ArtifactError, match="does not hold"):
        check_tensors("/m", shards, {"x": "s0.safetensors", "z": "s0.safetensors"})


# ------------------------------------------------------------------ the JSON decoder

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_fast_decoder_reads_every_document_as_json_does(value, ascii_only):
    from edge_core.artifact._files import loads

    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")
    assert loads(raw) == json.loads(raw)
    assert type(loads(raw)) is type(json.loads(raw))


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'\xef\xbb\xbf{"a": 1}', b'{"a": 123456789012345678901234567890}',
                                 b'{"a": "\\ud800"}', b'[1e400]'])
def test_what_the_fast_decoder_declines_json_reads_the_same_way(raw):
    from edge_core.artifact._files import loads

    # Compared as JSON text: NaN is not equal to itself.
    assert json.dumps(loads(raw)) == json.dumps(json.loads(raw.decode("utf-8-sig")))


@pytest.mark.parametrize("raw", [b'{"a": 1} trailing', b'{"a": ', b'\xff\xfe', b'{"a": [}'])
def test_what_neither_decoder_takes_is_json_s_error(raw):
    from edge_core.artifact import _files

    assert _files.loads(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    with pytest.raises((ValueError, UnicodeDecodeError)) as refused:
        _files.loads(raw)
    with pytest.raises(type(refused.value)):
        json.loads(raw.decode("utf-8-sig"))
