"""``Compression`` owns the compressed cache's settings: flags, schema, checks and load-time overrides follow
from its fields."""

from __future__ import annotations

import re

import pytest

from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.manifest_schema import schema_errors


def test_flags_are_derived_from_the_fields():
    assert Compression.parameters() == {
        "kv_capacity": "capacity",
        "kv_sink": "sink",
        "kv_window": "window",
        "kv_policy": "policy",
        "kv_dtype": "dtype",
        "kv_group": "group",
        "prefill_compress": "prefill_compress",
        "kv_rotation": "rotation",
        "kv_rotation_seed": "rotation_seed",
        "kv_mixed": "mixed",
        "kv_recall": "recall",
        "kv_recall_block": "recall_block",
        "kv_recall_every": "recall_every",
    }
    assert Compression.from_flags({"capacity": None, "dtype": None}) is None  # nothing asked for
    assert Compression.from_flags({"dtype": "int8"}) == Compression(dtype="int8")
    with pytest.raises(BuildSettingsError, match="--kv-window set"):
        Compression.from_flags({"window": 8})  # a setting alone does not silently do nothing


def test_schema_is_derived_from_the_fields():
    built = Compression(dtype="int8").resolved(4096)
    assert schema_errors(built.to_json(), Compression.schema()) == []
    assert schema_errors({**built.to_json(), "group": "32"}, Compression.schema())
    recall = {"recall", "recall_block", "recall_every"}
    optional = {"rotation", "rotation_seed", "mixed", "decode_kernel"} | recall
    assert {name.rstrip("?") for name in Compression.schema()} == set(built.to_json()) | optional
    rotated = Compression(dtype="int4", rotation="hadamard", mixed="int8").resolved(4096)
    assert schema_errors(rotated.to_json(), Compression.schema()) == []
    kernel = {"decode_kernel"}  # only fp32 slots of one pool (decode_kernel gqa)
    assert set(rotated.to_json()) | recall | kernel == {name.rstrip("?") for name in Compression.schema()}
    recalling = Compression(dtype="int8", rotation="hadamard", recall=2).resolved(4096)  # recall takes one pool
    assert schema_errors(recalling.to_json(), Compression.schema()) == []
    assert set(recalling.to_json()) | {"mixed"} | kernel == {name.rstrip("?") for name in Compression.schema()}
    native = Compression(dtype="fp32", decode_kernel="gqa").resolved(4096)
    assert schema_errors(native.to_json(), Compression.schema()) == []
    assert native.to_json()["decode_kernel"] == "gqa"
    assert schema_errors({**native.to_json(), "decode_kernel": 1}, Compression.schema())


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"policy": "lru"}, "unknown --kv-policy"),
        ({"sink": -1}, "--kv-sink must be a number ≥ 0"),
        ({"capacity": 60}, "must exceed --kv-sink + --kv-window"),
        ({"dtype": "int8", "group": 12}, "does not divide the head dim"),
        ({"dtype": "int4", "group": 1}, "even for int4"),
        ({"capacity": 9000}, "exceeds the context 4096"),
        ({"protect_fraction": 1.5}, "protect fraction"),
    ],
)
def test_every_check_is_one_line(changes, needle):
    with pytest.raises(BuildSettingsError, match=re.escape(needle)):
        Compression(**{"capacity": 512, **changes}).check(head_dim=64, context=4096)


def test_a_built_bundle_may_change_only_what_the_graph_takes_as_data():
    built = Compression(capacity=512, dtype="int8")
    assert built.override(64, capacity=256, prefill_compress="chunk") == Compression(
        capacity=256, dtype="int8", prefill_compress="chunk"
    )
    with pytest.raises(BuildSettingsError, match="dtype is fixed when the bundle is built"):
        built.override(64, dtype="int4")
    with pytest.raises(BuildSettingsError, match="must exceed"):
        built.override(64, capacity=10)
