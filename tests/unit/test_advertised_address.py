"""An engine bound to a wildcard address advertises this machine's own address (each replica of a scaled container
its own), and a named address as it is."""

from __future__ import annotations

import socket

import pytest

from kvcentric.runtime.transfer import advertised_address, own_address


def test_a_named_address_is_advertised_as_it_is():
    assert advertised_address("10.1.2.3", 50061) == "10.1.2.3:50061"
    assert advertised_address("decode", 50061) == "decode:50061"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_advertises_an_address_of_this_machine_that_a_server_can_listen_on(wildcard):
    host, port = advertised_address(wildcard, 50061).rsplit(":", 1)
    assert port == "50061" and host == own_address() and host not in ("0.0.0.0", "::", "")
    with socket.socket() as server:
        server.bind((host, 0))  # an address of this machine, not a guess
        server.listen()
        socket.create_connection(server.getsockname(), timeout=2).close()
