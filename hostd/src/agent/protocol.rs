//! The agent's wire protocol, shared by the in-sandbox server and hostd's client.
//!
//! One request per TCP connection: the client writes one JSON line, the agent answers with one
//! JSON line and closes. Output bytes travel base64-encoded (standard alphabet, padded).
//!
//! ```text
//! → {"op":"ping"}                                   ← {"ok":true}
//! → {"op":"exec","argv":["echo","hi"],"timeout_ms":1000}
//! ← {"exit_code":0,"stdout":"aGkK","stderr":"","timed_out":false}
//! ← {"error":"spawn nosuch: No such file or directory (os error 2)"}   (any request)
//! → {"op":"exec","argv":["cat"],"timeout_ms":1000,"env":[["A","b"]],"cwd":"/tmp","stdin":"eA=="}
//! → {"op":"stat","path":"/etc/hostname"}        ← {"stat":{"kind":"file","size":9,…}}
//! → {"op":"read","path":"/f","offset":0,"len":65536}   ← {"data":"…","eof":true}
//! → {"op":"write","path":"/f","offset":0,"data":"…","truncate":true}   ← {"written":3}
//! → {"op":"list","path":"/"}                    ← {"entries":[{"name":"bin","stat":{…}},…]}
//! → {"op":"rename","from":"/a","to":"/b"}       ← {"ok":true}
//! ← {"error":"…","code":"not_found"}            (a missing path; `too_large` over a limit)
//! → {"op":"exec","argv":["sh","-c","echo a"],"timeout_ms":1000,"stream":true}
//! ← {"fd":1,"data":"YQo="}  …as output arrives…  ← {"exit_code":0,"stdout":"","stderr":"",…}
//! → {"op":"tty","argv":["sh"],"timeout_ms":60000,"rows":24,"cols":80}
//! → {"input":"bHMK"}  → {"resize":{"rows":50,"cols":120}}   (any number, any time)
//! ← {"fd":1,"data":"…"}  …the terminal's output…  ← {"exit_code":0,"stdout":"","stderr":"",…}
//! ```
//!
//! A `tty` connection carries more than one request line: after the request, the client sends
//! [`TtyFrame`] lines for as long as the session runs, and closes its side to hang the
//! terminal up. A kept connection does too: after `{"op":"keep"}` (answered `{"ok":true}`)
//! the client sends one request line at a time and reads its one answer line, for as long as
//! it keeps the connection (hostd keeps a few per sandbox, `agent::kept`):
//!
//! ```text
//! → {"op":"keep"}  ← {"ok":true}  → {"op":"exec",…}  ← {"exit_code":0,…}  → {"op":"stat",…}  ← …
//! ```
//!
//! Append-only: new operations are new `op`s; new exec fields are optional and omitted when
//! empty, so a plain exec reads the same to an agent of an older bundle. The agent closes
//! a connection only after the client did (see `server`).

use serde::{Deserialize, Serialize};

/// The TCP port the agent listens on inside every sandbox.
pub const AGENT_PORT: u16 = berth_schemas::preview::AGENT_PORT;

/// The longest request or response line either side accepts, in bytes. Responses carry at most
/// two [`MAX_CAPTURED_OUTPUT`] buffers, base64-inflated by 4/3.
pub const MAX_LINE_BYTES: u64 = 4 * 1024 * 1024;

/// How much of each of stdout and stderr an exec captures, in bytes; the rest is read and
/// dropped so the process never blocks on a full pipe. Both together, with the reply's
/// envelope, must fit one NATS message (1 MiB by default): 448 KiB each leaves 128 KiB.
/// Larger output: the streaming exec, or write it to a file and download it.
pub const MAX_CAPTURED_OUTPUT: usize = 448 * 1024;

/// The longest exec timeout either side honours, in milliseconds (one day); longer requests
/// are clamped to it.
pub const MAX_EXEC_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// The most bytes one `read` returns or one `write` carries (base64 in a line of at most
/// [`MAX_LINE_BYTES`]).
pub const MAX_FILE_CHUNK: u64 = 1024 * 1024;

/// The most bytes an exec's stdin may carry.
pub const MAX_STDIN_BYTES: u64 = 1024 * 1024;

/// The most entries a `list` returns.
pub const MAX_DIR_ENTRIES: usize = 10_000;

/// `code` of an [`ErrorReply`] for a path that does not exist.
pub const CODE_NOT_FOUND: &str = "not_found";

/// `code` of an [`ErrorReply`] for a request over a size limit.
pub const CODE_TOO_LARGE: &str = "too_large";

/// `code` of an [`ErrorReply`] for a read of something that is not a regular file (a device,
/// FIFO or socket), refused before any byte is read.
pub const CODE_NOT_REGULAR: &str = "not_regular";

