//! The agent bundle: the `berth` binary (which contains `berth agent`) plus every shared
//! library it needs, so the agent can run inside a busybox root filesystem that has no libc.
//!
//! The bundle dir is bind-mounted read-only at [`AGENT_MOUNT`] in every container, whose process
//! is `/.berth/<loader> --library-path /.berth /.berth/berth agent --listen 0.0.0.0:18047`
//! (or `/.berth/berth agent …` for a statically linked binary).
//!
//! # Guarantees
//! - Bundles are content-addressed by a fingerprint of the binary (path, size, mtime): a new
//!   binary gets a new bundle dir on the next container start; a running container keeps the
//!   one it was started with.
//! - A bundle is built in a temporary dir and renamed into place.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;

use crate::agent::protocol::AGENT_PORT;
use crate::error::HostdError;
use crate::record::write_json_atomic;

/// Where the bundle is mounted inside each container.
pub const AGENT_MOUNT: &str = "/.berth";

/// The agent binary's file name inside the bundle.
pub const AGENT_FILE_NAME: &str = "berth";

/// The statx shim's file name inside the bundle: preloaded (`LD_PRELOAD`) into the processes
/// of gVisor sandboxes, so that everyday tools work there (see `shim/statx_shim.c`: gVisor
/// release 20221219 refuses `AT_NO_AUTOMOUNT`, which coreutils 9 passes to every `statx`).
pub const GUEST_PRELOAD_FILE: &str = "berth-statx.so";

/// The statx shim, built by `build.rs` from `shim/statx_shim.c`.
pub const STATX_SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/berth-statx.so"));

/// Hex characters of the binary fingerprint naming a bundle dir.
const FINGERPRINT_HEX_LEN: usize = 16;

/// The manifest written into every bundle.
const MANIFEST_FILE: &str = "manifest.json";

/// One line of `ldd` output that names a file to copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LddEntry {
    /// The name the binary asks for (`libc.so.6`), or the loader's file name.
    pub name: String,
    /// Where the host has it.
    pub path: PathBuf,
    /// Whether this is the dynamic loader (`ld-linux-x86-64.so.2`).
    pub loader: bool,
}

/// Parses `ldd` output. `linux-vdso` (no file) is skipped; `statically linked` yields nothing.
///
/// Errors: a message naming the libraries `ldd` reports as `not found`.
pub fn parse_ldd(output: &str) -> Result<Vec<LddEntry>, String> {
    let mut entries = Vec::new();
    let mut missing = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some((name, rest)) = line.split_once("=>") {
            let rest = rest.trim();
            if rest.starts_with("not found") {
                missing.push(name.trim().to_owned());
                continue;
            }
            let path = rest.split(" (").next().unwrap_or("").trim();
            if path.starts_with('/') {
                entries.push(LddEntry {
                    name: name.trim().to_owned(),
                    path: PathBuf::from(path),
                    loader: false,
                });
            }
        } else if line.starts_with('/') {
            let path = PathBuf::from(line.split(" (").next().unwrap_or(line).trim());
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| format!("odd loader path in ldd output: {line}"))?
                .to_owned();
            entries.push(LddEntry {
                name,
                path,
                loader: true,
            });
        }
    }
    if missing.is_empty() {
        Ok(entries)
    } else {
        Err(format!("libraries not found: {}", missing.join(", ")))
    }
}

/// A built bundle on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentBundle {
    /// The bundle dir on the host (bind-mount source).
    pub dir: PathBuf,
    /// The loader's file name in the bundle; `None` for a static binary.
    pub loader: Option<String>,
}

impl AgentBundle {
    /// The container process's argv: the agent listening on all addresses at [`AGENT_PORT`].
    pub fn argv(&self) -> Vec<String> {
        let agent = format!("{AGENT_MOUNT}/{AGENT_FILE_NAME}");
        let mut argv = match &self.loader {
            Some(loader) => vec![
                format!("{AGENT_MOUNT}/{loader}"),
                "--library-path".to_owned(),
                AGENT_MOUNT.to_owned(),
                agent,
            ],
            None => vec![agent],
        };
        argv.extend([
            "agent".to_owned(),
            "--listen".to_owned(),
            format!("0.0.0.0:{AGENT_PORT}"),
        ]);
        argv
    }
}

