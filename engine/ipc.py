"""ZMQ sockets between the frontend and the EngineCore: addresses, options, high-water marks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import zmq

# Messages queued per socket before a send pushes back.
SOCKET_HWM = 1000


def make_socket(ctx: zmq.Context, kind: int, addr: str, *, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
    sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class Endpoints:
    """A pair of addresses: IPC sockets in a private (0700) folder, or TCP on a host."""

    def __init__(self, transport: str, host: str = "127.0.0.1") -> None:
        self.transport = transport
        self.folder: Path | None = None
        if transport == "ipc":
            # mkdtemp creates the folder 0700: only this user can reach the sockets.
            self.folder = Path(tempfile.mkdtemp(prefix="lumen-"))
            self.input = f"ipc://{self.folder}/input"
            self.output = f"ipc://{self.folder}/output"
        elif transport == "tcp":
            self.input = f"tcp://{host}:*"
            self.output = f"tcp://{host}:*"
        else:
            raise ValueError(f"transport must be ipc or tcp, not {transport!r}")

    def bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """Bind the frontend's two sockets; a TCP wildcard port becomes the real one."""
        in_sock = make_socket(ctx, zmq.PUSH, self.input, bind=True)
        out_sock = make_socket(ctx, zmq.PULL, self.output, bind=True)
        self.input = in_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output = out_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return in_sock, out_sock

    def cleanup(self) -> None:
        if self.folder is not None:
            for name in ("input", "output"):
                (self.folder / name).unlink(missing_ok=True)
            self.folder.rmdir()
            self.folder = None
