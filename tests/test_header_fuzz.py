"""Property: whatever is done to a shard header of a generated checkpoint, opening and converting it either
succeeds or raises one `QuantkitError` whose single line names a file of the checkpoint — never another
exception, never a published partial output."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.convert.pipeline import convert
from quantkit.core.errors import QuantkitError
from quantkit.quant.recipe import load_recipe

_VALUES = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64), st.floats(allow_nan=True), st.text(max_size=8), st.none(),
    st.booleans(), st.lists(st.integers(min_value=-4, max_value=2**40), max_size=4),
)
_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets"])

# One mutation: (kind, which tensor (index, wrapped), field, new value / byte position)
MUTATIONS = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), _FIELDS, _VALUES),
    st.tuples(st.just("drop_field"), st.integers(0, 10**6), _FIELDS, st.none()),
    st.tuples(st.just("drop_tensor"), st.integers(0, 10**6), st.none(), st.none()),
    st.tuples(st.just("rename"), st.integers(0, 10**6), st.none(), st.text(max_size=12)),
    st.tuples(st.just("shift"), st.integers(0, 10**6), st.none(), st.integers(-64, 64)),
    st.tuples(st.just("dtype"), st.integers(0, 10**6), st.none(),
              st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "I64", "F8_E4M3", "BOOL", "U16", "F8_E8M0"])),
    st.tuples(st.just("metadata"), st.none(), st.none(), _VALUES),
    st.tuples(st.just("length"), st.none(), st.none(), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.none(), st.integers(0, 255)),
)


def mutate(shard: Path, mutation: tuple) -> None:
    kind, which, field, value = mutation
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if kind == "length":
        data[:8] = struct.pack("<Q", value)
        shard.write_bytes(bytes(data))
        return
    if kind == "byte":
        data[8 + which % n] = value
        shard.write_bytes(bytes(data))
        return
    header = json.loads(data[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[which % len(names)] if which is not None else None
    if kind == "set":
        header[name][field] = value
    elif kind == "drop_field":
        del header[name][field]
    elif kind == "drop_tensor":
        del header[name]
    elif kind == "rename":
        header[value or "x"] = header.pop(name)
    elif kind == "shift":
        header[name]["data_offsets"] = [o + value for o in header[name]["data_offsets"]]
    elif kind == "dtype":
        header[name]["dtype"] = value
    elif kind == "metadata":
        header["__metadata__"] = value
    raw = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data[8 + n :]))


@pytest.fixture(scope="module")
def pristine(ckpt_factory) -> Path:
    return ckpt_factory("glm_moe_dsa", "fp8")


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=MUTATIONS, shard_index=st.integers(0, 2))
def test_any_header_mutation_is_a_clean_error_or_a_clean_run(pristine, tmp_path_factory, mutation, shard_index):
    work = tmp_path_factory.mktemp("fuzz")
    src = work / "src"
    shutil.copytree(pristine, src)
    shard = sorted(src.glob("model-*.safetensors"))[shard_index]
    mutate(shard, mutation)
    out = work / "out"
    try:
        convert(src, out, load_recipe(None, {"model_type": "glm_moe_dsa"}, {}))
    except QuantkitError as exc:
        message = str(exc)
        assert "\n" not in message and str(src) in message, message
        assert not out.exists()
        return
    assert (out / "quantkit.json").exists()  # accepted: then it converted completely
