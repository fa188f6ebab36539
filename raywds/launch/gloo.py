"""Which network interface gloo (torch.distributed's CPU backend) listens on. Unless told
(GLOO_SOCKET_IFNAME), gloo binds to the address this machine's hostname resolves to, which on
many hosts is a loopback address (Debian's /etc/hosts maps it to 127.0.1.1): ranks on other
machines then cannot connect ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). raywds
names the interface that holds the address the other nodes know this one by.
"""

from __future__ import annotations

import os
import socket

import psutil


def interface_holding(address: str) -> str | None:
    """The name of the interface that holds `address`, or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def address_towards(host: str) -> str:
    """This machine's source address for packets to `host` (the routing table's choice; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def listen_on(address: str) -> None:
    """Make gloo use the interface holding `address`, unless GLOO_SOCKET_IFNAME already says which."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_holding(address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
