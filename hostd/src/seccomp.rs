//! The seccomp filter of every sandbox container (`linux.seccomp` of the OCI spec).
//!
//! Source: Docker's default profile (moby `profiles/seccomp/default.json`), resolved for the
//! capability set of [`crate::oci`] (no `CAP_SYS_ADMIN`, `CAP_SYS_PTRACE`, `CAP_SYS_MODULE`,
//! `CAP_SYS_TIME`, `CAP_BPF`, `CAP_PERFMON`, …; `CAP_SYS_CHROOT` kept, so `chroot` is allowed):
//! the default action is `EPERM`, and only the syscalls below are allowed. So, as in Docker,
//! these are refused: `unshare`, `setns`, `clone` with any namespace flag, `clone3` (with
//! `ENOSYS`, so libc falls back to `clone`, whose flags the filter can see), `mount`, `umount2`,
//! `fsopen`/`fsconfig`/`fsmount`/`fspick`, `open_tree`, `move_mount`, `mount_setattr`,
//! `pivot_root`, `keyctl`, `add_key`, `request_key`, `bpf`, `userfaultfd`, `perf_event_open`,
//! `kexec_load`/`kexec_file_load`, `init_module`/`finit_module`/`delete_module`, `reboot`,
//! `acct`, `swapon`/`swapoff`, `quotactl`, `syslog`, `settimeofday`/`clock_settime`,
//! `open_by_handle_at`, `kcmp`, `pidfd_getfd`, `process_madvise`, `lookup_dcookie`,
//! `fanotify_init`, `iopl`/`ioperm`, `sethostname`/`setdomainname`, `vhangup`, `mbind` and
//! `set_mempolicy`, `socket(AF_VSOCK)` and `personality` beyond the values Docker allows.
//!
//! Stricter than that profile: the `io_uring_*` syscalls are refused, as Docker has done since
//! 25.0 (moby "seccomp: block io_uring_* syscalls in default profile"): io_uring bypasses
//! syscall filtering and has been a steady source of kernel privilege escalations.
//!
//! `ptrace`, `process_vm_readv` and `process_vm_writev` are allowed on kernels ≥ 4.8 (where
//! `ptrace` can no longer bypass seccomp), refused before, as in Docker's profile; a sandbox
//! may debug its own processes, but not its agent (pid 1), which makes itself non-dumpable.
//!
//! gVisor: runsc (`--oci-seccomp`) loads the same filter for the sandbox's processes against
//! gVisor's kernel, except that `clone3` is left to that kernel ([`Target::Gvisor`]): this
//! runsc applies the filter's default `EPERM` instead of a rule's `errnoRet`, so the `ENOSYS`
//! that makes libc fall back to `clone` would reach programs as `EPERM`, and every thread
//! creation would fail; gVisor's kernel (release 20221219) answers `clone3` with `ENOSYS`
//! itself, and namespaces there are the sentry's, not the host's.
//!
//! Architectures: the native one only. Docker's `archMap` also admits the compat ABIs (x86 and
//! x32 on x86-64, arm on aarch64); this filter refuses every syscall made through them (runc's
//! bad-architecture action), which is stricter (the compat entry points have a long history of
//! kernel bugs) and costs less: runc compiles the filter once per admitted architecture, and
//! with three it added about 20 ms to every `runc run` on the development machine, against
//! about 8 ms with one (`runc run` of `true`, 30 interleaved runs each). What it costs the
//! sandbox: 32-bit binaries do not run.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder,
};

use crate::error::HostdError;

/// `EPERM`: what a refused syscall returns (Docker's `defaultErrnoRet`).
pub const EPERM: u32 = 1;

/// `ENOSYS`: what `clone3` returns, so libc falls back to `clone`.
pub const ENOSYS: u32 = 38;

/// Every namespace flag of `clone` (`CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS |
/// CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET`; `CLONE_NEWTIME` shares its bit
/// with `CSIGNAL` and cannot be passed to `clone`). A `clone` is allowed only when
/// `flags & CLONE_NAMESPACE_FLAGS == 0`.
pub const CLONE_NAMESPACE_FLAGS: u64 = 0x7E02_0000;

/// `AF_VSOCK`: the one socket family refused (Docker's profile).
pub const AF_VSOCK: u64 = 40;

