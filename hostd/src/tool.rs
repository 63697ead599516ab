//! Running external tools (`ip`, `runc`, `ldd`, `busybox`) with captured output and a bound on
//! how long they may take.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
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
    run_input(program, args, None).await
}

/// [`run`], with `input` (when given) written to the tool's stdin, which then closes: for
/// `ip -batch -` and `nft -f -`, one process for many commands.
///
/// Errors: as [`run`]; [`HostdError::Io`] when the input cannot be written.
pub async fn run_input(
    program: &str,
    args: &[&str],
    input: Option<&str>,
) -> Result<ToolOutput, HostdError> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let describe = || format!("{program} {}", args.join(" "));
    let finished = async {
        let mut child = cmd.spawn()?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin.write_all(input.as_bytes()).await?;
        }
        child.wait_with_output().await
    };
    let output = tokio::time::timeout(TOOL_TIMEOUT, finished)
        .await
        .map_err(|_| HostdError::Io {
            context: format!("{} timed out after {TOOL_TIMEOUT:?}", describe()),
            source: std::io::ErrorKind::TimedOut.into(),
        })?
        .map_err(HostdError::io(format!("run {}", describe())))?;
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

    #[tokio::test]
    async fn a_tool_reads_the_input_given() {
        let out = run_input("cat", &[], Some("one\ntwo\n")).await.unwrap();
        assert_eq!(out.stdout, "one\ntwo\n");
    }
}
