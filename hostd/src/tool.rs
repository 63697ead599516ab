//! Running external tools (`ip`, `runc`, `ldd`, `busybox`) with captured output and a bound on
//! how long they may take.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::error::HostdError;

/// The longest any one tool invocation may take before it is killed.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// What a finished tool printed.
#[derive(Debug, Clone)]
pub struct ToolOutput {
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// Runs `program args...` with stdin from `/dev/null` and returns its output.
///
/// Errors: [`HostdError::Io`] when it cannot be spawned or exceeds [`TOOL_TIMEOUT`];
/// [`HostdError::Tool`] when it exits unsuccessfully (with its trimmed stderr).
pub async fn run(program: &str, args: &[&str]) -> Result<ToolOutput, HostdError> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let describe = || format!("{program} {}", args.join(" "));
    let output = tokio::time::timeout(TOOL_TIMEOUT, cmd.output())
        .await
        .map_err(|_| HostdError::Io {
            context: format!("{} timed out after {TOOL_TIMEOUT:?}", describe()),
            source: std::io::ErrorKind::TimedOut.into(),
        })?
        .map_err(HostdError::io(format!("spawn {}", describe())))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    if output.status.success() {
        Ok(ToolOutput { stdout, stderr })
    } else {
        Err(HostdError::Tool {
            program: program.to_owned(),
            args: args.join(" "),
            status: output.status.to_string(),
            stderr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_tool_reports_its_stderr() {
        let err = run("sh", &["-c", "echo boom >&2; exit 3"])
            .await
            .unwrap_err();
        match err {
            HostdError::Tool { stderr, status, .. } => {
                assert_eq!(stderr, "boom");
                assert!(status.contains('3'), "{status}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_succeeding_tool_returns_its_stdout() {
        assert_eq!(run("echo", &["hi"]).await.unwrap().stdout, "hi\n");
    }
}
