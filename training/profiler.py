"""A jax.profiler trace of the steps of train.profile_steps (docs/tracking.md).

`StepProfiler` starts the trace before the first step of the window that the
run executes (a run resumed inside the window traces the rest of it), once the
steps before have finished on the device; marks each traced step with
`StepTraceAnnotation("train", step_num=N)` (the step markers XProf reads; the
batch is fetched inside it); blocks on each traced step's results, so that the
trace holds its device work; and stops after the window's last step, or when
the run ends inside the window (`close`). Process 0 only. The trace lands in
`<workdir>/profile/plugins/profile/<time>/`: `<host>.xplane.pb` for XProf and
TensorBoard's profile plugin, `perfetto_trace.json.gz` for Perfetto.
"""
import os

import jax

from configs.validation import profile_steps

PROFILE_DIR = "profile"


class StepProfiler:
  """Call `begin(n)` before step n runs, `end(n, outputs)` after it, and
  `close()` when the run ends, however it ends."""

  def __init__(self, train_config, workdir: str):
    self._window = profile_steps(train_config) if jax.process_index() == 0 else None
    self._dir = os.path.join(workdir, PROFILE_DIR)
    self._traced = []  # the steps traced so far, while tracing
    self._annotation = None  # the running step's marker

  def begin(self, step: int, state) -> None:
    """Before step `step` (counted from 1) fetches its batch and runs on `state`
    (waited for before the trace starts, so that no earlier step's device work
    runs inside it)."""
    if self._window is None or not self._window[0] <= step <= self._window[1]:
      return
    if not self._traced:
      jax.block_until_ready(state)
      jax.profiler.start_trace(self._dir, create_perfetto_trace=True)
    self._traced.append(step)
    self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
    self._annotation.__enter__()

  def end(self, step: int, outputs) -> None:
    """After step `step`: waits for its `outputs` (its device work) when traced;
    stops the trace after the window's last step."""
    if self._annotation is None:
      return
    jax.block_until_ready(outputs)
    self._annotation.__exit__(None, None, None)
    self._annotation = None
    if step == self._window[1]:
      self.close()

  def close(self) -> None:
    """Stops a running trace and says where it is."""
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if not self._traced:
      return
    jax.profiler.stop_trace()
    print(f"profile: steps {self._traced[0]}-{self._traced[-1]} traced into {self._dir}; "
          f"open it with xprof server --logdir {self._dir} (docs/tracking.md)", flush=True)
    self._traced = []
