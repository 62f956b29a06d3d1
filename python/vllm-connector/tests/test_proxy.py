"""The proxy between stand-in servers (aiohttp apps in this process): what reaches each of
them, and what happens when the client goes away."""

from __future__ import annotations

import asyncio
import socket

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import ClientSession, ClientTimeout, web  # noqa: E402

from kvbridge_vllm import proxy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(app: web.Application, port: int, **kwargs) -> web.AppRunner:
    runner = web.AppRunner(app, **kwargs)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def client_gives_up() -> dict:
    """A concurrent-flow request whose decode never answers; the client stops waiting after
    1 s. Returns what the stand-in prefill saw."""
    seen: dict = {}

    async def slow(request: web.Request, name: str) -> web.Response:
        seen[name] = await request.json()
        for _ in range(100):  # 10 s at most
            if request.transport is None or request.transport.is_closing():
                seen[f"{name} dropped"] = True
                break
            await asyncio.sleep(0.1)
        return web.json_response({})

    ports = [free_port() for _ in range(3)]
    runners = []
    for name, port in zip(("prefill", "decode"), ports):

        async def handler(request: web.Request, name: str = name) -> web.Response:
            return await slow(request, name)

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runners.append(await serve(app, port))
    front = proxy.app(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
    runners.append(await serve(front, ports[2], handler_cancellation=True))
    try:
        async with ClientSession(timeout=ClientTimeout(total=1)) as client:
            with pytest.raises(asyncio.TimeoutError):
                await client.post(f"http://127.0.0.1:{ports[2]}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        for _ in range(50):
            if "prefill dropped" in seen:
                break
            await asyncio.sleep(0.1)
    finally:
        for runner in runners:
            await runner.cleanup()
    return seen


def test_a_client_that_goes_away_drops_the_prefills_request_too():
    """Both servers got the request with the same room; once the client gave up, the proxy's
    request to the prefill was dropped (vLLM aborts it, and its room ends), not left to run to
    the prefill's waiting_timeout."""
    seen = asyncio.run(client_gives_up())
    room = seen["prefill"]["kv_transfer_params"]["kvbridge"]["room"]
    assert seen["decode"]["kv_transfer_params"]["kvbridge"]["room"] == room
    assert seen["prefill"]["max_tokens"] == 1
    assert seen.get("prefill dropped"), seen


def test_the_callers_trace_context_reaches_both_servers():
    async def run() -> dict:
        seen: dict = {}
        ports = [free_port() for _ in range(3)]
        runners = []
        for name, port in zip(("prefill", "decode"), ports):

            async def handler(request: web.Request, name: str = name) -> web.Response:
                seen[name] = request.headers.get("traceparent")
                return web.json_response({"choices": []})

            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            runners.append(await serve(app, port))
        front = proxy.app(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
        runners.append(await serve(front, ports[2]))
        try:
            async with ClientSession(timeout=ClientTimeout(total=10)) as client:
                async with client.post(
                    f"http://127.0.0.1:{ports[2]}/v1/completions", json={"prompt": [1], "max_tokens": 2},
                    headers={"traceparent": TRACE},
                ) as r:
                    assert r.status == 200
        finally:
            for runner in runners:
                await runner.cleanup()
        return seen

    assert asyncio.run(run()) == {"prefill": TRACE, "decode": TRACE}


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
