"""A small OpenAI-compatible router for a prefill and a decode running KvbridgeConnector.

``python -m kvbridge_vllm.proxy --prefill http://P:8100 --decode http://D:8200 --port 8000``

Concurrent (the default): each ``/v1/completions`` or ``/v1/chat/completions`` request gets a
room and goes to both servers at once, to the prefill with one output token; the decode
allocates its blocks while the prefill computes, and the prefill sends each layer as it is
computed. The prefill's bootstrap address is ``--prefill-bootstrap`` (default: the prefill's
host, port 8998). A prefill that fails does not fail the request: the decode's load fails by
its deadline and the decode computes the prompt itself (its log says why).

Sequential (``--sequential``): the request goes to the prefill first, with
``kv_transfer_params: {"do_remote_decode": true}`` and one output token; the prefill's answer
carries the ``kv_transfer_params`` that the same request then takes to the decode. A prefill
that answers without them (not running KvbridgeConnector as kv_producer) is a 502 that says
so. Either way the decode's response (streamed or not) is passed through unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from typing import Any, Optional
from urllib.parse import urlsplit

from aiohttp import ClientSession, ClientTimeout, web

from kvbridge_vllm.params import concurrent_params
from kvbridge_vllm.scheduler import new_room
from kvbridge_vllm.settings import DEFAULT_BOOTSTRAP_PORT

logger = logging.getLogger("kvbridge_vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
TRACE_HEADERS = ("traceparent", "tracestate")


def prefill_request(body: dict, params: Optional[dict] = None) -> dict:
    """The request as the prefill gets it: one token, no streaming, its KV kept for a decode
    (``params``: the concurrent flow's ``kv_transfer_params``)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **(params or {"do_remote_decode": True})}
    return out


def default_bootstrap(prefill_url: str) -> str:
    """The prefill's bootstrap address when none is given: its host, kvbridge's port."""
    return f"{urlsplit(prefill_url).hostname}:{DEFAULT_BOOTSTRAP_PORT}"


def decode_request(body: dict, prefill_answer: Any, prefill_url: str) -> dict:
    """The request as the decode gets it: the prefill's ``kv_transfer_params`` added. Raises
    ``ValueError`` when the prefill's answer has none."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not params:
        raise ValueError(
            f"the prefill at {prefill_url} answered without kv_transfer_params: start it with "
            '--kv-transfer-config \'{"kv_connector": "KvbridgeConnector", '
            '"kv_connector_module_path": "kvbridge_vllm.connector", "kv_role": "kv_producer"}\''
        )
    return {**body, "kv_transfer_params": params}


async def _relay(request: web.Request, r) -> web.StreamResponse:
    out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
    await out.prepare(request)
    async for chunk in r.content.iter_any():
        await out.write(chunk)
    await out.write_eof()
    return out


def app(
    prefill: str,
    decode: str,
    timeout: float = 600.0,
    *,
    sequential: bool = False,
    prefill_bootstrap: Optional[str] = None,
) -> web.Application:
    session_box: dict = {}
    bootstrap = prefill_bootstrap or default_bootstrap(prefill)

    async def start(_app):
        session_box["s"] = ClientSession(timeout=ClientTimeout(total=timeout))

    async def stop(_app):
        await session_box["s"].close()

    async def route(request: web.Request) -> web.StreamResponse:
        session: ClientSession = session_box["s"]
        # The caller's trace context goes on to both servers (vLLM keeps it for the connector).
        headers = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"the request body is not JSON: {e}"}, status=400)
        if not sequential:
            return await concurrent(request, session, body, headers)
        async with session.post(prefill + request.path, json=prefill_request(body), headers=headers) as r:
            answer = await r.json(content_type=None)
            if r.status != 200:
                return web.json_response(answer, status=r.status)
        try:
            onward = decode_request(body, answer, prefill)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=502)
        async with session.post(decode + request.path, json=onward, headers=headers) as r:
            return await _relay(request, r)

    async def to_prefill(session: ClientSession, path: str, body: dict, headers: dict) -> None:
        try:
            async with session.post(prefill + path, json=body, headers=headers) as r:
                if r.status != 200:
                    logger.warning("the prefill at %s answered %d: %s", prefill, r.status, await r.text())
        except Exception as e:  # the decode computes the prompt itself once its load fails
            logger.warning("the prefill at %s failed: %s", prefill, e)

    async def concurrent(request: web.Request, session: ClientSession, body: dict, headers: dict) -> web.StreamResponse:
        to_p, to_d = concurrent_params(new_room(), bootstrap)
        sent = asyncio.ensure_future(to_prefill(session, request.path, prefill_request(body, to_p), headers))
        try:
            onward = {**body, "kv_transfer_params": {**(body.get("kv_transfer_params") or {}), **to_d}}
            async with session.post(decode + request.path, json=onward, headers=headers) as r:
                return await _relay(request, r)
        except asyncio.CancelledError:
            # The client went away: the prefill's request is dropped too (vLLM aborts a request
            # whose client disconnected), so its room ends now, not at its waiting_timeout.
            sent.cancel()
            raise
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await sent

    async def health(_request):
        return web.Response(text="ok")

    application = web.Application()
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    for path in ROUTES:
        application.router.add_post(path, route)
    application.router.add_get("/health", health)
    return application


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbridge_vllm.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, help="the prefill server's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="the decode server's base URL, e.g. http://127.0.0.1:8200")
    p.add_argument(
        "--prefill-bootstrap",
        help=f"the prefill's kvbridge bootstrap address HOST:PORT (default: its host, port {DEFAULT_BOOTSTRAP_PORT})",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="prefill first, then the decode with the prefill's kv_transfer_params (vLLM's usual flow)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    application = app(
        args.prefill.rstrip("/"),
        args.decode.rstrip("/"),
        sequential=args.sequential,
        prefill_bootstrap=args.prefill_bootstrap,
    )
    # A client that disconnects cancels its request's handler, so both servers hear of it.
    web.run_app(application, host=args.host, port=args.port, print=None, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
