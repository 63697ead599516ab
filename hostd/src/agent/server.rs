//! The agent's TCP server (std only: threads, no async runtime inside the sandbox).
//!
//! One thread per connection; one request per connection, or a kept connection that carries
//! one request after another (see `protocol`). An exec runs its
//! command in a new process group with stdin from `/dev/null`, reads stdout and stderr on two
//! threads (capped at [`MAX_CAPTURED_OUTPUT`] each), and at the timeout kills the whole group.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::protocol::{
    DataReply, Entry, ErrorReply, ExecOutput, Kind, ListReply, OutputChunk, PingReply, Request,
    Response, Stat, StatReply, WrittenReply, CODE_NOT_FOUND, CODE_NOT_REGULAR, CODE_TOO_LARGE,
    MAX_CAPTURED_OUTPUT, MAX_DIR_ENTRIES, MAX_EXEC_TIMEOUT_MS, MAX_FILE_CHUNK, MAX_LINE_BYTES,
    MAX_STDIN_BYTES,
};
use crate::oci::GUEST_PATH;

/// How often an exec checks whether its process has exited, at most.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(5);

/// The first wait before an exec checks again whether its process has exited; each wait
/// doubles up to [`EXIT_POLL_INTERVAL`]. A short command (`echo`) ends within a millisecond:
/// a first wait of the whole interval put 5 ms on every such exec's round trip.
const FIRST_EXIT_POLL: Duration = Duration::from_micros(100);

/// How long an exec waits for its output readers after its process ended or was killed (a
/// background descendant may hold the pipes open).
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
    // Kept: a `tty` connection goes on with frames the client may already have sent.
    let mut reader = BufReader::new(stream.try_clone()?);
    (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line)?;
    let writer = Arc::new(Mutex::new(stream.try_clone()?));
    let response = match serde_json::from_str::<Request>(&line) {
        Ok(Request::Tty {
            argv,
            timeout_ms,
            env,
            cwd,
            rows,
            cols,
        }) => {
            let request = super::tty::TtyRequest {
                argv,
                env,
                cwd,
                timeout_ms,
                rows,
                cols,
            };
            let response = super::tty::run(reader, writer.clone(), request)
                .map(Response::Exec)
                .unwrap_or_else(|e| Response::Error(ErrorReply::new(e)));
            // The session's input thread reads until the client closes: the client closes
            // first, as for every other request.
            return write_line(&writer, &response);
        }
        Ok(Request::Exec {
            argv,
            timeout_ms,
            env,
            cwd,
            stdin,
            stream: true,
        }) => {
            let lines = writer.clone();
            let sink: Sink = Arc::new(move |fd, data: &[u8]| {
                let chunk = Response::Output(OutputChunk {
                    fd,
                    data: data.to_vec(),
                });
                // A client that went away stops receiving; the process runs on to its end.
                let _ = write_line(&lines, &chunk);
            });
            let input = ExecInput {
                argv: &argv,
                env: &env,
                cwd: cwd.as_deref(),
                stdin: &stdin,
                sink: Some(&sink),
            };
            exec_with(input, timeout_ms)
                .map(Response::Exec)
                .unwrap_or_else(|e| Response::Error(ErrorReply::new(e)))
        }
        Ok(Request::Keep) => return serve_kept(reader, &writer),
        Ok(request) => answer(request),
        Err(e) => Response::Error(ErrorReply::new(format!("bad request: {e}"))),
    };
    write_line(&writer, &response)?;
    await_client_close(&stream)
}

/// Serves a kept connection (`{"op":"keep"}`, see `protocol`): one answer line per request
/// line until the client closes; never closes first (the TIME_WAIT stays on the host side).
fn serve_kept(mut reader: BufReader<TcpStream>, writer: &Mutex<TcpStream>) -> std::io::Result<()> {
    write_line(writer, &Response::Ping(PingReply { ok: true }))?;
    // Idle between calls for as long as hostd keeps the connection.
    reader.get_ref().set_read_timeout(None)?;
    loop {
        let mut line = String::new();
        let read = (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line)?;
        if read == 0 {
            return Ok(());
        }
        if !line.ends_with('\n') {
            // Longer than any request: the framing is lost. Wait for the client to close.
            write_line(
                writer,
                &Response::Error(ErrorReply::new("request line too long")),
            )?;
            return await_client_close(reader.get_ref());
        }
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Exec { stream: true, .. } | Request::Tty { .. } | Request::Keep) => {
                Response::Error(ErrorReply::new(
                    "a streamed exec or a tty needs a connection of its own",
                ))
            }
            Ok(request) => answer(request),
            Err(e) => Response::Error(ErrorReply::new(format!("bad request: {e}"))),
        };
        write_line(writer, &response)?;
    }
}

