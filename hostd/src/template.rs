//! Templates: the read-only root filesystems sandboxes are overlaid on, and the runtime each
//! template's sandboxes run in.
//!
//! The registry ([`TEMPLATES`]) mirrors the `templates` table (migrations 0001 and 0006): a
//! command names only its template, and hostd looks the runtime up here, so the wire format
//! needed no change to select a runtime.
//!
//! - `base`: a busybox userland from the host's static busybox (`/bin/busybox`, Debian's
//!   `busybox-static`), on runc.
//! - `base-gvisor`: the same userland on runsc (gVisor): a stop keeps memory.
//! - `python`: Debian minimal with python3 and pip, built once with `debootstrap` from the
//!   mirror apt uses, into a machine-wide cache dir shared by every hostd (`berth template
//!   build python` builds it ahead of time), on runsc. Its dir in the cache is named after its
//!   package list too ([`TemplateDef::dir_name`]), so a build that changes the list builds
//!   anew instead of using an old root.
//!
//! Beyond the registry, a template can be imported from a root filesystem tarball (`berth
//! template import NAME FILE --runtime R`, see [`import_rootfs`]): it lands in the cache dir
//! with a [`IMPORTED_META`] file naming its runtime, and every hostd of the machine finds it
//! there.
//!
//! # Guarantees
//! A template is built in a temporary dir and renamed into place, so a crash never leaves half
//! a template where a sandbox could use it. Concurrent builds are serialized within a process,
//! and cached builds across processes by a lock file.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::error::HostdError;
use crate::runtime::runc::RUNC;
use crate::runtime::runsc::RUNSC;

/// The name of the busybox template.
pub const BASE_TEMPLATE: &str = "base";

/// The busybox template on gVisor.
pub const BASE_GVISOR_TEMPLATE: &str = "base-gvisor";

/// The Debian + python3 template.
pub const PYTHON_TEMPLATE: &str = "python";

/// Where expensive templates are cached for every hostd of the machine.
pub const DEFAULT_TEMPLATE_CACHE: &str = "/var/cache/berth/templates";

/// How long a debootstrap build may take.
pub const DEBOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The mirror used when apt's sources name none.
pub const FALLBACK_DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

/// The suite used when `/etc/os-release` names none.
pub const FALLBACK_DEBIAN_SUITE: &str = "bookworm";

/// How a template's root filesystem is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The host's static busybox and its applet links; built per hostd in milliseconds.
    Busybox,
    /// `debootstrap --variant=minbase --include=<packages>`; built once per machine into the
    /// cache dir.
    Debootstrap {
        /// Packages besides `minbase`.
        packages: &'static [&'static str],
    },
}

/// One template this build can make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateDef {
    /// The template's name (`base`, `python`).
    pub name: &'static str,
    /// The runtime its sandboxes run in (`runc`, `runsc`).
    pub runtime: &'static str,
    /// One line for listings.
    pub description: &'static str,
    /// How it is built.
    pub source: Source,
}

/// Every template this build can make; the `templates` table lists the same names and
/// runtimes.
pub const TEMPLATES: &[TemplateDef] = &[
    TemplateDef {
        name: BASE_TEMPLATE,
        runtime: RUNC,
        description: "BusyBox userland (busybox-static) on runc",
        source: Source::Busybox,
    },
    TemplateDef {
        name: BASE_GVISOR_TEMPLATE,
        runtime: RUNSC,
        description: "BusyBox userland on gVisor (runsc): stop keeps memory and processes",
        source: Source::Busybox,
    },
    TemplateDef {
        name: PYTHON_TEMPLATE,
        runtime: RUNSC,
        description: "Debian minimal with python3 on gVisor (runsc): stop keeps memory",
        source: Source::Debootstrap {
            packages: &["python3", "python3-pip"],
        },
    },
];

impl TemplateDef {
    /// The template's dir under its parent: its name, and for a debootstrapped one also 8 hex
    /// digits of the SHA-256 of its package list (`python-1a2b3c4d`).
    pub fn dir_name(&self) -> String {
        match self.source {
            Source::Busybox => self.name.to_owned(),
            Source::Debootstrap { packages } => {
                use sha2::{Digest, Sha256};
                let hash = hex::encode(Sha256::digest(packages.join(",").as_bytes()));
                format!("{}-{}", self.name, &hash[..8])
            }
        }
    }
}

