"""TLS on the HTTP and gRPC listeners with tritonserver's flag names, plain and mutual, from
tritonclient; a client without the right certificate is refused."""
import datetime
import ipaddress

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conftest import EXAMPLES
from ferry_server import Server


def _cert(name, issuer=None, ca=False, usage=None):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), False)
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    return cert, key


def _write(path, cert, key):
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("ferry test CA", ca=True)
    other_ca = _cert("someone else", ca=True)
    files = {"ca": _write(d / "ca", *ca)[0]}
    files["server"] = _write(d / "server", *_cert("localhost", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH))
    files["client"] = _write(d / "client", *_cert("client", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    files["stranger"] = _write(d / "stranger", *_cert("stranger", other_ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    return files


def simple_inputs(lib):
    a = np.ones((1, 16), dtype=np.int32)
    return [lib.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]


def http_client(url, pki, who):
    import gevent.ssl

    def factory(*_, **__):
        ctx = gevent.ssl.create_default_context(cafile=pki["ca"])
        if who:
            ctx.load_cert_chain(*pki[who])
        return ctx

    return httpclient.InferenceServerClient(url, ssl=True, ssl_context_factory=factory)


def grpc_client(url, pki, who):
    extra = {"private_key": pki[who][1], "certificate_chain": pki[who][0]} if who else {}
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=pki["ca"], **extra)


def test_tls_and_mutual_tls(pki):
    cert, key = pki["server"]
    args = ["--model-repository", EXAMPLES, "--http-use-ssl", "--http-server-cert", cert, "--http-server-key", key,
            "--grpc-use-ssl", "--grpc-server-cert", cert, "--grpc-server-key", key]
    with Server(args) as s:
        assert http_client(s.url, pki, None).infer("simple", simple_inputs(httpclient)).as_numpy("OUTPUT0")[0, 0] == 2
        assert grpc_client(s.grpc_url, pki, None).infer("simple", simple_inputs(grpcclient)).as_numpy("OUTPUT0")[0, 0] == 2
        with pytest.raises(Exception):
            httpclient.InferenceServerClient(s.url).is_server_live()  # plain HTTP to a TLS port
    mutual = args + ["--http-use-ssl-mutual", "--http-root-cert", pki["ca"],
                     "--grpc-use-ssl-mutual", "--grpc-root-cert", pki["ca"]]
    with Server(mutual) as s:
        assert http_client(s.url, pki, "client").infer("simple", simple_inputs(httpclient)).as_numpy("OUTPUT1")[0, 0] == 0
        assert grpc_client(s.grpc_url, pki, "client").is_server_ready()
        for who in (None, "stranger"):
            with pytest.raises(Exception):
                http_client(s.url, pki, who).is_server_live()
            with pytest.raises(Exception):
                grpc_client(s.grpc_url, pki, who).is_server_live(client_timeout=5)


def test_tls_flags_must_come_together():
    import subprocess

    from ferry_server import BINARY
    for args in (["--grpc-use-ssl"], ["--http-use-ssl-mutual"], ["--grpc-server-cert", "x.pem"]):
        out = subprocess.run([BINARY, "serve", *args], capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "ssl" in out.stderr, out.stderr
