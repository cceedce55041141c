"""The TLS options of the commands, declared once: a client's ``--tls``/``--tls-ca`` (``sos``
put/cat/ls/stat, restore/verify, mount, gateway) and a server's ``--tls-cert``/``--tls-key``
(``sos-server serve``, ``sos gateway``). Here because sos_wire is the package every command
imports; the commands check the pairs and load the files."""

from __future__ import annotations

import argparse

__all__ = ["add_tls_client_options", "add_tls_server_options"]


def add_tls_client_options(parser: argparse._ActionsContainer) -> None:
    """``--tls`` (the system CAs) and ``--tls-ca FILE``, on a parser or an argument group."""
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system CAs")
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=None,
        help="connect with TLS, trusting this CA file (default: $SOS_TLS_CA if set)",
    )


def add_tls_server_options(parser: argparse._ActionsContainer, *, serves: str = "TLS", note: str = "") -> None:
    """``--tls-cert FILE`` and ``--tls-key FILE``: ``serves`` names what the certificate serves
    (``TLS``, ``HTTPS (swebhdfs://)``), ``note`` ends its help."""
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=None,
        help=f"serve {serves} with this certificate chain file (PEM){note}",
    )
    parser.add_argument("--tls-key", metavar="FILE", default=None, help="the private key of --tls-cert (PEM)")
