//! Running the `berth` binary as a user would: its API and key from the environment, a home of
//! its own (so no config file of the machine's is read), output captured.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::support::Stack;

/// The built binary under test.
pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// A user of one API: a base URL, a key (or none) and a private home directory.
pub struct User {
    pub base: String,
    pub key: Option<String>,
    pub home: PathBuf,
}

/// What one run of the binary came to.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

impl User {
    /// The stack's org, with its key in `BERTH_API_KEY`.
    pub fn of(stack: &Stack) -> User {
        Self::with(&stack.base, Some(&stack.key))
    }

    /// A user of `base` with `key`.
    pub fn with(base: &str, key: Option<&str>) -> User {
        let home = crate::support::cleanup::fresh_dir("cli-home");
        User {
            base: base.to_owned(),
            key: key.map(str::to_owned),
            home,
        }
    }

    /// Where `berth login` writes by default for this user.
    pub fn config_path(&self) -> PathBuf {
        self.home.join(".config/berth/config.json")
    }

    /// A command for the binary with this user's environment.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(BERTH);
        command
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &self.home)
            .env("BERTH_API_URL", &self.base)
            .kill_on_drop(true);
        if let Some(key) = &self.key {
            command.env("BERTH_API_KEY", key);
        }
        command
    }

    /// Runs `berth ARGS` to its end.
    pub async fn run(&self, args: &[&str]) -> Run {
        self.run_with(args, None).await
    }

    /// Runs `berth ARGS` with `stdin` to its end.
    pub async fn run_with(&self, args: &[&str], stdin: Option<&[u8]>) -> Run {
        use tokio::io::AsyncWriteExt;
        let mut command = self.command(args);
        command
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = command.spawn().expect("spawn berth");
        let mut pipe = child.stdin.take().unwrap();
        if let Some(data) = stdin {
            pipe.write_all(data).await.unwrap();
        }
        drop(pipe);
        let output: Output = tokio::time::timeout(
            crate::support::env::HTTP_TIMEOUT * 4,
            child.wait_with_output(),
        )
        .await
        .expect("berth ended")
        .unwrap();
        Run {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl Drop for User {
    /// Removes the user's home (its config file holds a key), also when the test failed.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

/// Runs and asserts exit 0; returns stdout.
pub async fn ok(user: &User, args: &[&str]) -> String {
    let run = user.run(args).await;
    assert_eq!(run.code, 0, "berth {args:?}: {run:?}");
    run.stdout
}

/// The mode bits of a file.
pub fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}
