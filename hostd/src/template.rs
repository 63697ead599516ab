//! Templates: the read-only root filesystems sandboxes are overlaid on.
//!
//! One template exists, [`BASE_TEMPLATE`]: a busybox userland built from the host's static
//! busybox (`/bin/busybox`, Debian's `busybox-static`).
//!
//! # Guarantees
//! A template is built in a temporary dir and renamed into place, so a crash never leaves half
//! a template where a sandbox could use it. Concurrent builds are serialized.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::sync::Mutex;

use crate::error::HostdError;

/// The name of the busybox template.
pub const BASE_TEMPLATE: &str = "base";

/// Every template this build can make.
pub const KNOWN_TEMPLATES: &[&str] = &[BASE_TEMPLATE];

/// The host's static busybox, copied into the base template.
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// Directories of the base template, with their modes.
const BASE_DIRS: &[(&str, u32)] = &[
    ("bin", 0o755),
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("tmp", 0o1777),
    ("etc", 0o755),
    ("root", 0o700),
];

const BASE_PASSWD: &str =
    "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
const BASE_GROUP: &str = "root:x:0:\nnobody:x:65534:\n";

/// The templates of one hostd, under `<state_dir>/templates`.
#[derive(Debug)]
pub struct Templates {
    dir: PathBuf,
    busybox: PathBuf,
    build: Mutex<()>,
}

impl Templates {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            busybox: PathBuf::from(HOST_BUSYBOX),
            build: Mutex::new(()),
        }
    }

    /// The root filesystem of template `name`, built first if missing.
    ///
    /// Errors: [`HostdError::UnknownTemplate`]; [`HostdError::Io`] / [`HostdError::Tool`] when
    /// the build fails.
    pub async fn ensure(&self, name: &str) -> Result<PathBuf, HostdError> {
        if !KNOWN_TEMPLATES.contains(&name) {
            return Err(HostdError::UnknownTemplate {
                name: name.to_owned(),
                known: KNOWN_TEMPLATES.join(", "),
            });
        }
        let final_dir = self.dir.join(name);
        let rootfs = final_dir.join("rootfs");
        if rootfs.is_dir() {
            return Ok(rootfs);
        }
        let _guard = self.build.lock().await;
        if rootfs.is_dir() {
            return Ok(rootfs);
        }
        let started = std::time::Instant::now();
        let (templates, busybox) = (self.dir.clone(), self.busybox.clone());
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || build_into_place(&templates, &name, &busybox))
            .await
            .map_err(|e| HostdError::Io {
                context: "template build task".into(),
                source: std::io::Error::other(e),
            })??;
        tracing::info!(template = BASE_TEMPLATE, elapsed = ?started.elapsed(), "template built");
        Ok(rootfs)
    }
}

/// Builds template `name` in `<templates>/.<name>.tmp-<uuid>` and renames it to
/// `<templates>/<name>`.
fn build_into_place(templates: &Path, name: &str, busybox: &Path) -> Result<(), HostdError> {
    fs::create_dir_all(templates)
        .map_err(HostdError::io(format!("create {}", templates.display())))?;
    let tmp = templates.join(format!(".{name}.tmp-{}", uuid::Uuid::new_v4().simple()));
    let result = build_base(&tmp.join("rootfs"), busybox).and_then(|()| {
        fs::rename(&tmp, templates.join(name)).map_err(HostdError::io(format!(
            "rename {} into place",
            tmp.display()
        )))
    });
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result
}

/// Writes the base template's root filesystem into `rootfs` (which must not exist).
fn build_base(rootfs: &Path, busybox: &Path) -> Result<(), HostdError> {
    for (dir, mode) in BASE_DIRS {
        let path = rootfs.join(dir);
        fs::create_dir_all(&path).map_err(HostdError::io(format!("create {}", path.display())))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(*mode))
            .map_err(HostdError::io(format!("chmod {}", path.display())))?;
    }
    let target = rootfs.join("bin/busybox");
    fs::copy(busybox, &target).map_err(HostdError::io(format!(
        "copy {} to {}",
        busybox.display(),
        target.display()
    )))?;
    let list = std::process::Command::new(busybox)
        .arg("--list")
        .output()
        .map_err(HostdError::io(format!("run {} --list", busybox.display())))?;
    if !list.status.success() {
        return Err(HostdError::Tool {
            program: busybox.display().to_string(),
            args: "--list".into(),
            status: list.status.to_string(),
            stderr: String::from_utf8_lossy(&list.stderr).into_owned(),
        });
    }
    for applet in applets(&String::from_utf8_lossy(&list.stdout)) {
        let link = rootfs.join("bin").join(applet);
        symlink("busybox", &link).map_err(HostdError::io(format!("symlink {}", link.display())))?;
    }
    for (file, content) in [("etc/passwd", BASE_PASSWD), ("etc/group", BASE_GROUP)] {
        let path = rootfs.join(file);
        fs::write(&path, content).map_err(HostdError::io(format!("write {}", path.display())))?;
    }
    Ok(())
}

/// The applet names of `busybox --list` output, without `busybox` itself (its symlink would
/// replace the binary) and without anything that is not a plain file name.
fn applets(list: &str) -> impl Iterator<Item = &str> {
    list.lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox" && !a.contains('/') && *a != "." && *a != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_applet_list_skips_busybox_itself_and_path_like_names() {
        let list = "[\nash\nbusybox\nsh\n../evil\n\n";
        assert_eq!(applets(list).collect::<Vec<_>>(), ["[", "ash", "sh"]);
    }

    #[tokio::test]
    async fn an_unknown_template_is_refused_with_the_known_ones() {
        let t = Templates::new(std::env::temp_dir().join("berth-template-never-built"));
        match t.ensure("ubuntu").await.unwrap_err() {
            HostdError::UnknownTemplate { name, known } => {
                assert_eq!(name, "ubuntu");
                assert_eq!(known, "base");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_base_template_has_busybox_applets_and_etc_files() {
        if !Path::new(HOST_BUSYBOX).exists() {
            eprintln!("skipping: no {HOST_BUSYBOX}");
            return;
        }
        let dir = std::env::temp_dir().join(format!("berth-template-{}", uuid::Uuid::new_v4()));
        let rootfs = Templates::new(dir.clone())
            .ensure(BASE_TEMPLATE)
            .await
            .unwrap();
        assert!(rootfs.join("bin/busybox").is_file());
        assert_eq!(
            fs::read_link(rootfs.join("bin/sh")).unwrap(),
            Path::new("busybox")
        );
        assert!(fs::read_to_string(rootfs.join("etc/passwd"))
            .unwrap()
            .starts_with("root:"));
        // No temporary build dir is left behind.
        let leftovers: Vec<_> = fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(leftovers.len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
