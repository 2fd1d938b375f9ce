"""The least a CONNECT proxy can do, as a yardstick for scripts/tunnel-ceiling: read the CONNECT
head, connect, answer 200, then splice(2) socket -> pipe -> socket in one blocking thread per
direction. No routing, no limits, no logging, no event loop.

    python3 splice_relay.py PORT
"""

import fcntl
import os
import socket
import sys
import threading

F_SETPIPE_SZ = 1031


def one_way(src: socket.socket, dst: socket.socket) -> None:
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
    except OSError:
        pass
    try:
        while True:
            n = os.splice(src.fileno(), w, 1 << 20)
            if n == 0:
                break
            while n:
                n -= os.splice(r, dst.fileno(), n)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(r)
        os.close(w)


def serve(conn: socket.socket) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        b = conn.recv(1)
        if not b:
            return
        head += b
    host, port = head.split()[1].decode().rsplit(":", 1)
    up = socket.create_connection((host, int(port)))
    conn.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
    down = threading.Thread(target=one_way, args=(up, conn))
    down.start()
    one_way(conn, up)
    down.join()
    conn.close()
    up.close()


def main() -> None:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", int(sys.argv[1])))
    ls.listen(64)
    while True:
        c, _ = ls.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


if __name__ == "__main__":
    main()
