"""SPEECHLM_NAN_WATCH=1 (loaded by sitecustomize.py): where non-finite values enter stage 0.

Wraps `SpeechLMSteps.logits` once models/steps.py is imported. Each step computes on the device,
and reads back one step later (no host wait): rows whose hidden state is not finite, whose staged
aux input is not finite, whose stream-0 logits have no finite value; each row's phase; whether
layer 0's or the last layer's KV cache holds a non-finite value. It logs each request's first bad
row with the step's facts, and at the first step with a bad row or a non-finite KV value, every
layer's count of KV blocks holding one and every weight or buffer that is not finite (a full
scan, once). Two whole-layer scans a step slow it down: for finding a bug, not for timing.
"""

import importlib.abc
import importlib.util
import sys

STEPS_MODULE = "vllm_omni_speechlm.models.steps"
MAX_ROW_LOGS = 400
WATCH = None  # the stage process's `_Watch`, once the steps module is imported


class _Watch:
    def __init__(self, log, to_device):
        self.log, self.to_device = log, to_device
        self.pending = None  # (flags on the host, event, the step's host facts)
        self.calls = 0
        self.seen: set[str] = set()
        self.first: dict | None = None  # what the first bad step showed
        self.layers = None

    def kv_layers(self, model) -> list:
        import torch

        if self.layers is None:
            self.layers = []
            for name, module in model.named_modules():
                kv = getattr(module, "kv_cache", None)
                kv = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
                if isinstance(kv, torch.Tensor) and kv.numel():
                    self.layers.append((name, kv))
        return self.layers

    def step(self, steps, hidden):
        """Before the step's logits: queue its checks (the logits' come in `after`)."""
        import numpy as np
        import torch

        rows, n = steps.rows, hidden.shape[0]
        slots = self.to_device(rows.slots, hidden.device)  # every row is admitted by the logits hook
        token_row = self.to_device(np.repeat(np.arange(n), rows.scheduled), hidden.device)
        tokens = int(rows.scheduled.sum())
        aux_bad = torch.zeros(n, dtype=torch.long, device=hidden.device)
        aux_bad.index_add_(0, token_row, (~torch.isfinite(steps.model.aux_input[:tokens]).all(1)).long())
        self.calls += 1
        facts = (list(rows.req_ids), rows.slots.copy(), rows.computed.copy(), rows.scheduled.copy(), rows.prompt_len.copy(),
                 self.calls)
        return [(~torch.isfinite(hidden).all(1)).long(), aux_bad, steps.table.phase[slots]], facts

    def after(self, steps, checks, facts, logits):
        import torch

        layers = self.kv_layers(steps.model)
        kv = [(~torch.isfinite(layers[i][1]).all()).long().reshape(1) for i in (0, -1)] if layers else []
        logits_bad = (~torch.isfinite(logits).any(1)).long()
        flags = torch.cat([torch.stack([*checks, logits_bad]).flatten(), *kv])
        host = torch.empty(flags.shape, dtype=torch.long, pin_memory=flags.is_cuda)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event() if flags.is_cuda else None
        if event is not None:
            event.record()
        self.pending = host, event, facts

    def report(self, model) -> None:
        """The last step's checks (its copy has landed by now)."""
        if self.pending is None:
            return
        host, event, (req_ids, slots, computed, scheduled, prompt_len, call) = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        n = len(req_ids)
        flat = host.numpy()
        hidden_bad, aux_bad, phase, logits_bad = flat[: 4 * n].reshape(4, n)
        hidden_bad, aux_bad, logits_bad = hidden_bad > 0, aux_bad > 0, logits_bad > 0
        kv_bad = bool(flat[4 * n :].any())
        bad = hidden_bad | logits_bad | aux_bad
        if not (bad.any() or kv_bad):
            return
        if self.first is None:
            self.first = {"call": call, "bad_rows": int(bad.sum()), "rows": n, "kv_non_finite": kv_bad}
            self.log.warning("nan watch: first bad step, call %d: %d of %d rows bad, KV non-finite %s, tokens of "
                             "rows with more than one %d", call, int(bad.sum()), n, kv_bad, int(scheduled[scheduled > 1].sum()))
            self.first.update(self.scan(model))
        for i in bad.nonzero()[0]:
            if req_ids[i] in self.seen or len(self.seen) >= MAX_ROW_LOGS:
                continue
            self.seen.add(req_ids[i])
            self.log.warning("nan watch: call %d row %s slot %d computed %d scheduled %d prompt %d phase %d: hidden %s, "
                             "logits %s, aux input %s", call, req_ids[i], slots[i], computed[i], scheduled[i],
                             min(int(prompt_len[i]), 10**9), phase[i], hidden_bad[i], logits_bad[i], aux_bad[i])

    def scan(self, model) -> dict:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        params = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        buffers = [n for n, b in model.named_buffers() if b.is_floating_point() and not torch.isfinite(b).all()]
        counts = []
        for name, kv in self.kv_layers(model):
            blocks = kv.movedim(max(range(kv.dim()), key=kv.shape.__getitem__), 0)  # the blocks' dimension first
            counts.append(sum(int((~torch.isfinite(part)).flatten(1).any(1).sum()) for part in blocks.split(2048)))
        self.log.warning("nan watch: non-finite weights %s, buffers %s; KV blocks with a non-finite value per "
                         "layer %s", params[:10], buffers[:10], counts)
        return {"weights": params, "buffers": buffers, "kv_blocks": counts}


def _install(module) -> None:
    from vllm.logger import init_logger

    global WATCH
    watch = WATCH = _Watch(init_logger("speechlm.nan_watch"), module.to_device)
    logits = module.SpeechLMSteps.logits

    def watched(self, hidden_states):
        watch.report(self.model)
        if self.table is None or self.frames_host is None or len(self.rows.entries) != hidden_states.shape[0]:
            return logits(self, hidden_states)
        checks, facts = watch.step(self, hidden_states)
        out = logits(self, hidden_states)
        watch.after(self, checks, facts, out)
        return out

    module.SpeechLMSteps.logits = watched


class _Hook(importlib.abc.MetaPathFinder):
    """Patches the steps module right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != STEPS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    sys.meta_path.insert(0, _Hook())
