"""Routes from inside a sandbox to a port on the host: the public face of
:class:`~runtimes.base.Runtime` (``host_routes``, ``plan_host_route``, ``expose_host``)
and the hooks a backend overrides for the routes it makes itself
(``_host_routes``, ``_host_bind_address``, ``_expose_host``, ``_route_hint``). The kinds
and the channel's relay live in :mod:`.routes`.
"""

from __future__ import annotations

from .errors import HostRouteError, SandboxInvalidArgumentError
from .guards import Guarded
from .lifecycle import State
from .routes import HostRoute, RouteKind, channel_route, choose_route


class HostRouting(Guarded):
    """Routes to the host (see the module)."""

    def host_routes(self) -> tuple[RouteKind, ...]:
        """The routes by which a process in this sandbox can reach a port on the host,
        the default first (see :mod:`runtimes.routes`). Empty: none."""
        return self._all_host_routes() if self._state == State.OPEN else ()

    async def plan_host_route(self, via: str | None = None) -> tuple[RouteKind, str]:
        """The route :meth:`expose_host` will take (``via``, or the default) and the host
        address the service must listen on for it (``127.0.0.1`` except for ``gateway``).

        Raises:
            HostRouteError: the sandbox has no such route (or none); the message says what
                to configure.
            SandboxUnavailableError: the sandbox is closed.
            SandboxError: probing the sandbox failed.
        """
        self._check_open()
        kind = choose_route(self._all_host_routes(), via, self.describe(), self._route_hint())
        with self._guard("planning a route to the host"):
            return kind, await self._host_bind_address(kind)

    async def expose_host(self, port: int, *, via: str | None = None) -> HostRoute:
        """Make ``port`` of the host (listening on :meth:`plan_host_route`'s address)
        reachable from inside the sandbox; close the returned route when done (the runtime's
        ``close()`` ends it too).

        Raises:
            HostRouteError: no such route, or it could not be made (the channel is down,
                the agent could not listen, the forward was refused).
            SandboxInvalidArgumentError: ``port`` is not a TCP port.
            SandboxUnavailableError: the sandbox is closed or stopped answering.
        """
        self._check_open()
        if not 0 < port < 65536:
            raise SandboxInvalidArgumentError(f"not a TCP port: {port}")
        kind = choose_route(self._all_host_routes(), via, self.describe(), self._route_hint())
        with self._guard("exposing a host port"):
            if kind == "channel":
                return await channel_route(self._require_supervisor(), port)
            return await self._expose_host(port, kind)

    def _all_host_routes(self) -> tuple[RouteKind, ...]:
        """The backend's routes with the channel's relay: after ``loopback`` (no hop at
        all), before the rest (it needs no network)."""
        own = self._host_routes()
        channel = self._supervisor
        if channel is None or not channel.can_relay:
            return own
        direct = tuple(kind for kind in own if kind == "loopback")
        return (*direct, "channel", *(kind for kind in own if kind != "loopback"))

    # ------------------------------------------------------------------ backend hooks

    def _host_routes(self) -> tuple[RouteKind, ...]:
        """The routes this backend makes itself, the default first (the base adds the
        channel's relay)."""
        return ()

    def _route_hint(self) -> str:
        """What to configure for a route (for :class:`HostRouteError` messages)."""
        return ""

    async def _host_bind_address(self, via: RouteKind) -> str:
        """Where a host service must listen for ``via`` (one of :meth:`_host_routes`)."""
        return "127.0.0.1"

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """Make the route (``via`` is one of :meth:`_host_routes`, never ``channel``)."""
        raise HostRouteError(f"{self.describe()} cannot make a {via!r} route", via=via)
