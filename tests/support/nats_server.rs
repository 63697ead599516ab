//! A private `nats-server` a test starts with a generated config (auth, TLS) on a free
//! loopback port, for the tests of NATS authentication; the shared NATS the other tests use
//! stays open. Killed by its PID and its directory removed when it drops, also after a panic.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use berth::nats_access::{server_config, ServerTls};

use super::cleanup;
use super::env::SETTLE_TIMEOUT;

/// One nats-server child process and its directory (config, JetStream store, log).
pub struct NatsServer {
    pub port: u16,
    pub dir: PathBuf,
    tls: Option<ServerTls>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server with JetStream, the `auth` block (none: open) and `tls` (none: plain),
    /// and waits until it accepts TCP connections.
    pub async fn start(auth: Option<&str>, tls: Option<ServerTls>) -> Self {
        let dir = cleanup::fresh_dir("nats");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = Self {
            port,
            dir,
            tls,
            child: None,
        };
        server.write_config(auth);
        let log = std::fs::File::create(server.dir.join("nats.log")).unwrap();
        let mut command = Command::new("nats-server");
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec. A test
        // process killed from outside (no Drop) takes its server with it.
        unsafe {
            use std::os::unix::process::CommandExt as _;
            command.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                    .map_err(std::io::Error::from)
            });
        }
        server.child = Some(
            command
                .arg("-c")
                .arg(server.config_file())
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start nats-server"),
        );
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server never listened; see {}",
                server.dir.join("nats.log").display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server
    }

    fn config_file(&self) -> PathBuf {
        self.dir.join("nats.conf")
    }

    fn write_config(&self, auth: Option<&str>) {
        let store = self.dir.join("js");
        std::fs::write(
            self.config_file(),
            server_config(self.port, &store, auth, self.tls.as_ref()),
        )
        .unwrap();
    }

    /// `nats://127.0.0.1:<port>`, or `tls://localhost:<port>` with TLS (the name the test
    /// certificate is issued for).
    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("tls://localhost:{}", self.port),
            None => format!("nats://127.0.0.1:{}", self.port),
        }
    }

    /// Replaces the auth block and makes the server reload its config (SIGHUP, by our PID).
    /// The reload is asynchronous: wait for its effect.
    pub fn reload(&self, auth: Option<&str>) {
        self.write_config(auth);
        let pid = self.child.as_ref().unwrap().id() as i32;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap();
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nats.log")).unwrap_or_default()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "test failed: its nats-server's log is in {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Writes `pem` to `dir/name` and returns the path.
pub fn write_pem(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap();
    path
}
