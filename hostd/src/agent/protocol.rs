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
//! ```

use serde::{Deserialize, Serialize};

/// The TCP port the agent listens on inside every sandbox.
pub const AGENT_PORT: u16 = 18047;

/// The longest request or response line either side accepts, in bytes. Responses carry at most
/// two [`MAX_CAPTURED_OUTPUT`] buffers, base64-inflated by 4/3.
pub const MAX_LINE_BYTES: u64 = 4 * 1024 * 1024;

/// How much of each of stdout and stderr an exec captures, in bytes; the rest is read and
/// dropped so the process never blocks on a full pipe.
pub const MAX_CAPTURED_OUTPUT: usize = 1024 * 1024;

/// The longest exec timeout either side honours, in milliseconds (one day); longer requests
/// are clamped to it.
pub const MAX_EXEC_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// A request to the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Liveness check.
    Ping,
    /// Run `argv` (looked up on `PATH`), killing its process group after `timeout_ms`.
    Exec { argv: Vec<String>, timeout_ms: u64 },
}

/// The answer to [`Request::Ping`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    pub ok: bool,
}

/// The answer to [`Request::Exec`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecOutput {
    /// The exit status, or 128 + signal number when the process was killed by a signal.
    pub exit_code: i32,
    #[serde(with = "base64_bytes")]
    pub stdout: Vec<u8>,
    #[serde(with = "base64_bytes")]
    pub stderr: Vec<u8>,
    /// The process was still running at the timeout and was killed.
    pub timed_out: bool,
}

/// The answer to a request the agent could not carry out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// Any answer. Untagged: the variants have disjoint required fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Response {
    Exec(ExecOutput),
    Ping(PingReply),
    Error(ErrorReply),
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
                timeout_ms: 5
            }
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
        for other in [r#"{"ok":true}"#, r#"{"error":"x"}"#] {
            let parsed: Response = serde_json::from_str(other).unwrap();
            assert_eq!(serde_json::to_string(&parsed).unwrap(), other);
        }
    }

    #[test]
    fn an_unknown_op_is_refused() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"reboot"}"#).is_err());
    }
}
