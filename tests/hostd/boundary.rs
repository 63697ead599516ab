//! The sandbox boundary, probed from inside real sandboxes (issue 11, item 2): the seccomp
//! filter, the unprivileged user namespace, no raw sockets, masked and read-only paths, and
//! the agent's memory out of reach — on runc, and what of it applies on gVisor.
//!
//! The syscall probe (`syscall_probe.c`) is built by the test with the host's `cc -static`
//! (the C toolchain Rust links with, plus glibc's static `libc.a` from `libc6-dev`) and is
//! x86-64 only.

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::{AgentOp, AgentReply};
use berth_schemas::{CommandKind, SandboxId};
use std::os::unix::fs::MetadataExt;

use crate::harness::*;
use crate::support::env::run;

/// The host id of sandbox id 0 (`berth_hostd::isolation::SANDBOX_IDS`).
const BASE: u32 = 1 << 30;

/// `CAP_NET_RAW` and `CAP_SYS_ADMIN` as bits of `/proc/<pid>/status` capability masks.
const CAP_NET_RAW_BIT: u64 = 1 << 13;
const CAP_SYS_ADMIN_BIT: u64 = 1 << 21;

/// Sends one ICMP echo to 127.0.0.1 over an unprivileged ICMP socket and prints the reply's
/// type (0 = echo reply), then tries a raw ICMP socket.
const PING_PROBE: &str = "
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(30)
s.sendto(bytes([8, 0, 0, 0, 0, 1, 0, 1]), ('127.0.0.1', 0))
print('reply', s.recvfrom(64)[0][0])
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    print('raw allowed')
except PermissionError:
    print('raw refused')
";

/// Runs `script` with `sh -c` in the sandbox: (exit code, stdout, stderr).
async fn sh(
    h: &Harness,
    sandbox: SandboxId,
    script: &str,
) -> anyhow::Result<(i32, String, String)> {
    match h
        .exec(sandbox, &["sh", "-c", script], EXEC_TIMEOUT_MS)
        .await?
    {
        AgentReply::Exec {
            exit_code,
            stdout,
            stderr,
            ..
        } => Ok((
            exit_code,
            String::from_utf8_lossy(&stdout).into_owned(),
            String::from_utf8_lossy(&stderr).into_owned(),
        )),
        other => bail!("exec {script:?} failed: {other:?}"),
    }
}

/// `script` must fail, saying `Operation not permitted`, `Permission denied` or `Read-only
/// file system`.
async fn refused(h: &Harness, sandbox: SandboxId, script: &str) -> anyhow::Result<()> {
    let (code, out, err) = sh(h, sandbox, script).await?;
    ensure!(
        code != 0
            && ["not permitted", "denied", "Read-only"]
                .iter()
                .any(|m| err.contains(m)),
        "{script:?} was not refused: exit {code}, stdout {out:?}, stderr {err:?}"
    );
    Ok(())
}

/// The value of field `name` of `/proc/self/status` as the sandbox's shell sees it.
fn status_field<'a>(status: &'a str, name: &str) -> anyhow::Result<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
        .ok_or_else(|| anyhow::anyhow!("no {name} in {status}"))
}

/// Syscalls the probe tries that the filter must refuse with `EPERM` (on runc).
const DENIED_SYSCALLS: &[&str] = &[
    "unshare_user",
    "unshare_mount",
    "clone_newuser",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsmount",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "io_uring_setup",
    "kexec_load",
    "init_module",
    "finit_module",
    "delete_module",
    "socket_vsock",
    "personality_no_aslr",
];

/// Calls the probe makes that must work (so a probe that cannot run fails the test).
const ALLOWED_SYSCALLS: &[&str] = &["fork", "socket_tcp", "personality_query"];

