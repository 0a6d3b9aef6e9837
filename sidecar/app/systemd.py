"""systemd's notify protocol (sd_notify): READY=1, WATCHDOG=1, STOPPING=1 datagrams.

Does nothing unless ``$NOTIFY_SOCKET`` is set. The watchdog period comes from ``$WATCHDOG_USEC``
(set by systemd when the unit has ``WatchdogSec=``); the server pings at half of it from its event
loop, so a wedged loop stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import os
import socket


class SystemdNotifier:
    """Sends notify datagrams to ``$NOTIFY_SOCKET`` (path or abstract ``@name``)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address: str | None = None
        if address:
            # An abstract socket is given as "@name" and addressed with a leading NUL byte.
            self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        applies = not pid or pid == str(os.getpid())
        self.watchdog_interval: float | None = (
            int(usec) / 1_000_000 / 2 if usec.isdigit() and int(usec) > 0 and applies else None
        )

    def notify(self, state: str) -> bool:
        """Send one state string; returns False when disabled or the socket is gone."""
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall(state.encode())
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")
