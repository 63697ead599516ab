//! `berth sandbox shell ID [-- CMD…]`: an interactive terminal in a sandbox over the API's
//! WebSocket (`GET /v1/sandboxes/{id}/shell`). The local terminal is put in raw mode (and
//! restored however the session ends), keystrokes go as binary messages, a `SIGWINCH` sends
//! the new size, and the CLI exits with the remote process's exit code.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;

use clap::Args;
use futures::{SinkExt, StreamExt};
use nix::sys::termios::{self, SetArg, Termios};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use super::client::{CliError, Client};
use super::sandbox::{key_value, segment};

/// The terminal size sent when stdout is not a terminal.
const DEFAULT_SIZE: (u16, u16) = (24, 80);

/// How many reads of stdin wait to be sent before the reader waits.
const STDIN_QUEUE: usize = 4;

/// The most bytes one read of stdin takes.
const STDIN_READ_BYTES: usize = 16 * 1024;

/// End of transmission: what a terminal sends for Ctrl-D, sent when stdin (not a terminal)
/// reaches its end, so a shell reading a script exits.
const EOT: u8 = 0x04;

/// `berth sandbox shell`
#[derive(Args, Debug)]
pub struct ShellArgs {
    /// The sandbox's id.
    id: String,
    /// Environment, KEY=VALUE (repeatable).
    #[arg(long, short, value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Working directory (absolute).
    #[arg(long, short = 'w')]
    cwd: Option<String>,
    /// End the session after this long (`1h`, `30m`; at most a day).
    #[arg(long, default_value = "1h")]
    timeout: humantime::Duration,
    /// The program and its arguments (default: the API's, /bin/sh).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    cmd: Vec<String>,
}

/// The local terminal's settings, restored on drop.
struct RawMode(Option<Termios>);

impl RawMode {
    /// Raw mode on stdin when it is a terminal; nothing otherwise.
    fn enable() -> RawMode {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return RawMode(None);
        }
        let Ok(saved) = termios::tcgetattr(stdin.as_fd()) else {
            return RawMode(None);
        };
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        if termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).is_err() {
            return RawMode(None);
        }
        RawMode(Some(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = self.0.take() {
            let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &saved);
        }
    }
}

/// The size of the terminal on stdout (rows, cols), when it is one.
fn terminal_size() -> Option<(u16, u16)> {
    let mut size = nix::pty::Winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the pointer, which lives for the call.
    let ok = unsafe { nix::libc::ioctl(1, nix::libc::TIOCGWINSZ, &mut size) } == 0;
    (ok && size.ws_row > 0 && size.ws_col > 0).then_some((size.ws_row, size.ws_col))
}

/// Runs the session; returns the remote process's exit code.
///
/// Errors: the API's refusal before the session (404, 409 not running, 401), an unreachable
/// API, a session that breaks off.
pub async fn shell(client: &Client, args: ShellArgs) -> Result<i32, CliError> {
    let (rows, cols) = terminal_size().unwrap_or(DEFAULT_SIZE);
    let mut url = reqwest::Url::parse(&format!(
        "{}/v1/sandboxes/{}/shell",
        client.base,
        segment(&args.id)
    ))
    .map_err(|e| CliError::other("the API URL", e))?;
    let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
    url.set_scheme(scheme)
        .map_err(|()| CliError::Other("the API URL cannot carry a WebSocket".into()))?;
    {
        let mut query = url.query_pairs_mut();
        for arg in &args.cmd {
            query.append_pair("cmd", arg);
        }
        for (k, v) in &args.env {
            query.append_pair("env", &format!("{k}={v}"));
        }
        if let Some(cwd) = &args.cwd {
            query.append_pair("cwd", cwd);
        }
        query.append_pair("rows", &rows.to_string());
        query.append_pair("cols", &cols.to_string());
        query.append_pair("timeout_seconds", &args.timeout.as_secs().to_string());
    }
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| CliError::other("the WebSocket request", e))?;
    let auth = format!("Bearer {}", client.key())
        .parse()
        .map_err(|_| CliError::Other("the API key is not a valid header value".into()))?;
    request.headers_mut().insert("authorization", auth);
    let socket = match tokio_tungstenite::connect_async(request).await {
        Ok((socket, _)) => socket,
        Err(tungstenite::Error::Http(response)) => return Err(refusal(&response)),
        Err(e) => {
            return Err(CliError::Unreachable {
                url: client.base.clone(),
                reason: e.to_string(),
            })
        }
    };
    let raw = RawMode::enable();
    let result = session(socket).await;
    drop(raw);
    result
}

/// The error body of a refused upgrade (`{"error":{"code","message"}}`).
fn refusal(response: &tungstenite::http::Response<Option<Vec<u8>>>) -> CliError {
    let status = response.status().as_u16();
    let body: Value = response
        .body()
        .as_deref()
        .and_then(|b| serde_json::from_slice(b).ok())
        .unwrap_or(Value::Null);
    CliError::Api {
        status,
        code: body["error"]["code"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("http_{status}")),
        message: body["error"]["message"]
            .as_str()
            .unwrap_or("the shell was refused")
            .to_owned(),
    }
}

async fn session(
    socket: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
) -> Result<i32, CliError> {
    let (mut to_api, mut from_api) = socket.split();
    let mut keys = spawn_stdin_reader();
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .map_err(|e| CliError::other("SIGWINCH", e))?;
    let mut stdout = std::io::stdout();
    let mut stdin_open = true;
    let broke = |e: tungstenite::Error| CliError::other("the session broke off", e);
    loop {
        tokio::select! {
            message = from_api.next() => {
                let message = match message {
                    Some(message) => message.map_err(broke)?,
                    None => break,
                };
                match message {
                    Message::Binary(data) => {
                        let _ = stdout.write_all(&data);
                        let _ = stdout.flush();
                    }
                    Message::Text(text) => {
                        let value: Value = serde_json::from_str(text.as_str())
                            .map_err(|e| CliError::other("a malformed status", e))?;
                        if let Some(code) = value["exit_code"].as_i64() {
                            if value["timed_out"].as_bool() == Some(true) {
                                eprintln!("\r\nberth: the session reached its timeout\r");
                            }
                            return Ok(code as i32);
                        }
                        let error = &value["error"];
                        let code = error["code"].as_str().unwrap_or("error").to_owned();
                        return Err(CliError::Api {
                            status: match code.as_str() {
                                "conflict" => 409,
                                "invalid_request" => 400,
                                "host_unavailable" => 503,
                                "agent_error" => 502,
                                _ => 500,
                            },
                            code,
                            message: error["message"].as_str().unwrap_or("").to_owned(),
                        });
                    }
                    Message::Close(_) => break,
                    _ => {}
                }
            }
            keys_read = keys.recv(), if stdin_open => {
                let data = match keys_read {
                    Some(data) => data,
                    None => {
                        stdin_open = false;
                        vec![EOT]
                    }
                };
                to_api.send(Message::Binary(data.into())).await.map_err(broke)?;
            }
            _ = winch.recv() => {
                if let Some((rows, cols)) = terminal_size() {
                    let resize = json!({"resize": {"rows": rows, "cols": cols}});
                    to_api.send(Message::Text(resize.to_string().into())).await.map_err(broke)?;
                }
            }
        }
    }
    Err(CliError::Other(
        "the session ended without the process's exit status".into(),
    ))
}

/// A thread reading stdin (blocking) into a small queue; the queue closes at end of input.
fn spawn_stdin_reader() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(STDIN_QUEUE);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; STDIN_READ_BYTES];
        loop {
            match stdin.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}
