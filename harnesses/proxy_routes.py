"""Where the model proxy listens on the host, and how a sandbox reaches it
(:class:`ProxyRoute`, :func:`route_to_host`); the runtime makes the route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtimes import Runtime
from runtimes.errors import HostRouteError
from runtimes.routes import HostRoute

from .errors import ProxyRouteError

if TYPE_CHECKING:
    from .proxy import ModelProxy

__all__ = ["ProxyRoute", "route_to_host"]


@dataclass
class ProxyRoute:
    """Where the proxy listens on the host, and how the sandbox reaches it.

    ``via`` is a route of the runtime (:mod:`runtimes.routes`: ``"channel"``, a relay over
    the sandbox's channel, the default where it runs; ``"loopback"``; ``"gateway"``;
    ``"forward"``) or ``"url"`` (a URL the user exposed, e.g. a tunnel). The runtime makes
    the route (:meth:`runtimes.base.Runtime.expose_host`); this module never probes the
    sandbox itself.
    """

    bind_host: str
    via: str
    url: str | None = None
    exposed: HostRoute | None = None

    async def sandbox_base_url(self, runtime: Runtime, proxy: ModelProxy) -> str:
        """The proxy's base URL as seen from inside the sandbox.

        Raises:
            HostRouteError: the route could not be made (the channel is down, the forward
                was refused...).
            SandboxError: the sandbox failed.
        """
        if self.url is not None:
            return self.url.rstrip("/")
        self.exposed = await runtime.expose_host(proxy.port, via=self.via)
        return self.exposed.url("/v1")

    def lost(self) -> str | None:
        """Why the route stopped carrying traffic (its channel relay died), or ``None``."""
        return self.exposed.lost() if self.exposed is not None else None

    async def release(self, runtime: Runtime) -> None:
        """Undo what :meth:`sandbox_base_url` set up (a relay, an SSH reverse forward).

        Raises:
            SandboxError: the sandbox failed while undoing it.
        """
        exposed, self.exposed = self.exposed, None
        if exposed is not None:
            await exposed.close()


async def route_to_host(
    runtime: Runtime,
    *,
    proxy_url: str | None = None,
    bind_host: str | None = None,
    via: str | None = None,
) -> ProxyRoute:
    """How a process in ``runtime`` can reach a proxy on this host: the runtime's default
    route (:meth:`runtimes.base.Runtime.host_routes`), or ``via`` when given.

    ``proxy_url`` (a URL the user made reachable from the sandbox, e.g. a tunnel) and
    ``bind_host`` override the choice.

    Raises:
        ProxyRouteError: the sandbox has no such route (or none); the message says what to
            configure.
        SandboxError: probing the sandbox failed.
    """
    if proxy_url is not None:
        return ProxyRoute(bind_host=bind_host or "127.0.0.1", via="url", url=proxy_url)
    try:
        kind, address = await runtime.plan_host_route(via)
    except HostRouteError as exc:
        raise ProxyRouteError(f"no route to the model proxy: {exc}") from exc
    return ProxyRoute(bind_host=bind_host or address, via=kind)
