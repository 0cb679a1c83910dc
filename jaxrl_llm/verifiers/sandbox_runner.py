"""The program the sandbox runs: set up isolation, drop privileges, run code and its tests.

Never imported. `sandbox.run_python` executes this file's source with `python -I -S -c`, so the
package need not be importable inside the sandbox and no directory of ours lands on the
sandboxed interpreter's `sys.path`. Only the standard library is used.

Three processes, each with one job:

    runner (root when the trainer is root)   reads the job from stdin; unshares mount, net,
      │                                      pid, ipc and uts namespaces; waits.
      └─ init (pid 1 of the new pid ns)      mounts a fresh size-capped tmpfs on /tmp, /var/tmp
           │                                 and /dev/shm and a fresh /proc; enforces the
           │                                 wall-clock limit; when it exits the kernel kills
           │                                 every process left in the namespace.
           └─ harness (unprivileged user)    rlimits, then exec(code), exec(each test);
                                             reports each result as a line on fd 1.

Result lines start with a per-run random nonce so text that the code prints by accident can
never be taken for a result (its stdout/stderr go to /dev/null anyway).
"""

import ctypes
import json
import os
import resource
import signal
import socket
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent():
    """SIGKILL this process when its parent dies, so a killed worker leaves no sandbox."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def mount(source, target, fstype, flags, data):
    args = [None if a is None else a.encode() for a in (source, target, fstype)]
    if LIBC.mount(*args, flags, None if data is None else data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def report(job, line):
    text = f"{job['nonce']} {line}".replace("\n", " ")[:2000] + "\n"
    try:
        os.write(1, text.encode(errors="replace"))
    except OSError:
        pass


def python_dirs():
    """Top-most directories the interpreter imports from (prefixes, then sys.path)."""
    found = []
    for path in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]:
        path = os.path.realpath(path) if path else ""
        if os.path.isdir(path) and not any(under(path, top) for top in found):
            found = [top for top in found if not under(top, path)] + [path]
    return found


def under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def closed_ancestor(path):
    """First directory on `path` that others may not enter (e.g. /root, mode 0700)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def private_filesystem(job):
    """Fresh size-capped tmpfs on /tmp, /var/tmp, /dev/shm and on any closed directory the
    interpreter lives under (pyenv or conda in /root), with the interpreter's directories
    bound back read-only so the unprivileged user can import the standard library; then a
    /proc of the new pid namespace. Returns the workdir."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    needed = python_dirs()
    covers = [path for path in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(path)]
    covers += {a for a in map(closed_ancestor, needed) if a and a not in covers}
    moved = {
        path: os.open(path, os.O_PATH | os.O_DIRECTORY)
        for path in needed
        if any(under(path, cover) for cover in covers)
    }
    for cover in covers:
        mode = "1777" if cover in ("/tmp", "/var/tmp", "/dev/shm") else "0755"
        size = job["limits"]["tmpfs_mb"]
        mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,mode={mode}")
    for path, fd in moved.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        os.close(fd)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    socket.sethostname("sandbox")
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    return workdir


def harness(job, out):
    """Runs in the unprivileged process: setup + code once, then each test in order."""
    nonce, tests = job["nonce"], job["tests"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}

    def emit(line):
        os.write(out, f"{nonce} {line}".replace("\n", " ")[:2000].encode() + b"\n")

    try:
        exec(compile(job["setup"], "<setup>", "exec"), namespace)
        exec(compile(job["code"], "<solution>", "exec"), namespace)
    except BaseException as err:  # SystemExit too: exiting early must not pass the tests
        emit(f"ERROR {type(err).__name__}: {err}")
        emit("END")
        os._exit(0)
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            emit(f"PASS {index}")
        except BaseException as err:
            emit(f"FAIL {index} {type(err).__name__}: {err}")
    emit("END")
    os._exit(0)


def drop_privileges(job):
    limits = job["limits"]
    mib = 1 << 20
    for kind, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_AS, limits["memory_mb"] * mib),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mib),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        hard = value + 1 if kind == resource.RLIMIT_CPU else value  # SIGXCPU, then SIGKILL
        resource.setrlimit(kind, (value, hard))
    if os.geteuid() == 0 and job["uid"] is not None:
        os.setgroups([])
        os.setgid(job["gid"])
        os.setuid(job["uid"])


def start_harness(job, workdir):
    """Forks the harness with stdout/stderr on /dev/null and results on a private fd."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.chdir(workdir)
        os.environ["HOME"] = workdir
        out = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        drop_privileges(job)
        harness(job, out)
    finally:
        os._exit(70)


def describe(status):
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def init(job, isolated):
    """pid 1 of the sandbox: filesystem, wall-clock limit, then wait for the harness."""
    die_with_parent()
    try:
        workdir = private_filesystem(job) if isolated else job["workdir"]
        if job["uid"] is not None:
            os.chown(workdir, job["uid"], job["gid"])
    except OSError as err:
        report(job, f"SANDBOX_ERROR {err}")
        os._exit(0)
    uid = os.geteuid() if job["uid"] is None else job["uid"]
    report(job, f"ISOLATION namespaces={int(isolated)} uid={uid}")
    child = start_harness(job, workdir)

    def on_alarm(signum, frame):
        os.kill(child, signal.SIGKILL)
        report(job, "TIMEOUT")
        os._exit(0)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, job["limits"]["wall_s"])
    while True:
        pid, status = os.waitpid(-1, 0)  # pid 1 also reaps orphans re-parented to it
        if pid == child:
            break
    signal.setitimer(signal.ITIMER_REAL, 0)
    report(job, f"EXIT {describe(status)}")
    os._exit(0)


def main():
    job = json.loads(sys.stdin.buffer.read())
    sys.path.extend(path for path in job["site_dirs"] if path not in sys.path)
    die_with_parent()
    if os.getppid() != job["parent_pid"]:  # the parent died before prctl took hold
        os._exit(1)
    isolated = False
    if os.geteuid() == 0 and job["namespaces"]:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        isolated = LIBC.unshare(flags) == 0
    pid = os.fork()
    if pid == 0:
        try:
            init(job, isolated)
        finally:
            os._exit(71)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
