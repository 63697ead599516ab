//! A real OCI registry for a test: Debian's `docker-registry` (CNCF distribution 2.8) on a
//! free loopback port with its own config and storage dir, killed by its PID and removed on
//! drop; and images built by the test as OCI layouts (with the `tar` crate) and pushed into it
//! with `skopeo`.

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};

use super::env::unique;

/// An htpasswd line (user `berth`, a bcrypt hash of a password nobody uses): a registry with
/// it refuses anonymous pulls.
const HTPASSWD: &str = "berth:$2b$12$.K6L0/E0gINKYnykVs7c3eMv6hk8MrEbwRoazmPw74zdIf/LK4Vs6\n";

/// A running registry; killed and its dir removed on drop.
pub struct Registry {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Registry {
    /// Starts a registry that serves anyone.
    pub async fn start() -> Registry {
        Self::start_with(false).await
    }

    /// Starts a registry that refuses requests without credentials.
    pub async fn start_with_auth() -> Registry {
        Self::start_with(true).await
    }

    async fn start_with(auth: bool) -> Registry {
        let dir = std::env::temp_dir().join(format!("berth-registry-{}", unique()));
        std::fs::create_dir_all(dir.join("storage")).unwrap();
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let auth_section = if auth {
            std::fs::write(dir.join("htpasswd"), HTPASSWD).unwrap();
            format!(
                "auth:\n  htpasswd:\n    realm: berth-test\n    path: {}\n",
                dir.join("htpasswd").display()
            )
        } else {
            String::new()
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {addr}\n{auth_section}",
            dir.join("storage").display()
        );
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let log = std::fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start docker-registry (apt-get install docker-registry)");
        let registry = Registry { child, addr, dir };
        let client = reqwest::Client::new();
        let url = format!("http://{addr}/v2/");
        super::eventually("the registry answers", || {
            let req = client.get(&url).timeout(Duration::from_secs(2));
            async move { req.send().await.is_ok() }
        })
        .await;
        registry
    }

    /// `127.0.0.1:<port>/<repo>:<tag>`.
    pub fn reference(&self, repo: &str, tag: &str) -> String {
        format!("{}/{repo}:{tag}", self.addr)
    }

    /// Pushes the image of the OCI layout `layout` (tag `tag` there) as `repo:tag` with skopeo.
    pub fn push(&self, layout: &Path, tag: &str, repo: &str) {
        let out = Command::new("skopeo")
            .args([
                "--insecure-policy",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
            ])
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}", self.reference(repo, tag)))
            .output()
            .expect("run skopeo (apt-get install skopeo)");
        assert!(
            out.status.success(),
            "skopeo copy failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One entry of a test layer.
pub enum Entry<'a> {
    /// A regular file, mode 0644 (0755 when `exec`).
    File(&'a str, &'a [u8], bool),
    /// A directory, mode 0755.
    Dir(&'a str),
    /// A symlink to a target.
    Symlink(&'a str, &'a str),
    /// A character device (major, minor).
    CharDevice(&'a str, u32, u32),
}

/// A plain tar of `entries`, owned by root. Names go into the header raw (so a test can
/// write the `..` of a hostile layer).
pub fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut h = tar::Header::new_gnu();
        let (path, data): (&str, &[u8]) = match entry {
            Entry::File(p, d, exec) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(if *exec { 0o755 } else { 0o644 });
                (p, d)
            }
            Entry::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                (p, b"")
            }
            Entry::Symlink(p, target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                let link = &mut h.as_gnu_mut().unwrap().linkname;
                link[..target.len()].copy_from_slice(target.as_bytes());
                (p, b"")
            }
            Entry::CharDevice(p, major, minor) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_mode(0o666);
                h.set_device_major(*major).unwrap();
                h.set_device_minor(*minor).unwrap();
                (p, b"")
            }
        };
        let name = &mut h.as_gnu_mut().unwrap().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_size(data.len() as u64);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        builder.append(&h, data).unwrap();
    }
    builder.into_inner().unwrap()
}

/// The layers of a small bootable image: the host's static busybox with its shell and a few
/// applets, `/etc/passwd`, and the usual top-level dirs.
pub fn busybox_layer() -> Vec<u8> {
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let mut entries = vec![
        Entry::Dir("bin/"),
        Entry::Dir("dev/"),
        Entry::Dir("etc/"),
        Entry::Dir("proc/"),
        Entry::Dir("root/"),
        Entry::Dir("sys/"),
        Entry::Dir("tmp/"),
        Entry::File("bin/busybox", &busybox, true),
        Entry::File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", false),
        Entry::File("etc/group", b"root:x:0:\n", false),
    ];
    for applet in ["sh", "cat", "ls", "test", "echo", "find", "stat"] {
        entries.push(Entry::Symlink(
            Box::leak(format!("bin/{applet}").into_boxed_str()),
            "busybox",
        ));
    }
    tar_of(&entries)
}

/// gzip of `bytes`.
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes an OCI image layout in `dir` holding one image tagged `tag`: `layers` (plain tars,
/// lowest first, stored gzip-compressed) and a config for `linux/<arch>` with `entrypoint`.
pub fn write_layout(dir: &Path, tag: &str, layers: &[Vec<u8>], arch: &str, entrypoint: &[&str]) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| -> (String, usize) {
        let hex = sha256_hex(bytes);
        std::fs::write(blobs.join(&hex), bytes).unwrap();
        (format!("sha256:{hex}"), bytes.len())
    };
    let mut descriptors = Vec::new();
    let mut diff_ids = Vec::new();
    for layer in layers {
        diff_ids.push(format!("sha256:{}", sha256_hex(layer)));
        let (digest, size) = put(&gzip(layer));
        descriptors.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": digest,
            "size": size,
        }));
    }
    let config = json!({
        "architecture": arch,
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (config_digest, config_size) = put(&serde_json::to_vec(&config).unwrap());
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": descriptors,
    });
    let (manifest_digest, manifest_size) = put(&serde_json::to_vec(&manifest).unwrap());
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

/// Pushes a small bootable image as `repo:1` into `registry` and returns its reference: the
/// busybox layer, then a layer with `/etc/berth-mark` holding `mark` and the applets a default
/// entrypoint needs (`tail`, `sleep`). A unique `mark` gives the image a digest of its own, so
/// deleting its template frees no other test's root in the machine's shared image cache.
pub fn push_marked_image(registry: &Registry, repo: &str, mark: &str) -> String {
    let marked = tar_of(&[
        Entry::File("etc/berth-mark", mark.as_bytes(), false),
        Entry::Symlink("bin/tail", "busybox"),
        Entry::Symlink("bin/sleep", "busybox"),
    ]);
    let layout = std::env::temp_dir().join(format!("berth-layout-{}", unique()));
    write_layout(
        &layout,
        "1",
        &[busybox_layer(), marked],
        "amd64",
        &["/bin/sh"],
    );
    registry.push(&layout, "1", repo);
    let _ = std::fs::remove_dir_all(&layout);
    registry.reference(repo, "1")
}
