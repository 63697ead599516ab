//! The CLI's way to the API: where it is and which key to use (flags, `BERTH_API_URL`,
//! `BERTH_API_KEY`, the config file `berth login` writes), the HTTP client, and the errors a
//! user sees with their exit codes.
//!
//! # Exit codes
//! Errors of the CLI itself exit with a code from `sysexits.h`, so a script can tell them
//! apart (an `exec` otherwise exits with its command's own code):
//!
//! | code | meaning |
//! |---|---|
//! | 64 | the API refused the request as invalid (400, 413, 422) |
//! | 65 | `template pull`: the image's pull failed (its code and message are printed) |
//! | 66 | no such sandbox, template or path in the org (404) |
//! | 69 | the API cannot be reached, or its host or agent is unavailable (502, 503) |
//! | 70 | anything else the API or the CLI failed at (500, an unexpected answer) |
//! | 75 | try again later: a conflicting state, a wait that timed out, a limit (408, 409, 429) |
//! | 77 | the key was refused (401, 403) |
//! | 78 | no key configured, or an unreadable config file |

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The API a CLI talks to when neither a flag, `BERTH_API_URL` nor the config file names one.
pub const DEFAULT_API_URL: &str = "http://127.0.0.1:8080";

/// How long connecting to the API may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a plain request may take (the longest server-side wait is 5 minutes).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(330);

/// The config file's mode: only its owner reads the key.
const CONFIG_MODE: u32 = 0o600;

/// `sysexits.h` codes (see the module docs).
pub mod exit {
    /// The request was invalid.
    pub const USAGE: i32 = 64;
    /// Not found.
    pub const NOT_FOUND: i32 = 66;
    /// The API, its host or agent is unavailable.
    pub const UNAVAILABLE: i32 = 69;
    /// Anything else.
    pub const SOFTWARE: i32 = 70;
    /// Try again later.
    pub const TEMPFAIL: i32 = 75;
    /// The key was refused.
    pub const NOPERM: i32 = 77;
    /// No key configured.
    pub const CONFIG: i32 = 78;
}

/// What went wrong, as the user is told.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The API answered with an error status.
    #[error("{}", api_message(*.status, .code, .message))]
    Api {
        /// The HTTP status.
        status: u16,
        /// The error body's `code` (`not_found`, `conflict`, …), or `http_<status>`.
        code: String,
        /// The error body's `message`.
        message: String,
    },
    /// The API could not be reached.
    #[error("cannot reach the Berth API at {url}: {reason}")]
    Unreachable {
        /// The API's base URL.
        url: String,
        /// The connection error, with its causes.
        reason: String,
    },
    /// No API key is configured.
    #[error("no API key: set BERTH_API_KEY or run `berth login`")]
    NoKey,
    /// The config file is unreadable or malformed.
    #[error("config file {path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Anything else (a local file, an unexpected answer, a broken stream).
    #[error("{0}")]
    Other(String),
}

fn api_message(status: u16, code: &str, message: &str) -> String {
    match status {
        401 => format!(
            "the API refused the key ({code}: {message}); check BERTH_API_KEY or run `berth login`"
        ),
        _ => format!("{message} ({code}, HTTP {status})"),
    }
}

impl CliError {
    /// The process's exit code for this error (see the module docs).
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Api { status, .. } => match status {
                400 | 413 | 422 => exit::USAGE,
                401 | 403 => exit::NOPERM,
                404 => exit::NOT_FOUND,
                408 | 409 | 429 => exit::TEMPFAIL,
                502 | 503 => exit::UNAVAILABLE,
                _ => exit::SOFTWARE,
            },
            CliError::Unreachable { .. } => exit::UNAVAILABLE,
            CliError::NoKey | CliError::Config { .. } => exit::CONFIG,
            CliError::Other(_) => exit::SOFTWARE,
        }
    }

    /// An error for a local failure, with what was being done.
    pub fn other(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Self {
        CliError::Other(format!("{what}: {e}"))
    }
}

/// What `berth login` writes and every command reads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The API's base URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_url: Option<String>,
    /// The org's API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

/// Where the config file is: `explicit`, else `$XDG_CONFIG_HOME/berth/config.json`, else
/// `$HOME/.config/berth/config.json`.
pub fn config_path(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return Some(path.to_owned());
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(base.join("berth").join("config.json"))
}

