"""The rate of one launch/cluster link, measured once with a short TCP transfer.

    python launch/cluster_rate.py serve ADDR PORT           # on the receiving node
    python launch/cluster_rate.py send ADDR PORT SECONDS RATE SRC DST
    python launch/cluster_rate.py listen ADDR COUNT SECONDS  # the head: prints its port
    python launch/cluster_rate.py reach ADDR PORT SECONDS    # on a node: connect, retrying

The sender streams 1 MiB writes for SECONDS; the receiver times the bytes from
the first to the last and sends back "bytes seconds"; the sender prints one
line: the rate (TCP payload; headers are about 4 % of a 1500-byte frame) and
how it compares with RATE, the rate tc was given ("none": unshaped).

listen and reach are the build's readiness check: a node's veth and the
bridge port come up asynchronously, and an Open MPI daemon started on a node
that cannot reach the head yet exits before it reports back. The head accepts
COUNT connections (one per node) within SECONDS; each node retries until its
connection is accepted.
"""
import re
import socket
import sys
import time

UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def rate_bits(text: str):
    """tc's rate syntax (1gbit, 500mbit, 100mbps, ...) in bits/s, or None."""
    m = re.fullmatch(r"([0-9.]+)([a-z]*)", text.strip().lower())
    if not m or m.group(2) not in UNITS:
        return None
    return float(m.group(1)) * UNITS[m.group(2)]


def serve(addr, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(1)
    s.settimeout(30)
    c, _ = s.accept()
    buf, n, t0, t1 = bytearray(1 << 20), 0, None, None
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        t1 = time.perf_counter()
        t0 = t1 if t0 is None else t0
        n += k
    c.sendall(f"{n} {(t1 or 0) - (t0 or 0):.6f}".encode())
    c.close()


def send(addr, port, seconds, asked, src, dst):
    deadline = time.monotonic() + 10
    while True:                                  # the receiver may not listen yet
        try:
            c = socket.create_connection((addr, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    buf = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
    n, t = c.makefile().read().split()
    bits = int(n) * 8 / max(float(t), 1e-9)
    want = rate_bits(asked) if asked != "none" else None
    if want is None:
        verdict = "unshaped" if asked == "none" else f"asked {asked}"
    else:
        off = bits / want - 1
        verdict = (f"asked {asked}: {'within' if abs(off) <= 0.10 else 'OFF BY'} {abs(off) * 100:.0f} %"
                   f"{' (this machine cannot fill the link: see docs/multinode.md)' if off < -0.10 else ''}")
    print(f"  link {src} -> {dst}: {bits / 1e9:.3f} Gbit/s measured ({int(n) / 2**20:.0f} MiB in {float(t):.2f} s "
          f"of TCP), {verdict}")


def listen(addr, count, seconds):
    s = socket.socket()
    s.bind((addr, 0))
    s.listen(count)
    print(s.getsockname()[1], flush=True)
    deadline = time.monotonic() + seconds
    for _ in range(count):
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            s.accept()[0].close()
        except OSError:
            sys.exit(1)


def reach(addr, port, seconds):
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(1)
            time.sleep(0.05)


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[:1] == ["serve"] and len(a) == 3:
        serve(a[1], int(a[2]))
    elif a[:1] == ["send"] and len(a) == 7:
        send(a[1], int(a[2]), float(a[3]), a[4], a[5], a[6])
    elif a[:1] == ["listen"] and len(a) == 4:
        listen(a[1], int(a[2]), float(a[3]))
    elif a[:1] == ["reach"] and len(a) == 4:
        reach(a[1], int(a[2]), float(a[3]))
    else:
        sys.exit(__doc__)
