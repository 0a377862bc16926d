"""Operating-system isolation for the code tool: namespaces, a private root, a fresh uid.

`python -I -S isolation.py MODE PARENT DISK_MB INODES BINDS -- ARGV...` (BINDS joined by ':' as in
PATH; see `command`) is the launcher that `flaxchat.execution` starts instead of the bare
interpreter. It uses nothing but the standard library (it runs without site-packages), imports
little (json and platform alone would add 20 ms to every call) and does, in order:
1. dies with its parent (PR_SET_PDEATHSIG), then `unshare(2)` of the mount, pid, network, IPC and
   UTS namespaces, plus a user namespace when it is not root ("user" mode; as root, "root" mode);
2. forks the sandbox's pid 1, which also dies with the launcher; when pid 1 ends the kernel kills
   everything else in its pid namespace, so no process of the call outlives it;
3. in that child: a new root on a tmpfs holding only what the interpreter needs, bound read-only
   (the Python install, the system library folders, ld.so.cache, /dev/null, zero, random, urandom),
   a size-capped tmpfs for the working folder (/sandbox) and another for /tmp, no /proc, /sys, /etc,
   /home or /dev/shm; the host's root is detached (pivot_root), so nothing on the host is written;
4. as root it switches to a uid of its own per call (SANDBOX_UID_BASE + launcher pid: no two live
   calls share one); in user mode the exec drops every capability (its uid inside is not 0);
5. sets no_new_privs and a seccomp filter (`deny_syscalls`: no namespaces of its own, no mount,
   ptrace, bpf, perf_event_open, userfaultfd, keyrings), then execs `python -I -S -c RUNNER`
   (flaxchat.execution's runner then sets the resource limits and the Python-level guards).
A failure before the exec prints one line starting with SETUP_FAILED and exits with SETUP_EXIT.

`flaxchat.execution.isolation()` runs a real call once per process to learn which mode the kernel
allows; docs/inference.md states what this protects against and what it does not.
"""

from __future__ import annotations

import ctypes
import os
import sys

SETUP_EXIT = 125
SETUP_FAILED = "flaxchat-sandbox setup failed:"
WORKDIR = "/sandbox"
SANDBOX_UID_BASE = 0x7F000000  # + the launcher's pid (< 2**22): far above any uid a system hands out
INSIDE_UID = 1000  # user mode: the caller's uid as seen inside the namespace (not 0: exec drops caps)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# (AUDIT_ARCH, syscall numbers) for the seccomp filter; pivot_root's number is used to call it too.
SYSCALLS = {
    "x86_64": (0xC000003E, dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, clone=56,
                                clone3=435, ptrace=101, bpf=321, perf_event_open=298, userfaultfd=323,
                                keyctl=250, add_key=248, request_key=249, open_by_handle_at=304)),
    "aarch64": (0xC00000B7, dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, clone=220,
                                 clone3=435, ptrace=117, bpf=280, perf_event_open=241, userfaultfd=282,
                                 keyctl=219, add_key=217, request_key=218, open_by_handle_at=265)),
}
# Refused inside the sandbox: namespaces of its own (a nested user namespace would give it
# capabilities again) and the kernel interfaces most often behind local privilege escalations.
SANDBOX_DENY = ("unshare", "setns", "mount", "umount2", "pivot_root", "ptrace", "bpf", "perf_event_open",
                "userfaultfd", "keyctl", "add_key", "request_key", "open_by_handle_at")
CLONE_NEW_ANY = 0x7E020000  # every CLONE_NEW* flag (cgroup, uts, ipc, user, pid, net, ns)
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
SYSTEM_LIBS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def deny_syscalls(names=SANDBOX_DENY) -> None:
    """Install a seccomp filter on this process and all it starts: `names` fail with EPERM, clone with
    any CLONE_NEW* flag too, clone3 with ENOSYS (its flags sit in memory a filter cannot read; glibc
    then falls back to clone), and so does any syscall of another ABI (x32, i386 on x86_64) that could
    slip past the numbers. Needs no privilege (no_new_privs is set first)."""
    import struct
    arch = os.uname().machine
    if arch not in SYSCALLS:
        raise OSError(f"seccomp: no syscall table for {arch}")
    audit, nr = SYSCALLS[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x50000 | 1, 0x50000 | 38
    deny = [nr[n] for n in names]
    # Classic BPF over seccomp_data (nr at offset 0, arch at 4, args[0]'s low half at 16);
    # jt/jf count the instructions to skip. The last three are ALLOW, EPERM, ENOSYS.
    n = len(deny)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 7, audit), (ld, 0, 0, 0), (jge, n + 6, 0, 0x40000000)]
    prog += [(jeq, n - i + 4, 0, x) for i, x in enumerate(deny)]
    prog += [(jeq, 5, 0, nr["clone3"]), (jeq, 0, 2, nr["clone"]), (ld, 0, 0, 16), (jset, 1, 0, CLONE_NEW_ANY),
             (ret, 0, 0, allow), (ret, 0, 0, eperm), (ret, 0, 0, enosys)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(_libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0), "prctl(SECCOMP_MODE_FILTER)")