/// The `personality(2)` values allowed: `PER_LINUX`, `PER_LINUX32`, `UNAME26`,
/// `PER_LINUX32 | UNAME26`, and the query `0xffffffff` (Docker's profile).
pub const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// The kernel from which `ptrace` is allowed (it cannot bypass seccomp from 4.8 on).
pub const PTRACE_MIN_KERNEL: (u32, u32) = (4, 8);

/// Syscalls allowed on every architecture, whatever their arguments: Docker's unconditional
/// allow-list without `io_uring_enter`, `io_uring_register` and `io_uring_setup`.
pub const ALLOWED: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "bind",
    "brk",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chown32",
    "clock_adjtime",
    "clock_adjtime64",
    "clock_getres",
    "clock_getres_time64",
    "clock_gettime",
    "clock_gettime64",
    "clock_nanosleep",
    "clock_nanosleep_time64",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "epoll_wait_old",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fadvise64_64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchown",
    "fchown32",
    "fchownat",
    "fcntl",
    "fcntl64",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstat64",
    "fstatat64",
    "fstatfs",
    "fstatfs64",
    "fsync",
    "ftruncate",
    "ftruncate64",
    "futex",
    "futex_time64",
    "futex_waitv",
    "futimesat",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "getegid32",
    "geteuid",
    "geteuid32",
    "getgid",
    "getgid32",
    "getgroups",
    "getgroups32",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresgid32",
    "getresuid",
    "getresuid32",
    "getrlimit",
    "get_robust_list",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "get_thread_area",
    "gettid",
    "gettimeofday",
    "getuid",
    "getuid32",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "ioctl",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_pgetevents_time64",
    "ioprio_get",
    "ioprio_set",
    "io_setup",
    "io_submit",
    "ipc",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lchown32",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "_llseek",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "lstat64",
    "madvise",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mmap2",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedreceive_time64",
    "mq_timedsend",
    "mq_timedsend_time64",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "name_to_handle_at",
    "nanosleep",
    "newfstatat",
    "_newselect",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "ppoll_time64",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "pselect6",
    "pselect6_time64",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recv",
    "recvfrom",
    "recvmmsg",
    "recvmmsg_time64",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_rr_get_interval_time64",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "semtimedop_time64",
    "send",
    "sendfile",
    "sendfile64",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "setfsgid",
    "setfsgid32",
    "setfsuid",
    "setfsuid32",
    "setgid",
    "setgid32",
    "setgroups",
    "setgroups32",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setregid32",
    "setresgid",
    "setresgid32",
    "setresuid",
    "setresuid32",
    "setreuid",
    "setreuid32",
    "setrlimit",
    "set_robust_list",
    "setsid",
    "setsockopt",
    "set_thread_area",
    "set_tid_address",
    "setuid",
    "setuid32",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "sigprocmask",
    "sigreturn",
    "socketcall",
    "socketpair",
    "splice",
    "stat",
    "stat64",
    "statfs",
    "statfs64",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_gettime64",
    "timer_settime",
    "timer_settime64",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_gettime64",
    "timerfd_settime",
    "timerfd_settime64",
    "times",
    "tkill",
    "truncate",
    "truncate64",
    "ugetrlimit",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimensat_time64",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "waitpid",
    "write",
    "writev",
    // Docker allows this with CAP_SYS_CHROOT, which the sandbox keeps.
    "chroot",
];

/// Allowed on kernels from [`PTRACE_MIN_KERNEL`] on.
pub const ALLOWED_FROM_4_8: &[&str] = &["ptrace", "process_vm_readv", "process_vm_writev"];

/// One architecture family the filter is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchFamily {
    /// The seccomp architecture admitted (the native one).
    pub arch: Arch,
    /// Architecture-specific syscalls allowed (Docker's for that architecture; its 32-bit arm
    /// ones do not exist on aarch64).
    pub extra: &'static [&'static str],
    /// Which `clone` argument holds the flags (1 on s390, 0 elsewhere).
    pub clone_flags_arg: usize,
}

