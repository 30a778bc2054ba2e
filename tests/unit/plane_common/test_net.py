"""`plane_common.net`: a listener's host spec is checked where a config loads and resolved on the host
that binds; a spec that fits nothing names its key and what this host has."""

from __future__ import annotations

import pytest

from plane_common.net import NODE_IP_ENV, check_spec, endpoint, interface_of, resolve, route_to, socket_env


@pytest.mark.parametrize("spec", ["127.0.0.1", "::1", "auto", "iface:lo", "10.0.0.0/8"])
def test_check_spec_accepts_an_address_auto_an_interface_and_a_cidr(spec):
    check_spec(spec, "weights.host")


@pytest.mark.parametrize("spec", ["0.0.0.0", "::", "", " 127.0.0.1", "foo", "iface:"])
def test_check_spec_refuses_wildcards_and_malformed_specs_naming_the_key(spec):
    with pytest.raises(ValueError) as e:
        check_spec(spec, "queue.bind_host")
    assert "queue.bind_host" in str(e.value)


def test_auto_resolves_to_the_node_address_the_process_recorded(monkeypatch):
    monkeypatch.setenv(NODE_IP_ENV, "10.1.2.3")
    assert resolve("auto", "weights.host") == "10.1.2.3"


def test_an_interface_resolves_to_its_ipv4_address():
    assert resolve("iface:lo", "weights.host") == "127.0.0.1"


def test_a_cidr_resolves_to_this_hosts_address_inside_it():
    assert resolve("127.0.0.0/8", "weights.host") == "127.0.0.1"


def test_a_cidr_no_address_of_this_host_is_in_names_the_key_and_lists_the_addresses():
    with pytest.raises(ValueError) as e:
        resolve("198.51.100.0/24", "queue.bind_host")
    msg = str(e.value)
    assert "queue.bind_host" in msg and "198.51.100.0/24" in msg
    assert "127.0.0.1" in msg  # this host's addresses, so the user sees what would fit


def test_an_unknown_interface_lists_this_hosts_interfaces():
    with pytest.raises(ValueError) as e:
        resolve("iface:nosuchif0", "weights.host")
    msg = str(e.value)
    assert "weights.host" in msg and "nosuchif0" in msg and "'lo'" in msg


def test_loopback_is_reached_by_loopback_on_the_lo_interface():
    assert route_to("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"


def test_socket_env_points_gloo_and_nccl_at_the_interface_that_reaches_the_peer():
    env: dict[str, str] = {}
    assert socket_env("127.0.0.1", environ=env) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_socket_env_keeps_a_value_the_user_exported():
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert socket_env("127.0.0.1", environ=env) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_endpoint_brackets_ipv6_only():
    assert endpoint("::1", 5) == "tcp://[::1]:5"
    assert endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
