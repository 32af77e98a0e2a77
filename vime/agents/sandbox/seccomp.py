"""A seccomp filter for sandboxed programs: no sockets but connected AF_UNIX pairs, no new namespaces, no way into
other processes or the kernel's rarer doors.

    program = build_filter("x86_64", deny_network=True, deny_new_session=False)
    install(program)   # in the jail, after Landlock, before exec; inherited by every descendant

Why each rule:
- socket(domain != AF_UNIX) -> EPERM (unless network is allowed): the network is off even where no network
  namespace can be made (a default container), below anything a program can bypass (ctypes, `bash >/dev/tcp/...`,
  a static binary);
- socket(AF_UNIX) -> EPERM always, socketpair only of SOCK_STREAM or SOCK_SEQPACKET: a UNIX socket reaches any
  path-named socket the uid may open (D-Bus, docker.sock, Ray's sockets under /tmp), which neither Landlock (on
  most kernels) nor a network namespace governs; a filter cannot read connect()'s address, so the program gets no
  socket it could connect at all. A connected stream pair cannot be re-connected (EISCONN) and ignores sendto
  addresses, so asyncio's and multiprocessing's pairs still work;
- io_uring_* -> EPERM: io_uring opens sockets and files without the system calls filtered here;
- ptrace, process_vm_readv/writev, pidfd_getfd -> EPERM: no reading or writing another process (the jail that
  reports the program's exit status, a sibling sandbox of the same uid);
- userfaultfd, bpf, perf_event_open, add_key/request_key/keyctl -> EPERM: kernel surface a program never needs,
  often the first step of an exploit (the keyring is also shared per uid, outside every namespace);
- mount, umount2, pivot_root and the new mount API -> EPERM: the jail's mounts (scratch tmpfs, /proc) stay;
- unshare, setns, clone(CLONE_NEW*) -> EPERM, clone3 -> ENOSYS (libc falls back to clone, whose flags a filter can
  read): no fresh namespaces for the program, so no way around the limits through one, and less kernel to attack;
- setsid, setpgid -> EPERM (only when asked): where nothing else can find every descendant (no pid namespace,
  no cgroup, no uid of its own), the process group is the sure kill, and these are the only ways out of it;
- another architecture (i386 calls on x86_64) kills the process, x32 calls are refused: the numbers checked
  below are only those of the native ABI.

Standard library only, no vime imports: the jail imports this module by file before any sandboxed code runs.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian: low word first)
_NR, _ARCH, _ARG0_LOW, _ARG1_LOW = 0, 4, 16, 24
# BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K, _AND_K = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_X32_BIT = 0x40000000
_AF_UNIX = 1
_SOCK_TYPE_MASK, _SOCK_STREAM, _SOCK_SEQPACKET = 0xF, 1, 5
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2

# refused with EPERM in every sandbox (see the module docstring for why)
ALWAYS_REFUSED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv",
                  "process_vm_writev", "pidfd_getfd", "userfaultfd", "bpf", "perf_event_open", "add_key",
                  "request_key", "keyctl", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
                  "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns")
# the numbers the generic table (aarch64) and x86_64 share
_COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone3": 435, "open_tree": 428,
           "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438,
           "mount_setattr": 442}
# audit arch and the native numbers of the calls filtered here
ARCHES = {
    "x86_64": {**_COMMON, "audit": 0xC000003E, "x32": True, "socket": 41, "socketpair": 53, "unshare": 272,
               "setns": 308, "clone": 56, "setsid": 112, "setpgid": 109, "ptrace": 101, "process_vm_readv": 310,
               "process_vm_writev": 311, "userfaultfd": 323, "bpf": 321, "perf_event_open": 298, "add_key": 248,
               "request_key": 249, "keyctl": 250, "mount": 165, "umount2": 166, "pivot_root": 155},
    "aarch64": {**_COMMON, "audit": 0xC00000B7, "x32": False, "socket": 198, "socketpair": 199, "unshare": 97,
                "setns": 268, "clone": 220, "setsid": 157, "setpgid": 154, "ptrace": 117, "process_vm_readv": 270,
                "process_vm_writev": 271, "userfaultfd": 282, "bpf": 280, "perf_event_open": 241, "add_key": 217,
                "request_key": 218, "keyctl": 219, "mount": 40, "umount2": 39, "pivot_root": 41},
}


def machine() -> str:
    """This machine's architecture as named in ARCHES ("arm64" is "aarch64")."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _ins(code: int, jt: int = 0, jf: int = 0, k: int = 0) -> tuple[int, int, int, int]:
    return code, jt, jf, k


