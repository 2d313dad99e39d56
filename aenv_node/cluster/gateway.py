"""The gateway (``aenv-node gateway``, :8080): the whole E2B API and the sandbox traffic proxy in front of the
cluster's nodes, keeping nothing itself (the scheduler knows where each sandbox lives), so that several replicas
behind one address answer alike.

What it does with a request:

- sandbox traffic (``E2b-Sandbox-Id`` headers, ``{port}-{id}.{domain}`` hosts) goes, as it is, to the node the
  sandbox is bound to, whose own proxy takes it into the sandbox (nodes and gateways share ``api.domain``);
- a create asks the scheduler for a node, sends the create there and binds the new sandbox to it; a node that
  fails the create (it does not answer, or answers 5xx) gives its share back and the next node is tried, at most
  ``create_attempts`` nodes;
- a call about one sandbox goes to its node; a fork binds its children to the parent's node, a kill unbinds;
- listings (sandboxes, snapshots, templates, metrics) ask every live node and merge (``merge.py``); a node that
  fails its part is named in ``x-aenv-missing-nodes`` and left out;
- template calls go to the node holding the template (found by asking the nodes, remembered), and a new template
  to the node the scheduler picks.

Requests are forwarded with the node proxy's own streaming forwarder (``api.proxy.SandboxProxy.forward``):
bodies and responses stream both ways, WebSockets are relayed. Only creates, forks and listings, whose answers
the gateway reads, are buffered (JSON of at most ``MAX_JSON_BODY``).

One API key for the cluster: the gateway checks ``X-API-KEY`` against it and forwards it; nodes and the scheduler
are configured with the same key.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Optional
from urllib.parse import parse_qs

import httpx
import trio
from hypercorn.trio import serve

from ..api.proxy import SandboxProxy
from ..api.request_head import limit_request_head
from ..api.server import api_hypercorn_config, shield_last_send
from ..api.traffic import Message, Receive, Resolution, Scope, Send, Target, error_body, forwardable, header
from ..runtime.errors import SandboxNotRunning
from .gateway_io import Answer, Passed, Reply, host_port, json_field, read_body, replay
from .merge import (
    SandboxPage,
    listed_twice,
    merge_running,
    merge_sandbox_pages,
    merge_snapshots,
    merge_templates,
    page_templates,
    without_stale,
)
from .models import NodeView, Placement, PlacementRequest
from .scheduler_client import NoPlacement, SchedulerClient, SchedulerUnavailable

__all__ = ["Gateway", "run_gateway"]

log = logging.getLogger(__name__)

_SANDBOX = re.compile(r"^/(?:v2/)?sandboxes/(?P<id>[^/]+)(?P<rest>/[^/]+)?/?$")
_TEMPLATE = re.compile(r"^/(?:v2/)?templates/(?P<id>[^/]+)(?:/.*)?$")
_ALIAS = re.compile(r"^/templates/aliases/(?P<alias>[^/]+)/?$")
_LINEAGE = re.compile(r"^/snapshots/(?P<id>[^/]+)/lineage/?$")
#: how old a template listing a create reads its template's vCPUs and memory from may be (a template's
#: resources change only with a new build)
TEMPLATE_LIST_MAX_AGE_S = 10.0
#: request headers the gateway's own calls to a node do not pass on (httpx sets them)
_OWN = frozenset({b"host", b"content-length", b"accept-encoding"})


class Gateway:
    """The gateway's ASGI application (``asgi``), over a scheduler client it owns."""

    def __init__(self, scheduler: SchedulerClient, api_key: str, *, domain: str = "", create_attempts: int = 3,
                 default_cpu_count: int = 2, default_memory_mb: int = 512, node_timeout_s: float = 600.0) -> None:
        self.scheduler = scheduler
        self.api_key = api_key
        self.create_attempts = create_attempts
        self.default_cpu_count = default_cpu_count
        self.default_memory_mb = default_memory_mb
        # a create or a fork waits for its node (seconds under TCG); connecting to a node must be quick
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(node_timeout_s, connect=5.0))
        #: traffic of sandboxes, to their nodes; everything else reaches the API part
        self.asgi = SandboxProxy(self._api, self._sandbox_node, domain, keepalive=False)
        #: API requests, to a node by its id (pooled: one gateway talks to few nodes, often)
        self._to_node = SandboxProxy(self._api, self._node_address, keepalive=True)
        #: template id or alias -> the node holding it, as last found
        self._templates: dict[str, str] = {}
        #: the last merged template listing, and when (trio's clock)
        self._template_list: Optional[tuple[float, list[dict[str, Any]]]] = None

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.asgi.aclose()
            await self._to_node.aclose()
            await self._http.aclose()
            await self.scheduler.aclose()

    # ----- resolvers of the two forwarders ------------------------------------------------------

    async def _sandbox_node(self, sandbox_id: str, port: int) -> Resolution:
        try:
            bound = await self.scheduler.lookup(sandbox_id)
        except SchedulerUnavailable as exc:
            raise SandboxNotRunning(str(exc)) from exc
        # a node whose heartbeats the scheduler missed (its TTL passed while the scheduler restarted, say) may
        # well be serving: liveness decides placement, not whether an existing sandbox is tried
        if bound is None or bound.node is None:
            raise SandboxNotRunning(f"sandbox {sandbox_id} is bound to no known node")
        host, node_port = host_port(bound.node.status.url)
        return Resolution(host=host, port_map=lambda _p: node_port)

    async def _node_address(self, node_id: str, port: int) -> Resolution:
        view = await self.scheduler.node(node_id)
        if view is None:
            raise SandboxNotRunning(f"node {node_id} is not registered")
        host, node_port = host_port(view.status.url)
        return Resolution(host=host, port_map=lambda _p: node_port)

    # ----- the API --------------------------------------------------------------------------------

    async def _api(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008, "reason": "not a sandbox's traffic"})
            return
        try:
            await self._route(scope, receive, send)
        except Answer as exc:
            await Reply(exc.status, error_body(exc.status, exc.message),
                         [(b"content-type", b"application/json")]).send(send)
        except SchedulerUnavailable as exc:
            log.warning("%s", exc)
            await Reply(503, error_body(503, f"the cluster's scheduler is unavailable: {exc}"),
                         [(b"content-type", b"application/json")]).send(send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/health":
            await Reply.json(200, {"status": "ok"}).send(send)
            return
        given = header(scope["headers"], b"x-api-key") or ""
        if not given:
            raise Answer(401, "missing X-API-KEY header")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise Answer(401, "invalid API key")
        query = scope.get("query_string", b"").decode("latin-1")
        if path in ("/sandboxes", "/v2/sandboxes", "/sandboxes/", "/v2/sandboxes/"):
            if method == "POST":
                await (await self._create(scope, receive)).send(send)
            elif method == "GET":
                await (await self._list_sandboxes(scope, query, paged=path.startswith("/v2"))).send(send)
            else:
                raise Answer(405, f"method {method} is not allowed on {path}")
            return
        if path == "/sandboxes/metrics" and method == "GET":
            await (await self._merged_metrics(scope, query)).send(send)
            return
        if m := _SANDBOX.match(path):
            await self._sandbox_call(scope, receive, send, m["id"], m["rest"] or "")
            return
        if path == "/snapshots" and method == "GET":
            await (await self._list_snapshots(scope, query)).send(send)
            return
        if m := _LINEAGE.match(path):
            await (await self._first_found(scope, b"")).send(send)
            return
        if path in ("/templates", "/v2/templates") and method == "GET":
            await (await self._list_templates(scope, query, paged=path.startswith("/v2"))).send(send)
            return
        if path == "/v3/templates" and method == "POST":
            await (await self._register_template(scope, receive)).send(send)
            return
        if path == "/templates/tags" and method in ("POST", "DELETE"):
            body = await read_body(receive)
            name = json_field(body, "target" if method == "POST" else "name")
            await self._forward_to(scope, replay(body), send, await self._template_node(scope, name))
            return
        if m := _ALIAS.match(path):
            await self._forward_to(scope, receive, send, await self._template_node(scope, m["alias"]))
            return
        if (m := _TEMPLATE.match(path)) and method == "DELETE" and path.rstrip("/").count("/") == 2:
            await (await self._delete_everywhere(scope)).send(send)
            return
        if m := _TEMPLATE.match(path):
            await self._forward_to(scope, receive, send, await self._template_node(scope, m["id"]))
            return
        if path == "/openapi.json" and method == "GET":
            nodes = await self.scheduler.alive_nodes()
            if not nodes:
                raise Answer(503, "no live node to describe the API")
            await self._forward_to(scope, receive, send, nodes[0].status.node_id)
            return
        raise Answer(404, f"{method} {path} is not served by the cluster's gateway")

    # ----- forwarding -------------------------------------------------------------------------------

    async def _forward_to(self, scope: Scope, receive: Receive, send: Send, node_id: str) -> None:
        await self._to_node.forward(scope, receive, send, Target(node_id, 0))

    def _headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        return forwardable(scope["headers"], drop=_OWN)

    async def _call(self, node: NodeView | str, scope: Scope, *, method: Optional[str] = None,
                    path: Optional[str] = None, query: str = "", body: bytes = b"") -> httpx.Response:
        """The same request, buffered, to a node (a NodeView, or its URL)."""
        base = node if isinstance(node, str) else node.status.url
        url = base.rstrip("/") + (path or scope["path"]) + (f"?{query}" if query else "")
        return await self._http.request(method or scope["method"], url, content=body or None,
                                        headers=self._headers(scope))

    async def _sandbox_call(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, rest: str) -> None:
        bound = await self.scheduler.lookup(sandbox_id)
        if bound is None:
            raise Answer(404, f"sandbox {sandbox_id} not found")
        method = scope["method"]
        if method == "POST" and rest in ("/resume", "/connect"):
            # its node is gone or drains (or does not answer): a paused (published) sandbox resumes on another
            # node, which imports it from the shared repository and claims it there
            body = await read_body(receive)
            home = bound.node if bound.node is not None and not bound.node.status.draining else None
            if home is not None:
                try:
                    await Reply.of(await self._call(home, scope, body=body)).send(send)
                    return
                except httpx.ConnectError as exc:
                    log.warning("node %s of sandbox %s did not answer: %s", bound.binding.node_id, sandbox_id,
                                exc)
            await (await self._resume_elsewhere(scope, body, sandbox_id, bound.binding.node_id)).send(send)
            return
        if bound.node is None:
            raise Answer(503, f"sandbox {sandbox_id} is on node {bound.binding.node_id}, which the scheduler "
                              "does not know")
        if rest == "/fork" and method == "POST":
            await (await self._fork(scope, receive, bound.node)).send(send)
            return
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self._forward_to(scope, receive, watched, bound.node.status.node_id)
        if method == "DELETE" and not rest and status in (204, 404):
            await self.scheduler.unbind(sandbox_id)

    # ----- creates and forks ----------------------------------------------------------------------

    async def _resources(self, scope: Scope, template: str) -> tuple[int, int]:
        """The vCPUs and memory a sandbox of ``template`` asks for: the template's, as some node lists it."""
        try:
            for item in await self._all_templates(scope, max_age_s=TEMPLATE_LIST_MAX_AGE_S):
                if template in (item.get("templateID"), *item.get("aliases", [])):
                    return int(item["cpuCount"]), int(item["memoryMB"])
        except Answer:
            pass
        return self.default_cpu_count, self.default_memory_mb

    async def _placed(self, scope: Scope, body: bytes, req: PlacementRequest, what: str
                      ) -> tuple[Reply, Optional[Placement], Optional[httpx.Response]]:
        """Send the request to a node the scheduler places it on, then the next, until one takes it (2xx: its
        placement and answer are returned, the caller binds) or refuses it (4xx: the request's own fault, as
        every node would say); a node that does not answer or answers 5xx gives its share back and is left
        out (at most ``create_attempts`` nodes)."""
        excluded = list(req.exclude)
        last: Optional[Reply] = None
        for _ in range(self.create_attempts):
            try:
                placement = await self.scheduler.place(req.model_copy(update={"exclude": excluded}))
            except NoPlacement as exc:
                if last is not None:
                    return last, None, None
                raise Answer(503, f"no node can take the {what}: {exc}") from None
            try:
                r = await self._call(placement.url, scope, body=body)
            except httpx.HTTPError as exc:
                log.warning("%s on node %s failed: %s: %s", what, placement.node_id, type(exc).__name__, exc)
                last = Reply(502, error_body(502, f"node {placement.node_id} failed the {what}: {exc}"),
                              [(b"content-type", b"application/json")])
            else:
                last = Reply.of(r)
                if r.is_success:
                    return last, placement, r
                if r.status_code < 500:
                    await self.scheduler.release(placement)
                    return last, None, None
                log.warning("%s on node %s failed: %d %s", what, placement.node_id, r.status_code, r.text[:300])
            await self.scheduler.release(placement)
            excluded.append(placement.node_id)
        assert last is not None
        return last, None, None

    async def _create(self, scope: Scope, receive: Receive) -> Reply:
        body = await read_body(receive)
        template = json_field(body, "templateID") or "base"
        cpu, memory = await self._resources(scope, template)
        reply, placement, r = await self._placed(scope, body, PlacementRequest(
            template_id=template[:256], cpu_count=cpu, memory_mb=memory), "create")
        if placement is not None and r is not None:
            sandbox_id = str(r.json()["sandboxID"])
            try:
                await self.scheduler.bind(sandbox_id, placement.node_id, placement.placement_id)
            except SchedulerUnavailable:
                await self._discard(placement.url, scope, sandbox_id)
                await self.scheduler.release(placement)
                raise
        return reply

    async def _resume_elsewhere(self, scope: Scope, body: bytes, sandbox_id: str, gone: str) -> Reply:
        reply, placement, _r = await self._placed(scope, body, PlacementRequest(
            template_id="base", cpu_count=self.default_cpu_count, memory_mb=self.default_memory_mb,
            exclude=[gone]), "resume")
        if placement is not None:
            await self.scheduler.bind(sandbox_id, placement.node_id, placement.placement_id)
            log.info("sandbox %s moved from node %s to node %s", sandbox_id, gone, placement.node_id)
        return reply

    async def _discard(self, node_url: str, scope: Scope, sandbox_id: str) -> None:
        """Kill a sandbox the cluster could not bind (unreachable otherwise)."""
        try:
            await self._call(node_url, scope, method="DELETE", path=f"/sandboxes/{sandbox_id}")
        except httpx.HTTPError as exc:
            log.warning("sandbox %s on node %s is bound nowhere and could not be killed: %s", sandbox_id,
                        node_url, exc)

    async def _fork(self, scope: Scope, receive: Receive, node: NodeView) -> Reply:
        """Children stay on the parent's node (they share its memory and disk layers there)."""
        body = await read_body(receive)
        try:
            r = await self._call(node, scope, body=body)
        except httpx.HTTPError as exc:
            raise Answer(502, f"node {node.status.node_id} failed the fork: {exc}") from None
        if r.is_success:
            for child in r.json():
                if isinstance(child, dict) and isinstance(child.get("sandbox"), dict):
                    await self.scheduler.bind(str(child["sandbox"]["sandboxID"]), node)
        return Reply.of(r)

    # ----- listings ---------------------------------------------------------------------------------

    async def _fan_out(self, scope: Scope, query: str, *, path: Optional[str] = None
                       ) -> tuple[list[tuple[NodeView, httpx.Response]], list[str]]:
        """Every live node's answer to the same GET; the nodes that failed to answer."""
        nodes = await self.scheduler.alive_nodes()
        answers: list[tuple[NodeView, httpx.Response]] = []
        missing: list[str] = []

        async def ask(node: NodeView) -> None:
            try:
                answers.append((node, await self._call(node, scope, method="GET", path=path, query=query)))
            except httpx.HTTPError as exc:
                log.warning("listing on node %s failed: %s: %s", node.status.node_id, type(exc).__name__, exc)
                missing.append(node.status.node_id)

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(ask, node)
        for _node, r in answers:
            if not r.is_success:  # a bad query: every node refuses it alike
                raise Passed(Reply.of(r))
        answers.sort(key=lambda a: a[0].status.node_id)
        return answers, sorted(missing)

    @staticmethod
    def _missing(missing: list[str]) -> list[tuple[bytes, bytes]]:
        return [(b"x-aenv-missing-nodes", ",".join(missing).encode())] if missing else []

    async def _list_sandboxes(self, scope: Scope, query: str, *, paged: bool) -> Reply:
        try:
            answers, missing = await self._fan_out(scope, query)
        except Passed as passed:
            return passed.reply
        sent = [(n.status.node_id, r.json()) for n, r in answers]  # each node's page, parsed once
        home: dict[str, Optional[str]] = {}
        for sid in listed_twice(sent):  # rare: a sandbox that moved, still listed by the node it left
            bound = await self.scheduler.lookup(sid)
            home[sid] = bound.binding.node_id if bound is not None else None
        lists = [without_stale(items, node_id, home) for node_id, items in sent]
        if not paged:
            return Reply.json(200, merge_running(lists), self._missing(missing))
        params = parse_qs(query)
        limit = int(params.get("limit", ["100"])[-1])
        descending = params.get("order", ["asc"])[-1] == "desc"
        # a page of a node's that lost a stale item still says whether that node has more after its last
        pages = [SandboxPage(items, bool(r.headers.get("x-next-token")), page[-1] if page else None)
                 for items, (_id, page), (_n, r) in zip(lists, sent, answers)]
        items, token = merge_sandbox_pages(pages, limit=limit, descending=descending)
        headers = self._missing(missing) + ([(b"x-next-token", token.encode())] if token else [])
        return Reply.json(200, items, headers)

    async def _merged_metrics(self, scope: Scope, query: str) -> Reply:
        try:
            answers, missing = await self._fan_out(scope, query)
        except Passed as passed:
            return passed.reply
        merged: dict[str, Any] = {}
        for _n, r in answers:
            merged.update(r.json().get("sandboxes", {}))
        return Reply.json(200, {"sandboxes": merged}, self._missing(missing))

    async def _list_snapshots(self, scope: Scope, query: str) -> Reply:
        try:
            answers, missing = await self._fan_out(scope, query)
        except Passed as passed:
            return passed.reply
        limit = int(parse_qs(query).get("limit", ["100"])[-1])
        return Reply.json(200, merge_snapshots((r.json() for _n, r in answers), limit=limit),
                           self._missing(missing))

    async def _all_templates(self, scope: Scope, *, max_age_s: float = 0.0) -> list[dict[str, Any]]:
        """Every node's templates, merged (and where each is remembered); a listing at most ``max_age_s`` old
        is reused (a create reads its template's resources from it)."""
        if self._template_list is not None and trio.current_time() - self._template_list[0] <= max_age_s:
            return self._template_list[1]
        try:
            answers, _missing = await self._fan_out(scope, "", path="/templates")
        except Passed as passed:
            raise Answer(passed.reply.status, "listing templates failed") from None
        for node, r in answers:
            for item in r.json():
                for name in (item.get("templateID"), *item.get("aliases", [])):
                    if name and name not in self._templates:
                        self._templates[name] = node.status.node_id
        merged = merge_templates(r.json() for _n, r in answers)
        self._template_list = (trio.current_time(), merged)
        return merged

    async def _list_templates(self, scope: Scope, query: str, *, paged: bool) -> Reply:
        if not paged:
            return Reply.json(200, await self._all_templates(scope))
        params = parse_qs(query)
        limit = int(params.get("limit", ["100"])[-1])
        after = params.get("nextToken", [None])[-1]
        return Reply.json(200, page_templates(await self._all_templates(scope), limit=limit, after=after))

    async def _first_found(self, scope: Scope, query: bytes) -> Reply:
        """The answer of the node that knows the object a path names (lineage of a snapshot)."""
        answers: list[Reply] = []
        for node in await self.scheduler.alive_nodes():
            try:
                r = await self._call(node, scope, query=query.decode())
            except httpx.HTTPError:
                continue
            if r.status_code != 404:
                return Reply.of(r)
            answers.append(Reply.of(r))
        if answers:
            return answers[0]
        raise Answer(503, "no live node answered")

    # ----- templates --------------------------------------------------------------------------------

    async def _delete_everywhere(self, scope: Scope) -> Reply:
        """``DELETE /templates/{id}``: a template (or user snapshot) shared through the repository may be on
        several nodes (the one that made it and those that imported it): each deletes its copy, and the first
        also its shared records. 204 if any node had it; a refusal (403 a node's own template, 409 a build in
        progress) before a 404; 404 if none had it."""
        answers: list[httpx.Response] = []

        async def one(node: NodeView) -> None:
            try:
                answers.append(await self._call(node, scope))
            except httpx.HTTPError as exc:
                log.warning("deleting on node %s failed: %s: %s", node.status.node_id, type(exc).__name__, exc)

        async with trio.open_nursery() as nursery:
            for node in await self.scheduler.alive_nodes():
                nursery.start_soon(one, node)
        if any(r.is_success for r in answers):
            return Reply(204, b"", [])
        refused = [r for r in answers if r.status_code != 404]
        if refused or answers:
            return Reply.of((refused or answers)[0])
        raise Answer(503, "no live node answered")

    async def _template_node(self, scope: Scope, name: str) -> str:
        """The node holding template ``name`` (an id, an alias, or ``alias:tag``)."""
        key = name.split(":", 1)[0] if name else name
        if not key:
            nodes = await self.scheduler.alive_nodes()
            if not nodes:
                raise Answer(503, "no live node")
            return nodes[0].status.node_id
        node_id = self._templates.get(key)
        alive = {n.status.node_id for n in await self.scheduler.alive_nodes()}
        if node_id in alive:
            assert node_id is not None
            return node_id
        await self._all_templates(scope)
        node_id = self._templates.get(key)
        if node_id is None or node_id not in alive:
            raise Answer(404, f"template '{key}' not found")
        return node_id

    async def _register_template(self, scope: Scope, receive: Receive) -> Reply:
        """A new template build: on the node that already holds the name, else on the one the scheduler picks."""
        body = await read_body(receive)
        name = json_field(body, "name") or json_field(body, "alias")
        key = name.split(":", 1)[0] if name else ""
        node_id = self._templates.get(key) if key else None
        if node_id is None and key:
            try:
                node_id = await self._template_node(scope, key)
            except Answer:
                node_id = None
        if node_id is None:
            try:
                placement = await self.scheduler.place(PlacementRequest(
                    template_id="base", cpu_count=self.default_cpu_count, memory_mb=self.default_memory_mb))
            except NoPlacement as exc:
                raise Answer(503, f"no node can build the template: {exc}") from None
            await self.scheduler.release(placement)  # a build holds no sandbox's share once done
            node_id = placement.node_id
        node = await self.scheduler.node(node_id)
        if node is None:
            raise Answer(503, f"node {node_id} left")
        try:
            r = await self._call(node, scope, body=body)
        except httpx.HTTPError as exc:
            raise Answer(502, f"node {node_id} failed the template's registration: {exc}") from None
        if r.is_success:
            template_id = str(r.json().get("templateID", ""))
            for known in (template_id, key):
                if known:
                    self._templates[known] = node_id
        return Reply.of(r)


async def run_gateway(listen: str, gateway: Gateway, *, shutdown: Callable[[], Awaitable[Any]],
                      task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``gateway`` on ``listen`` until ``shutdown`` returns (the requests in flight finish), then close
    its connections; ``task_status`` gets the bound addresses."""
    hc = api_hypercorn_config(listen)  # as a node's: proxied Connect streams and idle stdin streams stay open
    app: Any = limit_request_head(shield_last_send(gateway.asgi))
    try:
        await serve(app, hc, shutdown_trigger=shutdown, task_status=task_status)
    finally:
        await gateway.aclose()
