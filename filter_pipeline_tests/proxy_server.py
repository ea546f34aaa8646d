"""A real HTTP proxy on 127.0.0.1, as a corporate proxy stands between the judge and its endpoint: plain
requests by absolute URI are forwarded, HTTPS goes through a CONNECT tunnel. It records what passed through it.
And a self-signed certificate authority for a TLS endpoint, as a proxy that re-signs traffic presents one.
"""

import datetime
import http.client
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


class LoopbackProxy:
    """`with LoopbackProxy() as proxy:` ... `proxy.url` ... `proxy.seen` (one "METHOD target" line per request).
    `demand_auth`: answer every tunnel (CONNECT, for HTTPS) with 407 Proxy Authentication Required, as a proxy
    whose credentials are missing or wrong does."""

    def __init__(self, demand_auth: bool = False):
        self.seen: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - a plain request, by absolute URI
                outer.seen.append(f"POST {self.path}")
                target = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-connection", "host")}
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                upstream.request("POST", target.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            def do_CONNECT(self):  # noqa: N802 - a tunnel for HTTPS
                outer.seen.append(f"CONNECT {self.path}")
                if demand_auth:
                    self.send_response(407, "Proxy Authentication Required")
                    self.send_header("Proxy-Authenticate", 'Basic realm="proxy"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                host, port = self.path.rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)), timeout=30)
                self.send_response(200, "Connection established")
                self.end_headers()
                self.wfile.flush()
                sockets = [self.connection, upstream]
                while True:
                    ready, _, _ = select.select(sockets, [], [], 30)
                    if not ready:
                        break
                    for s in ready:
                        data = s.recv(65536)
                        if not data:
                            upstream.close()
                            self.close_connection = True
                            return
                        (upstream if s is self.connection else self.connection).sendall(data)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "LoopbackProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a self-signed certificate for 127.0.0.1, its own CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loopback test CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "loopback-ca.pem", folder / "loopback-key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path
