"""The stage-1 engine around the codec decoder: what vLLM / vllm-omni's scheduler does differently
for it (`pipeline.py` names the class).

- `scheduler.py`: vllm-omni's generation scheduler, unlinking the windows of a request it ends early
"""
