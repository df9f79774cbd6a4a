"""Trust bundles: which CAs a federation trusts, for which identities, minus revocations.

File format (YAML; unknown keys are errors; certificate paths are relative to the file)::

    federation: acme
    authorities:
      - name: org-a
        certificate: org-a/ca.pem
        grants: ["coordinator/*", "operator/*", "region/eu-*"]
      - name: org-b
        certificate: org-b/ca.pem
        grants: ["region/us-*"]
    revoked_serials: ["4f1c..."]   # quoted hex serials, honoured everywhere

Errors name the file, the line and the key (``trust.yaml:7: authorities[1].grants[0]: ...``).
Serials are written as quoted hex strings because YAML would read ``1234`` as a decimal
integer, a different serial from hex ``1234``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import Encoding
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from geofed.fsutil import PUBLIC_MODE, atomic_write_bytes
from geofed.located_yaml import (
    DOCUMENT_KEY,
    SYNTAX_KEY,
    LocatedDocument,
    LocatedYamlError,
    format_key_path,
    parse_located,
)
from geofed.pki.errors import TrustBundleError
from geofed.pki.grants import Grant
from geofed.types import Identity, validate_name

_SERIAL_RE = re.compile(r"^[0-9a-f]{1,40}$")


def parse_serial(text: str) -> int:
    """Parse a hex serial (``4f1c``, ``4F:1C`` and ``0x4f1c`` all work)."""
    cleaned = text.strip().lower().replace(":", "").removeprefix("0x")
    if not _SERIAL_RE.fullmatch(cleaned):
        raise ValueError(f"serial {text!r} is not a hex number of at most 20 bytes")
    return int(cleaned, 16)


def format_serial(serial: int) -> str:
    """The canonical form of a serial: lowercase hex, no separators."""
    return format(serial, "x")


def _grant(text: str) -> str:
    Grant.parse(text)
    return text


def _serial(value: object) -> object:
    if not isinstance(value, str):
        # pydantic reports only ValueError as a validation error
        raise ValueError(f"serial {value!r} must be a quoted hex string")  # noqa: TRY004
    parse_serial(value)
    return value


GrantText = Annotated[str, AfterValidator(_grant)]
SerialText = Annotated[str, BeforeValidator(_serial)]


class AuthorityEntry(BaseModel):
    """One trusted CA in a trust bundle file."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(description="the member organization's authority name")
    certificate: str = Field(description="PEM file of the CA, relative to the bundle file")
    grants: list[GrantText] = Field(min_length=1, description="<role>/<name> globs it may issue")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return validate_name("authority name", value)


