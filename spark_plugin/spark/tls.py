"""Trust in an https gateway's certificate for both sides of a Spark application: a PKCS12
truststore made with the JDK's ``keytool`` (or given) for the JVMs' ``javax.net.ssl`` options,
and an ``ssl.SSLContext`` for Python (the marker listener)."""

from __future__ import annotations

import os
import shlex
import shutil
import ssl
import subprocess
import tempfile
from typing import cast

#: password of a truststore :func:`make_truststore` makes from a PEM file. It protects
#: nothing (a truststore holds only public certificates), but Java 17 needs the right one to
#: read a PKCS12 store's certificates: without it, "the trustAnchors parameter must be
#: non-empty"
TRUSTSTORE_PASSWORD = "changeit"
_PEM_CERT = ("-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----")


def keytool() -> str:
    """The JDK's ``keytool`` ($JAVA_HOME/bin first, then $PATH)."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "keytool"), os.X_OK):
        return os.path.join(home, "bin", "keytool")
    found = shutil.which("keytool")
    if not found:
        raise FileNotFoundError(
            "keytool (of a Java runtime) is needed to turn a PEM CA file into the "
            "PKCS12 truststore the Spark JVMs read: set JAVA_HOME, or pass "
            "truststore= a PKCS12 file made once with keytool -importcert"
        )
    return found


def pem_certificates(text: str) -> list[str]:
    """The PEM certificate blocks of ``text`` (a CA file, or ``keytool -list -rfc``'s output)."""
    begin, end = _PEM_CERT
    certs, at = [], 0
    while (i := text.find(begin, at)) >= 0:
        j = text.find(end, i)
        if j < 0:
            break
        certs.append(text[i : j + len(end)] + "\n")
        at = j + len(end)
    return certs


def _run_keytool(tool: str, store: str, password: str, *command: str) -> subprocess.CompletedProcess[str]:
    """``keytool COMMAND... -keystore STORE -storetype PKCS12 -storepass PASSWORD``, its
    output captured (the caller reads the return code)."""
    return subprocess.run(
        [tool, *command, "-keystore", store, "-storetype", "PKCS12", "-storepass", password],
        capture_output=True,
        text=True,
        timeout=120,
    )


def make_truststore(
    cafile: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *, password: str = TRUSTSTORE_PASSWORD
) -> str:
    """A PKCS12 truststore holding every certificate of the PEM file ``cafile`` (keytool
    -importcert, one alias per certificate); ``path`` default: a new file in a private
    temporary directory. Returns its path."""
    with open(cafile, encoding="ascii", errors="replace") as f:
        certs = pem_certificates(f.read())
    if not certs:
        raise ValueError(f"{cafile} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    work = tempfile.mkdtemp(prefix="sos-trust-")
    store = os.fspath(path) if path is not None else os.path.join(work, "truststore.p12")
    tool = keytool()
    for n, cert in enumerate(certs):
        one = os.path.join(work, f"ca-{n}.pem")
        with open(one, "w", encoding="ascii") as f:
            f.write(cert)
        proc = _run_keytool(tool, store, password, "-importcert", "-noprompt", "-alias", f"sos-ca-{n}", "-file", one)
        if proc.returncode != 0:
            raise RuntimeError(f"keytool -importcert of {cafile} failed: {(proc.stderr or proc.stdout).strip()}")
    return store


def truststore_certificates(truststore: str | os.PathLike[str], password: str) -> str:
    """The certificates of a PKCS12 truststore as PEM text (``keytool -list -rfc``): what
    Python's ssl module can load (``cadata=``)."""
    proc = _run_keytool(keytool(), os.fspath(truststore), password, "-list", "-rfc")
    certs = pem_certificates(proc.stdout)
    if proc.returncode != 0 or not certs:
        raise ValueError(
            f"cannot read the certificates of truststore {truststore} (is "
            f"truststore_password= right?): {(proc.stderr or proc.stdout).strip()}"
        )
    return "".join(certs)


def java_trust_options(truststore: str | os.PathLike[str], password: str) -> str:
    """The JVM options that make every HTTPS client of a JVM (Hadoop's WebHdfsFileSystem, its
    OAuth2 token fetch) trust the certificates of a PKCS12 truststore."""
    return " ".join(
        shlex.quote(o)
        for o in (
            f"-Djavax.net.ssl.trustStore={os.path.abspath(os.fspath(truststore))}",
            "-Djavax.net.ssl.trustStoreType=PKCS12",
            f"-Djavax.net.ssl.trustStorePassword={password}",
        )
    )


class GatewayTrust:
    """Trust in a gateway's TLS certificate, for both sides of a Spark application: the JVMs
    (``.java_options``: javax.net.ssl.trustStore, trustStoreType=PKCS12, trustStorePassword,
    for spark.driver.extraJavaOptions and spark.executor.extraJavaOptions) and Python (the
    marker listener's ``.context``).

    ``cafile``: a PEM file of the gateway's certificate or its CA (what ``--tls-ca`` takes);
    without ``truststore`` a PKCS12 truststore is made from it on this machine
    (:func:`make_truststore`, keytool), which the executors of a cluster find only if they
    run here or see the same path: give ``truststore=`` a file at the same path on every
    node for them (e.g. baked into the image or mounted from a Secret).
    ``truststore`` + ``truststore_password``: a PKCS12 truststore; without ``cafile`` its
    certificates are read back for Python (``keytool -list -rfc``)."""

    def __init__(
        self,
        *,
        cafile: str | os.PathLike[str] | None = None,
        truststore: str | os.PathLike[str] | None = None,
        truststore_password: str | None = None,
    ) -> None:
        if cafile is None and truststore is None:
            raise ValueError("GatewayTrust needs cafile= (PEM) or truststore= (PKCS12)")
        if truststore is not None and truststore_password is None:
            raise ValueError(
                "truststore= needs truststore_password=: Java 17 cannot read the "
                'certificates of a PKCS12 truststore without it ("the trustAnchors '
                'parameter must be non-empty")'
            )
        self.password = truststore_password if truststore_password is not None else TRUSTSTORE_PASSWORD
        self.truststore = (
            os.path.abspath(os.fspath(truststore))
            if truststore is not None
            else make_truststore(cast("str", cafile), password=self.password)
        )
        if cafile is not None:
            self.context = ssl.create_default_context(cafile=os.fspath(cafile))
        else:
            self.context = ssl.create_default_context(cadata=truststore_certificates(self.truststore, self.password))
        self.java_options = java_trust_options(self.truststore, self.password)