/// The seccomp architecture and its specific syscalls for a Rust target architecture
/// (`std::env::consts::ARCH`).
///
/// Errors: [`HostdError::Io`] (`Unsupported`) for an architecture this profile has no table for.
pub fn arch_family(arch: &str) -> Result<ArchFamily, HostdError> {
    let family = match arch {
        "x86_64" => ArchFamily {
            arch: Arch::ScmpArchX86_64,
            extra: &["arch_prctl", "modify_ldt"],
            clone_flags_arg: 0,
        },
        "aarch64" => ArchFamily {
            arch: Arch::ScmpArchAarch64,
            extra: &[],
            clone_flags_arg: 0,
        },
        "riscv64" => ArchFamily {
            arch: Arch::ScmpArchRiscv64,
            extra: &["riscv_flush_icache"],
            clone_flags_arg: 0,
        },
        "s390x" => ArchFamily {
            arch: Arch::ScmpArchS390x,
            extra: &[
                "s390_pci_mmio_read",
                "s390_pci_mmio_write",
                "s390_runtime_instr",
            ],
            clone_flags_arg: 1,
        },
        other => {
            return Err(HostdError::Io {
                context: format!("no seccomp profile for architecture {other}"),
                source: std::io::ErrorKind::Unsupported.into(),
            })
        }
    };
    Ok(family)
}

/// The kernel's `major.minor` from a release string (`6.18.44-fc`), `None` when unreadable.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The running kernel's `major.minor` (`uname -r`); `(0, 0)` when unreadable, which allows
/// the least.
pub fn running_kernel() -> (u32, u32) {
    nix::sys::utsname::uname()
        .ok()
        .and_then(|u| kernel_version(&u.release().to_string_lossy()))
        .unwrap_or((0, 0))
}

/// The kernel the filter's syscalls reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The host's Linux (runc).
    Linux,
    /// gVisor's kernel (runsc): `clone3` is allowed (see the module docs).
    Gvisor,
}

/// The filter for architecture family `family` on kernel `kernel` (`major.minor`), for
/// `target`.
///
/// Errors: [`HostdError::Oci`] when a builder refuses a value.
pub fn profile(
    family: &ArchFamily,
    kernel: (u32, u32),
    target: Target,
) -> Result<LinuxSeccomp, HostdError> {
    let mut names: Vec<String> = ALLOWED
        .iter()
        .chain(family.extra)
        .map(|s| (*s).to_owned())
        .collect();
    if kernel >= PTRACE_MIN_KERNEL {
        names.extend(ALLOWED_FROM_4_8.iter().map(|s| (*s).to_owned()));
    }
    let allow = |name: &str, args| -> Result<LinuxSyscall, HostdError> {
        Ok(LinuxSyscallBuilder::default()
            .names(vec![name.to_owned()])
            .action(LinuxSeccompAction::ScmpActAllow)
            .args(args)
            .build()?)
    };
    let arg = |index: usize, op, value: u64| {
        LinuxSeccompArgBuilder::default()
            .index(index)
            .op(op)
            .value(value)
            .build()
    };
    let mut syscalls = vec![LinuxSyscallBuilder::default()
        .names(names)
        .action(LinuxSeccompAction::ScmpActAllow)
        .build()?];
    // clone without namespace flags: (flags & mask) == 0.
    let no_namespaces = LinuxSeccompArgBuilder::default()
        .index(family.clone_flags_arg)
        .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
        .value(CLONE_NAMESPACE_FLAGS)
        .value_two(0u64)
        .build()?;
    syscalls.push(allow("clone", vec![no_namespaces])?);
    syscalls.push(match target {
        Target::Linux => LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_owned()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(ENOSYS)
            .build()?,
        Target::Gvisor => allow("clone3", vec![])?,
    });
    syscalls.push(allow(
        "socket",
        vec![arg(0, LinuxSeccompOperator::ScmpCmpNe, AF_VSOCK)?],
    )?);
    for persona in PERSONALITIES {
        syscalls.push(allow(
            "personality",
            vec![arg(0, LinuxSeccompOperator::ScmpCmpEq, persona)?],
        )?);
    }
    Ok(LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(EPERM)
        .architectures(vec![family.arch])
        .syscalls(syscalls)
        .build()?)
}