def die_with_parent(parent_alive) -> None:
    """SIGKILL this process when the thread that started it ends; also if that already happened."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PDEATHSIG, SIGKILL)")
    if not parent_alive():
        os._exit(SETUP_EXIT)


def _open_pipe(fd: int) -> bool:
    """Whether the write end of pipe `fd` is still open somewhere (the launcher holds it: a child in
    a new pid namespace sees its parent as pid 0, so getppid() cannot tell)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) != b""
    except BlockingIOError:
        return True


def command(exe: str, argv: list[str], mode: str, parent: int, disk_mb: int, inodes: int,
            binds: list[str]) -> list[str]:
    """The launcher's command line (pure): `argv` run in the sandbox, `mode` "root" or "user",
    `parent` the pid it must die with, `disk_mb`/`inodes` the cap of each of /sandbox and /tmp."""
    return [exe, "-I", "-S", __file__, mode, str(parent), str(disk_mb), str(inodes), ":".join(binds), "--",
            *argv]


def bind_sources(prefix: str) -> list[str]:
    """What the new root shows, read-only: the Python install, then the system library folders (a
    folder that is a symlink, /lib -> usr/lib on merged-/usr systems, is recreated as a symlink)."""
    out = [os.path.realpath(prefix)]
    out += [p for p in SYSTEM_LIBS if os.path.lexists(p)]
    out += [p for p in ("/etc/ld.so.cache",) if os.path.exists(p)]
    return out


def _locked_flags(path: str) -> int:
    """The flags a bind mount in a user namespace must keep when remounted (else EPERM)."""
    f = os.statvfs(path).f_flag
    flags = MS_NOSUID | MS_NODEV | (MS_NOEXEC if f & os.ST_NOEXEC else 0)
    if f & os.ST_NOATIME:
        flags |= MS_NOATIME
    elif f & os.ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    return flags | (MS_NODIRATIME if f & os.ST_NODIRATIME else 0)


def _bind(src: str, root: str, readonly: bool = True) -> None:
    dst = root + src
    if os.path.islink(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.lexists(dst):
            os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND | MS_REC)
    if readonly:
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(dst))


def build_root(cfg: dict, uid: int) -> None:
    """Make the private root and enter it: after this the host's files are out of reach."""
    os.umask(0o022)  # the skeleton's folders must be passable for the sandbox's uid, whatever ours was
    binds = cfg["binds"].split(":")
    # Any existing folder will do as the new root's mount point (this mount namespace is ours alone),
    # as long as nothing to be bound lies under it (a Python install in /tmp).
    root = next((p for p in ("/tmp", "/mnt", "/var/tmp", "/opt") if os.path.isdir(p) and not any(
        b == p or b.startswith(p + "/") for b in binds)), None)
    if root is None:
        raise OSError("no folder to build the sandbox's root on (/tmp, /mnt, /var/tmp, /opt)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for src in binds:
        if not any(src != b and src.startswith(b + "/") for b in binds):
            _bind(src, root)
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(dev, root, readonly=False)
    scratch = f"size={cfg['disk_mb']}m,nr_inodes={cfg['inodes']},uid={uid},gid={uid}"
    for path, mode in ((WORKDIR, "700"), ("/tmp", "1777")):
        os.makedirs(root + path, exist_ok=True)
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"{scratch},mode={mode}")
    os.chdir(root)
    arch = os.uname().machine
    if arch not in SYSCALLS:
        raise OSError(f"pivot_root: unknown syscall number on {arch}")
    _check(_libc.syscall(SYSCALLS[arch][1]["pivot_root"], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")  # the host's root, stacked under ours
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(WORKDIR)


def _child(cfg: dict, launcher: int, alive: int) -> None:
    uid = SANDBOX_UID_BASE + launcher if cfg["mode"] == "root" else INSIDE_UID
    build_root(cfg, uid)
    if cfg["mode"] == "root":
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to a non-zero uid: every capability goes
    die_with_parent(lambda: _open_pipe(alive))  # after the uid change, which would clear it
    os.close(alive)
    deny_syscalls()
    exe = cfg["argv"][0]
    os.execve(exe, cfg["argv"], {"LC_ALL": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": "/tmp"})


def main(argv: list[str]) -> None:
    mode, parent, disk_mb, inodes, binds, dashes, *rest = argv[1:]
    assert dashes == "--" and rest, "usage: isolation.py MODE PARENT DISK_MB INODES BINDS -- ARGV..."
    cfg = dict(mode=mode, parent=int(parent), disk_mb=int(disk_mb), inodes=int(inodes), binds=binds, argv=rest)
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a signal that dumps core leaves no file
        die_with_parent(lambda: os.getppid() == cfg["parent"])
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        uid, gid = os.geteuid(), os.getegid()
        if cfg["mode"] == "user":
            _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{INSIDE_UID} {uid} 1"),
                               ("gid_map", f"{INSIDE_UID} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        else:
            _check(_libc.unshare(flags), "unshare")
        launcher = os.getpid()
        alive, keep = os.pipe()
        pid = os.fork()
    except Exception as e:
        print(SETUP_FAILED, e, file=sys.stderr, flush=True)
        os._exit(SETUP_EXIT)
    if pid == 0:
        try:
            os.close(keep)
            _child(cfg, launcher, alive)
        except BaseException as e:
            print(SETUP_FAILED, e, file=sys.stderr, flush=True)
        os._exit(SETUP_EXIT)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # pass a signal on as itself: the caller tells SIGXCPU from SIGKILL
        import signal
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv)