def _refuse(number: int, err: int) -> list[tuple]:
    """if nr == number: return -err"""
    return [_ins(_JEQ_K, 0, 1, number), _ins(_RET_K, k=_ERRNO | err)]


def build_filter(arch: str, deny_network: bool, deny_new_session: bool) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions for `arch` (a key of ARCHES)."""
    if arch not in ARCHES:
        raise ValueError(f"no seccomp filter for architecture {arch!r}; known: {sorted(ARCHES)}")
    a = ARCHES[arch]
    prog = [_ins(_LD_W_ABS, k=_ARCH), _ins(_JEQ_K, 1, 0, a["audit"]), _ins(_RET_K, k=_KILL_PROCESS),
            _ins(_LD_W_ABS, k=_NR)]
    if a["x32"]:
        prog += [_ins(_JGE_K, 0, 1, _X32_BIT), _ins(_RET_K, k=_ERRNO | errno.EPERM)]
    # each block that loads an argument ends in a return, so A need not be reloaded after it
    if deny_network:  # socket: none at all
        prog += _refuse(a["socket"], errno.EPERM)
    else:  # socket: any family but AF_UNIX
        prog += [_ins(_JEQ_K, 0, 4, a["socket"]), _ins(_LD_W_ABS, k=_ARG0_LOW), _ins(_JEQ_K, 0, 1, _AF_UNIX),
                 _ins(_RET_K, k=_ERRNO | errno.EPERM), _ins(_RET_K, k=_ALLOW)]
    # socketpair: connected stream or seqpacket pairs only (a datagram pair could sendto() any path)
    prog += [_ins(_JEQ_K, 0, 6, a["socketpair"]), _ins(_LD_W_ABS, k=_ARG1_LOW), _ins(_AND_K, k=_SOCK_TYPE_MASK),
             _ins(_JEQ_K, 2, 0, _SOCK_STREAM), _ins(_JEQ_K, 1, 0, _SOCK_SEQPACKET),
             _ins(_RET_K, k=_ERRNO | errno.EPERM), _ins(_RET_K, k=_ALLOW)]
    for name in ALWAYS_REFUSED:
        prog += _refuse(a[name], errno.EPERM)
    prog += _refuse(a["clone3"], errno.ENOSYS)
    if deny_new_session:
        prog += _refuse(a["setsid"], errno.EPERM) + _refuse(a["setpgid"], errno.EPERM)
    # clone: refuse namespace flags (flags are the first argument on both architectures)
    prog += [_ins(_JEQ_K, 0, 4, a["clone"]), _ins(_LD_W_ABS, k=_ARG0_LOW), _ins(_JSET_K, 0, 1, _CLONE_NEW),
             _ins(_RET_K, k=_ERRNO | errno.EPERM), _ins(_RET_K, k=_ALLOW)]
    prog.append(_ins(_RET_K, k=_ALLOW))
    return prog


def encode(prog: list[tuple[int, int, int, int]]) -> bytes:
    """struct sock_filter[]: u16 code, u8 jt, u8 jf, u32 k each."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(prog: list[tuple[int, int, int, int]]) -> None:
    """Apply the filter to this thread and everything it starts from now on (irreversible)."""
    code = encode(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