/// Where a streamed exec's output goes: `(fd, bytes)` as they are read.
pub type Sink = Arc<dyn Fn(u8, &[u8]) + Send + Sync>;

/// Writes one response line (whole, under the lock, so streamed chunks never interleave).
pub(super) fn write_line(writer: &Mutex<TcpStream>, response: &Response) -> std::io::Result<()> {
    let mut out = serde_json::to_vec(response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    let stream = writer.lock().unwrap_or_else(|e| e.into_inner());
    (&*stream).write_all(&out)?;
    (&*stream).flush()
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

/// Carries out one request.
fn answer(request: Request) -> Response {
    let result = match request {
        Request::Ping => Ok(Response::Ping(PingReply { ok: true })),
        Request::Exec {
            argv,
            timeout_ms,
            env,
            cwd,
            stdin,
            stream: _,
        } => {
            let input = ExecInput {
                argv: &argv,
                env: &env,
                cwd: cwd.as_deref(),
                stdin: &stdin,
                sink: None,
            };
            exec_with(input, timeout_ms)
                .map(Response::Exec)
                .map_err(ErrorReply::new)
        }
        Request::Tty { .. } => Err(ErrorReply::new(
            "a tty session is served on its own connection",
        )),
        Request::Keep => Err(ErrorReply::new("keep is the first request of a connection")),
        Request::Stat { path } => stat(&path).map(|stat| Response::Stat(StatReply { stat })),
        Request::Read { path, offset, len } => read(&path, offset, len).map(Response::Data),
        Request::Write {
            path,
            offset,
            data,
            truncate,
        } => write(&path, offset, &data, truncate)
            .map(|written| Response::Written(WrittenReply { written })),
        Request::List { path } => list(&path).map(|entries| Response::List(ListReply { entries })),
        Request::Rename { from, to } => std::fs::rename(&from, &to)
            .map(|()| Response::Ping(PingReply { ok: true }))
            .map_err(|e| io_error(&format!("rename {from} to {to}"), e)),
        Request::Remove { path } => match std::fs::remove_file(&path) {
            Ok(()) => Ok(Response::Ping(PingReply { ok: true })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Response::Ping(PingReply { ok: true }))
            }
            Err(e) => Err(io_error(&format!("remove {path}"), e)),
        },
    };
    result.unwrap_or_else(Response::Error)
}

/// An [`ErrorReply`] for an I/O error, coded `not_found` when the path does not exist.
fn io_error(what: &str, e: std::io::Error) -> ErrorReply {
    ErrorReply {
        error: format!("{what}: {e}"),
        code: (e.kind() == std::io::ErrorKind::NotFound).then(|| CODE_NOT_FOUND.to_owned()),
    }
}

fn too_large(what: &str, limit: u64) -> ErrorReply {
    ErrorReply {
        error: format!("{what} exceeds {limit}"),
        code: Some(CODE_TOO_LARGE.to_owned()),
    }
}

fn stat_of(meta: &std::fs::Metadata) -> Stat {
    use std::os::unix::fs::MetadataExt;
    let ft = meta.file_type();
    let kind = if ft.is_file() {
        Kind::File
    } else if ft.is_dir() {
        Kind::Dir
    } else if ft.is_symlink() {
        Kind::Symlink
    } else {
        Kind::Other
    };
    Stat {
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        modified: meta.mtime(),
    }
}

/// Metadata of `path`, following symlinks (a link to a dir lists as a dir).
fn stat(path: &str) -> Result<Stat, ErrorReply> {
    std::fs::metadata(path)
        .map(|m| stat_of(&m))
        .map_err(|e| io_error(&format!("stat {path}"), e))
}

fn read(path: &str, offset: u64, len: u64) -> Result<DataReply, ErrorReply> {
    use std::io::{Seek, SeekFrom};
    if len > MAX_FILE_CHUNK {
        return Err(too_large("read length", MAX_FILE_CHUNK));
    }
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking open: opening a FIFO without a writer would otherwise block until one
    // comes. Only a regular file is read: a device never ends (`/dev/zero`) and its size says
    // nothing, and a FIFO or socket would block. (O_NONBLOCK changes nothing for a regular
    // file's reads.)
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io_error(&format!("open {path}"), e))?;
    let meta = file
        .metadata()
        .map_err(|e| io_error(&format!("stat {path}"), e))?;
    if !meta.file_type().is_file() {
        return Err(ErrorReply {
            error: format!("{path} is not a regular file"),
            code: Some(CODE_NOT_REGULAR.to_owned()),
        });
    }
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| io_error(&format!("seek {path}"), e))?;
    let mut data = Vec::with_capacity(len as usize);
    (&mut file)
        .take(len)
        .read_to_end(&mut data)
        .map_err(|e| io_error(&format!("read {path}"), e))?;
    let size = file
        .metadata()
        .map_err(|e| io_error(&format!("stat {path}"), e))?
        .len();
    let eof = offset + data.len() as u64 >= size;
    Ok(DataReply { data, eof })
}

