"""A minimal Chrome DevTools Protocol client over a WebSocket (RFC 6455), standard library only.

Enough for the browser template's hooks: one connection, text frames, commands answered by id (events that
arrive in between are skipped). Debian's python3 has no WebSocket module, and the template installs nothing
from PyPI.
"""
import base64
import json
import os
import socket
import struct
import urllib.request

ENDPOINT = "http://127.0.0.1:9222"


def browser_ws_url(timeout=5):
    with urllib.request.urlopen(ENDPOINT + "/json/version", timeout=timeout) as r:
        return json.load(r)["webSocketDebuggerUrl"]


class CDP:
    def __init__(self, ws_url, timeout=10):
        rest = ws_url.split("://", 1)[1]
        hostport, path = rest.split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("CDP closed during the WebSocket handshake")
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status + b" ":
            raise ConnectionError(f"CDP refused the WebSocket upgrade: {status.decode(errors='replace')}")
        self.next_id = 0

    def close(self):
        self.sock.close()

    def _exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("CDP connection closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _frame(self):
        """One message (continuation frames joined); control frames are skipped."""
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self._exact(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self._exact(8))
            mask = self._exact(4) if b1 & 0x80 else None
            data = self._exact(n)
            if mask:
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 8:
                raise ConnectionError("CDP sent close")
            if opcode in (0, 1, 2):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts)

    def send(self, method, **params):
        return self.send_to(None, method, **params)

    def send_to(self, session_id, method, **params):
        """A command to one attached target (`Target.attachToTarget` with `flatten=True` gives the session id),
        or to the browser when `session_id` is None."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session_id is not None:
            message["sessionId"] = session_id
        payload = json.dumps(message).encode()
        n = len(payload)
        if n < 126:
            head = bytes([0x81, 0x80 | n])
        elif n < 65536:
            head = bytes([0x81, 0x80 | 126]) + struct.pack(">H", n)
        else:
            head = bytes([0x81, 0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))
        while True:
            msg = json.loads(self._frame())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