/// The template called `name`.
///
/// Errors: [`HostdError::UnknownTemplate`] listing the known ones.
pub fn lookup(name: &str) -> Result<&'static TemplateDef, HostdError> {
    TEMPLATES
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| HostdError::UnknownTemplate {
            name: name.to_owned(),
            known: TEMPLATES
                .iter()
                .map(|t| t.name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The dir of the machine's OCI image cache ([`crate::image::ImageCache`]) in the template
/// cache.
pub const IMAGE_CACHE_DIR: &str = "oci";

/// The metadata file of an imported template, beside its `rootfs/` in the cache dir.
pub const IMPORTED_META: &str = "template.json";

/// The longest template name.
pub const MAX_TEMPLATE_NAME_LEN: usize = 64;

/// What [`IMPORTED_META`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportedTemplate {
    /// `runc` or `runsc`.
    pub runtime: String,
    /// One line for listings.
    pub description: String,
}

/// The runtime name of this build called `name` (`runc`, `runsc`).
///
/// Errors: [`HostdError::UnsupportedRuntime`].
pub fn known_runtime(name: &str) -> Result<&'static str, HostdError> {
    [RUNC, RUNSC]
        .into_iter()
        .find(|r| *r == name)
        .ok_or_else(|| HostdError::UnsupportedRuntime {
            name: name.to_owned(),
            offered: format!("{RUNC}, {RUNSC}"),
        })
}

/// The imported template `name` of `cache`, when there is one.
fn read_imported(cache: &Path, name: &str) -> Option<ImportedTemplate> {
    if valid_name(name).is_err() {
        return None;
    }
    let dir = cache.join(name);
    let meta: ImportedTemplate =
        serde_json::from_slice(&fs::read(dir.join(IMPORTED_META)).ok()?).ok()?;
    dir.join("rootfs").is_dir().then_some(meta)
}

/// Template names: lowercase ASCII letters, digits and `-`, starting with a letter or digit,
/// at most [`MAX_TEMPLATE_NAME_LEN`].
fn valid_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TEMPLATE_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    ok.then_some(()).ok_or_else(|| {
        format!(
            "template names are 1 to {MAX_TEMPLATE_NAME_LEN} of a-z, 0-9 and '-', not starting with '-'"
        )
    })
}

