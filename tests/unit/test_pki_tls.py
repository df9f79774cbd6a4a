"""TLS contexts from a trust bundle, exercised by in-memory handshakes (no sockets)."""

from __future__ import annotations

import ssl
from datetime import UTC, datetime, timedelta

import pytest

from geofed.pki import OutsideGrant, peer_identity
from tests.support.pki import Federation, make_federation


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    federation = make_federation(
        tmp_path_factory.mktemp("tls") / "fed",
        "acme",
        authorities={"org-a": ["coordinator/*", "region/eu-*"], "org-b": ["region/us-*"]},
    )
    federation.add_untrusted_authority("rogue")
    return federation


def _handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str = "localhost"
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """Run a TLS handshake through memory BIOs; errors surface from the side that refuses."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side, out, peer_in in (
            ("client", client, c_out, s_in),
            ("server", server, s_out, c_in),
        ):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            if data := out.read():
                peer_in.write(data)
        if all(done.values()):
            # TLS 1.3 servers check the client certificate on its first read.
            with pytest.raises(ssl.SSLWantReadError):
                server.read(1)
            return server, client
    raise AssertionError("handshake did not finish")


def _pair(fed: Federation, client, server=None):
    bundle = fed.bundle()
    server = server or fed.coordinator()
    return server.server_context(bundle), client.client_context(bundle)


def test_mutual_handshake_and_peer_identities_on_both_sides(fed):
    coordinator, region = fed.coordinator(), fed.region("eu-west")
    server_ctx, client_ctx = _pair(fed, region, coordinator)
    server, client = _handshake(server_ctx, client_ctx)
    assert server.version() in {"TLSv1.2", "TLSv1.3"}
    assert peer_identity(server, fed.bundle()) == region.identity
    assert peer_identity(client, fed.bundle()) == coordinator.identity


def test_contexts_trust_only_the_bundle_and_require_tls12(fed):
    server_ctx, client_ctx = _pair(fed, fed.region("eu-west"))
    for context in (server_ctx, client_ctx):
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
        assert len(context.get_ca_certs()) == 2  # org-a and org-b, no system store
    assert client_ctx.check_hostname


@pytest.mark.parametrize(
    ("make_client", "reason"),
    [
        (lambda fed: fed.region("eu-west", authority="rogue"), "unable to get local issuer"),
        (
            lambda fed: fed.region(
                "eu-west",
                not_before=datetime.now(UTC) - timedelta(days=2),
                not_after=datetime.now(UTC) - timedelta(days=1),
            ),
            "certificate has expired",
        ),
    ],
)
def test_server_refuses_unknown_ca_and_expired_clients_in_the_handshake(fed, make_client, reason):
    server_ctx, client_ctx = _pair(fed, make_client(fed))
    with pytest.raises(ssl.SSLCertVerificationError) as caught:
        _handshake(server_ctx, client_ctx)
    assert reason in caught.value.verify_message


def test_server_refuses_a_client_without_certificate(fed):
    server_ctx, _ = _pair(fed, fed.region("eu-west"))
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(cadata=fed.bundle().ca_pem().decode())
    with pytest.raises(ssl.SSLError, match="PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        _handshake(server_ctx, anonymous)


def test_out_of_grant_passes_openssl_but_not_peer_identity(fed):
    forged = fed.region("eu-west", authority="org-b")
    server, _ = _handshake(*_pair(fed, forged))
    with pytest.raises(OutsideGrant):
        peer_identity(server, fed.bundle())
