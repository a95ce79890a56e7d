"""Run inside a harness's sandbox: a loopback port forwarded to the session endpoint's unix socket.

Contract: ``python relay.py SOCKET PORT READY`` listens on ``127.0.0.1:PORT`` (the sandbox's own
network namespace, where nothing else is reachable), creates the file ``READY`` once it listens,
and forwards each connection, both ways, to the unix socket ``SOCKET`` (the session endpoint,
bound into the sandbox). A harness's HTTP client uses ``http://127.0.0.1:PORT/v1`` as any base
URL. Standard library only: it runs on the sandbox's Python without Shipyard importable. It lives
as long as the harness: the sandbox kills it when the harness's command ends.
"""

import contextlib
import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing side."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def forward(conn: socket.socket, path: str) -> None:
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        return
    back = threading.Thread(target=pump, args=(up, conn), daemon=True)
    back.start()
    pump(conn, up)
    back.join()
    conn.close()
    up.close()


def main() -> None:
    path, port, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)
    open(ready, "w").close()
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=forward, args=(conn, path), daemon=True).start()


if __name__ == "__main__":
    main()