/// Builds `syscall_probe.c` with the host's C compiler (static), copies it into the sandbox
/// through the agent and runs it: each try's name and its errno (`0` = it succeeded, `sig<N>`
/// = it was killed).
async fn syscall_probe(
    h: &Harness,
    sandbox: SandboxId,
) -> anyhow::Result<BTreeMap<String, String>> {
    let dir = std::env::temp_dir().join(format!("berth-probe-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    let source = dir.join("probe.c");
    let binary = dir.join("probe");
    std::fs::write(&source, include_str!("syscall_probe.c"))?;
    let built = run(
        "cc",
        &[
            "-static",
            "-O1",
            "-o",
            &binary.to_string_lossy(),
            &source.to_string_lossy(),
        ],
    )
    .await
    .context("build the syscall probe (needs cc and a static libc)");
    let bytes = built.and_then(|_| Ok(std::fs::read(&binary)?));
    std::fs::remove_dir_all(&dir)?;
    let bytes = bytes?;
    for (i, chunk) in bytes.chunks(512 * 1024).enumerate() {
        let reply = h
            .agent(
                sandbox,
                AgentOp::Write {
                    path: "/root/probe".into(),
                    offset: (i * 512 * 1024) as u64,
                    data: chunk.to_vec(),
                    truncate: i == 0,
                },
            )
            .await?;
        ensure!(
            matches!(reply, AgentReply::Written { .. }),
            "upload: {reply:?}"
        );
    }
    let (code, out, err) = sh(h, sandbox, "chmod +x /root/probe && /root/probe").await?;
    ensure!(code == 0, "probe: {code} {out:?} {err:?}");
    Ok(out
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// Probes both kinds of sandbox agree on: the seccomp filter, no raw sockets, namespace and
/// mount syscalls refused, the agent's memory not readable, `/proc/kcore` masked.
async fn common_probes(h: &Harness, sandbox: SandboxId) -> anyhow::Result<()> {
    let (_, status, _) = sh(h, sandbox, "cat /proc/self/status").await?;
    ensure!(status_field(&status, "Seccomp")? == "2", "{status}");
    for set in ["CapBnd", "CapEff", "CapPrm"] {
        let mask = u64::from_str_radix(status_field(&status, set)?, 16)?;
        ensure!(
            mask & (CAP_NET_RAW_BIT | CAP_SYS_ADMIN_BIT) == 0,
            "{set} {mask:x} holds NET_RAW or SYS_ADMIN"
        );
    }

    // New namespaces and mounts: the seccomp filter (and the missing CAP_SYS_ADMIN).
    refused(h, sandbox, "unshare -U true").await?;
    refused(h, sandbox, "unshare -m true").await?;
    refused(h, sandbox, "unshare -n true").await?;
    refused(h, sandbox, "mount -t tmpfs none /tmp").await?;

    // Raw sockets: traceroute opens socket(AF_INET, SOCK_RAW, IPPROTO_ICMP), arping an
    // AF_PACKET socket; both need CAP_NET_RAW.
    refused(h, sandbox, "traceroute -n -m 1 -q 1 -w 1 127.0.0.1").await?;
    refused(h, sandbox, "arping -c 1 -w 1 -I eth0 127.0.0.1").await?;

    // The agent (pid 1, and the server process that runs this shell) is not dumpable, so its
    // memory cannot be opened; the shell's own can (the probe itself works).
    let (code, out, err) = sh(h, sandbox, "exec 3</proc/self/mem && echo opened").await?;
    ensure!(
        code == 0 && out == "opened\n",
        "control: {code} {out:?} {err:?}"
    );
    refused(h, sandbox, "exec 3</proc/1/mem && echo opened").await?;
    refused(h, sandbox, "exec 3</proc/$PPID/mem && echo opened").await?;

    // Masked paths read empty (or do not exist): each one that the host's kernel has and
    // shows to root with some content.
    let mut checked = 0;
    for path in MASKED_PROBES {
        if std::fs::read(path).map_or(true, |c| c.is_empty()) {
            continue;
        }
        checked += 1;
        let (_, out, _) = sh(h, sandbox, &format!("cat {path} 2>/dev/null | wc -c")).await?;
        ensure!(out.trim() == "0", "{path} shows {out:?} bytes");
    }
    ensure!(checked > 0, "the host has none of {MASKED_PROBES:?}");
    Ok(())
}

/// Masked paths probed (those of `berth_hostd::oci::MASKED_PATHS` that are files with
/// content on a typical kernel).
const MASKED_PROBES: &[&str] = &[
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/interrupts",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runc_sandbox_is_confined_by_seccomp_an_unprivileged_user_namespace_and_masked_paths(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(runc_boundary(h))).await
}

async fn runc_boundary(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let created = h.send(&h.command(sandbox, 1, CommandKind::Create)).await?;
    succeeded_address(&created)?;
    common_probes(h, sandbox).await?;

    // Docker's deny set, syscall by syscall: EPERM; clone3 ENOSYS (so libc falls back to
    // clone, whose flags the filter sees); a 32-bit syscall refused (only the native
    // architecture is admitted); the controls work.
    let tries = syscall_probe(h, sandbox).await?;
    for name in DENIED_SYSCALLS {
        ensure!(
            tries.get(*name).map(String::as_str) == Some("1"),
            "{name}: {:?} (all: {tries:?})",
            tries.get(*name)
        );
    }
    ensure!(
        tries.get("clone3_newuser").map(String::as_str) == Some("38"),
        "{tries:?}"
    );
    ensure!(
        tries.get("int80_getpid").is_some_and(|v| v != "0"),
        "{tries:?}"
    );
    for name in ALLOWED_SYSCALLS {
        ensure!(
            tries.get(*name).map(String::as_str) == Some("0"),
            "{name}: {tries:?}"
        );
    }

    // Sandbox root is host uid 1073741824, not 0: inside, and as the host sees the container.
    let (_, maps, _) = sh(h, sandbox, "cat /proc/self/uid_map /proc/self/gid_map").await?;
    let expected = format!("0 {BASE} 65536");
    let lines: Vec<String> = maps
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    ensure!(lines == [expected.clone(), expected], "maps: {maps:?}");
    let state = run(
        "runc",
        &[
            "--root",
            &h.runc_root().to_string_lossy(),
            "state",
            &h.names(sandbox).container_id,
        ],
    )
    .await?;
    let pid = serde_json::from_str::<serde_json::Value>(&state)?["pid"]
        .as_i64()
        .unwrap_or(0);
    let host_status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let uids: Vec<&str> = status_field(&host_status, "Uid")?
        .split_whitespace()
        .collect();
    ensure!(
        uids.iter().all(|u| *u == BASE.to_string()),
        "host uids {uids:?}"
    );

    // Unprivileged ICMP sockets are open in the sandbox's network namespace (busybox's `ping`
    // knows only raw sockets, so the probe is the host's python3 entering the sandbox's user
    // and network namespaces as its root): an echo to 127.0.0.1 is answered, a raw socket
    // is still refused.
    let range = run(
        "ip",
        &[
            "netns",
            "exec",
            &h.names(sandbox).netns,
            "cat",
            "/proc/sys/net/ipv4/ping_group_range",
        ],
    )
    .await?;
    ensure!(
        range.split_whitespace().collect::<Vec<_>>() == ["0", "2147483647"],
        "ping_group_range {range:?}"
    );
    let pid_arg = pid.to_string();
    let echo = run(
        "nsenter",
        &[
            "--target",
            &pid_arg,
            "--user",
            "--net",
            "--setuid",
            "0",
            "--setgid",
            "0",
            "/usr/bin/python3",
            "-c",
            PING_PROBE,
        ],
    )
    .await?;
    ensure!(echo == "reply 0\nraw refused\n", "ICMP probe: {echo:?}");

    let (_, status, _) = sh(h, sandbox, "cat /proc/self/status").await?;
    ensure!(status_field(&status, "NoNewPrivs")? == "1", "{status}");

    // Read-only kernel tunables (and the sysrq trigger where the kernel has one); /sys is an
    // empty read-only tmpfs.
    let (_, mounts, _) = sh(h, sandbox, "cat /proc/self/mounts").await?;
    let mut read_only = vec!["/proc/sys", "/sys"];
    if std::path::Path::new("/proc/sysrq-trigger").exists() {
        read_only.push("/proc/sysrq-trigger");
    }
    for path in read_only {
        let options = mounts
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(path))
            .and_then(|l| l.split_whitespace().nth(3))
            .unwrap_or("");
        ensure!(
            options.split(',').any(|o| o == "ro"),
            "{path} not read-only: {options:?}"
        );
    }
    refused(h, sandbox, "echo 1 > /proc/sys/kernel/panic").await?;
    let (_, out, _) = sh(h, sandbox, "ls -A /sys").await?;
    ensure!(out.is_empty(), "/sys shows {out:?}");

    // Files keep their owners inside; new ones belong to the sandbox's ids on the host.
    let (code, out, err) = sh(
        h,
        sandbox,
        "stat -c %u:%g / /bin/busybox /etc/passwd && touch /root/mine && \
         chown 1000:100 /root/mine && stat -c %u:%g /root/mine && ls -ld /root | cut -c1-10",
    )
    .await?;
    ensure!(
        code == 0 && out == "0:0\n0:0\n0:0\n1000:100\ndrwx------\n",
        "ownership inside: {code} {out:?} {err:?}"
    );
    // The upper dir lies on the sandbox's disk, mounted while it runs.
    let upper = h.sandbox_dir(sandbox).join("disk/upper");
    let mine = std::fs::metadata(upper.join("root/mine"))?;
    ensure!((mine.uid(), mine.gid()) == (BASE + 1000, BASE + 100));
    ensure!(std::fs::metadata(&upper)?.uid() == BASE);

    // Stop and start: the same files, the same owners.
    let stopped = h.send(&h.command(sandbox, 2, CommandKind::Stop)).await?;
    ensure!(h.containers().await?.is_empty(), "{stopped:?}");
    succeeded_address(&h.send(&h.command(sandbox, 3, CommandKind::Start)).await?)?;
    let (_, out, _) = sh(h, sandbox, "stat -c %u:%g /root/mine").await?;
    ensure!(out == "1000:100\n", "after a restart: {out:?}");

    // A disk written before sandboxes had a user namespace (owned by host root) is shifted
    // once at the next start, and stays usable.
    // (Stopped, the disk is unmounted: the test mounts its image aside to make it so.)
    let stop = h.command(sandbox, 4, CommandKind::Stop);
    h.send(&stop).await?;
    // The stop snapshot's upload mounts the disk again for a moment in the background: mount
    // it aside only once that is over (two mounts of one ext4 image corrupt it).
    h.durable(stop.id).await?;
    let image = h.sandbox_dir(sandbox).join("disk.img");
    let aside = h.state_dir.join("legacy-disk");
    std::fs::create_dir_all(&aside)?;
    run(
        "mount",
        &[
            "-o",
            "loop",
            &image.to_string_lossy(),
            &aside.to_string_lossy(),
        ],
    )
    .await?;
    let chowned = run(
        "chown",
        &["-R", "0:0", &aside.join("upper").to_string_lossy()],
    )
    .await;
    run("umount", &[&aside.to_string_lossy()]).await?;
    chowned?;
    succeeded_address(&h.send(&h.command(sandbox, 5, CommandKind::Start)).await?)?;
    let (code, out, err) = sh(
        h,
        sandbox,
        "echo more >> /root/mine && stat -c %u:%g /root/mine && cat /root/mine",
    )
    .await?;
    ensure!(
        code == 0 && out == "0:0\nmore\n",
        "legacy disk: {code} {out:?} {err:?}"
    );
    ensure!(std::fs::metadata(upper.join("root/mine"))?.uid() == BASE);

    let deleted = h.send(&h.command(sandbox, 6, CommandKind::Delete)).await?;
    ensure!(
        matches!(
            deleted.outcome,
            berth_schemas::wire::ResultOutcome::Succeeded { .. }
        ),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_sandbox_refuses_the_same_probes_where_they_apply() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(gvisor_boundary(h))).await
}

async fn gvisor_boundary(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    succeeded_address(&h.send(&create).await?)?;
    common_probes(h, sandbox).await?;

    // The same syscalls are refused (by the filter inside the sandbox or by gVisor's kernel,
    // which implements few of them); the controls work (but `personality(0xffffffff)`, which
    // gVisor does not implement).
    let tries = syscall_probe(h, sandbox).await?;
    for name in DENIED_SYSCALLS
        .iter()
        .chain(&["clone3_newuser", "int80_getpid"])
    {
        ensure!(
            tries.get(*name).is_some_and(|v| v != "0"),
            "{name}: {:?} (all: {tries:?})",
            tries.get(*name)
        );
    }
    for name in ["fork", "socket_tcp"] {
        ensure!(
            tries.get(name).map(String::as_str) == Some("0"),
            "{name}: {tries:?}"
        );
    }

    // gVisor's own user namespace: its sandbox process is not host root.
    let state = run(
        "runsc",
        &[
            "--root",
            &h.runsc_root().to_string_lossy(),
            "state",
            &h.names(sandbox).container_id,
        ],
    )
    .await?;
    let pid = serde_json::from_str::<serde_json::Value>(&state)?["pid"]
        .as_i64()
        .unwrap_or(0);
    let host_status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let uid = status_field(&host_status, "Uid")?;
    ensure!(
        !uid.starts_with("0\t") && !uid.starts_with("0 "),
        "sentry uid {uid:?}"
    );

    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(
        matches!(
            deleted.outcome,
            berth_schemas::wire::ResultOutcome::Succeeded { .. }
        ),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}
