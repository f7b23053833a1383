"""vllm-omni routes the speech LMs do not serve. Each answers 404, as vllm-omni answers a route
its model lacks, instead of running a request built for another kind of model: the speech batch
route's items have no `seed` and no `extra_params` (its schema drops them, and top-level model
options, silently), the chat batch route is vllm-omni's chat, not this model's, and
`/v1/audio/generate` would send a diffusion prompt."""

from __future__ import annotations

import functools
from typing import Any

from vllm_omni_speechlm.compat import dispatch_route
from vllm_omni_speechlm.serving.model_info import is_speechlm

UNSERVED = {
    "/v1/audio/speech/batch": "its items cannot carry seed or the model's options; send one request per item to "
                              "/v1/audio/speech",
    "/v1/chat/completions/batch": "send one request per conversation to /v1/chat/completions",
    "/v1/audio/generate": "use /v1/audio/speech",
}


async def _not_served(path: str, hint: str, request: Any, raw_request: Any, stock: Any) -> Any:
    from fastapi.responses import JSONResponse

    message = f"{path} is not served for this speech LM: {hint}"
    body = {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}
    return JSONResponse(content=body, status_code=404)


def register_routes() -> None:
    for path, hint in UNSERVED.items():
        dispatch_route(path, is_speechlm, functools.partial(_not_served, path, hint))
