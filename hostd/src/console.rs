//! A sandbox's console log: what its processes write to their stdout and stderr (the agent's
//! own, and whatever inherits them), capped on the host's disk and read only by its tail.
//!
//! The container's stdio is a pipe whose reader is a small process of its own, `berth
//! console-log` ([`copy_capped`]), not hostd: it outlives a hostd restart as the container does,
//! and ends when the container does (the last writer closes the pipe). It appends to
//! `console.log` until the next write would pass the cap, then renames it to `console.log.1`
//! (replacing the older one) and starts a new `console.log`: at most two files of at most the
//! cap each, whatever the sandbox writes. The shape of conmon's and containerd's log drivers
//! (`max-size`, `max-file`).
//!
//! hostd reads a console log only to quote a failed boot ([`tail`]): it seeks to the last bytes
//! and never reads a file whole.
//!
//! # Assumptions
//! If the writer process is killed, the container's writes to its stdio fail with `EPIPE` (a
//! process that does not ignore `SIGPIPE` dies of it); nothing reattaches a reader.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::error::HostdError;

/// The default cap of one console log file, in bytes (1 MiB); a sandbox's console takes at
/// most twice this on the host (the current file and one rotated file).
pub const DEFAULT_CONSOLE_LOG_MAX_BYTES: u64 = 1024 * 1024;

/// The `berth` subcommand that runs [`copy_capped`] on its stdin.
pub const WRITER_SUBCOMMAND: &str = "console-log";

/// How long a failed `run` waits for the writer to drain what the runtime said before the
/// log's tail is quoted (the writer ends once no process holds the pipe).
pub const WRITER_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest read from the pipe, in bytes (a pipe holds 64 KiB by default).
const CHUNK: usize = 64 * 1024;

/// The rotated file beside `log`: `<log>.1`.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Copies `input` to `log` until end of input, rotating before a write would take `log` past
/// `max_bytes` (see the module docs). A write that fails (a full host disk) drops that data
/// and goes on reading, so the sandbox never sees its stdio fail; a chunk larger than
/// `max_bytes` keeps only its last `max_bytes`.
///
/// Errors: reading `input` (other than `EINTR`); opening `log` at the start.
pub fn copy_capped(input: &mut impl Read, log: &Path, max_bytes: u64) -> std::io::Result<()> {
    let open = || OpenOptions::new().create(true).append(true).open(log);
    let mut file = Some(open()?);
    let mut size = file
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .map_or(0, |m| m.len());
    let mut buf = vec![0u8; CHUNK];
    let cap = usize::try_from(max_bytes).unwrap_or(usize::MAX).max(1);
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let data = &buf[n.saturating_sub(cap)..n];
        let len = data.len() as u64;
        if size + len > max_bytes || file.is_none() {
            // Best effort: a failed rename leaves the old file to be truncated below.
            let _ = std::fs::rename(log, rotated(log));
            file = OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(log)
                .ok();
            size = 0;
        }
        if let Some(f) = file.as_mut() {
            match f.write_all(data) {
                Ok(()) => size += len,
                Err(_) => file = None,
            }
        }
    }
}

/// The last `max_bytes` bytes the console wrote: the end of `log`, preceded by the end of its
/// rotated file when `log` holds fewer. Reads at most `max_bytes` from disk; missing files
/// read as empty.
pub fn tail(log: &Path, max_bytes: usize) -> Vec<u8> {
    let current = read_last(log, max_bytes);
    if current.len() >= max_bytes {
        return current;
    }
    let mut out = read_last(&rotated(log), max_bytes - current.len());
    out.extend_from_slice(&current);
    out
}

/// The last `n` bytes of `path` (fewer when it is shorter; empty when it cannot be read).
fn read_last(path: &Path, n: usize) -> Vec<u8> {
    let read = || -> std::io::Result<Vec<u8>> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        let want = len.min(n as u64);
        file.seek(SeekFrom::Start(len - want))?;
        let mut out = Vec::with_capacity(want as usize);
        file.take(want).read_to_end(&mut out)?;
        Ok(out)
    };
    read().unwrap_or_default()
}

/// A running console writer for one container start: the write end of its pipe, to hand to
/// the runtime as stdout and stderr, and the writer process.
#[derive(Debug)]
pub struct ConsoleWriter {
    pipe: OwnedFd,
    child: tokio::process::Child,
    log: PathBuf,
}

