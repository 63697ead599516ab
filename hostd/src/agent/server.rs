//! The agent's TCP server (std only: threads, no async runtime inside the sandbox).
//!
//! One thread per connection; one request per connection (see `protocol`). An exec runs its
//! command in a new process group with stdin from `/dev/null`, reads stdout and stderr on two
//! threads (capped at [`MAX_CAPTURED_OUTPUT`] each), and at the timeout kills the whole group.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::protocol::{
    ErrorReply, ExecOutput, PingReply, Request, Response, MAX_CAPTURED_OUTPUT, MAX_EXEC_TIMEOUT_MS,
    MAX_LINE_BYTES,
};
use crate::oci::GUEST_PATH;

/// How often an exec checks whether its process has exited.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(5);

/// How long an exec waits for its output readers after the process was killed (a descendant
/// that left the process group may hold the pipes open).
const READER_GRACE: Duration = Duration::from_millis(500);

/// How long a client may take to send its request line.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the agent waits for the client to close after the answer was sent. The client
/// closes first, so the connection's TIME_WAIT lands on the host side: gVisor refuses to
/// checkpoint a sandbox holding a TCP endpoint in TIME_WAIT (for a minute after each call).
const CLIENT_CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Offset added to a signal number to form the exit code of a killed process (shell convention).
const SIGNAL_EXIT_BASE: i32 = 128;

/// Serves connections on `listener` until accepting fails.
///
/// Errors: the accept error.
pub fn serve(listener: TcpListener) -> std::io::Result<()> {
    use std::io::ErrorKind::{ConnectionAborted, Interrupted};
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            // Transient: a signal (a gVisor restore), or a client that gave up.
            Err(e) if matches!(e.kind(), Interrupted | ConnectionAborted) => continue,
            Err(e) => return Err(e),
        };
        thread::spawn(move || {
            if let Err(e) = handle(stream) {
                eprintln!("berth agent: connection: {e}");
            }
        });
    }
}

fn handle(stream: TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(REQUEST_READ_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_LINE_BYTES)).read_line(&mut line)?;
    let response = match serde_json::from_str::<Request>(&line) {
        Ok(Request::Ping) => Response::Ping(PingReply { ok: true }),
        Ok(Request::Exec { argv, timeout_ms }) => match exec(&argv, timeout_ms) {
            Ok(out) => Response::Exec(out),
            Err(error) => Response::Error(ErrorReply { error }),
        },
        Err(e) => Response::Error(ErrorReply {
            error: format!("bad request: {e}"),
        }),
    };
    let mut out = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    (&stream).write_all(&out)?;
    (&stream).flush()?;
    await_client_close(&stream)
}

/// Reads (and drops) until the client closes its side or [`CLIENT_CLOSE_WAIT`] passes.
fn await_client_close(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(CLIENT_CLOSE_WAIT))?;
    let mut sink = [0u8; 512];
    loop {
        match (&*stream).read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // Timed out or reset: close from this side after all.
            Err(_) => return Ok(()),
        }
    }
}

/// Runs `argv`, capturing output, killing the process group at `timeout_ms` (clamped to
/// [`MAX_EXEC_TIMEOUT_MS`]). When the process exits but a background descendant keeps its
/// output pipes open, the answer waits for them until the timeout (plus a short grace).
///
/// Errors: a message when `argv` is empty or the process cannot be spawned.
pub fn exec(argv: &[String], timeout_ms: u64) -> Result<ExecOutput, String> {
    let (program, args) = argv.split_first().ok_or("empty argv")?;
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", GUEST_PATH)
        .env("HOME", "/root")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("spawn {program}: {e}"))?;
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(MAX_EXEC_TIMEOUT_MS));
    let stdout = spawn_reader(child.stdout.take());
    let stderr = spawn_reader(child.stderr.take());
    let group = Pid::from_raw(child.id() as i32);

    let (status, timed_out) = wait_until(&mut child, deadline, group)?;
    // Readers finish when every holder of the pipes is gone. After a timeout the group was
    // killed; give stragglers outside the group a short grace, then return what was read.
    let reader_deadline = if timed_out {
        Instant::now() + READER_GRACE
    } else {
        deadline.max(Instant::now()) + READER_GRACE
    };
    let stdout = stdout.collect(reader_deadline);
    let stderr = stderr.collect(reader_deadline);
    let exit_code = status
        .code()
        .or_else(|| status.signal().map(|s| SIGNAL_EXIT_BASE + s))
        .unwrap_or(-1);
    Ok(ExecOutput {
        exit_code,
        stdout,
        stderr,
        timed_out,
    })
}

/// Waits for `child` until `deadline`; at the deadline kills its process group and reaps it.
fn wait_until(
    child: &mut Child,
    deadline: Instant,
    group: Pid,
) -> Result<(std::process::ExitStatus, bool), String> {
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            return Ok((status, false));
        }
        if Instant::now() >= deadline {
            let _ = killpg(group, Signal::SIGKILL);
            let status = child.wait().map_err(|e| format!("wait: {e}"))?;
            return Ok((status, true));
        }
        thread::sleep(EXIT_POLL_INTERVAL);
    }
}

/// A thread reading one pipe to EOF, keeping the first [`MAX_CAPTURED_OUTPUT`] bytes.
struct Reader {
    done: mpsc::Receiver<Vec<u8>>,
}

fn spawn_reader<R: Read + Send + 'static>(pipe: Option<R>) -> Reader {
    let (tx, done) = mpsc::channel();
    thread::spawn(move || {
        let mut kept = Vec::new();
        if let Some(mut pipe) = pipe {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match pipe.read(&mut buf) {
                    // A restored gVisor sandbox interrupts blocked reads once.
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let room = MAX_CAPTURED_OUTPUT.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                }
            }
        }
        let _ = tx.send(kept);
    });
    Reader { done }
}

impl Reader {
    /// The captured bytes, or nothing if the pipe is still open at `deadline` (the reader
    /// thread is then left to finish on its own).
    fn collect(self, deadline: Instant) -> Vec<u8> {
        let wait = deadline.saturating_duration_since(Instant::now());
        self.done.recv_timeout(wait).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn exec_captures_stdout_and_the_exit_code() {
        let out = exec(
            &argv(&["sh", "-c", "echo hello; echo oops >&2; exit 3"]),
            5_000,
        )
        .unwrap();
        assert_eq!(out.stdout, b"hello\n");
        assert_eq!(out.stderr, b"oops\n");
        assert_eq!(out.exit_code, 3);
        assert!(!out.timed_out);
    }

    #[test]
    fn exec_kills_the_process_group_at_the_timeout() {
        let started = Instant::now();
        let out = exec(&argv(&["sh", "-c", "sleep 5; echo late"]), 300).unwrap();
        assert!(out.timed_out);
        assert_eq!(out.exit_code, 128 + 9);
        assert!(out.stdout.is_empty());
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn exec_output_is_capped() {
        let out = exec(&argv(&["sh", "-c", "head -c 3000000 /dev/zero"]), 10_000).unwrap();
        assert_eq!(out.stdout.len(), MAX_CAPTURED_OUTPUT);
        assert_eq!(out.exit_code, 0);
    }

    #[test]
    fn exec_of_a_missing_program_is_an_error() {
        assert!(exec(&argv(&["/no/such/program"]), 1_000)
            .unwrap_err()
            .contains("spawn"));
        assert!(exec(&[], 1_000).is_err());
    }
}