impl Config {
    /// Reads the config file; a missing file is an empty config.
    ///
    /// Errors: [`CliError::Config`] when it cannot be read or parsed.
    pub fn load(path: Option<&Path>) -> Result<Config, CliError> {
        let Some(path) = path else {
            return Ok(Config::default());
        };
        let bad = |reason: String| CliError::Config {
            path: path.to_owned(),
            reason,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                eprintln!(
                    "berth: warning: {} holds an API key and is readable by others; \
                     chmod 600 it",
                    path.display()
                );
            }
        }
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
    }

    /// Writes the config file with mode 0600 (its directory 0700), replacing it atomically.
    ///
    /// Errors: [`CliError::Config`] on any I/O error.
    pub fn save(&self, path: &Path) -> Result<(), CliError> {
        let bad = |e: std::io::Error| CliError::Config {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(bad)?;
        }
        let tmp = path.with_extension("json.tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(CONFIG_MODE)
            .open(&tmp)
            .map_err(bad)?;
        let mut text = serde_json::to_vec_pretty(self).expect("a config serializes");
        text.push(b'\n');
        file.write_all(&text).map_err(bad)?;
        file.sync_all().map_err(bad)?;
        std::fs::rename(&tmp, path).map_err(bad)
    }
}

use std::os::unix::fs::DirBuilderExt;

/// An authenticated client of one API.
#[derive(Clone)]
pub struct Client {
    /// The API's base URL, without a trailing `/`.
    pub base: String,
    key: String,
    http: reqwest::Client,
}

impl Client {
    /// A client of `base` with `key`.
    ///
    /// Errors: [`CliError::Other`] when the HTTP client cannot be built.
    pub fn new(base: &str, key: &str) -> Result<Client, CliError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .map_err(|e| CliError::other("HTTP client", e))?;
        Ok(Client {
            base: base.trim_end_matches('/').to_owned(),
            key: key.to_owned(),
            http,
        })
    }

    /// The key, for the WebSocket of a shell.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A request builder for `path` (starting with `/`), authenticated.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.key)
    }

    /// Sends `request` (without a total timeout: streams), turning a failed connection and
    /// an error status into [`CliError`].
    ///
    /// Errors: [`CliError::Unreachable`], [`CliError::Api`].
    pub async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, CliError> {
        let response = request.send().await.map_err(|e| self.unreachable(&e))?;
        if response.status().is_success() {
            return Ok(response);
        }
        Err(error_of(response).await)
    }

    /// Sends a request with an optional JSON body and reads a JSON answer.
    ///
    /// Errors: as [`Client::send`], and [`CliError::Other`] for an answer that is not JSON.
    pub async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, CliError> {
        let mut request = self.request(method, path).timeout(REQUEST_TIMEOUT);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = self.send(request).await?;
        response
            .json()
            .await
            .map_err(|e| CliError::other("the API's answer", e))
    }

    /// A connection failure, with its causes (`connection refused`, a DNS error, …).
    pub fn unreachable(&self, e: &reqwest::Error) -> CliError {
        use std::error::Error;
        let mut reason = e.to_string();
        let mut source = e.source();
        while let Some(cause) = source {
            reason.push_str(": ");
            reason.push_str(&cause.to_string());
            source = cause.source();
        }
        if e.is_status() {
            return CliError::Other(reason);
        }
        CliError::Unreachable {
            url: self.base.clone(),
            reason,
        }
    }
}

/// The [`CliError::Api`] of an error response (`{"error":{"code","message"}}`, or the status
/// alone when the body is not Berth's).
pub async fn error_of(response: reqwest::Response) -> CliError {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let error = &body["error"];
    CliError::Api {
        status,
        code: error["code"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("http_{status}")),
        message: error["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| {
                reqwest::StatusCode::from_u16(status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("error")
                    .to_lowercase()
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_failure_has_its_exit_code() {
        let api = |status| CliError::Api {
            status,
            code: "x".into(),
            message: "y".into(),
        };
        assert_eq!(api(401).exit_code(), exit::NOPERM);
        assert_eq!(api(404).exit_code(), exit::NOT_FOUND);
        assert_eq!(api(409).exit_code(), exit::TEMPFAIL);
        assert_eq!(api(400).exit_code(), exit::USAGE);
        assert_eq!(api(503).exit_code(), exit::UNAVAILABLE);
        assert_eq!(api(500).exit_code(), exit::SOFTWARE);
        assert_eq!(CliError::NoKey.exit_code(), exit::CONFIG);
        assert!(api(401).to_string().contains("berth login"));
    }

    #[test]
    fn the_config_is_written_for_its_owner_only_and_read_back() {
        let dir = std::env::temp_dir().join(format!("berth-cli-config-{}", std::process::id()));
        let path = dir.join("sub/config.json");
        let config = Config {
            api_url: Some("http://h:1".into()),
            api_key: Some("k".into()),
        };
        config.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let back = Config::load(Some(&path)).unwrap();
        assert_eq!(back.api_key.as_deref(), Some("k"));
        assert!(Config::load(Some(&dir.join("missing")))
            .unwrap()
            .api_key
            .is_none());
        std::fs::write(&path, "{\"api_kee\":1}").unwrap();
        assert!(matches!(
            Config::load(Some(&path)),
            Err(CliError::Config { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
