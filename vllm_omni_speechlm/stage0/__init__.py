"""The stage-0 engine around the speech LM: what vLLM / vllm-omni's scheduler, runner and worker
do differently for it (deploy YAMLs and `pipeline.py` name these classes).

- `scheduler.py`: paired-CFG scheduling (a hidden companion per guided request, one unit)
- `steady_rows.py`: the short path of the scheduler update for decode rows
- `client_frames.py`: frames to the client in blocks of steps
- `window_gate.py`: only window-completing steps reach the async_chunk adapter
- `runner.py`: the model runner and workers, per-request loops batched
- `runner_loops.py`: vLLM's own per-request loops of an async step, batched
"""
