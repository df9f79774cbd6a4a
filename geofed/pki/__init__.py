"""Federation PKI: CAs, issued identities, trust bundles, TLS and certificate checks.

Each member organization runs a CA (:func:`create_ca`, ``geofed ca init``) and issues one
certificate per principal (:func:`issue`, ``geofed ca issue``) naming
``spiffe://<federation>/<role>/<name>``. A :class:`TrustBundle` says which CAs the
federation trusts and for which identities; :func:`verify_certificate` is the one decision
every check goes through (TLS peers and manifest signers alike). Daemons hold the bundle
through :class:`~geofed.pki.bundle_source.ReloadingBundle`, so revocations apply without a
restart; the MQTT broker, which cannot read the bundle, gets each CA's CRL
(:mod:`geofed.pki.crl`, ``geofed ca crl``).
"""

from geofed.pki.authority import (
    CertificateAuthority,
    IssuedCredential,
    create_ca,
    generate_key,
    issue,
    mqtt_username,
)
from geofed.pki.errors import (
    BadCertificate,
    CertificateRefused,
    CredentialStoreError,
    Expired,
    NoPeerCertificate,
    NotYetValid,
    OutsideGrant,
    PKIError,
    Revoked,
    TrustBundleError,
    UnexpectedPeer,
    UnknownAuthority,
    WrongFederation,
)
from geofed.pki.grants import Grant, InvalidGrant
from geofed.pki.store import (
    CredentialFiles,
    load_ca,
    load_credential,
    read_certificate,
    save_ca,
    save_credential,
)
from geofed.pki.tls import client_ssl_context, peer_certificate, peer_identity, server_ssl_context
from geofed.pki.trust import (
    TrustBundle,
    TrustBundleFile,
    TrustedAuthority,
    add_revoked_serials,
    format_serial,
    load_trust_bundle,
    parse_serial,
    read_trust_bundle_file,
    write_trust_bundle_file,
)
from geofed.pki.verify import certificate_identity, verify_certificate

__all__ = [
    "BadCertificate",
    "CertificateAuthority",
    "CertificateRefused",
    "CredentialFiles",
    "CredentialStoreError",
    "Expired",
    "Grant",
    "InvalidGrant",
    "IssuedCredential",
    "NoPeerCertificate",
    "NotYetValid",
    "OutsideGrant",
    "PKIError",
    "Revoked",
    "TrustBundle",
    "TrustBundleError",
    "TrustBundleFile",
    "TrustedAuthority",
    "UnexpectedPeer",
    "UnknownAuthority",
    "WrongFederation",
    "add_revoked_serials",
    "certificate_identity",
    "client_ssl_context",
    "create_ca",
    "format_serial",
    "generate_key",
    "issue",
    "load_ca",
    "load_credential",
    "load_trust_bundle",
    "mqtt_username",
    "parse_serial",
    "peer_certificate",
    "peer_identity",
    "read_certificate",
    "read_trust_bundle_file",
    "save_ca",
    "save_credential",
    "server_ssl_context",
    "verify_certificate",
    "write_trust_bundle_file",
]
