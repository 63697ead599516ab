//! The agent's terminal sessions (std only): a process on a new pseudo-terminal, its output
//! streamed to the connection, the client's [`TtyFrame`] lines written to the terminal.
//!
//! # Guarantees
//! - The process leads a new session whose controlling terminal is the pty, so job control,
//!   `SIGWINCH` on a resize and `SIGHUP` on a hang-up behave as on a real terminal.
//! - The session's process group is killed at the timeout; when the client closes the
//!   connection, the agent shuts its side down at once and the group is sent `SIGHUP`, then
//!   `SIGKILL` [`HANGUP_GRACE`] later.
//! - A signal is only sent while the session leader is not yet reaped (under the lock that
//!   reaps it), so its process group id cannot have been reused by another process.
//! - Memory is bounded: output moves in 16 KiB reads, input in frames of at most
//!   [`MAX_TTY_INPUT`] bytes, one at a time; a slow side blocks the other's pipe.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::pty::{openpty, Winsize};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::protocol::{
    ExecOutput, OutputChunk, Response, TtyFrame, MAX_EXEC_TIMEOUT_MS, MAX_LINE_BYTES, MAX_TTY_INPUT,
};
use super::server::write_line;
use crate::oci::GUEST_PATH;

/// How long a hung-up session's processes have to end on `SIGHUP` before they get `SIGKILL`.
pub const HANGUP_GRACE: Duration = Duration::from_secs(2);

/// How long the answer waits for the terminal's last output after the process ended (a
/// background process may hold the terminal open).
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

/// How often the session checks whether its process has ended.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// `TERM` of a session unless the request sets one.
const DEFAULT_TERM: &str = "xterm";

/// Offset added to a signal number to form the exit code of a killed process.
const SIGNAL_EXIT_BASE: i32 = 128;

/// What a session runs.
pub struct TtyRequest {
    /// argv; `argv[0]` is looked up on `PATH`.
    pub argv: Vec<String>,
    /// Set over `PATH`, `HOME` and `TERM`.
    pub env: Vec<(String, String)>,
    /// Working directory; `/` when `None`.
    pub cwd: Option<String>,
    /// Kill the process group after this many milliseconds.
    pub timeout_ms: u64,
    /// The terminal's first size.
    pub rows: u16,
    /// The terminal's first size.
    pub cols: u16,
}

/// The session leader, until it is reaped (`None` after).
type Leader = Arc<Mutex<Option<Child>>>;

/// Runs one session on `reader`'s connection (the request line already read), writing output
/// lines through `writer`. Returns the answer to write last; the connection's input side
/// stays with a thread that ends when the client closes it.
///
/// Errors: a message when the pty cannot be made or the process cannot be spawned (a missing
/// program is answered like a shell: its message as output, exit 127).
pub fn run(
    reader: BufReader<TcpStream>,
    writer: Arc<Mutex<TcpStream>>,
    request: TtyRequest,
) -> Result<ExecOutput, String> {
    let (program, args) = request.argv.split_first().ok_or("empty argv")?;
    let size = winsize(request.rows, request.cols);
    let pty = openpty(Some(&size), None).map_err(|e| format!("openpty: {e}"))?;
    let master = File::from(pty.master);
    let child = match spawn(program, args, &request, pty.slave) {
        Ok(child) => child,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            let message = format!("berth: {program}: {e}\r\n");
            let _ = write_line(&writer, &output(message.as_bytes()));
            return Ok(finished(code, false));
        }
    };
    let group = Pid::from_raw(child.id() as i32);
    let leader: Leader = Arc::new(Mutex::new(Some(child)));
    let hung_up: Arc<Mutex<Option<Instant>>> = Arc::default();

    let output_done = spawn_output(
        master.try_clone().map_err(|e| format!("pty: {e}"))?,
        writer.clone(),
    );
    spawn_input(reader, master, leader.clone(), group, hung_up.clone());

    let deadline =
        Instant::now() + Duration::from_millis(request.timeout_ms.min(MAX_EXEC_TIMEOUT_MS));
    let (status, timed_out) = loop {
        {
            let mut guard = leader.lock().unwrap_or_else(|e| e.into_inner());
            let child = guard.as_mut().expect("reaped only here");
            if let Some(status) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
                *guard = None;
                break (status, false);
            }
            let now = Instant::now();
            let hangup_over = hung_up
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|at| now >= at + HANGUP_GRACE);
            if now >= deadline || hangup_over {
                let _ = killpg(group, Signal::SIGKILL);
                let status = child.wait().map_err(|e| format!("wait: {e}"))?;
                *guard = None;
                break (status, now >= deadline);
            }
        }
        thread::sleep(EXIT_POLL_INTERVAL);
    };
    // The terminal's last output, unless a background process keeps it open.
    let _ = output_done.recv_timeout(OUTPUT_GRACE);
    let exit_code = status
        .code()
        .or_else(|| status.signal().map(|s| SIGNAL_EXIT_BASE + s))
        .unwrap_or(-1);
    Ok(finished(exit_code, timed_out))
}

fn finished(exit_code: i32, timed_out: bool) -> ExecOutput {
    ExecOutput {
        exit_code,
        stdout: Vec::new(),
        stderr: Vec::new(),
        timed_out,
    }
}

fn output(data: &[u8]) -> Response {
    Response::Output(OutputChunk {
        fd: 1,
        data: data.to_vec(),
    })
}