/// Builds and caches agent bundles under `<state_dir>/agent/`.
#[derive(Debug)]
pub struct Bundles {
    dir: PathBuf,
    binary: PathBuf,
    current: Mutex<Option<(String, AgentBundle)>>,
}

impl Bundles {
    /// Bundles kept in `dir`, built from the `berth` executable at `binary`.
    pub fn new(dir: PathBuf, binary: PathBuf) -> Self {
        Self {
            dir,
            binary,
            current: Mutex::new(None),
        }
    }

    /// The bundle for the agent binary as it is now, built if the binary changed.
    ///
    /// Errors: [`HostdError::Io`] (binary missing, copy failed), [`HostdError::Tool`] (`ldd`),
    /// [`HostdError::Bundle`] (libraries not found).
    pub async fn ensure(&self) -> Result<AgentBundle, HostdError> {
        let fingerprint = fingerprint(&self.binary)?;
        let mut current = self.current.lock().await;
        if let Some((fp, bundle)) = current.as_ref() {
            if *fp == fingerprint && bundle.dir.is_dir() {
                return Ok(bundle.clone());
            }
        }
        let dir = self.dir.join(&fingerprint);
        let manifest = dir.join(MANIFEST_FILE);
        let bundle = match fs::read(&manifest)
            .ok()
            .and_then(|b| serde_json::from_slice::<AgentBundle>(&b).ok())
        {
            Some(bundle) => bundle,
            None => self.build(&dir).await?,
        };
        *current = Some((fingerprint, bundle.clone()));
        Ok(bundle)
    }

