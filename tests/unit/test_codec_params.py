"""One codec-parameters model: the job spec, the announcement and the manifest share it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from geofed.codec_params import CodecParams, InvalidConfig


class Record(BaseModel):
    """A strict record holding codec parameters, as announcements and manifests do."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    codec: CodecParams


def test_the_wire_form_is_the_four_fields_in_order() -> None:
    params = CodecParams(scheme="int4", block_size=64, zstd_level=3)
    assert Record(codec=params).model_dump_json() == (
        '{"codec":{"scheme":"int4","block_size":64,"zstd_level":3,"stochastic_rounding":false}}'
    )
    assert Record.model_validate_json(Record(codec=params).model_dump_json()).codec == params
    assert Record(codec=params).model_dump() == {"codec": params.as_dict()}


def test_missing_fields_take_their_defaults() -> None:
    assert Record.model_validate_json('{"codec": {}}').codec == CodecParams()
    assert Record.model_validate({"codec": {"scheme": "fp32"}}).codec == CodecParams("fp32")


@pytest.mark.parametrize(
    ("codec", "where", "message"),
    [
        ({"scheme": "int2"}, "codec.scheme", "'fp32', 'int8' or 'int4'"),
        ({"block_size": 33}, "codec.block_size", "block_size 33 must be even"),
        ({"block_size": 1 << 17}, "codec.block_size", "less than or equal to 65536"),
        ({"block_size": "128"}, "codec.block_size", "valid integer"),
        ({"block_size": True}, "codec.block_size", "valid integer"),
        ({"zstd_level": 0}, "codec.zstd_level", "greater than or equal to 1"),
        ({"stochastic_rounding": 1}, "codec.stochastic_rounding", "valid boolean"),
        ({"level": 3}, "codec.level", "Extra inputs are not permitted"),
        ({"scheme": "fp32", "stochastic_rounding": True}, "codec", "not fp32"),
    ],
)
def test_a_record_locates_each_refusal(codec: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Record.model_validate_json(json.dumps({"codec": codec}))
    error = caught.value.errors()[0]
    assert ".".join(str(part) for part in error["loc"]) == where
    assert message in error["msg"]


def test_a_record_checks_an_instance_like_its_wire_form() -> None:
    fast = CodecParams(zstd_level=-5)  # a fast zstd level: the codec's own callers only
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        Record(codec=fast)


def test_direct_construction_refuses_what_records_refuse() -> None:
    with pytest.raises(InvalidConfig, match="block_size 33 must be even"):
        CodecParams(block_size=33)
    with pytest.raises(InvalidConfig, match="applies to int8 and int4, not fp32"):
        CodecParams(scheme="fp32", stochastic_rounding=True)


def test_rounding_to_nearest_keeps_everything_else() -> None:
    params = CodecParams(scheme="int4", block_size=32, zstd_level=5, stochastic_rounding=True)
    assert params.rounding_to_nearest() == CodecParams("int4", 32, 5, False)
