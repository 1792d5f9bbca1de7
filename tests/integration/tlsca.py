"""
A throwaway test CA for TLS integration tests: a CA and a leaf certificate
for C{localhost} made with C{cryptography}, helpers to listen with them
(an C{ssl:} endpoint string and a ready-built server context) and the
client trust root relay takes as C{buildApplication(..., trustRoot=...)}.

Twisted 26.10's server-side L{CertificateOptions} hands pyOpenSSL C{X509}
objects to C{Context.use_certificate}, which pyOpenSSL deprecates; under
the suite's C{filterwarnings = error} the lazily built context would raise
inside the reactor on the first handshake. L{TestCA.serverOptions} builds
(and caches) the context at once with that one warning ignored.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import warnings

from attrs import define, field
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet.endpoints import SSL4ServerEndpoint
from twisted.internet.ssl import Certificate, PrivateCertificate


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def makeCA(commonName: str = "relay test CA"):
    """
    @return: (CA private key, CA certificate), valid one day.
    """
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(commonName))
        .issuer_name(_name(commonName))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def makeLeaf(caKey, caCert, hostnames=("localhost",)):
    """
    A server certificate signed by the CA.

    @param hostnames: DNS names for the subject alternative name (the first
        is also the common name).
    @return: (leaf private key, leaf certificate).
    """
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hostnames[0]))
        .issuer_name(caCert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hostnames]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(caKey.public_key()), False
        )
        .sign(caKey, hashes.SHA256())
    )
    return key, cert


def _keyPEM(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


@define(eq=False)
class TestCA:
    """
    A CA plus one leaf certificate, as PEM bytes and (lazily) files.

    @ivar caPEM: the CA certificate.
    @ivar leafKeyPEM: the leaf's private key.
    @ivar leafCertPEM: the leaf certificate.
    @ivar hostnames: the leaf's DNS names.
    """

    __test__ = False  # not a pytest test class

    caPEM: bytes
    leafKeyPEM: bytes = field(repr=False)
    leafCertPEM: bytes
    hostnames: tuple
    _dir: str = None

    @classmethod
    def create(cls, hostnames=("localhost",)) -> TestCA:
        """
        @param hostnames: the leaf certificate's DNS names.
        @return: a new CA and leaf.
        """
        caKey, caCert = makeCA()
        leafKey, leafCert = makeLeaf(caKey, caCert, tuple(hostnames))
        return cls(
            caPEM=caCert.public_bytes(serialization.Encoding.PEM),
            leafKeyPEM=_keyPEM(leafKey),
            leafCertPEM=leafCert.public_bytes(serialization.Encoding.PEM),
            hostnames=tuple(hostnames),
        )

    def trustRoot(self) -> Certificate:
        """
        @return: the client trust root (relay's C{trustRoot}).
        """
        return Certificate.loadPEM(self.caPEM)

    def privateCertificate(self) -> PrivateCertificate:
        """
        @return: the leaf with its key.
        """
        return PrivateCertificate.loadPEM(self.leafKeyPEM + self.leafCertPEM)

    def serverOptions(self):
        """
        Server TLS options with the OpenSSL context already built (see the
        module docstring for why).
        """
        options = self.privateCertificate().options()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Passing pyOpenSSL", DeprecationWarning)
            options.getContext()
        return options

    def files(self) -> tuple:
        """
        Write the key and certificate to a temporary directory outside the
        working tree (removed by L{cleanup}).

        @return: (key path, certificate path).
        """
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="relay-tlsca-")
            with open(os.path.join(self._dir, "leaf.key"), "wb") as f:
                f.write(self.leafKeyPEM)
            with open(os.path.join(self._dir, "leaf.pem"), "wb") as f:
                f.write(self.leafCertPEM)
        return os.path.join(self._dir, "leaf.key"), os.path.join(self._dir, "leaf.pem")

    def endpointString(self, port: int = 0, interface: str = "127.0.0.1") -> str:
        """
        An C{ssl:} server endpoint string with this leaf. Note: a server
        built from it creates its context lazily, inside the reactor; under
        C{filterwarnings = error} prefer L{listen}.
        """
        key, cert = self.files()
        return f"ssl:{port}:interface={interface}:privateKey={key}:certKey={cert}"

    async def listen(self, reactor, factory, port: int = 0, interface: str = "127.0.0.1"):
        """
        Listen with TLS on C{interface}, the context built up front.

        @return: the listening port.
        """
        endpoint = SSL4ServerEndpoint(reactor, port, self.serverOptions(), interface=interface)
        return await endpoint.listen(factory)

    def cleanup(self) -> None:
        """
        Remove the files written by L{files}. Idempotent.
        """
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
