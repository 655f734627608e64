"""How a process inside a sandbox reaches a port on the host: :class:`HostRoute`.

A runtime says which routes it has (:meth:`runtimes.base.Runtime.host_routes`, preferred
first) and makes one (:meth:`runtimes.base.Runtime.expose_host`). The routes:

``channel``
    A listener on the sandbox's loopback whose connections the channel agent relays, as
    opaque byte streams over the authenticated channel, to ``127.0.0.1:<port>`` on the host
    (``docs/channel.md``, "Relay"). Needs the channel (python3 in the sandbox), nothing of
    the sandbox's network: works with Docker ``network="none"``, SSH without forwarding,
    Modal. The default wherever the channel runs.
``loopback``
    The sandbox shares the host's network namespace (the subprocess runtime, Docker
    ``network="host"``): ``127.0.0.1:<port>`` as it is.
``gateway``
    The sandbox's default gateway is this host (a Docker bridge): the service must listen on
    the gateway's address (:meth:`~runtimes.base.Runtime.plan_host_route` says which).
``forward``
    A reverse port forward of the backend's connection (SSH ``-R``; a ray sandbox: its node's
    actor relays to the driver, ``docs/ray.md``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .errors import HostRouteError

if TYPE_CHECKING:
    from .channel import ChannelSupervisor

__all__ = ["ROUTES", "HostRoute", "RouteKind", "channel_route", "choose_route"]

RouteKind = Literal["channel", "loopback", "gateway", "forward"]
ROUTES: tuple[RouteKind, ...] = ("channel", "loopback", "gateway", "forward")


def _never_lost() -> str | None:
    return None


@dataclass(eq=False)
class HostRoute:
    """A host port made reachable from inside a sandbox: connect to ``host:port`` there.

    ``via`` names the route. A ``channel`` route dies with its channel: :meth:`lost` then
    says why and :meth:`check` raises. :meth:`close` undoes the route (stops the relay's
    listener, cancels a forward); idempotent.
    """

    via: RouteKind
    host: str
    port: int
    _lost: Callable[[], str | None] = field(default=_never_lost, repr=False)
    _close: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    closed: bool = False

    @property
    def address(self) -> str:
        """``host:port`` as seen from inside the sandbox."""
        return f"{self.host}:{self.port}"

    def url(self, path: str = "") -> str:
        """``http://host:port`` + ``path``."""
        return f"http://{self.address}{path}"

    def lost(self) -> str | None:
        """Why the route stopped working (a channel relay whose channel died), or ``None``."""
        return self._lost()

    def check(self) -> None:
        """Raise if the route stopped working.

        Raises:
            HostRouteError: the relay carrying it died (the message says why).
        """
        reason = self.lost()
        if reason is not None:
            raise HostRouteError(
                f"the {self.via} route to the host port (sandbox {self.address}) stopped: {reason}",
                via=self.via,
            )

    async def close(self) -> None:
        """Undo the route (idempotent).

        Raises:
            SandboxError: the backend failed while undoing it (an SSH forward's cancel).
        """
        if self.closed:
            return
        self.closed = True
        if self._close is not None:
            await self._close()


async def channel_route(supervisor: ChannelSupervisor, port: int) -> HostRoute:
    """A ``channel`` route: a relay listener in the sandbox to ``127.0.0.1:port`` here.

    Raises:
        HostRouteError: the channel cannot relay (down, distrusted, no python3) or the
            agent could not listen.
        SandboxUnavailableError: the sandbox stopped answering.
    """
    listener = await supervisor.listen(("127.0.0.1", port))
    return HostRoute(
        "channel",
        "127.0.0.1",
        listener.sandbox_port,
        _lost=lambda: listener.lost,
        _close=listener.aclose,
    )


def choose_route(
    available: Sequence[RouteKind], via: str | None, describe: str, hint: str = ""
) -> RouteKind:
    """``via`` if this sandbox has that route, else the first one it has.

    Raises:
        HostRouteError: ``via`` is not a route of this sandbox, or it has none; the message
            lists what it has and ``hint`` (what to configure).
    """
    if via is not None and via not in ROUTES:
        raise HostRouteError(f"unknown route {via!r}: one of {', '.join(ROUTES)}", via=via)
    if via is None and available:
        return available[0]
    if via is not None and via in available:
        return via
    have = ", ".join(available) if available else "none"
    wanted = f"the {via!r} route" if via else "a route"
    raise HostRouteError(
        f"{describe} has no {wanted} to the host (its routes: {have})"
        + (f". {hint}" if hint else ""),
        via=via,
    )
