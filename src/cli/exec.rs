//! `berth sandbox exec ID -- CMD…`: runs a command through `POST …/exec/stream` and writes its
//! stdout and stderr as they arrive; the CLI exits with the command's exit code.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use clap::Args;
use futures::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};

use super::client::{exit, CliError, Client};
use super::sandbox::{key_value, segment};

/// The most bytes of stdin `-i` sends (the API's limit on an exec's stdin).
pub const MAX_STDIN_BYTES: usize = 256 * 1024;

/// The longest NDJSON line the CLI holds while reading it (a line carries at most one 16 KiB
/// chunk of output, JSON-escaped).
const MAX_LINE_BYTES: usize = 1024 * 1024;

/// `berth sandbox exec`
#[derive(Args, Debug)]
pub struct ExecArgs {
    /// The sandbox's id.
    id: String,
    /// Environment, KEY=VALUE (repeatable).
    #[arg(long, short, value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Working directory (absolute).
    #[arg(long, short = 'w')]
    cwd: Option<String>,
    /// Kill the command after this long (`30s`, `5m`; at most 10 minutes).
    #[arg(long, default_value = "30s")]
    timeout: humantime::Duration,
    /// Send this process's stdin (UTF-8, at most 256 KiB) to the command.
    #[arg(long, short)]
    interactive: bool,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    cmd: Vec<String>,
}

/// Runs the command; returns its exit code.
///
/// Errors: the API's refusal (404, 409 not running, …), a broken stream, bad stdin.
pub async fn exec(client: &Client, args: ExecArgs) -> Result<i32, CliError> {
    let env: BTreeMap<String, String> = args.env.into_iter().collect();
    let mut body = json!({
        "cmd": args.cmd,
        "timeout_ms": args.timeout.as_millis() as u64,
    });
    if !env.is_empty() {
        body["env"] = json!(env);
    }
    if let Some(cwd) = args.cwd {
        body["cwd"] = json!(cwd);
    }
    if args.interactive {
        let mut stdin = Vec::new();
        std::io::stdin()
            .take(MAX_STDIN_BYTES as u64 + 1)
            .read_to_end(&mut stdin)
            .map_err(|e| CliError::other("read stdin", e))?;
        if stdin.len() > MAX_STDIN_BYTES {
            return Err(CliError::Other(format!(
                "stdin is over the {MAX_STDIN_BYTES}-byte limit of an exec; copy the data in \
                 with `berth sandbox cp` instead"
            )));
        }
        let text = String::from_utf8(stdin)
            .map_err(|_| CliError::Other("stdin is not UTF-8 text".into()))?;
        body["stdin"] = json!(text);
    }
    let request = client
        .request(
            Method::POST,
            &format!("/v1/sandboxes/{}/exec/stream", segment(&args.id)),
        )
        .json(&body);
    let response = client.send(request).await?;
    let mut stream = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| CliError::other("the output stream broke off", e))?;
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let value: Value = serde_json::from_slice(&line)
                .map_err(|e| CliError::other("a malformed output line", e))?;
            if let Some(text) = value["stdout"].as_str() {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            } else if let Some(text) = value["stderr"].as_str() {
                let _ = stderr.write_all(text.as_bytes());
                let _ = stderr.flush();
            } else if let Some(code) = value["exit_code"].as_i64() {
                if value["timed_out"].as_bool() == Some(true) {
                    eprintln!(
                        "berth: the command was killed at its timeout ({})",
                        args.timeout
                    );
                }
                if value["oom_killed"].as_bool() == Some(true) {
                    eprintln!("berth: the sandbox's memory limit killed a process");
                }
                return Ok(code as i32);
            } else if !value["error"].is_null() {
                let error = &value["error"];
                let code = error["code"].as_str().unwrap_or("error").to_owned();
                return Err(CliError::Api {
                    status: match code.as_str() {
                        "conflict" => 409,
                        "host_unavailable" => 503,
                        "agent_error" => 502,
                        _ => 500,
                    },
                    code,
                    message: error["message"].as_str().unwrap_or("").to_owned(),
                });
            }
        }
        if pending.len() > MAX_LINE_BYTES {
            return Err(CliError::Other("an output line over the size limit".into()));
        }
    }
    eprintln!("berth: the output stream ended without the command's exit");
    Ok(exit::UNAVAILABLE)
}