class TrustBundleFile(BaseModel):
    """The YAML document of a trust bundle, before its certificate files are read."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    federation: str
    authorities: list[AuthorityEntry] = Field(min_length=1)
    revoked_serials: list[SerialText] = Field(default_factory=list)

    @field_validator("federation")
    @classmethod
    def _federation(cls, value: str) -> str:
        return validate_name("federation", value)

    @field_validator("authorities")
    @classmethod
    def _unique(cls, value: list[AuthorityEntry]) -> list[AuthorityEntry]:
        names = [entry.name for entry in value]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"authority names must be unique; repeated: {', '.join(duplicates)}")
        return value


@dataclass(frozen=True)
class TrustedAuthority:
    """A CA certificate and the identities it may issue."""

    name: str
    certificate: x509.Certificate
    grants: tuple[Grant, ...]

    def allows(self, identity: Identity) -> bool:
        return any(grant.allows(identity) for grant in self.grants)


@dataclass(frozen=True)
class TrustBundle:
    """The verified, in-memory form of a trust bundle."""

    federation: str
    authorities: tuple[TrustedAuthority, ...]
    revoked_serials: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        validate_name("federation", self.federation)
        if not self.authorities:
            raise ValueError("a trust bundle needs at least one authority")

    def is_revoked(self, serial: int) -> bool:
        return serial in self.revoked_serials

    def revoke(self, serials: Iterable[int]) -> TrustBundle:
        """A copy with ``serials`` added to the revocation list."""
        return replace(self, revoked_serials=self.revoked_serials | frozenset(serials))

    def ca_pem(self) -> bytes:
        """All trusted CA certificates, concatenated (TLS ``cadata``, a broker's ``cafile``)."""
        return b"".join(a.certificate.public_bytes(Encoding.PEM) for a in self.authorities)


def load_trust_bundle(path: Path) -> TrustBundle:
    """Read and verify a trust bundle file and the CA certificates it names."""
    spec, source = _read(path)
    authorities = []
    for index, entry in enumerate(spec.authorities):
        cert_path = path.parent / entry.certificate
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            _check_ca(cert)
        except (OSError, ValueError) as err:
            loc = ("authorities", index, "certificate")
            raise TrustBundleError(
                path, source.lines.line_of(loc), format_key_path(loc), f"{cert_path}: {err}"
            ) from None
        grants = tuple(Grant.parse(text) for text in entry.grants)
        authorities.append(TrustedAuthority(name=entry.name, certificate=cert, grants=grants))
    return TrustBundle(
        federation=spec.federation,
        authorities=tuple(authorities),
        revoked_serials=frozenset(parse_serial(s) for s in spec.revoked_serials),
    )


def read_trust_bundle_file(path: Path) -> TrustBundleFile:
    """Parse and validate the YAML of a trust bundle (certificate files are not read)."""
    return _read(path)[0]


def _read(path: Path) -> tuple[TrustBundleFile, LocatedDocument]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TrustBundleError(path, None, None, f"cannot read trust bundle: {err}") from None
    try:
        # Unbounded: revocation lists only grow, and the model below is shallow (strings
        # and lists of strings), so validating it never walks far into an alias's expansion.
        source = parse_located(text, max_bytes=None, max_nodes=None)
    except LocatedYamlError as err:
        problem = err.problems[0]
        located = problem.key in (SYNTAX_KEY, DOCUMENT_KEY)
        message = problem.message if located else f"{problem.key}: {problem.message}"
        raise TrustBundleError(path, problem.line, None, message) from None
    if not isinstance(source.data, dict):
        line = source.lines.line_of(()) if source.lines.lines else None
        raise TrustBundleError(path, line, None, "expected a mapping at top level")
    try:
        return TrustBundleFile.model_validate(source.data), source
    except ValidationError as err:
        first = err.errors()[0]
        loc = tuple(first["loc"])
        more = f" (and {err.error_count() - 1} more errors)" if err.error_count() > 1 else ""
        key = format_key_path(loc) if loc else None
        raise TrustBundleError(path, source.lines.line_of(loc), key, first["msg"] + more) from None


def write_trust_bundle_file(path: Path, spec: TrustBundleFile) -> None:
    """Write ``spec`` to ``path`` atomically (comments in a previous file are not kept)."""
    text = yaml.safe_dump(spec.model_dump(), sort_keys=False, default_flow_style=False)
    atomic_write_bytes(path, text.encode("utf-8"), mode=PUBLIC_MODE)


def add_revoked_serials(path: Path, serials: Sequence[int]) -> list[int]:
    """Append ``serials`` to the bundle file's revocation list; return those newly added."""
    spec = read_trust_bundle_file(path)
    present = {parse_serial(s) for s in spec.revoked_serials}
    added = [s for s in dict.fromkeys(serials) if s not in present]
    if added:
        updated = spec.model_copy(
            update={"revoked_serials": [*spec.revoked_serials, *map(format_serial, added)]}
        )
        write_trust_bundle_file(path, updated)
    return added


def _check_ca(cert: x509.Certificate) -> None:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        raise ValueError("not a CA certificate (no basicConstraints)") from None
    except x509.DuplicateExtension as err:
        raise ValueError(f"malformed extensions: {err}") from None
    if not constraints.ca:
        raise ValueError("not a CA certificate (basicConstraints CA:FALSE)")
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as err:
        raise ValueError(f"not a self-signed root CA ({err or type(err).__name__})") from None