/// The filter for this machine (its architecture and running kernel) and `target`.
///
/// Errors: as [`arch_family`] and [`profile`].
pub fn host_profile(target: Target) -> Result<LinuxSeccomp, HostdError> {
    profile(
        &arch_family(std::env::consts::ARCH)?,
        running_kernel(),
        target,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(p: &LinuxSeccomp) -> Vec<String> {
        p.syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|s| s.action() == LinuxSeccompAction::ScmpActAllow && s.args().is_none())
            .flat_map(|s| s.names().clone())
            .collect()
    }

    #[test]
    fn docker_deny_set_and_io_uring_are_not_allowed() {
        let p = profile(&arch_family("x86_64").unwrap(), (6, 18), Target::Linux).unwrap();
        assert_eq!(p.default_action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(p.default_errno_ret(), Some(EPERM));
        let names = allowed(&p);
        for denied in [
            "unshare",
            "setns",
            "clone3",
            "mount",
            "umount2",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "open_tree",
            "move_mount",
            "mount_setattr",
            "pivot_root",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "userfaultfd",
            "perf_event_open",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "quotactl",
            "syslog",
            "settimeofday",
            "clock_settime",
            "open_by_handle_at",
            "kcmp",
            "pidfd_getfd",
            "iopl",
            "ioperm",
            "sethostname",
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "acct",
            "lookup_dcookie",
        ] {
            assert!(!names.iter().any(|n| n == denied), "{denied} allowed");
        }
        for needed in [
            "read",
            "execve",
            "socketpair",
            "arch_prctl",
            "chroot",
            "ptrace",
        ] {
            assert!(names.iter().any(|n| n == needed), "{needed} refused");
        }
    }

    #[test]
    fn clone_is_allowed_only_without_namespace_flags_and_clone3_falls_back() {
        let p = profile(&arch_family("x86_64").unwrap(), (6, 18), Target::Linux).unwrap();
        let rules = p.syscalls().as_ref().unwrap();
        let clone = rules
            .iter()
            .find(|s| s.names() == &["clone".to_owned()])
            .unwrap();
        let arg = &clone.args().as_ref().unwrap()[0];
        assert_eq!(arg.index(), 0);
        assert_eq!(arg.op(), LinuxSeccompOperator::ScmpCmpMaskedEq);
        // CLONE_NEWUSER (0x10000000) and CLONE_NEWNS (0x20000) are inside the mask.
        assert_eq!(arg.value() & 0x1000_0000, 0x1000_0000);
        assert_eq!(arg.value() & 0x2_0000, 0x2_0000);
        assert_eq!(arg.value_two(), Some(0));
        let clone3 = rules
            .iter()
            .find(|s| s.names() == &["clone3".to_owned()])
            .unwrap();
        assert_eq!(clone3.action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(clone3.errno_ret(), Some(ENOSYS));
        let s390 = profile(&arch_family("s390x").unwrap(), (6, 1), Target::Linux).unwrap();
        let clone = s390
            .syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .find(|s| s.names() == &["clone".to_owned()])
            .unwrap()
            .clone();
        assert_eq!(clone.args().as_ref().unwrap()[0].index(), 1);
        let gvisor = profile(&arch_family("x86_64").unwrap(), (6, 1), Target::Gvisor).unwrap();
        let clone3 = gvisor
            .syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .find(|s| s.names() == &["clone3".to_owned()])
            .unwrap()
            .clone();
        assert_eq!(clone3.action(), LinuxSeccompAction::ScmpActAllow);
    }

    #[test]
    fn only_the_native_architecture_is_admitted_and_ptrace_needs_4_8() {
        let x86 = profile(&arch_family("x86_64").unwrap(), (4, 7), Target::Linux).unwrap();
        assert_eq!(
            x86.architectures().as_ref().unwrap(),
            &[Arch::ScmpArchX86_64]
        );
        assert!(!allowed(&x86).iter().any(|n| n == "ptrace"));
        let arm = profile(&arch_family("aarch64").unwrap(), (6, 1), Target::Linux).unwrap();
        assert_eq!(
            arm.architectures().as_ref().unwrap(),
            &[Arch::ScmpArchAarch64]
        );
        assert!(!allowed(&arm).iter().any(|n| n == "arch_prctl"));
        assert!(arch_family("sparc64").is_err());
        assert_eq!(kernel_version("6.18.44-fc-v657"), Some((6, 18)));
        assert_eq!(kernel_version("5.4"), Some((5, 4)));
        assert_eq!(kernel_version("junk"), None);
    }

    #[test]
    fn the_filter_serializes_as_the_oci_spec_spells_it() {
        let p = profile(&arch_family("x86_64").unwrap(), (6, 18), Target::Linux).unwrap();
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(json["defaultErrnoRet"], 1);
        assert_eq!(json["architectures"][0], "SCMP_ARCH_X86_64");
        let text = json.to_string();
        assert!(text.contains("SCMP_CMP_MASKED_EQ"), "{text}");
        assert!(text.contains("\"errnoRet\":38"), "{text}");
    }
}