fn write(path: &str, offset: u64, data: &[u8], truncate: bool) -> Result<u64, ErrorReply> {
    use std::io::{Seek, SeekFrom};
    if data.len() as u64 > MAX_FILE_CHUNK {
        return Err(too_large("write length", MAX_FILE_CHUNK));
    }
    if let Some(parent) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| io_error(&format!("create {}", parent.display()), e))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(path)
        .map_err(|e| io_error(&format!("open {path}"), e))?;
    if truncate {
        file.set_len(offset)
            .map_err(|e| io_error(&format!("truncate {path}"), e))?;
    }
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| io_error(&format!("seek {path}"), e))?;
    file.write_all(data)
        .map_err(|e| io_error(&format!("write {path}"), e))?;
    Ok(data.len() as u64)
}

fn list(path: &str) -> Result<Vec<Entry>, ErrorReply> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| io_error(&format!("list {path}"), e))? {
        let entry = entry.map_err(|e| io_error(&format!("list {path}"), e))?;
        if entries.len() == MAX_DIR_ENTRIES {
            return Err(too_large("directory entries", MAX_DIR_ENTRIES as u64));
        }
        // Entries that vanish while listing are skipped.
        let Ok(meta) = entry.metadata() else { continue };
        entries.push(Entry {
            name: entry.file_name().to_string_lossy().into_owned(),
            stat: stat_of(&meta),
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// What an exec runs with.
#[derive(Clone, Copy)]
pub struct ExecInput<'a> {
    /// argv; `argv[0]` is looked up on `PATH`.
    pub argv: &'a [String],
    /// Set over the default `PATH` and `HOME`.
    pub env: &'a [(String, String)],
    /// Working directory; `/` when `None`.
    pub cwd: Option<&'a str>,
    /// Written to the process's stdin, which is then closed (`/dev/null` when empty).
    pub stdin: &'a [u8],
    /// Where output goes as it is read; `None` captures it (up to [`MAX_CAPTURED_OUTPUT`]
    /// per stream) into the [`ExecOutput`].
    pub sink: Option<&'a Sink>,
}

/// Runs `argv` with the default environment, in `/`, with no stdin; see [`exec_with`].
///
/// Errors: as [`exec_with`].
pub fn exec(argv: &[String], timeout_ms: u64) -> Result<ExecOutput, String> {
    let input = ExecInput {
        argv,
        env: &[],
        cwd: None,
        stdin: &[],
        sink: None,
    };
    exec_with(input, timeout_ms)
}

/// Runs a process, capturing output, killing the process group at `timeout_ms` (clamped to
/// [`MAX_EXEC_TIMEOUT_MS`]). When the process exits but a background descendant keeps its
/// output pipes open, the answer comes `READER_GRACE` later with what was read by then; the
/// descendant keeps running.
///
/// Errors: a message when `argv` is empty, stdin is over [`MAX_STDIN_BYTES`], or the process
/// cannot be spawned.
pub fn exec_with(input: ExecInput<'_>, timeout_ms: u64) -> Result<ExecOutput, String> {
    let (program, args) = input.argv.split_first().ok_or("empty argv")?;
    if input.stdin.len() as u64 > MAX_STDIN_BYTES {
        return Err(format!("stdin exceeds {MAX_STDIN_BYTES} bytes"));
    }
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .env("PATH", GUEST_PATH)
        .env("HOME", "/root")
        // The statx shim of gVisor sandboxes (`crate::oci::guest_env`) reaches what runs.
        .envs(std::env::var("LD_PRELOAD").ok().map(|p| ("LD_PRELOAD", p)))
        .envs(input.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(input.cwd.unwrap_or("/"))
        .stdin(if input.stdin.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = match command.spawn() {
        Ok(child) => child,
        // A missing program or directory is the user's mistake, answered as a shell would
        // (127 not found, 126 not executable), not as an agent failure.
        Err(e) => return spawn_failure(program, input.cwd, &e),
    };
    if let Some(mut pipe) = child.stdin.take() {
        let data = input.stdin.to_vec();
        // A process that never reads its stdin must not block the exec.
        thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(MAX_EXEC_TIMEOUT_MS));
    let stdout = spawn_reader(child.stdout.take(), 1, input.sink.cloned());
    let stderr = spawn_reader(child.stderr.take(), 2, input.sink.cloned());
    let group = Pid::from_raw(child.id() as i32);

    let (status, timed_out) = wait_until(&mut child, deadline, group)?;
    // Readers finish when every holder of the pipes is gone. A background descendant (`cmd &`)
    // may hold them open long after the process ended, or outlive a timeout's kill by leaving
    // the group: the answer comes a short grace after the process ended, with what was read.
    let reader_deadline = Instant::now() + READER_GRACE;
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

/// Exit code of a program that was not found (shell convention).
const EXIT_NOT_FOUND: i32 = 127;
/// Exit code of a program that could not be executed (shell convention).
const EXIT_NOT_EXECUTABLE: i32 = 126;

/// The answer for a process that could not be spawned: a shell-like exit code and message on
/// stderr for the user's mistakes; an error for anything else.
fn spawn_failure(
    program: &str,
    cwd: Option<&str>,
    e: &std::io::Error,
) -> Result<ExecOutput, String> {
    let cwd_missing = cwd.is_some_and(|d| !std::path::Path::new(d).is_dir());
    let (exit_code, message) = match e.kind() {
        _ if cwd_missing => (
            EXIT_NOT_EXECUTABLE,
            format!(
                "berth: cwd {}: no such directory\n",
                cwd.unwrap_or_default()
            ),
        ),
        std::io::ErrorKind::NotFound => (
            EXIT_NOT_FOUND,
            format!("berth: {program}: command not found\n"),
        ),
        std::io::ErrorKind::PermissionDenied => (
            EXIT_NOT_EXECUTABLE,
            format!("berth: {program}: permission denied\n"),
        ),
        _ => return Err(format!("spawn {program}: {e}")),
    };
    Ok(ExecOutput {
        exit_code,
        stdout: Vec::new(),
        stderr: message.into_bytes(),
        timed_out: false,
    })
}

/// Waits for `child` until `deadline`; at the deadline kills its process group and reaps it.
fn wait_until(
    child: &mut Child,
    deadline: Instant,
    group: Pid,
) -> Result<(std::process::ExitStatus, bool), String> {
    let mut pause = FIRST_EXIT_POLL;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            return Ok((status, false));
        }
        if Instant::now() >= deadline {
            let _ = killpg(group, Signal::SIGKILL);
            let status = child.wait().map_err(|e| format!("wait: {e}"))?;
            return Ok((status, true));
        }
        thread::sleep(pause);
        pause = (pause * 2).min(EXIT_POLL_INTERVAL);
    }
}

/// A thread reading one pipe to EOF. What it read so far stays readable while the thread
/// still blocks on a pipe that a background descendant holds open.
struct Reader {
    done: mpsc::Receiver<()>,
    kept: Arc<Mutex<Vec<u8>>>,
}

/// A thread reading one pipe (`fd` 1 or 2) to EOF: into `sink` when given, else keeping the
/// first [`MAX_CAPTURED_OUTPUT`] bytes.
fn spawn_reader<R: Read + Send + 'static>(pipe: Option<R>, fd: u8, sink: Option<Sink>) -> Reader {
    let (tx, done) = mpsc::channel();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let into = kept.clone();
    thread::spawn(move || {
        if let Some(mut pipe) = pipe {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match pipe.read(&mut buf) {
                    // A restored gVisor sandbox interrupts blocked reads once.
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Ok(0) | Err(_) => break,
                    Ok(n) => match &sink {
                        Some(sink) => sink(fd, &buf[..n]),
                        None => {
                            let mut kept = into.lock().unwrap_or_else(|p| p.into_inner());
                            let room = MAX_CAPTURED_OUTPUT.saturating_sub(kept.len());
                            kept.extend_from_slice(&buf[..n.min(room)]);
                        }
                    },
                }
            }
        }
        let _ = tx.send(());
    });
    Reader { done, kept }
}

impl Reader {
    /// The captured bytes once the pipe closed, or what was read by `deadline` if it is still
    /// open then (the reader thread is left to finish on its own).
    fn collect(self, deadline: Instant) -> Vec<u8> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let _ = self.done.recv_timeout(wait);
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *kept)
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
        let out = exec(&argv(&["sh", "-c", "sleep 5; echo late"]), 300).unwrap();
        assert!(out.timed_out);
        assert_eq!(out.exit_code, 128 + 9);
        assert!(out.stdout.is_empty());
    }

    #[test]
    fn a_background_child_holding_the_pipes_neither_delays_nor_swallows_the_output() {
        // Before, the answer waited for the pipes until the timeout and came back empty.
        let out = exec(&argv(&["sh", "-c", "sleep 12 & echo started"]), 5_000).unwrap();
        assert_eq!(out.stdout, b"started\n");
        assert_eq!(out.exit_code, 0);
        assert!(!out.timed_out);
    }

    #[test]
    fn a_missing_program_exits_127_like_a_shell() {
        let out = exec(&argv(&["/nonexistent"]), 5_000).unwrap();
        assert_eq!(out.exit_code, 127);
        assert_eq!(out.stderr, b"berth: /nonexistent: command not found\n");
    }

    #[test]
    fn exec_output_is_capped() {
        let out = exec(&argv(&["sh", "-c", "head -c 3000000 /dev/zero"]), 10_000).unwrap();
        assert_eq!(out.stdout.len(), MAX_CAPTURED_OUTPUT);
        assert_eq!(out.exit_code, 0);
    }

    #[test]
    fn exec_passes_env_cwd_and_stdin() {
        let env = [("GREETING".to_owned(), "hi".to_owned())];
        let input = ExecInput {
            argv: &argv(&["sh", "-c", "echo $GREETING; pwd; cat"]),
            env: &env,
            cwd: Some("/tmp"),
            stdin: b"from stdin",
            sink: None,
        };
        let out = exec_with(input, 5_000).unwrap();
        assert_eq!(out.stdout, b"hi\n/tmp\nfrom stdin");
        assert_eq!(out.exit_code, 0);
    }

    #[test]
    fn files_are_written_read_in_chunks_listed_and_renamed() {
        let dir = std::env::temp_dir().join(format!("berth-agent-files-{}", std::process::id()));
        let path = dir.join("sub/f").to_string_lossy().into_owned();
        assert_eq!(write(&path, 0, b"hello ", true).unwrap(), 6);
        assert_eq!(write(&path, 6, b"world", false).unwrap(), 5);
        let first = read(&path, 0, 6).unwrap();
        assert_eq!((first.data.as_slice(), first.eof), (&b"hello "[..], false));
        let rest = read(&path, 6, 100).unwrap();
        assert_eq!((rest.data.as_slice(), rest.eof), (&b"world"[..], true));
        assert_eq!(stat(&path).unwrap().size, 11);
        let listed = list(&dir.join("sub").to_string_lossy()).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "f");
        assert_eq!(listed[0].stat.kind, Kind::File);
        let missing = stat(&dir.join("nope").to_string_lossy()).unwrap_err();
        assert_eq!(missing.code.as_deref(), Some(CODE_NOT_FOUND));
        assert_eq!(
            read(&path, 0, MAX_FILE_CHUNK + 1)
                .unwrap_err()
                .code
                .as_deref(),
            Some(CODE_TOO_LARGE)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_or_a_device_is_refused_at_once_not_read() {
        let dir = std::env::temp_dir().join(format!("berth-agent-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("pipe");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Without O_NONBLOCK this open would block until a writer came.
        let refused = read(&fifo.to_string_lossy(), 0, 16).unwrap_err();
        assert_eq!(refused.code.as_deref(), Some(CODE_NOT_REGULAR));
        let zero = read("/dev/zero", 0, 16).unwrap_err();
        assert_eq!(zero.code.as_deref(), Some(CODE_NOT_REGULAR));
        let path = dir.join("f").to_string_lossy().into_owned();
        write(&path, 0, b"x", true).unwrap();
        assert!(matches!(
            answer(Request::Remove { path: path.clone() }),
            Response::Ping(_)
        ));
        assert!(stat(&path).is_err(), "removed");
        // Removing what is gone is not an error.
        assert!(matches!(
            answer(Request::Remove { path }),
            Response::Ping(_)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn exec_of_an_empty_argv_is_an_error() {
        assert!(exec(&[], 1_000).is_err());
    }
}