fn winsize(rows: u16, cols: u16) -> Winsize {
    Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Spawns the session leader on the pty's `slave` side.
fn spawn(
    program: &str,
    args: &[String],
    request: &TtyRequest,
    slave: OwnedFd,
) -> std::io::Result<Child> {
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .env("PATH", GUEST_PATH)
        .env("HOME", "/root")
        .env("TERM", DEFAULT_TERM)
        .envs(request.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(request.cwd.as_deref().unwrap_or("/"))
        .stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave));
    // SAFETY: `setsid` and `ioctl` are async-signal-safe, and the closure touches no memory
    // the parent shares (it runs in the forked child before exec).
    unsafe {
        command.pre_exec(|| {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            // The pty (now fd 0) becomes the new session's controlling terminal.
            if nix::libc::ioctl(0, nix::libc::TIOCSCTTY as _, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // `command` holds the slave's descriptors: it is dropped here, so the terminal reports
    // end of file once the session's processes close theirs.
    command.spawn()
}

/// A thread copying the terminal's output to the connection; signals when the terminal is
/// closed on every side (`EIO` on Linux) or the client went away.
fn spawn_output(mut master: File, writer: Arc<Mutex<TcpStream>>) -> mpsc::Receiver<()> {
    let (done, finished) = mpsc::channel();
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match master.read(&mut buf) {
                // A restored gVisor sandbox interrupts blocked reads once.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if write_line(&writer, &output(&buf[..n])).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = done.send(());
    });
    finished
}

/// A thread writing the client's frames to the terminal; when the client closes the
/// connection (or sends what is not a frame), it hangs the session up.
fn spawn_input(
    mut reader: BufReader<TcpStream>,
    mut master: File,
    leader: Leader,
    group: Pid,
    hung_up: Arc<Mutex<Option<Instant>>>,
) {
    thread::spawn(move || {
        // Frames come whenever the user types: no read timeout on this side.
        let _ = reader.get_ref().set_read_timeout(None);
        loop {
            let mut line = String::new();
            match (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            match serde_json::from_str::<TtyFrame>(&line) {
                Ok(TtyFrame::Input(data)) if data.len() <= MAX_TTY_INPUT => {
                    // Blocks while the terminal's input queue is full: the client's next
                    // frame waits, and so does the host's.
                    if master.write_all(&data).is_err() {
                        break;
                    }
                }
                Ok(TtyFrame::Resize { rows, cols }) => {
                    let size = winsize(rows, cols);
                    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which lives
                    // for the call.
                    unsafe {
                        nix::libc::ioctl(master.as_raw_fd(), nix::libc::TIOCSWINSZ, &size);
                    }
                }
                Ok(TtyFrame::Input(_)) | Err(_) => break,
            }
        }
        // The client is gone: end the connection now, not when the session's processes are
        // gone (a gVisor checkpoint fails on a connection that is still closing), then hang up,
        // unless the leader was already reaped (its group id could then name another
        // process's group).
        let _ = reader.get_ref().shutdown(std::net::Shutdown::Both);
        let guard = leader.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_some() {
            let _ = killpg(group, Signal::SIGHUP);
            *hung_up.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn read_until(
        lines: &mut BufReader<TcpStream>,
        seen: &mut String,
        want: &str,
    ) -> Option<ExecOutput> {
        loop {
            let mut line = String::new();
            assert!(
                lines.read_line(&mut line).unwrap() > 0,
                "ended before {want:?}: {seen}"
            );
            match serde_json::from_str::<Response>(&line).unwrap() {
                Response::Output(chunk) => {
                    seen.push_str(&String::from_utf8_lossy(&chunk.data));
                    if seen.contains(want) {
                        return None;
                    }
                }
                Response::Exec(out) => return Some(out),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// A session over a real loopback connection: output, input, resize and exit code.
    #[test]
    fn a_session_echoes_input_reports_its_size_and_exits_with_its_code() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let reader = BufReader::new(stream.try_clone().unwrap());
            let writer = Arc::new(Mutex::new(stream));
            let request = TtyRequest {
                argv: vec!["sh".into()],
                env: vec![("PS1".into(), "$ ".into())],
                cwd: None,
                timeout_ms: 30_000,
                rows: 24,
                cols: 80,
            };
            let out = run(reader, writer.clone(), request).unwrap();
            write_line(&writer, &Response::Exec(out)).unwrap();
        });
        let mut client = TcpStream::connect(addr).unwrap();
        let mut lines = BufReader::new(client.try_clone().unwrap());
        let send = |client: &mut TcpStream, frame: TtyFrame| {
            let mut line = serde_json::to_vec(&frame).unwrap();
            line.push(b'\n');
            client.write_all(&line).unwrap();
        };
        send(
            &mut client,
            TtyFrame::Input(b"tty >/dev/null && echo is-a-tty; stty size\n".to_vec()),
        );
        let mut seen = String::new();
        assert!(read_until(&mut lines, &mut seen, "24 80").is_none());
        assert!(seen.contains("is-a-tty"), "{seen}");
        send(
            &mut client,
            TtyFrame::Resize {
                rows: 50,
                cols: 132,
            },
        );
        send(
            &mut client,
            TtyFrame::Input(b"stty size; exit 7\n".to_vec()),
        );
        assert!(read_until(&mut lines, &mut seen, "50 132").is_none());
        let exit = loop {
            if let Some(out) = read_until(&mut lines, &mut seen, "\u{0}never") {
                break out;
            }
        };
        assert_eq!(exit.exit_code, 7);
        drop(client);
        server.join().unwrap();
    }
}
