"""The grader's launcher inside a test container, shipped read-only to ``/eval/plugins`` (``rollbus_launch``).

Run as the grading command itself (``python3 -I -S rollbus_launch.py SOCKET CMD...``), before any code of the
repository: it connects to the grader's socket (:class:`rollbus.grading.channel.SocketChannel`, whose host
end accepts this one connection and then removes the socket), reads the configuration, puts it into a pipe
of its own and becomes ``CMD`` (``exec``) holding the pipe's two ends and the connection, the configuration
pipe's number in ``ROLLBUS_CHANNEL``: the descriptors bwrap's command inherits from the host, so
:mod:`rollbus_channel` claims them the same way. Without a channel (no socket: a run outside the grader)
``CMD`` runs reporting nothing. Imports nothing of rollbus; runs under the image's Python.
"""

import json
import os
import socket
import sys


def channel(path):
    """The configuration pipe's read end (its write end and the connection inheritable too), or None."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        data = b""
        while len(data) < 1 << 16:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        config = json.loads(data)
        read, write = os.pipe()
        config["report_fd"], config["refill_fd"] = conn.fileno(), write
        os.write(write, (json.dumps(config) + "\n").encode())
    except (OSError, ValueError, TypeError):
        conn.close()
        return None
    for fd in (read, write, conn.detach()):
        os.set_inheritable(fd, True)
    return read


def main(argv):
    path, command = argv[1], argv[2:]
    fd = channel(path)
    if fd is not None:
        os.environ["ROLLBUS_CHANNEL"] = str(fd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