    async fn build(&self, dir: &Path) -> Result<AgentBundle, HostdError> {
        let binary = self.binary.to_string_lossy().into_owned();
        let entries = match crate::tool::run("ldd", &[&binary]).await {
            Ok(out) => parse_ldd(&out.stdout).map_err(|reason| HostdError::Bundle { reason })?,
            // glibc's ldd exits 1 with "not a dynamic executable" for static binaries.
            Err(HostdError::Tool { stderr, .. }) if stderr.contains("not a dynamic executable") => {
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        let tmp = self
            .dir
            .join(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
        let bundle = AgentBundle {
            dir: dir.to_path_buf(),
            loader: entries.iter().find(|e| e.loader).map(|e| e.name.clone()),
        };
        let (binary, tmp2, final_dir, bundle2) = (
            self.binary.clone(),
            tmp.clone(),
            dir.to_path_buf(),
            bundle.clone(),
        );
        let result = tokio::task::spawn_blocking(move || {
            copy_bundle(&binary, &entries, &tmp2)?;
            write_json_atomic(&tmp2.join(MANIFEST_FILE), &bundle2)?;
            match fs::rename(&tmp2, &final_dir) {
                Ok(()) => Ok(()),
                // Another build of the same fingerprint won the race: use it.
                Err(_) if final_dir.join(MANIFEST_FILE).is_file() => {
                    let _ = fs::remove_dir_all(&tmp2);
                    Ok(())
                }
                Err(e) => Err(HostdError::io(format!("rename {}", tmp2.display()))(e)),
            }
        })
        .await
        .map_err(|e| HostdError::Io {
            context: "agent bundle task".into(),
            source: std::io::Error::other(e),
        })?;
        if result.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        result?;
        self.remove_stale(dir);
        tracing::info!(bundle = %dir.display(), loader = ?bundle.loader, "agent bundle built");
        Ok(bundle)
    }

    /// Removes bundles of older binaries. Containers started from one keep their bind mount
    /// (and the agent keeps its mapped files), so this only frees disk.
    fn remove_stale(&self, keep: &Path) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let is_bundle = name.len() == FINGERPRINT_HEX_LEN
                && name
                    .to_str()
                    .is_some_and(|n| n.bytes().all(|b| b.is_ascii_hexdigit()));
            if is_bundle && path != keep {
                let _ = fs::remove_dir_all(&path);
            }
        }
    }
}

/// A fingerprint of the binary: its canonical path, size and modification time.
fn fingerprint(binary: &Path) -> Result<String, HostdError> {
    let canonical = fs::canonicalize(binary).map_err(HostdError::io(format!(
        "resolve agent binary {}",
        binary.display()
    )))?;
    let meta = fs::metadata(&canonical).map_err(HostdError::io(format!(
        "stat agent binary {}",
        canonical.display()
    )))?;
    let mut h = Sha256::new();
    h.update(canonical.as_os_str().as_encoded_bytes());
    h.update(meta.size().to_le_bytes());
    h.update(meta.mtime().to_le_bytes());
    h.update(meta.mtime_nsec().to_le_bytes());
    Ok(hex::encode(h.finalize())[..FINGERPRINT_HEX_LEN].to_owned())
}

/// Copies the binary (as [`AGENT_FILE_NAME`]) and every ldd entry (under its `name`) into `dir`.
fn copy_bundle(binary: &Path, entries: &[LddEntry], dir: &Path) -> Result<(), HostdError> {
    fs::create_dir_all(dir).map_err(HostdError::io(format!("create {}", dir.display())))?;
    let copy = |from: &Path, name: &str| -> Result<(), HostdError> {
        let to = dir.join(name);
        fs::copy(from, &to).map_err(HostdError::io(format!(
            "copy {} to {}",
            from.display(),
            to.display()
        )))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o755))
            .map_err(HostdError::io(format!("chmod {}", to.display())))
    };
    copy(binary, AGENT_FILE_NAME)?;
    let shim = dir.join(GUEST_PRELOAD_FILE);
    fs::write(&shim, STATX_SHIM).map_err(HostdError::io(format!("write {}", shim.display())))?;
    fs::set_permissions(&shim, fs::Permissions::from_mode(0o755))
        .map_err(HostdError::io(format!("chmod {}", shim.display())))?;
    for entry in entries {
        copy(&entry.path, &entry.name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LDD: &str = "\tlinux-vdso.so.1 (0x00007ffd1b7f2000)\n\
        \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f0e1a000000)\n\
        \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0e19e00000)\n\
        \t/lib64/ld-linux-x86-64.so.2 (0x00007f0e1a2b0000)\n";

    #[test]
    fn ldd_output_yields_libraries_and_the_loader_but_not_the_vdso() {
        let entries = parse_ldd(LDD).unwrap();
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2"]
        );
        assert_eq!(
            entries[1].path,
            Path::new("/lib/x86_64-linux-gnu/libc.so.6")
        );
        assert!(entries[2].loader && !entries[0].loader);
        assert_eq!(entries[2].path, Path::new("/lib64/ld-linux-x86-64.so.2"));
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let err = parse_ldd("\tlibfoo.so.1 => not found\n").unwrap_err();
        assert!(err.contains("libfoo.so.1"), "{err}");
    }

    #[test]
    fn a_static_binary_needs_no_files() {
        assert!(parse_ldd("\tstatically linked\n").unwrap().is_empty());
    }

    #[test]
    fn the_agent_runs_through_the_bundled_loader() {
        let b = AgentBundle {
            dir: "/x".into(),
            loader: Some("ld-linux-x86-64.so.2".into()),
        };
        assert_eq!(
            b.argv(),
            [
                "/.berth/ld-linux-x86-64.so.2",
                "--library-path",
                "/.berth",
                "/.berth/berth",
                "agent",
                "--listen",
                "0.0.0.0:18047"
            ]
        );
        let static_bundle = AgentBundle {
            dir: "/x".into(),
            loader: None,
        };
        assert_eq!(static_bundle.argv()[0], "/.berth/berth");
    }

    #[tokio::test]
    async fn a_bundle_holds_the_binary_its_libraries_and_is_reused_until_the_binary_changes() {
        let dir = std::env::temp_dir().join(format!("berth-bundle-{}", uuid::Uuid::new_v4()));
        fs::create_dir_all(&dir).unwrap();
        let binary = dir.join("prog");
        fs::copy("/bin/true", &binary).unwrap();
        let bundles = Bundles::new(dir.join("agent"), binary.clone());
        let first = bundles.ensure().await.unwrap();
        assert!(first.dir.join(AGENT_FILE_NAME).is_file());
        let loader = first
            .loader
            .clone()
            .expect("/bin/true is dynamically linked");
        assert!(first.dir.join(&loader).is_file());
        assert!(first.dir.join("libc.so.6").is_file());
        assert_eq!(bundles.ensure().await.unwrap(), first);

        // A new binary (different size) gets a new bundle; the old one is removed.
        fs::copy("/bin/ls", &binary).unwrap();
        let second = bundles.ensure().await.unwrap();
        assert_ne!(second.dir, first.dir);
        assert!(!first.dir.exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
