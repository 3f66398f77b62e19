"""Server and child processes that cannot outlive the process that started them: free
loopback ports, a process group of their own, the kernel's death signal, and an atexit
handler for whatever the context managers did not stop."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import IO

logger = logging.getLogger("splu.deploy")

HOST = "127.0.0.1"

# Both servers answer within tens of milliseconds, so poll often rather than sleep long.
_READY_POLL_SECONDS = 0.02
PORT_ATTEMPTS = 3  # starts on fresh ports when another process took the last ones first
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 20


class ServerStartError(RuntimeError):
    """A server exited or did not answer while starting; the message ends with its log."""


class PortTakenError(ServerStartError):
    """Another process listens on the port a server was to take."""


# Ports free_port() handed out: the kernel may offer a closed port again at once, and two
# servers of this process (a cluster's nodes, each with a bus port) would then share one.
_handed_out: set[int] = set()
# The second field of /proc/net/tcp's rows is local address:port, the fourth the state
# (0A: listening), the tenth the socket's inode.
_LISTEN = "0A"


def free_port() -> int:
    """A loopback port that is free now and not handed out before by this process. Another
    process can still take it before the server binds it: `Server.start` checks."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _listens_on(group: int, port: int) -> bool | None:
    """Whether a process of process group `group` holds the socket listening on `port`:
    None if no socket listens there, True where the system has no /proc/net/tcp to tell."""
    if not Path("/proc/net/tcp").exists():
        return True
    sockets = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        with suppress(OSError):
            for row in table.read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError):
            if os.getpgid(int(entry.name)) == group and any(
                str(fd.readlink()) in sockets for fd in (entry / "fd").iterdir()
            ):
                return True
    return False


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn that makes the kernel SIGKILL the child when its parent dies.

    The atexit handler and the context manager do not run when this process is SIGKILLed or
    crashes hard; PR_SET_PDEATHSIG survives exec, so the server itself gets the signal then.
    Linux sends it when the *thread* that forked exits, so start servers from a thread that
    outlives them (normally the main thread).
    """

    def set_death_signal() -> None:
        if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        # The parent may have died between fork and prctl; nobody would send the signal then.
        if os.getppid() != parent:
            os._exit(1)

    return set_death_signal


class Server:
    """A server subprocess, alone in its process group, that cannot outlive this process.

    The own process group (a new session) keeps a terminal's Ctrl-C away from the server, so
    that the context manager, not the signal, decides the order of shutdown, and lets stop()
    and kill() reach everything the server forked (Redis forks to rewrite its AOF).
    """

    name = "server"

    def __init__(
        self, port: int | None, log_path: Path | None, env: Mapping[str, str] | None = None
    ) -> None:
        # A port chosen here is chosen again if another process takes it first; one the
        # caller gave, or one a client already knows (after a start), is kept.
        self._port_chosen = port is None
        self.port = port or free_port()
        self.log_path = log_path
        self.env = env
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (to signal it, or to find it among processes)."""
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process ended by itself (None while it runs)."""
        return None if self._process is None else self._process.poll()

    @property
    def running(self) -> bool:
        """False once stopped or killed, and also when the server died on its own."""
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and return once it answers a real request, not just a connect,
        on a port it listens on itself. If another process took a port chosen here first,
        start on fresh ports."""
        if self.running:
            raise RuntimeError(f"{self.name} already runs (pid {self.pid})")
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start_once(timeout)
                break
            except PortTakenError:
                if not self._port_chosen or attempt == PORT_ATTEMPTS - 1:
                    raise
                self._choose_ports()
        self._port_chosen = False

    def _ports(self) -> list[int]:
        return [self.port]

    def _choose_ports(self) -> None:
        self.port = free_port()

    def _taken(self) -> int | None:
        """A port of this server that another process listens on, if any."""
        assert self._process is not None
        group = self._process.pid
        return next((p for p in self._ports() if _listens_on(group, p) is False), None)

    def _start_once(self, timeout: float) -> None:
        # Reaps a server that died on its own, and whatever it left in its process group.
        self.kill()
        started = time.monotonic()
        self._process = self._spawn(self._command())
        _started.add(self)
        try:
            self._wait_until_ready(started + timeout)
        except BaseException:
            self.kill()
            raise
        logger.info(
            "started %s pid %d: %s, ready in %.0f ms",
            self.name,
            self._process.pid,
            self._describe(),
            (time.monotonic() - started) * 1000,
        )

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group so the server shuts down cleanly; SIGKILL it after timeout."""
        if self._process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._process.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL the process group: a crash."""
        if self._process is None:
            return
        self._signal_group(signal.SIGKILL)
        self._process.wait()
        self._forget()

    def restart(self, timeout: float = 10.0) -> None:
        """A clean stop and a start on the same port (and, for Redis, the same data dir)."""
        self.stop()
        self.start(timeout)

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    def _spawn(self, command: list[str]) -> subprocess.Popen[bytes]:
        death_signal = _die_with_parent(os.getpid()) if sys.platform == "linux" else None
        output: IO[bytes] | int = (
            subprocess.DEVNULL if self.log_path is None else self.log_path.open("ab")
        )
        try:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=death_signal,
                env=self.env,
            )
        finally:
            if not isinstance(output, int):
                output.close()

    def _wait_until_ready(self, deadline: float) -> None:
        assert self._process is not None
        while not (self._answers() and self._listens()):
            code = self._process.poll()
            ended = code is not None or time.monotonic() > deadline
            if ended and (port := self._taken()) is not None:
                raise PortTakenError(
                    f"{self.name} found another process listening on {HOST}:{port}"
                    f"{self._log_tail()}"
                )
            if code is not None:
                raise ServerStartError(f"{self.name} exited with code {code}{self._log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer on {HOST}:{self.port}{self._log_tail()}"
                )
            time.sleep(_READY_POLL_SECONDS)

    def _listens(self) -> bool:
        """Whether the server's own process group holds the socket listening on its port,
        not another process that took the port first (its answers would pass for ours)."""
        assert self._process is not None
        return _listens_on(self._process.pid, self.port) is True

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        return f"; end of {self.log_path}:\n" + "\n".join(lines)

    def _signal_group(self, signum: int) -> None:
        assert self._process is not None
        with suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def _forget(self) -> None:
        self._process = None
        _started.discard(self)


class ManagedProcess(Server):
    """Any child, such as a stream worker, with the servers' guarantee: it cannot outlive us."""

    name = "process"

    def __init__(
        self, command: list[str], env: Mapping[str, str] | None = None, log_path: Path | None = None
    ) -> None:
        super().__init__(None, log_path, env)
        self.command = command

    def _command(self) -> list[str]:
        return self.command

    def _answers(self) -> bool:
        return True

    def _ports(self) -> list[int]:
        return []

    def _listens(self) -> bool:
        return True

    def _describe(self) -> str:
        return " ".join(self.command[:4])


def spawn(
    command: list[str], env: Mapping[str, str] | None = None, log_path: Path | None = None
) -> ManagedProcess:
    """Start `command` in its own process group, killed by the kernel if this process dies."""
    process = ManagedProcess(command, env, log_path)
    process.start()
    return process


# Servers started and not yet stopped, for the atexit handler: it stops servers started without
# the context manager (benchmarks, tests) and those whose stop() a Ctrl-C interrupted.
_started: set[Server] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_started):
        server.stop(timeout=2.0)
