"""Schema of a region policy file (YAML), validated once at load.

Each region of the federation has one policy file. Unknown keys are errors, and so are
duplicate keys; every error names the file, the line and the key path.

.. code-block:: yaml

    region: eu-west                # the region this file governs (a DNS-label name)
    jurisdiction: EU               # upper-case code: EU, US, IN, US-CA, ...
    description: Frankfurt site    # optional, free text
    datasets:                      # data that lives in this region
      - name: eu-support-chats     # unique across the federation
        classification: personal   # public | internal | confidential | personal
        processed_in: [region:eu-west]   # where it may be trained on (required)
        exports:                   # optional, stricter rules for artifacts derived from it
          logs:
            - {effect: deny, to: ["*"], note: logs may quote training text}
    storage:                       # storage locations this region owns
      - name: eu-ckpt              # unique across the federation
        jurisdiction: EU
    exports:                       # per artifact kind, an ordered list of rules
      model_delta:
        - effect: allow            # allow | deny
          to: [coordinator]        # destination patterns
          note: approved by the DPO   # optional; quoted in decisions
      global_checkpoint:
        - {effect: allow, to: ["jurisdiction:EU"]}
        - {effect: deny, to: ["*"]}

Artifact kinds: ``raw_data``, ``regional_checkpoint``, ``model_delta``, ``global_update``,
``global_checkpoint``, ``metrics``, ``logs``. Destination patterns: ``coordinator``,
``region:NAME``, ``storage:NAME``, ``jurisdiction:CODE`` and ``*`` (see
:mod:`policies.destinations`). Dataset ``processed_in`` takes ``region:``,
``jurisdiction:`` and ``*`` patterns only.

How rules decide (see :mod:`policies.transfer`):

- The first rule of a list whose ``to:`` matches the destination decides. When no rule
  matches, or a kind has no list, the answer is **deny** (default deny).
- Rules are addressed by stable ids: ``eu-west:exports.global_checkpoint[1]`` is the second
  rule (indices start at 0) of eu-west's list for ``global_checkpoint``;
  ``eu-west:datasets[0].exports.logs[0]`` is a dataset-level rule.
- An artifact derived from several regions' data may move only if the policy of every
  contributing region, and of the region it leaves from, allows it. A dataset's own
  ``exports`` list, when it has one for the kind, must allow it too (dataset rules can only
  restrict further).
- Moving an artifact into a region is never restricted by that region's own policy
  (rule id ``REGION:home``): nothing leaves it.
- Built in: ``raw_data`` of a ``confidential`` or ``personal`` dataset never goes to another
  region, the coordinator, or storage its region does not own, whatever the rules say
  (rule id ``REGION:datasets[i].classification``).

YAML is read with YAML 1.2 booleans: only ``true``/``false`` are booleans, so a
jurisdiction ``NO`` (Norway) stays a string.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator

from geofed.types import ArtifactKind, validate_name
from policies.destinations import DestinationPattern, validate_jurisdiction


class Classification(StrEnum):
    """How sensitive a dataset is; ``confidential`` and ``personal`` pin raw data home."""

    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    PERSONAL = "personal"

    @property
    def pins_raw_data(self) -> bool:
        return self in (Classification.CONFIDENTIAL, Classification.PERSONAL)


class Effect(StrEnum):
    ALLOW = "allow"
    DENY = "deny"


def _region_name(value: str) -> str:
    return validate_name("region", value)


def _dataset_name(value: str) -> str:
    return validate_name("dataset", value)


def _storage_name(value: str) -> str:
    return validate_name("storage location", value)


RegionName = Annotated[str, AfterValidator(_region_name)]
DatasetName = Annotated[str, AfterValidator(_dataset_name)]
StorageName = Annotated[str, AfterValidator(_storage_name)]
Jurisdiction = Annotated[str, AfterValidator(validate_jurisdiction)]
Destination = Annotated[DestinationPattern, PlainValidator(DestinationPattern.parse)]


class StrictModel(BaseModel):
    """Base of every policy model: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ExportRule(StrictModel):
    """Allow or deny one artifact kind to the destinations listed in ``to``."""

    effect: Effect = Field(description="allow or deny")
    to: tuple[Destination, ...] = Field(
        min_length=1, description="destination patterns this rule applies to"
    )
    note: str | None = Field(
        default=None, description="why the rule exists; quoted in every decision it makes"
    )


ExportRules = dict[ArtifactKind, tuple[ExportRule, ...]]


class Dataset(StrictModel):
    """A dataset living in the region, with where it may be processed."""

    name: DatasetName = Field(description="unique across the federation")
    classification: Classification
    processed_in: tuple[Destination, ...] = Field(
        min_length=1,
        description="region:, jurisdiction: or * patterns naming where it may be trained on",
    )
    description: str = ""
    exports: ExportRules = Field(
        default_factory=dict,
        description="stricter per-kind rules for artifacts derived from this dataset",
    )


class Storage(StrictModel):
    """A storage location (bucket, file system) owned by the region."""

    name: StorageName = Field(description="unique across the federation")
    jurisdiction: Jurisdiction = Field(description="where the stored bytes physically live")
    description: str = ""


class RegionPolicy(StrictModel):
    """The whole policy file of one region."""

    region: RegionName
    jurisdiction: Jurisdiction
    description: str = ""
    datasets: tuple[Dataset, ...] = ()
    storage: tuple[Storage, ...] = ()
    exports: ExportRules = Field(default_factory=dict)
