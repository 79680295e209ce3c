"""Real servers for the egress tests, on 127.0.0.1 only: files over HTTP and HTTPS, a
package index for pip, git's smart HTTP, and the proxy in front of them."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import base64
import http.server
import os
import socket
import ssl
import subprocess
import threading
import zipfile

from karotte import net
from karotte.egress import EgressProxy, parse_policy, static_resolver


class Handler(http.server.SimpleHTTPRequestHandler):
    """Files of a directory over HTTP/1.1 with keep-alive; each request's Host, path and
    headers are kept in server.seen."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a head and a body in two writes: no delayed ACK

    def log_message(self, *args):
        pass

    def _note(self):
        self.server.seen.append((self.command, self.path, dict(self.headers)))

    def do_GET(self):
        self._note()
        if "echo-headers" in self.path:
            body = "\n".join(f"{k}: {v}" for k, v in self.headers.items()).encode()
            self._reply(200, body)
            return
        if self.path.startswith("/big/"):  # /big/N: N bytes of zeros
            size = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            block = bytes(1 << 20)
            while size:
                n = min(size, len(block))
                self.wfile.write(block[:n])
                size -= n
            return
        super().do_GET()

    def do_POST(self):
        self._note()
        length = int(self.headers.get("Content-Length", 0))
        self._reply(200, hashlib.sha256(self.rfile.read(length)).hexdigest().encode())

    def _reply(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class GitHandler(http.server.BaseHTTPRequestHandler):
    """git's smart HTTP: each request handed to `git http-backend` as CGI."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a head and a body in two writes: no delayed ACK

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._cgi()

    def do_POST(self):
        self._cgi()

    def _cgi(self):
        self.server.seen.append((self.command, self.path, dict(self.headers)))
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        env = {"GIT_PROJECT_ROOT": self.server.root, "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_ADDR": "127.0.0.1",
               "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
               "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
               "PATH": os.environ["PATH"]}
        out = subprocess.run(["git", "http-backend"], input=body, env=env,
                             capture_output=True, check=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.split(b"\r\n"):
            name, _, value = line.decode().partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def http_server(handler=Handler, directory=None, tls: ssl.SSLContext | None = None, **attrs):
    """A threading server on 127.0.0.1; yields it (server.port, server.seen)."""
    handler = functools.partial(handler, directory=directory) if directory else handler
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.seen = []
    server.port = server.server_address[1]
    for key, value in attrs.items():
        setattr(server, key, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def file_server(root, files, tls_names=None):
    """files ({name: text}) written into the directory root, served over HTTP, or over
    HTTPS with a self-signed certificate for tls_names (its path in server.cert)."""
    for name, text in files.items():
        (root / name).write_text(text)
    context = None
    if tls_names is not None:
        cert, key = make_cert(str(root), tls_names)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
    with http_server(directory=str(root), tls=context) as server:
        if context is not None:
            server.cert = cert
        yield server


def make_cert(directory, names):
    """A self-signed certificate for names, made by openssl; (cert, key) paths."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    san = ",".join(f"DNS:{n}" for n in names)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={names[0]}", "-addext", f"subjectAltName={san}",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


def make_wheel(directory, name, version):
    """A minimal pure-Python wheel of one module `name` that sets VALUE = version."""
    dist = f"{name}-{version}"
    path = os.path.join(directory, f"{dist}-py3-none-any.whl")
    files = {f"{name}.py": f"VALUE = {version!r}\n",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
                                           f"Version: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for arcname, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{arcname},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, text in files.items():
            zf.writestr(arcname, text)
        zf.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def noting_resolver(hosts, asked: list[str]):
    """A resolver of the table hosts that appends each name it is asked to asked."""
    table = static_resolver(hosts)

    async def resolve(name, port):
        asked.append(name)
        return await table(name, port)
    return resolve


@contextlib.contextmanager
def sandboxes_proxy(hosts):
    """Within: an EgressProxy on the table hosts, the one new sandboxes use
    (net.use_egress_proxy); every name it resolves is kept in its `asked`."""
    asked: list[str] = []
    egress = EgressProxy(noting_resolver(hosts, asked))
    egress.asked = asked
    old = net.use_egress_proxy(egress)
    try:
        yield egress
    finally:
        net.use_egress_proxy(old)
        egress.close()


class Gateway:
    """An EgressProxy with a resolver table the test controls; every name the proxy
    resolves is kept in `asked`. A context manager: its exit closes every session."""

    def __init__(self, hosts):
        self.hosts = dict(hosts)
        self.asked: list[str] = []
        self.proxy = EgressProxy(noting_resolver(self.hosts, self.asked))
        self.sessions = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def serve(self, allow=(), upstreams=None, limits=None):
        """A session for the policy; (session, proxy URL, {upstream: URL})."""
        policy = parse_policy(allow, upstreams, limits)
        front = listener()
        ups = {u.name: listener() for u in policy.upstreams}
        urls = {name: f"http://127.0.0.1:{s.getsockname()[1]}" for name, s in ups.items()}
        url = f"http://127.0.0.1:{front.getsockname()[1]}"
        session = self.proxy.serve(policy, proxy=front, upstreams=ups)
        self.sessions.append(session)
        return session, url, urls

    def close(self):
        for session in self.sessions:
            session.close(wait=True)
        self.proxy.close()
