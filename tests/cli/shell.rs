//! `berth sandbox shell` as a person uses it: the binary runs on a pseudo-terminal the test
//! opens (it is the session leader, the pty its controlling terminal), the test types at the
//! master side and reads what the terminal shows. On runc and on gVisor: a command's output,
//! the terminal's size and a resize (`SIGWINCH` through the CLI, the API and the agent), the
//! remote side being a real tty, the exit code, and the local terminal restored afterwards.
//! A CLI killed mid-session hangs the remote terminal up: its processes end.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use nix::pty::{openpty, Winsize};
use nix::sys::termios::{self, LocalFlags};
use serde_json::json;
use sqlx::PgPool;

use crate::kit::User;
use crate::support::{eventually, Stack, SETTLE_TIMEOUT};

fn size(rows: u16, cols: u16) -> Winsize {
    Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// `berth ARGS` on a new pty: the child, the master (to type at) and what the terminal showed.
struct Terminal {
    child: tokio::process::Child,
    master: File,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Terminal {
    fn open(user: &User, args: &[&str], rows: u16, cols: u16) -> Terminal {
        let pty = openpty(Some(&size(rows, cols)), None).unwrap();
        let mut command = user.command(args);
        command
            .stdin(Stdio::from(pty.slave.try_clone().unwrap()))
            .stdout(Stdio::from(pty.slave.try_clone().unwrap()))
            .stderr(Stdio::from(pty.slave));
        // SAFETY: only async-signal-safe calls, in the forked child before exec.
        unsafe {
            command.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if nix::libc::ioctl(0, nix::libc::TIOCSCTTY as _, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawn berth on the pty");
        drop(command);
        let master = File::from(pty.master);
        let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
        let (mut reader, into) = (master.try_clone().unwrap(), seen.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with EIO once every holder of the slave side is gone.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal {
            child,
            master,
            seen,
        }
    }

    fn seen(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    fn type_line(&mut self, line: &str) {
        self.master.write_all(line.as_bytes()).unwrap();
        self.master.write_all(b"\r").unwrap();
    }

    async fn wait_for(&self, what: &str) {
        eventually(&format!("the terminal shows {what:?}"), || async {
            self.seen().contains(what)
        })
        .await;
    }

    fn resize(&self, rows: u16, cols: u16) {
        let winsize = size(rows, cols);
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer, live for the call. The kernel
        // sends SIGWINCH to the terminal's foreground process group: berth.
        let rc =
            unsafe { nix::libc::ioctl(self.master.as_raw_fd(), nix::libc::TIOCSWINSZ, &winsize) };
        assert_eq!(rc, 0);
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_interactive_shell_types_reads_resizes_and_exits_with_its_code_on_runc_and_gvisor(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);
    for template in ["base", "base-gvisor"] {
        let id = create(&stack, template).await;
        let mut term = Terminal::open(&user, &["sandbox", "shell", &id], 30, 100);
        term.type_line("echo hel''lo-$((6*7))");
        term.wait_for("hello-42").await;
        term.type_line("tty; stty size");
        term.wait_for("/dev/pts/").await;
        term.wait_for("30 100").await;

        // A resize reaches the remote terminal (asked until the SIGWINCH went through).
        term.resize(40, 120);
        eventually("the remote terminal is 40 x 120", || {
            (&term.master).write_all(b"stty size\r").unwrap();
            let seen = term.seen();
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                seen.contains("40 120")
            }
        })
        .await;

        // While berth runs, the local terminal is raw; the remote process's code is berth's.
        let local = termios::tcgetattr(&term.master).unwrap();
        assert!(
            !local.local_flags.contains(LocalFlags::ICANON),
            "raw while in the session"
        );
        term.type_line("exit 7");
        let status = tokio::time::timeout(SETTLE_TIMEOUT, term.child.wait())
            .await
            .expect("berth ends with the shell")
            .unwrap();
        assert_eq!(status.code(), Some(7), "{template}: {}", term.seen());
        let restored = termios::tcgetattr(&term.master).unwrap();
        assert!(
            restored
                .local_flags
                .contains(LocalFlags::ICANON | LocalFlags::ECHO),
            "the local terminal is restored"
        );
    }

    a_cli_killed_mid_session_hangs_the_remote_terminal_up(&stack, &user).await;
    a_gvisor_stop_hangs_an_open_session_up_and_keeps_memory(&stack, &user).await;
    stack.assert_no_capacity_drift().await;
}

async fn create(stack: &Stack, template: &str) -> String {
    let (status, body) = stack
        .call(
            reqwest::Method::POST,
            "/v1/sandboxes?wait=running&timeout=120s",
            Some(json!({"template": template, "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body["id"].as_str().unwrap().to_owned()
}

/// The session's foreground `sleep` ends when the CLI is killed: the API cancels the session,
/// the host closes the agent's connection, the agent hangs the terminal up.
async fn a_cli_killed_mid_session_hangs_the_remote_terminal_up(stack: &Stack, user: &User) {
    let id = create(stack, "base").await;
    let mut term = Terminal::open(user, &["sandbox", "shell", &id], 24, 80);
    term.type_line("echo slee''ping; exec sleep 4242");
    term.wait_for("sleeping").await;
    let running = || async {
        let (_, out) = stack
            .exec(&id, &["sh", "-c", "ps | grep -c '[s]leep 4242'"])
            .await;
        out["stdout"].as_str().unwrap_or("").trim().to_owned()
    };
    eventually("the sleep runs", || async { running().await == "1" }).await;
    term.child.start_kill().unwrap();
    term.child.wait().await.unwrap();
    eventually("the hung-up sleep is gone", || async {
        running().await == "0"
    })
    .await;
}

/// A memory stop of a gVisor sandbox with a shell open: the session is hung up (the CLI exits
/// 75, the sandbox is not running), the checkpoint finds no connection and keeps memory, and a
/// process started before the stop still runs after the start.
async fn a_gvisor_stop_hangs_an_open_session_up_and_keeps_memory(stack: &Stack, user: &User) {
    let id = create(stack, "base-gvisor").await;
    let (status, _) = stack
        .exec(
            &id,
            &["sh", "-c", "sleep 4343 </dev/null >/dev/null 2>&1 &"],
        )
        .await;
    assert_eq!(status, 200);
    let mut term = Terminal::open(user, &["sandbox", "shell", &id], 24, 80);
    term.type_line("echo in-''session");
    term.wait_for("in-session").await;
    let (status, stopped) = stack
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/stop?wait=stopped&timeout=120s"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    let status = tokio::time::timeout(SETTLE_TIMEOUT, term.child.wait())
        .await
        .expect("berth ends when the session is hung up")
        .unwrap();
    assert_eq!(status.code(), Some(75), "{}", term.seen());
    assert!(term.seen().contains("not running"), "{}", term.seen());
    let (status, started) = stack
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/start?wait=running&timeout=120s"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{started}");
    let (_, out) = stack
        .exec(&id, &["sh", "-c", "ps | grep -c '[s]leep 4343'"])
        .await;
    assert_eq!(
        out["stdout"], "1\n",
        "the process from before the stop kept running"
    );
}
