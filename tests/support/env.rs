//! What every test binary needs from its environment: the NATS URL, unique names, timeouts
//! sized for a loaded 2-core machine, polling, tracing, and running a tool.

use std::time::Duration;

use berth_schemas::Subjects;

/// The longest any single HTTP request of a test may take.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a test waits for a sandbox, a host or a delivery to settle. Generous: on a fresh
/// machine whose two cores also build, a step that takes 1 s idle can take 20.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Pause between two looks of [`eventually`].
const POLL: Duration = Duration::from_millis(50);

/// NATS the tests use.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// Twelve random hex characters: a subject prefix, an org name, a directory name.
pub fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// A subject prefix no other test uses (`t<12 hex>`).
pub fn unique_subjects() -> Subjects {
    Subjects::new(&format!("t{}", unique())).expect("a hex prefix is valid")
}

/// Polls `check` until it holds; panics naming `what` after [`SETTLE_TIMEOUT`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Logs of the code under test go to the test's output (shown when it fails); `RUST_LOG`
/// overrides `default`.
pub fn init_tracing(default: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .with_ansi(false)
        .with_test_writer()
        .try_init();
}

/// Whether the test runs as root (runc, network namespaces and mounts need it).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Runs `program` and returns its stdout; an error names the tool and carries its stderr.
pub async fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program` to completion, synchronously, ignoring how it ended (cleanup in `Drop`).
#[allow(unused_imports)]
pub use berth::host_leftovers::run_quietly;

/// A path as a string argument of a tool.
pub fn path_str(p: &std::path::Path) -> String {
    p.to_string_lossy().into_owned()
}
