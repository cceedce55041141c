"""A gateway of a pair listening on port 0 names the port it bound in its lease (lease.py):
a standby probes the active at the lease's address, and ``HOST:0`` named no one, so the
standby found the active "down" and held each request it refused for 30 s. Real processes."""

from __future__ import annotations

import time

from sos_client import Client
from spark_plugin.gateway.pair.lease import LeaseHolder, LeaseWatcher
from spark_plugin.gateway.process import GatewayProcess

NS = "leaseurl"


def test_a_gateway_listening_on_port_0_names_its_bound_port_in_its_lease(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    gw = GatewayProcess(
        NS, str(tmp_path / "cache"), sos_server.address, key, listen="127.0.0.1:0", extra_args=["--lease", "0.4"]
    ).start()
    try:
        port = gw.url.rsplit(":", 1)[1]
        assert port != "0"
        watcher = LeaseWatcher(0.4)
        deadline = time.monotonic() + 30
        with Client(sos_server.address, key, NS, timeout=30) as client:
            while watcher.active_address != f"127.0.0.1:{port}" and time.monotonic() < deadline:
                watcher.observe(client)
                time.sleep(0.1)
        assert watcher.active_address == f"127.0.0.1:{port}"
    finally:
        assert gw.stop() == 0


def test_the_lease_url_keeps_a_given_port_and_fills_in_a_bound_one() -> None:
    def holder(url: str, bound: tuple[str, int] | None) -> LeaseHolder:
        return LeaseHolder(lambda: None, 1, 1.0, url=url, bound=lambda: bound)  # type: ignore[arg-type,return-value]

    assert holder("10.0.0.5:0", ("10.0.0.5", 41234)).served_url() == "10.0.0.5:41234"
    assert holder("10.0.0.5:0", None).served_url() == "10.0.0.5:0"  # not bound yet
    assert holder("gw.example:9870", ("0.0.0.0", 9870)).served_url() == "gw.example:9870"
    assert holder("", ("0.0.0.0", 9870)).served_url() == ""  # a wildcard names no address
