"""A bound on the requests the API server holds for the speech LM: beyond it, HTTP 429 at once.

`max_pending_requests` (the deploy YAML's top level; absent: no bound) counts the requests of
both routes from arrival until their response ends: decoding, or waiting for a slot in stage 0.
One more request gets 429 with `Retry-After` before any engine work, so it costs the streams
already running nothing, and the client can retry or go to another replica. A streamed response
holds its place until its body ends, fails, is closed (a client that goes away) or is dropped
unread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from vllm_omni_speechlm import compat

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, limit: int | None):
        self.limit, self.pending = limit, 0

    def enter(self) -> bool:
        if self.limit is not None and self.pending >= self.limit:
            return False
        self.pending += 1
        return True

    def leave(self) -> None:
        self.pending -= 1


class _ReleasingBody:
    """A response body that calls `release` once when it ends, fails, is closed or is dropped."""

    def __init__(self, body: Any, release: Callable[[], None]):
        self._body, self._release = body, release

    def __aiter__(self) -> _ReleasingBody:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._body.__anext__()
        except BaseException:
            self._done()
            raise

    async def aclose(self) -> None:
        self._done()
        close = getattr(self._body, "aclose", None)
        if close is not None:
            await close()

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        self._done()


def admission(app: Any) -> Admission:
    """The app's admission gate, made on first use from the served deploy YAML."""
    gate = getattr(app.state, "speechlm_admission", None)
    if gate is None:
        gate = app.state.speechlm_admission = Admission(compat.deploy_max_pending(compat.served_deploy_config(app)))
    return gate


def too_many(limit: int) -> Any:
    from fastapi.responses import JSONResponse

    message = f"server busy: {limit} requests pending ({compat.MAX_PENDING_KEY}); retry after {RETRY_AFTER_S} s"
    body = {"error": {"message": message, "type": "TooManyRequests", "param": None, "code": 429}}
    return JSONResponse(content=body, status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})


async def admitted(raw_request: Any, call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()`'s response if the request fits under the bound (held until its body ends), else 429."""
    from starlette.responses import StreamingResponse

    gate = admission(raw_request.app)
    if not gate.enter():
        return too_many(gate.limit)
    try:
        response = await call()
    except BaseException:
        gate.leave()
        raise
    if isinstance(response, StreamingResponse):
        response.body_iterator = _ReleasingBody(response.body_iterator, gate.leave)
    else:
        gate.leave()
    return response
