"""A real single-node SLURM cluster on this machine, for the tests and for trying sweeps.

  python -m scripts.local_slurm up [--dir DIR]    # prints: export SLURM_CONF=DIR/slurm.conf
  python -m scripts.local_slurm down [--dir DIR]  # stops its jobs and daemons

`up` installs what is missing (`apt-get install slurm-wlm munge`, as root),
writes `slurm.conf`, a munge key and every state, spool and log file into DIR
(default: a new temporary directory), starts munged, slurmctld and slurmd in
the background and returns once the node is idle. One node (this host at
127.0.0.1, all its CPUs), one partition `debug`, no GPUs, no accounting
database: the sweep launcher does not ask SLURM for job states (it reads the
variants' files, and squeue says what is alive), so there is no slurmdbd.

`down` cancels the cluster's jobs and stops, by PID, every process it started:
the daemons (their PIDs are in DIR/pids), the job step daemons they spawned
(marked in their environment) and the jobs' processes (whose SLURM_CONF is
this cluster's). Run as root: slurmd starts jobs as their submitting user.
"""
import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
MARK = "TLAB_LOCAL_SLURM"  # in the daemons' environment (and their slurmstepd's): DIR
PARTITION = "debug"
CRED_EXPIRE_S = 10  # a requeued job restarts after about this long (SLURM's default: 120)


class ClusterError(Exception):
  """The cluster could not be started (the message says which step and its log)."""


def install() -> None:
  """apt-get installs slurm-wlm and munge when slurmctld or munged is missing."""
  if all(shutil.which(d) for d in DAEMONS):
    return
  if os.geteuid() != 0:
    raise ClusterError(f"SLURM is not installed and this is not root: apt-get install "
                       f"{' '.join(PACKAGES)}")
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
      raise ClusterError(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def write_config(directory: str) -> str:
  """slurm.conf (and the directories it names) in `directory`; returns its path."""
  for sub in ("state", "spool", "munge"):  # a new cluster: no jobs of an earlier one
    shutil.rmtree(os.path.join(directory, sub), ignore_errors=True)
    os.makedirs(os.path.join(directory, sub))
  host = socket.gethostname()
  memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
  d = directory
  conf = f"""\
ClusterName=tlab
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
  path = os.path.join(directory, "slurm.conf")
  with open(path, "w", encoding="utf-8") as f:
    f.write(conf)
  return path


def _start(directory: str, name: str, command: list[str], env: dict) -> int:
  log = open(os.path.join(directory, f"{name}.out"), "ab")  # pylint: disable=consider-using-with
  process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
  with open(os.path.join(directory, "pids"), "a", encoding="utf-8") as f:
    f.write(f"{name} {process.pid}\n")
  return process.pid


def _wait(what: str, ready, timeout_s: float, log: str) -> None:
  deadline = time.time() + timeout_s
  while not ready():
    if time.time() > deadline:
      raise ClusterError(f"{what} not ready after {timeout_s:.0f} s; see {log}")
    time.sleep(0.2)


def _node_state(env: dict) -> str:
  result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True,
                          text=True, check=False)
  return result.stdout.strip()


def up(directory: str, timeout_s: float = 60) -> str:
  """Installs, configures and starts the cluster in `directory`; returns SLURM_CONF.
  On failure, stops what it started."""
  install()
  os.makedirs(directory, exist_ok=True)
  conf = write_config(directory)
  munge = os.path.join(directory, "munge")
  with open(os.path.join(munge, "munge.key"), "wb") as f:
    f.write(secrets.token_bytes(1024))
  os.chmod(os.path.join(munge, "munge.key"), 0o600)
  env = {**os.environ, "SLURM_CONF": conf, MARK: directory}
  try:
    _start(directory, "munged", [
        "munged", "--foreground", "--force", f"--key-file={munge}/munge.key",
        f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
        f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"], env)
    _wait("munged", lambda: os.path.exists(f"{munge}/munge.socket"), 20, f"{directory}/munged.out")
    _start(directory, "slurmctld", ["slurmctld", "-D", "-c"], env)
    _start(directory, "slurmd", ["slurmd", "-D"], env)
    _wait("the node", lambda: _node_state(env) == "idle", timeout_s,
          f"{directory}/slurmctld.log and slurmd.log")
  except BaseException:
    down(directory)
    raise
  return conf


def _environ(pid: int) -> dict:
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      items = f.read().split(b"\0")
  except OSError:
    return {}
  return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _processes_of(directory: str) -> list[int]:
  """Job step daemons (marked) and job processes (this cluster's SLURM_CONF and a
  job id) left on this machine, not counting this process."""
  conf = os.path.join(directory, "slurm.conf")
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    env = _environ(int(entry))
    if env.get(MARK) == directory or (env.get("SLURM_CONF") == conf and "SLURM_JOB_ID" in env):
      pids.append(int(entry))
  return pids


def _is_job(pid: int, conf: str) -> bool:
  env = _environ(pid)
  return env.get("SLURM_CONF") == conf and "SLURM_JOB_ID" in env


def _alive(pid: int) -> bool:
  """Whether the process exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _stop(pids: list[int], timeout_s: float) -> None:
  """SIGTERM, then SIGKILL for those still alive after `timeout_s`."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in pids:
      try:
        os.kill(pid, sig)
      except ProcessLookupError:
        pass
    deadline = time.time() + timeout_s
    while any(_alive(p) for p in pids) and time.time() < deadline:
      time.sleep(0.1)
  for pid in pids:  # reap those that are this process's children
    try:
      os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
      pass


def _daemon_pids(directory: str) -> list[int]:
  try:
    with open(os.path.join(directory, "pids"), encoding="utf-8") as f:
      return [int(line.split()[1]) for line in f if line.strip()]
  except FileNotFoundError:
    return []


def _daemons_alive(directory: str) -> bool:
  return any(_alive(p) for p in _daemon_pids(directory))


def down(directory: str, timeout_s: float = 10) -> None:
  """Cancels the cluster's jobs, then stops its daemons and any process left, by PID."""
  conf = os.path.join(directory, "slurm.conf")
  if _daemons_alive(directory) and shutil.which("scancel"):
    subprocess.run(["scancel", "--full", "--quiet", f"--partition={PARTITION}"],
                   env={**os.environ, "SLURM_CONF": conf}, capture_output=True, timeout=30,
                   check=False)
    deadline = time.time() + timeout_s
    while (any(_is_job(p, conf) for p in _processes_of(directory))
           and time.time() < deadline):
      time.sleep(0.2)
  _stop([p for p in _daemon_pids(directory)[::-1] if _alive(p)], timeout_s)
  _stop(_processes_of(directory), timeout_s)
  if os.path.exists(os.path.join(directory, "pids")):
    os.remove(os.path.join(directory, "pids"))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("command", choices=["up", "down"])
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "tlab-slurm"),
                      help="where the config, state and logs live (default: %(default)s)")
  args = parser.parse_args()
  directory = os.path.abspath(args.dir)
  try:
    if args.command == "up":
      if _daemons_alive(directory):
        print(f"already up; export SLURM_CONF={directory}/slurm.conf")
        return 0
      conf = up(directory)
      print(f"SLURM is up (node idle). Use it with:\n  export SLURM_CONF={conf}\n"
            f"Stop it with: python -m scripts.local_slurm down --dir {directory}")
    else:
      down(directory)
      print(f"SLURM in {directory} is down")
  except ClusterError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
