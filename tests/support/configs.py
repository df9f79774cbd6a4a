"""Small config documents shared by the unit tests of the daemons' config loaders."""

from __future__ import annotations

#: The smallest coordinator config that loads; tests append or replace keys.
MINIMAL_COORDINATOR = """\
federation: acme
jurisdiction: EU
trust_bundle: pki/trust.yaml
identity: {cert: pki/cert.pem, key: pki/key.pem}
state_dir: state
policies_dir: policies
storage:
  - {name: eu-ckpt, jurisdiction: EU, path: ckpt}
"""