/// Imports a root filesystem tarball (plain or gzip-compressed, detected by its first bytes)
/// as template `name` with `runtime`, into `<cache>/<name>/` (unpacked aside, then renamed
/// into place). Ownership, permissions and extended attributes are kept; entries that would
/// land outside the root are refused (the `tar` crate's unpack rules).
///
/// Errors: [`HostdError::File`] for a bad name, a built-in or already imported name;
/// [`HostdError::UnsupportedRuntime`]; [`HostdError::Io`] when the tarball can't be read or
/// unpacked.
pub fn import_rootfs(
    name: &str,
    tarball: &Path,
    runtime: &str,
    description: &str,
    cache: &Path,
) -> Result<PathBuf, HostdError> {
    use std::io::{BufRead, BufReader};
    let refuse = |reason: String| HostdError::File {
        path: name.to_owned(),
        reason,
    };
    valid_name(name).map_err(refuse)?;
    let runtime = known_runtime(runtime)?;
    if lookup(name).is_ok() {
        return Err(refuse("is a built-in template".into()));
    }
    let final_dir = cache.join(name);
    if final_dir.exists() {
        return Err(refuse(format!(
            "is already imported at {} (sandboxes may use it; remove it by hand first)",
            final_dir.display()
        )));
    }
    fs::create_dir_all(cache).map_err(HostdError::io(format!("create {}", cache.display())))?;
    let tmp = cache.join(format!(".{name}.import-{}", uuid::Uuid::new_v4().simple()));
    let rootfs = tmp.join("rootfs");
    let unpacked = (|| {
        fs::create_dir_all(&rootfs)
            .map_err(HostdError::io(format!("create {}", rootfs.display())))?;
        let file = fs::File::open(tarball)
            .map_err(HostdError::io(format!("open {}", tarball.display())))?;
        let mut reader = BufReader::new(file);
        let gzip = reader
            .fill_buf()
            .map_err(HostdError::io(format!("read {}", tarball.display())))?
            .starts_with(&[0x1f, 0x8b]);
        let stream: Box<dyn std::io::Read> = if gzip {
            Box::new(flate2::read::GzDecoder::new(reader))
        } else {
            Box::new(reader)
        };
        let mut archive = tar::Archive::new(stream);
        archive.set_preserve_permissions(true);
        archive.set_preserve_ownerships(true);
        archive.set_unpack_xattrs(true);
        archive
            .unpack(&rootfs)
            .map_err(HostdError::io(format!("unpack {}", tarball.display())))?;
        let meta = ImportedTemplate {
            runtime: runtime.to_owned(),
            description: description.to_owned(),
        };
        crate::record::write_json_atomic(&tmp.join(IMPORTED_META), &meta)?;
        fs::rename(&tmp, &final_dir).map_err(HostdError::io(format!(
            "rename {} into place",
            tmp.display()
        )))
    })();
    if let Err(e) = unpacked {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(final_dir.join("rootfs"))
}

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

/// The templates of one hostd: busybox ones under `<state_dir>/templates`, debootstrapped
/// ones in the machine-wide cache.
#[derive(Debug)]
pub struct Templates {
    dir: PathBuf,
    cache: PathBuf,
    images: crate::image::ImageCache,
    busybox: PathBuf,
    build: Mutex<()>,
}

impl Templates {
    /// Templates kept per hostd in `dir`, expensive ones shared machine-wide in `cache`.
    pub fn new(dir: PathBuf, cache: PathBuf) -> Self {
        Self {
            images: crate::image::ImageCache::new(cache.join(IMAGE_CACHE_DIR)),
            dir,
            cache,
            busybox: PathBuf::from(HOST_BUSYBOX),
            build: Mutex::new(()),
        }
    }

    /// The root filesystem of template `name`, or for a template pulled from an OCI image
    /// (`image`, pinned to its digest: the create's `SandboxSpec::image`), of that image,
    /// pulled into the machine's image cache first if missing ([`crate::image`]).
    ///
    /// Errors: as [`Templates::ensure`]; [`HostdError::Image`] when the pull fails.
    pub async fn ensure_for(&self, name: &str, image: Option<&str>) -> Result<PathBuf, HostdError> {
        let Some(image) = image else {
            return self.ensure(name).await;
        };
        let started = std::time::Instant::now();
        let pulled = self
            .images
            .ensure_rootfs(image, &crate::image::ImageLimits::default(), |p| {
                tracing::debug!(template = name, progress = ?p, "image pull");
            })
            .await?;
        tracing::info!(template = name, image, elapsed = ?started.elapsed(), "template image ready");
        Ok(pulled.rootfs)
    }

    /// The root filesystem of template `name`, built first if missing.
    ///
    /// Errors: [`HostdError::UnknownTemplate`]; [`HostdError::Io`] / [`HostdError::Tool`] when
    /// the build fails.
    pub async fn ensure(&self, name: &str) -> Result<PathBuf, HostdError> {
        let def = match lookup(name) {
            Ok(def) => def,
            Err(unknown) => {
                return match read_imported(&self.cache, name) {
                    Some(_) => Ok(self.cache.join(name).join("rootfs")),
                    None => Err(unknown),
                }
            }
        };
        let parent = match def.source {
            Source::Busybox => &self.dir,
            Source::Debootstrap { .. } => &self.cache,
        };
        let rootfs = parent.join(def.dir_name()).join("rootfs");
        if rootfs.is_dir() {
            return Ok(rootfs);
        }
        let _guard = self.build.lock().await;
        if rootfs.is_dir() {
            return Ok(rootfs);
        }
        let started = std::time::Instant::now();
        match def.source {
            Source::Busybox => {
                let (templates, busybox) = (self.dir.clone(), self.busybox.clone());
                let name = def.name;
                tokio::task::spawn_blocking(move || {
                    build_into_place(&templates, name, |rootfs| build_base(rootfs, &busybox))
                })
                .await
                .map_err(|e| HostdError::Io {
                    context: "template build task".into(),
                    source: std::io::Error::other(e),
                })??;
            }
            Source::Debootstrap { packages } => {
                build_debootstrap(
                    &self.cache,
                    &def.dir_name(),
                    packages,
                    &DebianSource::detect(),
                )
                .await?
            }
        }
        tracing::info!(template = def.name, elapsed = ?started.elapsed(), "template built");
        Ok(rootfs)
    }
}

/// Builds template `name` into `cache` if it is built once per machine (`python`), for
/// `berth template build`; returns its root filesystem. Busybox templates are built by each
/// hostd on first use and need no build ahead of time.
///
/// Errors: [`HostdError::UnknownTemplate`] (also for a per-hostd template); build errors as
/// [`Templates::ensure`].
pub async fn build_cached(name: &str, cache: &Path) -> Result<PathBuf, HostdError> {
    let def = lookup(name)?;
    if def.source == Source::Busybox {
        return Err(HostdError::UnknownTemplate {
            name: name.to_owned(),
            known: TEMPLATES
                .iter()
                .filter(|t| t.source != Source::Busybox)
                .map(|t| t.name)
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    // The per-hostd dir is never used for a cached template.
    Templates::new(cache.join(".unused"), cache.to_path_buf())
        .ensure(name)
        .await
}

/// Where debootstrap fetches packages from: the mirror and suite apt uses on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebianSource {
    /// The archive URL (`http://deb.debian.org/debian`).
    pub mirror: String,
    /// The release (`bookworm`).
    pub suite: String,
}

impl DebianSource {
    /// The first Debian mirror in apt's sources (deb822 `*.sources` or one-line
    /// `sources.list`), and the suite of `/etc/os-release`; fallbacks otherwise.
    pub fn detect() -> Self {
        let mut texts = Vec::new();
        if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
            let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            paths.sort();
            for path in paths {
                if path
                    .extension()
                    .is_some_and(|e| e == "sources" || e == "list")
                {
                    texts.extend(fs::read_to_string(&path).ok());
                }
            }
        }
        texts.extend(fs::read_to_string("/etc/apt/sources.list").ok());
        let mirror = texts
            .iter()
            .find_map(|t| apt_mirror(t))
            .unwrap_or_else(|| FALLBACK_DEBIAN_MIRROR.to_owned());
        let suite = fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
                    .map(|v| v.trim_matches('"').to_owned())
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| FALLBACK_DEBIAN_SUITE.to_owned());
        Self { mirror, suite }
    }
}

/// The first plain Debian archive URI of an apt sources text (either format), skipping the
/// security archive.
pub fn apt_mirror(text: &str) -> Option<String> {
    let candidates = text.lines().filter_map(|line| {
        let line = line.trim();
        if let Some(uris) = line.strip_prefix("URIs:") {
            return uris.split_whitespace().next().map(str::to_owned);
        }
        let rest = line.strip_prefix("deb ")?;
        rest.split_whitespace()
            .find(|w| w.contains("://"))
            .map(str::to_owned)
    });
    candidates
        .filter(|uri| !uri.contains("security"))
        .map(|uri| uri.trim_end_matches('/').to_owned())
        .next()
}

/// Builds a debootstrap template into `<cache>/<name>` (under a lock file, so two processes
/// don't build it twice).
async fn build_debootstrap(
    cache: &Path,
    name: &str,
    packages: &'static [&'static str],
    source: &DebianSource,
) -> Result<(), HostdError> {
    fs::create_dir_all(cache).map_err(HostdError::io(format!("create {}", cache.display())))?;
    let lock_path = cache.join(format!(".{name}.lock"));
    let lock = fs::File::create(&lock_path)
        .map_err(HostdError::io(format!("create {}", lock_path.display())))?;
    let lock = tokio::task::spawn_blocking(move || {
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| HostdError::io("lock the template cache")(e.into()))
    })
    .await
    .map_err(|e| HostdError::Io {
        context: "template lock task".into(),
        source: std::io::Error::other(e),
    })??;
    if cache.join(name).join("rootfs").is_dir() {
        drop(lock);
        return Ok(());
    }
    let tmp = cache.join(format!(".{name}.tmp-{}", uuid::Uuid::new_v4().simple()));
    let rootfs = tmp.join("rootfs");
    fs::create_dir_all(&tmp).map_err(HostdError::io(format!("create {}", tmp.display())))?;
    tracing::info!(template = name, mirror = %source.mirror, suite = %source.suite, "debootstrap started");
    let include = format!("--include={}", packages.join(","));
    let args = [
        "--variant=minbase",
        include.as_str(),
        source.suite.as_str(),
        &rootfs.to_string_lossy(),
        source.mirror.as_str(),
    ]
    .map(str::to_owned);
    let log_path = tmp.join("debootstrap.log");
    let built = async {
        let log = fs::File::create(&log_path)
            .map_err(HostdError::io(format!("create {}", log_path.display())))?;
        let log_err = log.try_clone().map_err(HostdError::io("duplicate log"))?;
        let status = tokio::process::Command::new("debootstrap")
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true)
            .status();
        let status = tokio::time::timeout(DEBOOTSTRAP_TIMEOUT, status)
            .await
            .map_err(|_| HostdError::Io {
                context: format!("debootstrap timed out after {DEBOOTSTRAP_TIMEOUT:?}"),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(HostdError::io(
                "spawn debootstrap (apt-get install debootstrap)",
            ))?;
        if !status.success() {
            let text = fs::read_to_string(&log_path).unwrap_or_default();
            let tail = &text[text.len().saturating_sub(2048)..];
            return Err(HostdError::Tool {
                program: "debootstrap".into(),
                args: args.join(" "),
                status: status.to_string(),
                stderr: tail.trim().to_owned(),
            });
        }
        // Package caches are not part of the template.
        let _ = fs::remove_dir_all(rootfs.join("var/cache/apt/archives"));
        let _ = fs::create_dir_all(rootfs.join("var/cache/apt/archives/partial"));
        fs::rename(&tmp, cache.join(name)).map_err(HostdError::io(format!(
            "rename {} into place",
            tmp.display()
        )))
    }
    .await;
    if built.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    drop(lock);
    built
}