/// A request to the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Liveness check.
    Ping,
    /// Run `argv` (looked up on `PATH`), killing its process group after `timeout_ms`, with
    /// extra environment `env`, working directory `cwd` (default `/`) and `stdin` (default
    /// empty).
    Exec {
        /// The program and its arguments.
        argv: Vec<String>,
        /// Kill the process group after this many milliseconds.
        timeout_ms: u64,
        /// Extra environment variables.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        env: Vec<(String, String)>,
        /// Working directory (default `/`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// Standard input (default empty).
        #[serde(default, skip_serializing_if = "Vec::is_empty", with = "base64_bytes")]
        stdin: Vec<u8>,
        /// Send output as [`OutputChunk`] lines while the process runs; the final
        /// [`ExecOutput`] then carries no output.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        stream: bool,
    },
    /// Describe `path` (not following a final symlink).
    Stat {
        /// The path.
        path: String,
    },
    /// Read at most `len` (≤ [`MAX_FILE_CHUNK`]) bytes from `offset`.
    Read {
        /// The file.
        path: String,
        /// Where to start.
        offset: u64,
        /// The most bytes to read.
        len: u64,
    },
    /// Write `data` at `offset` (creating the file and its parent dirs; `truncate` cuts the
    /// file to `offset` first).
    Write {
        /// The file.
        path: String,
        /// Where to write.
        offset: u64,
        /// What to write.
        #[serde(with = "base64_bytes")]
        data: Vec<u8>,
        /// Cut the file to `offset` first.
        truncate: bool,
    },
    /// List a directory (at most [`MAX_DIR_ENTRIES`] entries).
    List {
        /// The directory.
        path: String,
    },
    /// Rename `from` to `to`.
    Rename {
        /// The current path.
        from: String,
        /// The new path.
        to: String,
    },
    /// Remove a file (a missing one is not an error).
    Remove {
        /// The file.
        path: String,
    },
    /// Keep this connection for more requests: the agent answers `{"ok":true}`, then answers
    /// each further request line in turn, one line each, until the client closes (never
    /// closing first). A streamed `exec` or a `tty` still needs a connection of its own and is
    /// refused on a kept one. An agent older than this answers `{"error":"bad request: …"}`;
    /// its client then opens one connection per call.
    Keep,
    /// Run `argv` on a new pseudo-terminal of `rows` × `cols` as the leader of a new session
    /// (the terminal is its controlling terminal); output comes as [`OutputChunk`] lines
    /// (`fd` 1), input as [`TtyFrame`] lines on the same connection, then one
    /// [`ExecOutput`] without output. The session's process group is killed at `timeout_ms`,
    /// and hung up (then killed) when the client closes the connection.
    Tty {
        /// The program and its arguments.
        argv: Vec<String>,
        /// Kill the process group after this many milliseconds.
        timeout_ms: u64,
        /// Extra environment variables (over `PATH`, `HOME` and `TERM=xterm`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        env: Vec<(String, String)>,
        /// Working directory (default `/`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// The terminal's lines.
        rows: u16,
        /// The terminal's columns.
        cols: u16,
    },
}

/// The most bytes one [`TtyFrame::Input`] carries.
pub const MAX_TTY_INPUT: usize = 64 * 1024;

/// What a client sends on a `tty` connection after its request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TtyFrame {
    /// Bytes for the terminal's input (at most [`MAX_TTY_INPUT`]).
    Input(#[serde(with = "base64_bytes")] Vec<u8>),
    /// The terminal's new size: its foreground processes get `SIGWINCH`.
    Resize {
        /// Lines.
        rows: u16,
        /// Columns.
        cols: u16,
    },
}

/// What a path is, as the agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (device, socket, fifo).
    Other,
}

/// A path's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// What it is.
    pub kind: Kind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Seconds since the Unix epoch.
    pub modified: i64,
}

/// The answer to [`Request::Stat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatReply {
    /// The path's metadata.
    pub stat: Stat,
}

/// The answer to [`Request::Read`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataReply {
    /// The bytes read.
    #[serde(with = "base64_bytes")]
    pub data: Vec<u8>,
    /// The read reached the end of the file.
    pub eof: bool,
}

/// The answer to [`Request::Write`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenReply {
    /// Bytes written.
    pub written: u64,
}

/// One entry of a [`ListReply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The entry's name (not a path).
    pub name: String,
    /// Its metadata.
    pub stat: Stat,
}

/// A piece of a streamed exec's output: `fd` 1 is stdout, 2 is stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// 1: stdout, 2: stderr.
    pub fd: u8,
    /// The bytes.
    #[serde(with = "base64_bytes")]
    pub data: Vec<u8>,
}

