"""An agent's credentials from a test federation's principal, as the daemon loads them."""

from __future__ import annotations

from regional_agent.credentials import Credentials
from tests.support.pki import Federation, Principal


def agent_credentials(fed: Federation, principal: Principal) -> Credentials:
    """``principal``'s key and certificate with ``fed``'s trust bundle."""
    return Credentials(
        identity=principal.identity,
        certificate=principal.credential.certificate,
        private_key=principal.credential.private_key,
        bundle=fed.bundle(),
        cert_file=principal.cert_file,
        key_file=principal.key_file,
    )
