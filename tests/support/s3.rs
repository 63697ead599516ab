//! A real S3 server for the tests: the `s3s-fs` binary (from crates.io; `.ci/run` installs it)
//! serving a directory on a loopback port, started per test and killed by its own PID. Shared
//! by the root package's tests (`support::s3`) and `berth-storage`'s (which include this file).
//!
//! A bucket is a directory below the server's root and an object is a file below it at its
//! key (`<root>/<bucket>/<key>`), written whole (to a temporary name, then renamed), so a test
//! can watch objects arrive.

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where `.ci/run` installs `s3s-fs` (`cargo install s3s-fs --features binary --root
/// /var/tmp/berth-tools`); `BERTH_S3S_FS` overrides it.
pub const S3S_FS_DEFAULT: &str = "/var/tmp/berth-tools/bin/s3s-fs";
/// How long a started S3 server may take to accept connections on a loaded machine.
pub const SERVER_START_TIMEOUT: Duration = Duration::from_secs(60);
/// The access key the server accepts.
pub const ACCESS_KEY: &str = "berth-test";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "berth-test-secret";
/// The bucket every test server has.
pub const BUCKET: &str = "berth";

/// A real `s3s-fs` process serving `root` on a loopback port; killed (by its own handle) on drop.
pub struct S3Server {
    child: Mutex<Option<Child>>,
    /// The directory it serves (a bucket is a directory below it).
    pub root: PathBuf,
    /// Its loopback port.
    pub port: u16,
}

impl S3Server {
    /// Starts a server on `root` (creating the bucket directory) on a free port and waits
    /// until it accepts.
    pub fn start(root: &Path) -> S3Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        S3Server::start_on(root, port)
    }

    /// Starts a server on `root` and loopback `port` (a restart of one that was killed: same
    /// directory, same address) and waits until it accepts.
    ///
    /// Panics: `s3s-fs` is missing, exits at start (the port is taken), or does not listen
    /// within [`SERVER_START_TIMEOUT`].
    pub fn start_on(root: &Path, port: u16) -> S3Server {
        let bin = std::env::var("BERTH_S3S_FS").unwrap_or_else(|_| S3S_FS_DEFAULT.to_owned());
        assert!(
            Path::new(&bin).is_file(),
            "the S3 tests need the s3s-fs server at {bin} (set BERTH_S3S_FS to use another); install it with \
             `cargo install s3s-fs@0.14.1 --features binary --locked --root /var/tmp/berth-tools`, as .ci/run does"
        );
        fs::create_dir_all(root.join(BUCKET)).unwrap();
        let child = Command::new(&bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                ACCESS_KEY,
                "--secret-key",
                SECRET_KEY,
            ])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
        let server = S3Server {
            child: Mutex::new(Some(child)),
            root: root.to_owned(),
            port,
        };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = server
                .child
                .lock()
                .unwrap()
                .as_mut()
                .unwrap()
                .try_wait()
                .unwrap()
            {
                panic!("s3s-fs exited at start on port {port}: {status}");
            }
            assert!(
                start.elapsed() < SERVER_START_TIMEOUT,
                "s3s-fs did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// The server's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL, by its own PID) and reaps it.
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The directory of `key` prefix `prefix` in the bucket: where its objects land.
    pub fn dir_of(&self, prefix: &str) -> PathBuf {
        self.root.join(BUCKET).join(prefix)
    }

    /// The environment that points a `berth hostd` (or `berth api`) at this server's bucket
    /// under `prefix`: `BERTH_OBJECT_STORE` and the `AWS_*` settings, with the endpoint at
    /// loopback `port` (the server's own, or a relay in front of it).
    pub fn env(&self, prefix: &str, port: u16) -> Vec<(String, String)> {
        [
            ("BERTH_OBJECT_STORE", format!("s3://{BUCKET}/{prefix}")),
            ("AWS_ENDPOINT", format!("http://127.0.0.1:{port}")),
            ("AWS_ALLOW_HTTP", "true".to_owned()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ("AWS_REGION", "us-east-1".to_owned()),
            ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "false".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}