/// The answer to [`Request::List`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListReply {
    /// The directory's entries.
    pub entries: Vec<Entry>,
}

/// The answer to [`Request::Ping`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    /// Always true.
    pub ok: bool,
}

/// The answer to [`Request::Exec`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecOutput {
    /// The exit status, or 128 + signal number when the process was killed by a signal.
    pub exit_code: i32,
    /// What the process wrote on stdout (unless streamed).
    #[serde(with = "base64_bytes")]
    pub stdout: Vec<u8>,
    /// What the process wrote on stderr (unless streamed).
    #[serde(with = "base64_bytes")]
    pub stderr: Vec<u8>,
    /// The process was still running at the timeout and was killed.
    pub timed_out: bool,
}

/// The answer to a request the agent could not carry out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What went wrong.
    pub error: String,
    /// [`CODE_NOT_FOUND`], [`CODE_TOO_LARGE`], or absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

impl ErrorReply {
    /// An error without a code.
    pub fn new(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            code: None,
        }
    }
}

/// Any answer. Untagged: the variants have disjoint required fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Response {
    /// To [`Request::Exec`].
    Exec(ExecOutput),
    /// To [`Request::Ping`].
    Ping(PingReply),
    /// To any request the agent could not carry out.
    Error(ErrorReply),
    /// To [`Request::Stat`].
    Stat(StatReply),
    /// To [`Request::Read`].
    Data(DataReply),
    /// To [`Request::Write`].
    Written(WrittenReply),
    /// To [`Request::List`].
    List(ListReply),
    /// A streamed exec's output, before its [`ExecOutput`].
    Output(OutputChunk),
}

mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_documented_json_shape() {
        assert_eq!(
            serde_json::to_string(&Request::Ping).unwrap(),
            r#"{"op":"ping"}"#
        );
        let exec: Request =
            serde_json::from_str(r#"{"op":"exec","argv":["echo","hi"],"timeout_ms":5}"#).unwrap();
        assert_eq!(
            exec,
            Request::Exec {
                argv: vec!["echo".into(), "hi".into()],
                timeout_ms: 5,
                env: vec![],
                cwd: None,
                stdin: vec![],
                stream: false,
            }
        );
        // A plain exec serializes as before the optional fields existed.
        assert_eq!(
            serde_json::to_string(&exec).unwrap(),
            r#"{"op":"exec","argv":["echo","hi"],"timeout_ms":5}"#
        );
    }

    #[test]
    fn responses_round_trip_and_output_is_base64() {
        let out = Response::Exec(ExecOutput {
            exit_code: 0,
            stdout: b"hi\n".to_vec(),
            stderr: vec![],
            timed_out: false,
        });
        let line = serde_json::to_string(&out).unwrap();
        assert_eq!(
            line,
            r#"{"exit_code":0,"stdout":"aGkK","stderr":"","timed_out":false}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&line).unwrap(), out);
        for other in [
            r#"{"ok":true}"#,
            r#"{"error":"x"}"#,
            r#"{"error":"x","code":"not_found"}"#,
            r#"{"data":"aGkK","eof":true}"#,
            r#"{"written":3}"#,
            r#"{"fd":2,"data":"aGkK"}"#,
            r#"{"entries":[{"name":"a","stat":{"kind":"dir","size":0,"mode":493,"modified":1}}]}"#,
            r#"{"stat":{"kind":"file","size":1,"mode":420,"modified":2}}"#,
        ] {
            let parsed: Response = serde_json::from_str(other).unwrap();
            assert_eq!(serde_json::to_string(&parsed).unwrap(), other);
        }
    }

    #[test]
    fn tty_frames_have_the_documented_json_shape() {
        let input = TtyFrame::Input(b"ls\n".to_vec());
        assert_eq!(
            serde_json::to_string(&input).unwrap(),
            r#"{"input":"bHMK"}"#
        );
        let resize: TtyFrame =
            serde_json::from_str(r#"{"resize":{"rows":50,"cols":120}}"#).unwrap();
        assert_eq!(
            resize,
            TtyFrame::Resize {
                rows: 50,
                cols: 120
            }
        );
        let tty: Request = serde_json::from_str(
            r#"{"op":"tty","argv":["sh"],"timeout_ms":60000,"rows":24,"cols":80}"#,
        )
        .unwrap();
        assert!(matches!(
            tty,
            Request::Tty {
                rows: 24,
                cols: 80,
                ..
            }
        ));
    }

    #[test]
    fn an_unknown_op_is_refused() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"reboot"}"#).is_err());
    }
}