/// Builds template `name` in `<templates>/.<name>.tmp-<uuid>` and renames it to
/// `<templates>/<name>`.
fn build_into_place(
    templates: &Path,
    name: &str,
    build: impl FnOnce(&Path) -> Result<(), HostdError>,
) -> Result<(), HostdError> {
    fs::create_dir_all(templates)
        .map_err(HostdError::io(format!("create {}", templates.display())))?;
    let tmp = templates.join(format!(".{name}.tmp-{}", uuid::Uuid::new_v4().simple()));
    let result = build(&tmp.join("rootfs")).and_then(|()| {
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

    #[test]
    fn the_mirror_is_read_from_either_apt_sources_format() {
        let deb822 = "Types: deb\n# http://snapshot.example/archive\nURIs: http://deb.example.org/debian\nSuites: bookworm\n\nTypes: deb\nURIs: http://deb.example.org/debian-security\n";
        assert_eq!(
            apt_mirror(deb822).as_deref(),
            Some("http://deb.example.org/debian")
        );
        let one_line = "deb http://security.example.org/debian-security bookworm-security main\ndeb [arch=amd64] http://ftp.example.org/debian/ bookworm main\n";
        assert_eq!(
            apt_mirror(one_line).as_deref(),
            Some("http://ftp.example.org/debian")
        );
        assert_eq!(apt_mirror("# nothing\n"), None);
    }

    fn tarball_of(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, data) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o755);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            header.set_cksum();
            builder.append_data(&mut header, path, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    #[tokio::test]
    async fn an_imported_tarball_is_a_template_with_its_runtime() {
        let dir = std::env::temp_dir().join(format!("berth-import-{}", uuid::Uuid::new_v4()));
        fs::create_dir_all(&dir).unwrap();
        let tarball = dir.join("rootfs.tar.gz");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(
            &mut gz,
            &tarball_of(&[("etc/motd", b"hi\n"), ("bin/tool", b"#!/bin/sh\n")]),
        )
        .unwrap();
        fs::write(&tarball, gz.finish().unwrap()).unwrap();
        let cache = dir.join("cache");
        let rootfs = import_rootfs("mine", &tarball, RUNSC, "mine", &cache).unwrap();
        assert_eq!(fs::read(rootfs.join("etc/motd")).unwrap(), b"hi\n");

        let templates = Templates::new(dir.join("own"), cache.clone());
        assert_eq!(templates.ensure("mine").await.unwrap(), rootfs);
        assert!(templates.ensure("other").await.is_err());

        // Refused: the same name again, a built-in name, a bad name, an unknown runtime.
        assert!(import_rootfs("mine", &tarball, RUNC, "", &cache).is_err());
        assert!(import_rootfs(BASE_TEMPLATE, &tarball, RUNC, "", &cache).is_err());
        assert!(import_rootfs("../x", &tarball, RUNC, "", &cache).is_err());
        assert!(import_rootfs("fine", &tarball, "kata", "", &cache).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_template_names_a_runtime_this_build_has() {
        for t in TEMPLATES {
            assert!([RUNC, RUNSC].contains(&t.runtime), "{t:?}");
        }
        assert_eq!(lookup(BASE_TEMPLATE).unwrap().runtime, RUNC);
    }

    #[tokio::test]
    async fn an_unknown_template_is_refused_with_the_known_ones() {
        let t = Templates::new(
            std::env::temp_dir().join("berth-template-never-built"),
            std::env::temp_dir().join("berth-template-cache-never-built"),
        );
        match t.ensure("ubuntu").await.unwrap_err() {
            HostdError::UnknownTemplate { name, known } => {
                assert_eq!(name, "ubuntu");
                assert_eq!(known, "base, base-gvisor, python");
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
        let rootfs = Templates::new(dir.clone(), dir.join("cache"))
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
