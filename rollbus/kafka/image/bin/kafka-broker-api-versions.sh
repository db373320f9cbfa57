#!/usr/bin/env python3
"""Health check: the broker answers an ApiVersions request (what apache/kafka's script of this name proves).
Only `--bootstrap-server HOST:PORT` is read; exit 0 when the broker answers with error code 0."""
import socket
import struct
import sys

args = sys.argv[1:]
server = args[args.index("--bootstrap-server") + 1] if "--bootstrap-server" in args else "localhost:9092"
host, _, port = server.rpartition(":")
client = b"health"
body = struct.pack(">hhih", 18, 0, 1, len(client)) + client  # ApiVersions v0, correlation id 1
try:
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", sock.recv(4))[0]
        reply = b""
        while len(reply) < size:
            chunk = sock.recv(size - len(reply))
            if not chunk:
                break
            reply += chunk
except OSError as exc:
    print(f"{server}: {exc}", file=sys.stderr)
    sys.exit(1)
correlation, error = struct.unpack(">ih", reply[:6])
sys.exit(0 if correlation == 1 and error == 0 else 1)