impl ConsoleWriter {
    /// Starts `<berth> console-log --path <log> --max-bytes <max_bytes>` reading a new pipe, in
    /// a process group of its own (a terminal's Ctrl-C to hostd does not end it) with its
    /// output to `/dev/null`.
    ///
    /// Errors: [`HostdError::Io`] when the pipe or the process cannot be made.
    pub fn spawn(berth: &Path, log: &Path, max_bytes: u64) -> Result<Self, HostdError> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| HostdError::io("console pipe")(std::io::Error::from(e)))?;
        let child = tokio::process::Command::new(berth)
            .arg(WRITER_SUBCOMMAND)
            .arg("--path")
            .arg(log)
            .arg("--max-bytes")
            .arg(max_bytes.to_string())
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(false)
            .spawn()
            .map_err(HostdError::io(format!(
                "spawn {} {WRITER_SUBCOMMAND}",
                berth.display()
            )))?;
        Ok(Self {
            pipe: write,
            child,
            log: log.to_path_buf(),
        })
    }

    /// The pipe's write end, once more, for one of the runtime's stdio.
    ///
    /// Errors: [`HostdError::Io`] when the descriptor cannot be duplicated.
    pub fn stdio(&self) -> Result<Stdio, HostdError> {
        let fd = self
            .pipe
            .try_clone()
            .map_err(HostdError::io("duplicate the console pipe"))?;
        Ok(Stdio::from(fd))
    }

    /// The runtime started the container: hostd lets go of its end of the pipe and of the
    /// writer (tokio reaps it when it ends, with the container).
    pub fn detach(self) {
        drop(self.pipe);
        drop(self.child);
    }

    /// The runtime failed: closes hostd's end of the pipe, waits up to
    /// [`WRITER_DRAIN_TIMEOUT`] for the writer to write what it read and end, and returns the
    /// log's last `max_bytes`, trimmed.
    pub async fn fail(self, max_bytes: usize) -> String {
        let Self {
            pipe,
            mut child,
            log,
        } = self;
        drop(pipe);
        if tokio::time::timeout(WRITER_DRAIN_TIMEOUT, child.wait())
            .await
            .is_err()
        {
            tracing::warn!(log = %log.display(), "console writer still running after a failed start");
        }
        String::from_utf8_lossy(&tail(&log, max_bytes))
            .trim()
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh dir below the system's temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir() -> TempDir {
        let d = std::env::temp_dir().join(format!("berth-console-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    #[test]
    fn writing_far_more_than_the_cap_keeps_two_files_of_at_most_the_cap() {
        let d = dir();
        let log = d.path().join("console.log");
        let cap = 10_000u64;
        // 1 MiB in lines, so the last bytes are recognisable.
        let mut input = Vec::new();
        for i in 0..100_000 {
            input.extend_from_slice(format!("{i:09}\n").as_bytes());
        }
        copy_capped(&mut &input[..], &log, cap).unwrap();
        let current = std::fs::metadata(&log).unwrap().len();
        let old = std::fs::metadata(rotated(&log)).unwrap().len();
        assert!(current <= cap && old <= cap, "{current} {old}");
        assert!(current + old > 0);
        // The newest bytes are kept.
        let end = tail(&log, 10);
        assert_eq!(end, b"000099999\n");
    }

    #[test]
    fn a_chunk_larger_than_the_cap_keeps_its_end() {
        let d = dir();
        let log = d.path().join("console.log");
        let input: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        copy_capped(&mut &input[..], &log, 100).unwrap();
        let kept = std::fs::read(&log).unwrap();
        assert_eq!(kept, &input[input.len() - 100..]);
    }

    #[test]
    fn the_tail_continues_into_the_rotated_file() {
        let d = dir();
        let log = d.path().join("console.log");
        std::fs::write(rotated(&log), b"older-").unwrap();
        std::fs::write(&log, b"newer").unwrap();
        assert_eq!(tail(&log, 8), b"er-newer");
        assert_eq!(tail(&log, 3), b"wer");
        assert_eq!(tail(&d.path().join("missing"), 8), b"");
    }

    #[test]
    fn the_tail_of_a_huge_file_reads_only_its_end() {
        // A sparse terabyte: reading it whole would fail to allocate, not return.
        let d = dir();
        let log = d.path().join("console.log");
        let file = File::create(&log).unwrap();
        file.set_len(1 << 40).unwrap();
        let mut file = OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(b"the end").unwrap();
        assert_eq!(tail(&log, 7), b"the end");
    }
}
