"""Two "nodes" on one machine: a network namespace joined to the host by a veth pair.

The host side is the head node; the namespace is the other node, with its own address,
reached only over the veth link. Needs root (``ip netns``); the test fails saying so
otherwise.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True, slots=True)
class NodePair:
    namespace: str
    head_if: str
    head_addr: str
    node_if: str
    node_addr: str

    def in_node(self, *argv: str) -> list[str]:
        """``argv`` run inside the other node's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def node_pair(head_addr: str, node_addr: str) -> Iterator[NodePair]:
    """A namespace with ``node_addr`` on a veth whose host end has ``head_addr`` (/24)."""
    if os.geteuid() != 0:
        pytest.fail("the multi-node region test needs root for ip netns and veth links")
    tag = f"{os.getpid() % 100000}"
    pair = NodePair(f"geofed-n{tag}", f"gfh{tag}", head_addr, f"gfn{tag}", node_addr)
    _ip("netns", "add", pair.namespace)
    try:
        _ip("link", "add", pair.head_if, "type", "veth", "peer", "name", pair.node_if)
        _ip("link", "set", pair.node_if, "netns", pair.namespace)
        _ip("addr", "add", f"{head_addr}/24", "dev", pair.head_if)
        _ip("link", "set", pair.head_if, "up")
        for args in (
            ("addr", "add", f"{node_addr}/24", "dev", pair.node_if),
            ("link", "set", pair.node_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", pair.namespace, "ip", *args)
        yield pair
    finally:
        # Deleting the namespace deletes its veth end, and with it the pair.
        subprocess.run(["ip", "netns", "del", pair.namespace], check=False, timeout=10)
        subprocess.run(["ip", "link", "del", pair.head_if], check=False, capture_output=True)
