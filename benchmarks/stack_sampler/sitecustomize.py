"""Diagnosis hooks for every Python process of a server under test, loaded by putting this folder
first on PYTHONPATH (Python imports `sitecustomize` at start-up, in spawned children too).

SPEECHLM_STACK_SAMPLES=DIR   while DIR/phase exists, a daemon thread samples every thread's
                             Python stack every SPEECHLM_STACK_SAMPLE_MS (5), counted under the
                             phase that file names (serve_load.py writes the level), and rewrites
                             DIR/stacks-<pid>.txt every 10 s and at exit: a header naming the
                             process, then "phase<TAB>count<TAB>thread<TAB>root;...;leaf" lines
                             (`benchmarks/stack_samples.py` summarizes them).
SPEECHLM_TRACE_LAUNCHERS=1   every Triton C module built (a launcher or utility missing from
                             TRITON_CACHE_DIR) is logged on stderr as `launcher build trace:`
                             with the Python stack that asked for it: what a request compiled.
SPEECHLM_TRACE_SPAWNS=1      a `spawn trace: t=<epoch> pid=<pid> <event>` line on stderr when a
                             process starts another (`start <name>`, with the seconds `start()`
                             took), when a spawned child's interpreter is up (`interpreter`), when
                             it has re-run the parent's main module (`prepared`) and when it has
                             unpickled its target and runs it (`run <name>`): where a stage
                             process's start goes before it logs anything.
SPEECHLM_NAN_WATCH=1         stage 0 reports where non-finite values enter its rows and its KV
                             cache (nan_watch.py; it slows each step).

Nothing here is imported by the project; it changes no behaviour, only observes.
"""

import os
import sys
import threading
import time
import traceback
from collections import Counter

_OUT = os.environ.get("SPEECHLM_STACK_SAMPLES")
_LAUNCHERS = os.environ.get("SPEECHLM_TRACE_LAUNCHERS") == "1"
_SPAWNS = os.environ.get("SPEECHLM_TRACE_SPAWNS") == "1"
_NAN_WATCH = os.environ.get("SPEECHLM_NAN_WATCH") == "1"
_DUMP_EVERY_S = 10.0


def _frame_label(frame) -> str:
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)})"


def _folded(frame) -> str:
    labels = []
    while frame is not None and len(labels) < 60:
        labels.append(_frame_label(frame))
        frame = frame.f_back
    return ";".join(reversed(labels))


def _process_name() -> str:
    import multiprocessing

    return multiprocessing.current_process().name


_counts: Counter = Counter()
_started = time.time()


def _dump() -> None:
    path = os.path.join(_OUT, f"stacks-{os.getpid()}.txt")
    header = f"# pid={os.getpid()} name={_process_name()} seconds={time.time() - _started:.1f} argv={' '.join(sys.argv)[:300]}\n"
    lines = (f"{phase}\t{n}\t{thread}\t{stack}\n" for (phase, thread, stack), n in _counts.most_common())
    with open(path + ".tmp", "w") as f:
        f.write(header)
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def _phase() -> str | None:
    try:
        with open(os.path.join(_OUT, "phase")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _traced_build(build):
    def build_traced(name, *args, **kwargs):
        stack = "".join(traceback.format_stack(limit=30)[:-1])
        print(f"launcher build trace: pid={os.getpid()} proc={_process_name()} module={name} t={time.time():.3f}\n{stack}",
              file=sys.stderr, flush=True)
        return build(name, *args, **kwargs)

    build_traced.__wrapped__ = build
    return build_traced


def _hook_triton() -> bool:
    """Wrap Triton's C build once its module is loaded (importing it here would load Triton in
    every process)."""
    module = sys.modules.get("triton.runtime.build")
    build = getattr(module, "_build", None)
    if build is None:
        return False
    if not hasattr(build, "__wrapped__"):
        module._build = _traced_build(build)
    return True


def _spawn_event(event: str, at: float | None = None) -> None:
    # One write(2) per line: processes starting together share stderr, and print's separate
    # newline let their lines run into each other.
    line = f"spawn trace: t={time.time() if at is None else at:.3f} pid={os.getpid()} {event}\n"
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), line.encode())


def _hook_spawns() -> None:
    """Wrap multiprocessing's process start, a spawned child's preparation and its bootstrap."""
    import multiprocessing.process as mp_process
    import multiprocessing.spawn as mp_spawn

    start, bootstrap, prepare = mp_process.BaseProcess.start, mp_process.BaseProcess._bootstrap, mp_spawn.prepare

    def traced_start(self):
        begun = time.time()
        start(self)
        _spawn_event(f"start {self.name} child={self.pid} took={time.time() - begun:.3f}", begun)

    def traced_bootstrap(self, *args, **kwargs):
        _spawn_event(f"run {self.name}")
        return bootstrap(self, *args, **kwargs)

    def traced_prepare(data):
        prepare(data)
        _spawn_event("prepared")

    mp_process.BaseProcess.start, mp_process.BaseProcess._bootstrap, mp_spawn.prepare = (
        traced_start, traced_bootstrap, traced_prepare)


def _run(interval_s: float) -> None:
    me = threading.get_ident()
    last_dump = time.time()
    hooked = not _LAUNCHERS
    while True:
        time.sleep(interval_s)
        hooked = hooked or _hook_triton()
        if not _OUT:
            if hooked:
                return
            continue
        phase = _phase()
        if phase:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    _counts[(phase, names.get(ident, str(ident)), _folded(frame))] += 1
        if _counts and time.time() - last_dump >= _DUMP_EVERY_S:
            _dump()
            last_dump = time.time()


def _start() -> None:
    global _started
    _counts.clear()  # a forked child starts its own counts
    _started = time.time()
    interval_s = float(os.environ.get("SPEECHLM_STACK_SAMPLE_MS", "5")) / 1e3 if _OUT else 0.05
    threading.Thread(target=_run, args=(interval_s,), name="stack-sampler", daemon=True).start()


if _NAN_WATCH:
    import nan_watch

    nan_watch.install()
if _SPAWNS:
    _spawn_event("interpreter")
    _hook_spawns()
if _OUT or _LAUNCHERS:
    if _OUT:
        os.makedirs(_OUT, exist_ok=True)
    _start()
    os.register_at_fork(after_in_child=_start)
    if _OUT:
        import atexit

        atexit.register(lambda: _counts and _dump())
